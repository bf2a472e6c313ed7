"""The ``triptych`` command meets an ordinary mistake with one line naming it and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import cli


@pytest.mark.parametrize(("argv", "says"), [
    (["stats", "--config", "/nonexistent/triptych.toml"], "No such file"),
    (["stats", "--config", "MALFORMED"], "MALFORMED: Expected ']'"),
    (["serve", "--config", "CAPACITY0"], "capacity"),
    (["stats", "--endpoint", "foo"], "Invalid argument"),
])
def test_a_mistake_is_one_line_and_exit_1(argv: list[str], says: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    files = {"MALFORMED": "[daemon\n", "CAPACITY0": "[workers.denoiser]\ncapacity = 0\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path / a) if a in files else a for a in argv]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"triptych {argv[0]}: ") and says in err and "\n" not in err
