"""``triptych submit``: one request from the command line, its outputs written to files.

Imported by cli.py only when a submit runs: the other commands do not load the client library.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import signal
import sys
import tempfile
import uuid
from pathlib import Path
from typing import NoReturn

import anyio
import msgspec

from orchestrator.client import AsyncClient, Client, Generation
from orchestrator.config import DaemonConfig, read_config
from orchestrator.rejection import Rejection, from_another_socket
from orchestrator.tables import STAGES_HEADER, progress_line, stage_row
from transfer.protocol import GenParams, Progress


class _DaemonAddress(msgspec.Struct, frozen=True):
    client_endpoint: str = DaemonConfig().client_endpoint


class _ClientSide(msgspec.Struct, frozen=True):
    """What a client reads of the cluster's config: ``daemon.client_endpoint``, the rest
    ignored. A client host then needs neither the workers' sections nor ``daemon.token``
    (the secret that lets whoever holds it register as a worker and read the prompts), nor
    a copy that passes the checks the daemon makes of them."""

    daemon: _DaemonAddress = _DaemonAddress()


def configured_endpoint(config: Path) -> str:
    """``daemon.client_endpoint`` in the config file ``config``; errors name the file."""
    return read_config(config, _ClientSide).daemon.client_endpoint


def _say(line: str) -> None:
    """Print ``line`` to stderr. Once nobody reads it (`2>&1 | head -2`), print nothing more:
    the request runs on and its outputs are written, and the exit status is its outcome's,
    not a broken pipe's (which ``triptych``'s rule for `| head` would have made 0, the
    request cancelled and nothing written)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        # To /dev/null: what is still buffered, and the lines to come, go nowhere quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        os.close(devnull)


def _print_progress(progress: Progress) -> None:
    _say(progress_line(progress))


def _generate(endpoint: str, params: GenParams, args: argparse.Namespace, rid: str) -> Generation:
    """One request; with ``--progress`` on a DEALER, printing each ``Progress`` to stderr."""
    options = {"request_id": rid, "timeout_s": args.timeout, "priority": args.priority}
    if not args.progress:
        with Client(endpoint) as client:
            return client.submit(params, **options)

    async def watched() -> Generation:
        # On the loop, SIGTERM cancels the wait as asyncio's runner cancels it on Ctrl-C. Raised
        # from the handler, _Terminated would land in whichever task runs, the client's reader
        # mid-receive most often under a stream of progress: that ends the reader, and the
        # client's close then reports it as a crash, traceback and all.
        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as wait:
            signal.signal(signal.SIGTERM, lambda _signum, _frame: loop.call_soon_threadsafe(wait.cancel))
            try:
                async with AsyncClient(endpoint) as client:
                    return await client.submit(params, on_progress=_print_progress, **options)
            finally:
                signal.signal(signal.SIGTERM, _terminate)
        raise _Terminated

    return anyio.run(watched)


class _Terminated(KeyboardInterrupt):
    """SIGTERM during ``triptych submit``, raised as Ctrl-C is so that both clients cancel the
    request: it is what ``timeout(1)``, systemd and Kubernetes send, and by default it would
    end the process with the request left running at the daemon for nobody."""


def _terminate(_signum: int, _frame: object) -> NoReturn:
    raise _Terminated


def submit(args: argparse.Namespace, endpoint: str, out: Path) -> int:
    """Send the request ``args`` describe to the daemon at ``endpoint``, write its outputs into
    ``out`` and print their paths and the stage timings; the exit status."""
    params = GenParams(prompt=args.prompt, negative_prompt=args.negative_prompt, width=args.width,
                       height=args.height, steps=args.steps, guidance=args.guidance, seed=args.seed,
                       num_images=args.num_images, output=args.output)
    rid = args.request_id or uuid.uuid4().hex  # chosen here, to name it if Ctrl-C cancels it
    signal.signal(signal.SIGTERM, _terminate)
    try:
        generation = _generate(endpoint, params, args, rid)
    except Rejection as exc:
        if from_another_socket(exc):  # the daemon's control socket: as the worker socket's answer is said
            raise ValueError(f"{endpoint} is not a Triptych client socket: {exc.rejected.message}") from None
        _say(f"rejected ({exc.reason}): {as_flags(exc.rejected.message)}")
        return 2
    except _Terminated:
        _say(f"terminated: request {rid} cancelled")
        return 143
    except KeyboardInterrupt:  # both clients cancel a request whose wait is interrupted
        _say(f"interrupted: request {rid} cancelled")
        return 130
    # All written before any is printed: a reader of stdout that leaves early (`| head -1`)
    # ends the printing, and would have ended the writing with it.
    paths = _write_outputs(generation, out, rid)
    for spec, path in zip(generation.result.outputs, paths, strict=True):
        print(path if spec.name.endswith(".png") else f"{path}  {spec.dtype} {tuple(spec.shape)}")
    print(STAGES_HEADER)
    for stage in generation.result.stages:
        print(stage_row(stage))
    return 0


def _write_outputs(generation: Generation, out: Path, rid: str) -> list[Path]:
    """Write ``generation``'s outputs into ``out``, each a file named for ``rid`` and itself; their paths."""
    paths = []
    for spec, data in zip(generation.result.outputs, generation.frames, strict=True):
        path = out / f"{file_stem(rid)}-{spec.name}{'' if spec.name.endswith('.png') else '.bin'}"
        try:
            _write_whole(path, data)
        except OSError as exc:
            raise OSError(f"request {rid} completed, but {path} could not be written: {exc.strerror or exc}") from None
        paths.append(path)
    return paths


def _write_whole(path: Path, data: bytes | bytearray) -> None:
    """Write ``data`` to ``path`` under a hidden name beside it, renamed once whole: a write
    that fails (a full disk) leaves no short file under a name a later job looks for."""
    part = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.part")
    file = part.open("xb")  # x: a name of its own, never another file
    try:
        with file:
            file.write(data)
        part.replace(path)
    except BaseException:  # a Ctrl-C in a long write too
        part.unlink(missing_ok=True)
        raise


# The Submit fields a refusal unsent names (``- at `$.params.steps```) as the flags that set them.
_FIELD_FLAGS = {"$.timeout_s": "--timeout", "$.request_id": "--request-id", "$.priority": "--priority"}


def as_flags(message: str) -> str:
    """A refusal's message naming ``submit``'s flags where it names the Submit's fields."""
    def flag(match: re.Match[str]) -> str:
        field = match.group(1)
        name = field.removeprefix("$.params.")
        return _FIELD_FLAGS.get(field) or ("--" + name.replace("_", "-") if name != field else field)

    return re.sub(r"`?(\$\.[a-z_.]+)`?", flag, message)


def writable_directory(out: Path) -> Path:
    """``out``, made if missing and found writable before the request is sent: a result
    that cannot be written would be computed (GPU time) and then lost."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise OSError(f"cannot write into --out {out}: {exc.strerror or exc}") from None
    return out


def file_stem(rid: str) -> str:
    """The request id as the start of its output files' names, so another submit into the
    same --out overwrites nothing: no slash (it would lead out of --out), and short enough
    for any file system (an id may be 128 characters of 4 UTF-8 bytes each). An id that
    had to change takes a hash of itself, so "x/y" and "x_y" stay apart."""
    if "/" not in rid and len(rid.encode()) <= 100:
        return rid
    return f"{rid.replace('/', '_')[:24]}~{hashlib.blake2b(rid.encode(), digest_size=6).hexdigest()}"
