"""`triptych` and `python -m orchestrator`: the CLI, the daemon's stop signals kept first."""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        from orchestrator.early_signals import keep

        keep()  # before the CLI's imports (a fifth of a second): a stop then is a drain, not a kill
    from orchestrator.cli import main as cli_main

    return cli_main()
