"""`triptych` and `python -m orchestrator`: the CLI, the daemon's stop signals kept first."""

from __future__ import annotations

import os
import sys

from orchestrator.parent_death import PARENT_ENV, end_with_parent


def main() -> int:
    if sys.argv[1:2] in (["serve"], ["worker"]):
        from orchestrator.early_signals import keep

        # Before the CLI's imports (a fifth of a second; torch's, for a worker, two): a stop
        # then is a clean stop once the process watches for signals, not a kill.
        keep()
    if (parent := os.environ.pop(PARENT_ENV, None)) is not None and not end_with_parent(int(parent)):
        print(f"triptych {' '.join(sys.argv[1:2])}: the process that started this one has ended", file=sys.stderr)
        return 1
    try:
        from orchestrator.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        # Ctrl-C before a command runs (in the CLI's imports, a fifth of a second, or as it
        # parses), where no command's own handling catches it: the exit status it gets
        # later, without a traceback.
        return 130
