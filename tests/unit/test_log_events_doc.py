"""docs/operations.md's Log events table names every warning and error the code logs, and
nothing the code does not log: an operator greps for these names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
# `log.warning("worker.evicted", ...)`: an event is a dotted name as the first argument, or
# either of two (`"a.b" if cut_short else "a.c"`); `log(...)` where the level was chosen
# (warning, or info when it is expected).
CALL = re.compile(r'(?:\.(?:warning|error|exception|critical)|\blog)\(\s*"([a-z_]+\.[a-z_]+)"'
                  r'(?:\s+if\s+[^"]+\s+else\s+"([a-z_]+\.[a-z_]+)")?')
ROW = re.compile(r"^\| (`[a-z_.]+`\\?\*?(?:, `[a-z_.]+`\\?\*?)*) \| (warning|error) \|", re.MULTILINE)


def logged() -> set[str]:
    return {name for package in ("actors", "orchestrator", "transfer") for path in (ROOT / package).rglob("*.py")
            for match in CALL.finditer(path.read_text()) for name in match.groups() if name}


def documented() -> set[str]:
    doc = (ROOT / "docs" / "operations.md").read_text()
    table = doc[doc.index("### Log events"):]
    table = table[:table.index("\n## ")]
    return {name for row in ROW.finditer(table) for name in re.findall(r"`([a-z_.]+)`", row.group(1))}


def test_every_warning_and_error_logged_is_in_the_table_and_no_other() -> None:
    found = logged()
    assert len(found) > 30  # the scan still finds the calls
    assert documented() == found
