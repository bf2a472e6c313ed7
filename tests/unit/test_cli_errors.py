"""The ``triptych`` command meets an ordinary mistake with one line naming it and exit 1."""

from __future__ import annotations

import signal
import socket
from pathlib import Path

import pytest

from orchestrator import cli, metrics


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


@pytest.fixture
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A metrics command that gets as far as serving fails the test instead of serving forever."""
    monkeypatch.setattr(metrics, "serve_metrics", lambda *args, **kwargs: pytest.fail("the exporter started"))


@pytest.mark.usefixtures("never_serve")
@pytest.mark.parametrize(("argv", "says"), [
    (["--scrape-timeout", "0"], "argument --scrape-timeout: expected a positive number of seconds, got '0'"),
    (["--scrape-timeout", "-1"], "argument --scrape-timeout: expected a positive number of seconds, got '-1'"),
    (["--scrape-timeout", "nan"], "argument --scrape-timeout"),
    (["--port", "70000"], "argument --port: expected a port number 0-65535, got '70000'"),
])
def test_metrics_refuses_a_bad_number_as_it_parses(argv: list[str], says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A scrape timeout of 0 or less would time out at once or wait forever; a port past 65535 cannot be bound."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["metrics", *argv])
    assert exited.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.usefixtures("never_serve")
def test_metrics_checks_its_endpoint_before_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    """Not left to each scrape, where it would be an HTTP 500."""
    assert cli.main(["metrics", "--endpoint", "nonsense"]) == 1
    assert capsys.readouterr().err == "triptych metrics: Invalid argument (addr='nonsense')\n"


@pytest.mark.parametrize(("argv", "says"), [
    (["--port", "BUSY"], "Address already in use"),
    (["--host", "192.0.2.1", "--port", "0"], "Cannot assign requested address"),  # a documentation-only address
])
def test_metrics_that_cannot_listen_is_one_line_and_never_says_it_serves(argv: list[str], says: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        assert cli.main(["metrics", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("triptych metrics: ") and says in err and err.count("\n") == 1
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # Ctrl-C works again
