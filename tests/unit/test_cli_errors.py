"""The ``triptych`` command meets an ordinary mistake with one line naming it and exit 1."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import zmq

from orchestrator import cli, entry, metrics
from orchestrator.connection_watch import NO_DAEMON_S
from orchestrator.limits import UnsatisfiableLimits
from orchestrator.submit_command import as_flags, file_stem
from tests.actors.fake_daemon import CLIENT_SOCKETS_REFUSAL, CONTROL_SOCKETS_REFUSAL, WORKER_SOCKETS_REFUSAL, router_at
from transfer.binding import EndpointUnusable
from transfer.protocol import encode


@pytest.mark.parametrize(("argv", "says"), [
    (["stats", "--config", "/nonexistent/triptych.toml"], "cannot read the config file /nonexistent/triptych.toml"),
    (["stats", "--config", "MALFORMED"], "MALFORMED: Expected ']'"),
    (["serve", "--config", "CAPACITY0"], "capacity"),
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


@pytest.mark.parametrize("command", [["stats"], ["workers"], ["drain"], ["submit", "--prompt", "p"]])
def test_a_command_with_no_daemon_there_says_so_within_seconds(command: list[str], tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Not after its whole timeout (120 s for a submit) of silence."""
    endpoint = f"ipc://{tmp_path}/nobody"
    started = time.monotonic()
    out = ["--out", str(tmp_path)] if command[0] == "submit" else []
    assert cli.main([*command, "--endpoint", endpoint, *out]) == 1
    assert time.monotonic() - started < NO_DAEMON_S + 2
    assert capsys.readouterr().err.strip() == (
        f"triptych {command[0]}: no daemon at {endpoint}: nothing there took a connection within 3s")


def test_a_command_facing_a_daemon_that_does_not_answer_says_so(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A stopped daemon's socket still takes connections (the kernel does), and never
    completes ZMQ's handshake: not "nothing there"."""
    with socket.socket(socket.AF_UNIX) as frozen:
        frozen.bind(str(tmp_path / "frozen"))
        frozen.listen()
        endpoint = f"ipc://{tmp_path}/frozen"
        assert cli.main(["stats", "--endpoint", endpoint]) == 1
    assert capsys.readouterr().err.strip() == (
        f"triptych stats: no daemon answers at {endpoint}: something there took the connection but did not "
        "complete ZMQ's handshake within 3s (a stopped or stuck daemon, or not a ZMQ socket)")


@pytest.mark.parametrize("endpoint", ["foo", "tcp://*:5556", "tcp://127.0.0.1:99999"])
def test_an_endpoint_no_command_can_connect_to_is_a_usage_error(endpoint: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["stats", "--endpoint", endpoint])
    assert exited.value.code == 2 and f"argument --endpoint: {endpoint} is " in capsys.readouterr().err


@pytest.mark.parametrize(("command", "answer", "said"), [
    (["submit"], CONTROL_SOCKETS_REFUSAL, "is not a Triptych client socket: this is the daemon's control socket;"),
    (["submit", "--progress"], CONTROL_SOCKETS_REFUSAL, "is not a Triptych client socket: this is the daemon's "
                                                        "control socket;"),
    (["submit"], WORKER_SOCKETS_REFUSAL, "is not a Triptych client socket: this is the daemon's worker socket;"),
    (["stats"], CLIENT_SOCKETS_REFUSAL, "is not a control socket: this is the daemon's client socket;"),
    (["stats"], WORKER_SOCKETS_REFUSAL, "is not a control socket: this is the daemon's worker socket;"),
], ids=["submit-control", "submit-progress-control", "submit-worker", "stats-client", "stats-worker"])
def test_a_command_at_another_of_the_daemons_sockets_exits_1_whichever_it_is(
    command: list[str], answer: object, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control socket's refusal was exit 2, a refused request's, the worker socket's 1:
    one mistake, two statuses (a client audit). The submit epilog says 1."""
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/daemon"
    daemon = router_at(ctx, endpoint)

    done = threading.Event()

    def answer_everything() -> None:  # as another socket of the daemon's answers each message
        while not done.is_set():
            if daemon.poll(50):
                identity, *_ = daemon.recv_multipart()
                daemon.send_multipart([identity, b"", encode(answer)])

    playing = threading.Thread(target=answer_everything)
    playing.start()
    sigterm = signal.getsignal(signal.SIGTERM)  # a submit takes it, to cancel its request
    try:
        flags = ["--prompt", "p", "--out", str(tmp_path)] if command[0] == "submit" else []
        assert cli.main([*command, *flags, "--endpoint", endpoint]) == 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        done.set()
        playing.join(10)
        daemon.close(linger=0)
        ctx.term()
    err = capsys.readouterr().err
    assert err.startswith(f"triptych {command[0]}: {endpoint} {said}") and err.count("\n") == 1, err


def test_a_usage_error_shows_the_commands_own_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """Not the list of every command."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["stats", "--json", "--bogus"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("usage: triptych stats ")
    assert err.endswith("triptych stats: error: unrecognized arguments: --bogus\n")


def test_a_guidance_of_nan_is_said_to_be_no_number(capsys: pytest.CaptureFixture[str]) -> None:
    """The bound's "Expected `float` >= 0.0" read as if nan were below 0."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["submit", "--prompt", "p", "--guidance", "nan"])
    assert exited.value.code == 2 and "argument --guidance: expected a number, got 'nan'" in capsys.readouterr().err


def test_an_empty_endpoint_is_the_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As when none is given: a script passing an unset variable still reaches the daemon it names."""
    config = tmp_path / "c.toml"
    config.write_text(f'[daemon]\ncontrol_endpoint = "ipc://{tmp_path}/nobody"\n')
    assert cli.main(["stats", "--endpoint", "", "--config", str(config)]) == 1
    assert f"no daemon at ipc://{tmp_path}/nobody" in capsys.readouterr().err


def test_submit_with_an_endpoint_reads_no_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As stats does: a client host given only the daemon's address needs no config file."""
    endpoint = f"ipc://{tmp_path}/nobody"
    assert cli.main(["submit", "--prompt", "p", "--endpoint", endpoint, "--config", "/nonexistent/triptych.toml",
                     "--out", str(tmp_path)]) == 1
    assert f"no daemon at {endpoint}" in capsys.readouterr().err


def test_submit_reads_only_the_client_endpoint_of_its_config(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A client host's copy of the cluster's config need not hold daemon.token, the secret that
    lets a worker register: the checks the daemon makes of the rest are not a client's."""
    config = tmp_path / "c.toml"
    config.write_text(f'[daemon]\nclient_endpoint = "ipc://{tmp_path}/nobody"\nworker_endpoint = "tcp://0.0.0.0:5557"\n'
                      "[workers.denoiser]\ncapacity = 0\n")
    assert cli.main(["submit", "--prompt", "p", "--config", str(config), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"triptych submit: no daemon at ipc://{tmp_path}/nobody: nothing there took a connection within 3s")
    config.write_text("[daemon]\nclient_endpoint = 5555\n")
    assert cli.main(["submit", "--prompt", "p", "--config", str(config), "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"triptych submit: {config}: Expected `str`, got `int` - at `$.daemon.client_endpoint`")


def test_a_configs_wildcard_endpoint_is_one_line_not_a_zmq_error(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon binds tcp://*:PORT; a command reading the same file must be told to name a host."""
    config = tmp_path / "c.toml"
    config.write_text('[daemon]\ncontrol_endpoint = "tcp://*:5556"\n')
    assert cli.main(["stats", "--config", str(config)]) == 1
    assert capsys.readouterr().err.strip() == ("triptych stats: tcp://*:5556 is an address for the daemon to bind, "
                                               "not one to connect to: name the daemon's host and port")


def test_submit_refuses_a_timeout_of_zero_as_it_parses(capsys: pytest.CaptureFixture[str]) -> None:
    """0 used to be read as "none given" and waited the default 120 s."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["submit", "--prompt", "p", "--timeout", "0"])
    assert (exited.value.code == 2
            and "argument --timeout: expected a positive number of seconds" in capsys.readouterr().err)


@pytest.mark.parametrize("name", ["", "n" * 513])
def test_a_worker_name_no_registration_carries_is_a_usage_error(name: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Past 512 characters the worker loaded its model, then every registration was refused."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["worker", "--role", "encoder", "--name", name])
    assert (exited.value.code == 2
            and f"argument --name: expected 1 to 512 characters, got {len(name)}" in capsys.readouterr().err)


@pytest.mark.usefixtures("never_serve")
@pytest.mark.parametrize("out", ["/proc", "/proc/nope", "FILE"])
def test_submit_into_a_directory_it_cannot_write_says_so_before_sending(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, out: str
) -> None:
    """Was found only as the result was written: the request computed, then lost. /proc
    refuses even root, and nothing listens at the endpoint: the refusal comes first. One it
    cannot make (a file's name, a folder of /proc) said only "[Errno 17] File exists"."""
    if out == "FILE":
        (out_path := tmp_path / "a-file").write_text("")
        out = str(out_path)
    assert cli.main(["submit", "--prompt", "p", "--out", out, "--endpoint", "ipc:///nonexistent/client"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"triptych submit: cannot write into --out {out}: ") and err.count("\n") == 1


def test_ids_that_name_files_alike_write_different_files() -> None:
    """An id with a slash (or too long for a file name) is changed, and takes a hash of
    itself: "x/y" became "x_y", and overwrote the outputs of a request named that."""
    assert file_stem("x_y") == "x_y"
    assert file_stem("x/y").startswith("x_y~")
    assert file_stem("🦊" * 128) != file_stem("🦊" * 127 + "🐺")
    assert all(len(file_stem(rid).encode()) <= 200 for rid in ("🦊" * 128, "/" * 128))


def test_metrics_checks_its_endpoint_before_it_serves(capsys: pytest.CaptureFixture[str]) -> None:
    """Not left to each scrape, where it would be an HTTP 500."""
    with pytest.raises(SystemExit) as exited:
        cli.main(["metrics", "--endpoint", "nonsense"])
    assert exited.value.code == 2
    assert "argument --endpoint: nonsense is not tcp://host:port or ipc://path" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--port", "BUSY"], "cannot listen on 127.0.0.1:BUSY: Address already in use"),
    (["--host", "192.0.2.1", "--port", "0"], "cannot listen on 192.0.2.1:0: Cannot assign requested address"),
    (["--host", "no-such-host.invalid", "--port", "0"], "triptych metrics: cannot listen on no-such-host.invalid:0: "),
])
def test_metrics_that_cannot_listen_is_one_line_and_never_says_it_serves(argv: list[str], says: str,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        argv, says = [port if a == "BUSY" else a for a in argv], says.replace("BUSY", port)
        assert cli.main(["metrics", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("triptych metrics: ") and says in err and err.count("\n") == 1
    assert not {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # Ctrl-C works again


async def _fails_at_start(exc: Exception) -> None:
    async with anyio.create_task_group() as tg:  # as the daemon's and the worker's do
        tg.start_soon(_raise, exc)


async def _raise(exc: Exception) -> None:
    raise exc


def test_a_process_that_fails_at_start_logs_one_line_naming_the_cause(logs: list[dict]) -> None:
    in_use = EndpointUnusable("Address already in use: tcp://127.0.0.1:5557")
    assert cli._run_logged(_fails_at_start, in_use, ordinary=(EndpointUnusable,)) == 1
    assert logs == [{"event": "process.failed", "error": f"EndpointUnusable: {in_use}", "log_level": "error"}]


def test_a_crash_is_logged_with_its_own_traceback(logs: list[dict]) -> None:
    bug = ValueError("a bug, not a bad setting")  # the base class of an ordinary failure
    assert cli._run_logged(_fails_at_start, bug, ordinary=(EndpointUnusable, UnsatisfiableLimits)) == 1
    assert logs == [{"event": "process.crashed", "exc_info": bug, "log_level": "error"}]


def test_console_lines_show_no_frame_locals_and_no_colour_codes_in_a_file() -> None:
    """The console renderer's default (rich) prints each frame's locals: the config, its token."""
    script = """if True:
        from orchestrator.log import configure_logging
        import structlog
        configure_logging(json=False)
        def start(token="s3cret-token"):
            raise RuntimeError("boom")
        try:
            start()
        except RuntimeError:
            structlog.get_logger().exception("process.crashed")
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert "RuntimeError: boom" in done.stderr and "s3cret-token" not in done.stderr
    assert "\x1b[" not in done.stderr  # console lines into a file (a pipe here): no colour codes


def test_ctrl_c_before_a_command_runs_exits_130_quietly(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Ctrl-C in the first fifth of a second (the CLI's imports, its parser) printed a
    traceback and died by the signal (a client audit)."""
    def interrupted() -> None:
        raise KeyboardInterrupt  # as Ctrl-C lands in argparse's own imports

    monkeypatch.setattr(cli, "_parser", interrupted)
    monkeypatch.setattr(sys, "argv", ["triptych", "stats"])
    assert entry.main() == 130
    assert capsys.readouterr() == ("", "")


def test_a_reader_that_leaves_early_is_no_error(tmp_path: Path) -> None:
    """`triptych stats --json | head -1`: the rest of the output has nowhere to go."""
    long_stats = "cli._stats = lambda args: print(json.dumps(list(range(100000)), indent=2)) or 0"
    done = subprocess.run(
        f'{sys.executable} -c "import json, sys; from orchestrator import cli; {long_stats}; '
        f"sys.exit(cli.main(['stats']))\" | head -1",
        shell=True, capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.stdout == "[\n" and done.stderr == ""


def test_a_submit_refused_unsent_names_the_flags_not_the_wire_fields() -> None:
    """A new user typed --steps 5000 and was told of `$.params.steps`, a field of a message
    they never saw."""
    assert as_flags("not sent: Expected `int` <= 1000 - at `$.params.steps`") == \
        "not sent: Expected `int` <= 1000 - at --steps"
    assert as_flags("not sent: Expected `float` <= 86400.0 - at `$.timeout_s`").endswith("at --timeout")
    assert as_flags("not sent: Expected `int` >= 1 - at `$.params.num_images`").endswith("at --num-images")
    said = "steps 1000 exceeds 999 for model 'tiny-sd15'"
    assert as_flags(said) == said
