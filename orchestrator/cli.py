"""The ``triptych`` command: run the daemon and its workers, submit work, inspect, drain, export metrics."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

import anyio
import msgspec
import zmq

from orchestrator.arguments import at_least, connect_endpoint, number, positive_seconds, worker_name
from orchestrator.config import load_config
from orchestrator.connection_watch import NO_DAEMON_S, ConnectionWatch
from orchestrator.endpoints import dial_problem
from transfer.binding import EndpointUnusable

if TYPE_CHECKING:
    from collections.abc import Callable

    from orchestrator.control_client import Control

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.toml"

Answer = TypeVar("Answer")


def _serve(args: argparse.Namespace) -> int:
    from orchestrator.early_signals import keep

    early = keep()  # kept since the process started (orchestrator/entry.py), or from now on
    from orchestrator.daemon import serve
    from orchestrator.log import configure_logging

    cfg = load_config(args.config)
    configure_logging(cfg.log.level, json=cfg.log.json, daemon="orchestrator")
    return _run_logged(partial(serve, early=early, own_process=True), cfg, ordinary=(EndpointUnusable,))


def _worker(args: argparse.Namespace) -> NoReturn:
    from orchestrator.early_signals import keep

    early = keep()  # kept since the process started (orchestrator/entry.py), or from now on
    from orchestrator.limits import UnsatisfiableLimits
    from orchestrator.log import configure_logging
    from orchestrator.stages.base import ModelUnloadable
    from orchestrator.worker import run_worker
    from orchestrator.worker_registration import DaemonUnreachable, WorkerRefused
    from transfer.engine import EngineUnusable
    from transfer.pool import PoolUnallocatable

    cfg = load_config(args.config)
    configure_logging(cfg.log.level, json=cfg.log.json, worker=args.role)
    code = _run_logged(partial(run_worker, early=early), args.role, cfg, args.name, ordinary=(
        WorkerRefused, DaemonUnreachable, EndpointUnusable, UnsatisfiableLimits, ModelUnloadable, EngineUnusable,
        PoolUnallocatable))
    # Everything the worker holds is closed by now (sockets, the engine, its socket file);
    # the interpreter's own finalization would spend ~0.7 s more tearing down torch, on
    # every restart of a worker, for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_logged(main, *args: object, ordinary: tuple[type[Exception], ...]) -> int:
    """Run a process's event loop. An ``ordinary`` failure (a refusal, a port in use: each
    its own exception type, so no bug passes for one) is one line naming it; anything else
    is a crash, logged once with its traceback. Both exit 1."""
    import structlog

    try:
        anyio.run(main, *args, backend="asyncio")
    except Exception as exc:  # a process's outermost catch: nothing above it could
        cause = _sole_cause(exc)
        if isinstance(cause, ordinary):
            structlog.get_logger().error("process.failed", error=f"{type(cause).__name__}: {cause}")
        else:
            structlog.get_logger().error("process.crashed", exc_info=cause)
        return 1
    return 0


def _sole_cause(exc: BaseException) -> BaseException:
    """The one exception inside task-group wrappers (each group of one), or ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _instant_workers(args: argparse.Namespace) -> int:
    from orchestrator.instant_workers import serve

    serve(load_config(args.config), {"encoder": args.encoders, "denoiser": args.denoisers, "decoder": args.decoders})
    return 0


def _submit(args: argparse.Namespace) -> int:
    from orchestrator.submit_command import configured_endpoint, submit, writable_directory

    endpoint = args.endpoint or configured_endpoint(args.config)
    out = writable_directory(Path(args.out))  # before the request: a result it could not write would be lost
    return submit(args, _daemon_at(endpoint), out)


def _control_endpoint(args: argparse.Namespace) -> str:
    """``--endpoint``, or the config's control endpoint."""
    return args.endpoint or load_config(args.config).daemon.control_endpoint


def _control(args: argparse.Namespace) -> Control:
    """The control client (which says "no daemon" itself, within NO_DAEMON_S)."""
    from orchestrator.control_client import Control

    return Control(_check_endpoint(_control_endpoint(args)))


def _daemon_at(endpoint: str) -> str:
    """``endpoint``, once something there took a ZMQ connection (see ``_check_endpoint``)."""
    return _check_endpoint(endpoint, answered_within_s=NO_DAEMON_S)


def _ask(control: Control, question: Callable[[Control], Answer]) -> Answer:
    """``question``'s answer from ``control``. Where another of the daemon's sockets answered,
    a ``ValueError`` saying so, as ``Control`` raises for the worker socket's answer: one
    mistake, one exit status, whichever socket it was."""
    from orchestrator.rejection import Rejection, from_another_socket

    try:
        return question(control)
    except Rejection as exc:
        if from_another_socket(exc):
            raise ValueError(f"{control.endpoint} is not a control socket: {exc.rejected.message}") from None
        raise


def _stats(args: argparse.Namespace) -> int:
    from orchestrator.tables import stats_table

    stats = _ask(_control(args), lambda control: control.stats())
    print(json.dumps(msgspec.to_builtins(stats), indent=2) if args.json else stats_table(stats))
    return 0


def _workers(args: argparse.Namespace) -> int:
    from orchestrator.tables import workers_report

    workers = _ask(_control(args), lambda control: control.workers())
    print(json.dumps(msgspec.to_builtins(workers), indent=2) if args.json else workers_report(workers.instances))
    return 0


def _drain(args: argparse.Namespace) -> int:
    draining = _ask(_control(args), lambda control: control.drain())
    print(f"draining: new requests are refused; requests in flight: {draining.in_flight}. The daemon exits once "
          "they end, or once its drain_timeout_s passes")
    return 0


def _check_endpoint(endpoint: str, *, answered_within_s: float = 0.0) -> str:
    """``endpoint``, checked: ``EndpointUnusable`` for one no peer can connect to (malformed,
    or a ``*`` only the daemon can bind); with ``answered_within_s``, ``TimeoutError`` unless
    something there takes a connection in that time (a command would otherwise wait out its
    whole timeout for a daemon that is not running)."""
    if (problem := dial_problem(endpoint)) is not None:
        raise EndpointUnusable(f"{endpoint} is {problem}")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    watch = ConnectionWatch(sock) if answered_within_s else None
    try:
        sock.connect(endpoint)
        if watch is not None and not watch.wait_connected(answered_within_s):
            raise TimeoutError(watch.why_none(endpoint, answered_within_s))
    finally:
        if watch is not None:
            watch.close()
        sock.close(linger=0)
    return endpoint


def _metrics(args: argparse.Namespace) -> int:
    from orchestrator.control_client import Control
    from orchestrator.metrics import serve_metrics

    # Not _control: the exporter may start before the daemon, and says triptych_up 0 till then.
    control = Control(_control_endpoint(args), timeout_s=args.scrape_timeout)
    # The other commands meet a bad endpoint on their one request; the exporter asks only
    # when scraped, where it would be triptych_up 0 on every scrape instead of one line here.
    _check_endpoint(control.endpoint)
    _not_another_socket(control)
    serve_metrics(control.stats, args.port, args.host,
                  listening=lambda url: print(f"serving Prometheus metrics on {url}", flush=True))
    return 0


def _not_another_socket(control: Control) -> None:
    """``ValueError`` if what answers at ``control``'s endpoint is not a control socket (the
    daemon's client or worker socket); no answer is fine, or a busy one: the daemon may come
    later, or have time then."""
    from orchestrator.rejection import Rejection

    with contextlib.suppress(TimeoutError, ConnectionError, Rejection):
        _ask(control, lambda control: control.stats())


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 for any free one."""
    if not text.isdecimal() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triptych", description="Serve diffusion models disaggregated: run the daemon and its workers, "
                                     "submit work, inspect, drain, export metrics.")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func, help: str, epilog: str | None = None) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".", epilog=epilog)
        p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="cluster TOML (default: %(default)s)")
        p.set_defaults(func=func, usage_error=p.error)  # its own usage, not the list of commands
        return p

    def endpoint(p: argparse.ArgumentParser, key: str) -> None:
        p.add_argument("--endpoint", default="", type=connect_endpoint,
                       help=f"the daemon's socket (default: daemon.{key} in --config)")

    command("serve", _serve, "run the orchestrator daemon")
    p = command("worker", _worker, "run one stage worker")
    p.add_argument("--role", required=True, choices=["encoder", "denoiser", "decoder"])
    p.add_argument("--name", default=None, type=worker_name,
                   help="stable name, unique among live workers; a restart under it replaces the old one "
                        "once that is silent")
    p = command("instant-workers", _instant_workers,
                "zero-work workers that answer orders at once, for measuring the daemon alone")
    p.add_argument("--encoders", type=at_least(1), default=1, help="(default: %(default)s)")
    p.add_argument("--denoisers", type=at_least(1), default=2, help="(default: %(default)s)")
    p.add_argument("--decoders", type=at_least(1), default=1, help="(default: %(default)s)")
    p = command("submit", _submit, "generate and write the outputs",
                epilog="Exit status: 0 written; 2 the daemon refused or failed the request, or the command "
                       "line is wrong (either way the reason is printed); 1 another error (no daemon at the "
                       "endpoint, or another of its sockets; a timeout; a bad config); 130 interrupted (SIGINT), "
                       "143 terminated (SIGTERM), the request cancelled either way.")
    endpoint(p, "client_endpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--width", type=int, default=64, help="pixels (default: %(default)s)")
    p.add_argument("--height", type=int, default=64, help="pixels (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="denoising steps (default: %(default)s)")
    p.add_argument("--guidance", type=number, default=5.0, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--num-images", type=int, default=1, help="(default: %(default)s)")
    p.add_argument("--output", choices=["png", "raw"], default="png", help="(default: %(default)s)")
    p.add_argument("--request-id", default="")
    p.add_argument("--priority", type=int, default=0, help="-100..100; higher is served first")
    p.add_argument("--timeout", type=positive_seconds, default=None, help="seconds; 120 when not given")
    p.add_argument("--progress", action="store_true", help="print where the request stands while it runs")
    p.add_argument("--out", default="out", help="directory the outputs are written to (default: %(default)s)")
    p = command("stats", _stats, "print the daemon's stats")
    endpoint(p, "control_endpoint")
    p.add_argument("--json", action="store_true", help="the Stats message as JSON instead of a table")
    p = command("workers", _workers, "list the registered worker instances")
    endpoint(p, "control_endpoint")
    p.add_argument("--json", action="store_true", help="as JSON instead of a table")
    p = command("drain", _drain, "stop admitting, finish the work in flight, then exit the daemon")
    endpoint(p, "control_endpoint")
    p = command("metrics", _metrics, "serve the daemon's stats as Prometheus metrics over HTTP")
    endpoint(p, "control_endpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=9464, help="0: any free port (default: %(default)s)")
    p.add_argument("--scrape-timeout", type=positive_seconds, default=2.0,
                   help="seconds to wait for the daemon's stats (default: %(default)s)")
    # Whole programs of their own; everything after the name is passed through.
    sub.add_parser("demo", help="run the local demo cluster (see --help)", add_help=False)
    sub.add_parser("bench", help="run the control-plane benchmark (see --help)", add_help=False)
    sub.add_parser("soak", help="run the chaos soak: traffic while workers are killed and frozen (see --help)",
                   add_help=False)
    sub.add_parser("bench-handoff", help="time a large hand-off, Mooncake vs same-host copy (see --help)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("demo", "bench", "bench-handoff", "soak"):
        from orchestrator import bench, demo, handoff_bench, soak

        return {"demo": demo.main, "bench": bench.main, "bench-handoff": handoff_bench.main,
                "soak": soak.main}[args.command](rest)
    if rest:
        args.usage_error(f"unrecognized arguments: {' '.join(rest)}")
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    """Run a command; an ordinary failure is one line on stderr and an exit status."""
    from orchestrator.rejection import Rejection

    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Rejection as exc:
        # The daemon refused the request: at a wrong endpoint (the client socket for the
        # control one), or too busy to answer it.
        print(f"triptych {args.command}: rejected ({exc.reason}): {exc.rejected.message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Whoever read the output left early (`| head`): nothing went wrong here. Stdout
        # goes to /dev/null so the interpreter's last flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (OSError, msgspec.DecodeError, ValueError, TimeoutError, zmq.ZMQError) as exc:
        # An ordinary mistake (a missing or bad config, a daemon not running, a bad
        # endpoint, an unwritable --out): one line naming it, not a traceback.
        print(f"triptych {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
