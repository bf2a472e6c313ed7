"""``triptych submit``: one request from the command line, its outputs written to files.

Imported by cli.py only when a submit runs: the other commands do not load the client library.
"""

from __future__ import annotations

import argparse
import hashlib
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
from orchestrator.config import DaemonConfig
from orchestrator.rejection import Rejection
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
    """``daemon.client_endpoint`` in the config file ``config``; errors name the file, as
    ``load_config``'s do."""
    try:
        return msgspec.toml.decode(config.read_bytes(), type=_ClientSide).daemon.client_endpoint
    except OSError as exc:
        raise OSError(f"cannot read the config file {config}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:  # a ValidationError too
        raise msgspec.DecodeError(f"{config}: {exc}") from None


def _print_progress(progress: Progress) -> None:
    print(progress_line(progress), file=sys.stderr)


def _generate(endpoint: str, params: GenParams, args: argparse.Namespace, rid: str) -> Generation:
    """One request; with ``--progress`` on a DEALER, printing each ``Progress`` to stderr."""
    options = {"request_id": rid, "timeout_s": args.timeout, "priority": args.priority}
    if not args.progress:
        with Client(endpoint) as client:
            return client.submit(params, **options)

    async def watched() -> Generation:
        async with AsyncClient(endpoint) as client:
            return await client.submit(params, on_progress=_print_progress, **options)

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
        print(f"rejected ({exc.reason}): {as_flags(exc.rejected.message)}", file=sys.stderr)
        return 2
    except _Terminated:
        print(f"terminated: request {rid} cancelled", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # both clients cancel a request whose wait is interrupted
        print(f"interrupted: request {rid} cancelled", file=sys.stderr)
        return 130
    for spec, data in zip(generation.result.outputs, generation.frames, strict=True):
        suffix = "" if spec.name.endswith(".png") else ".bin"
        path = out / f"{file_stem(rid)}-{spec.name}{suffix}"
        try:
            path.write_bytes(data)
        except OSError as exc:
            raise OSError(f"request {rid} completed, but {path} could not be written: {exc.strerror or exc}") from None
        print(path if suffix == "" else f"{path}  {spec.dtype} {tuple(spec.shape)}")
    print(STAGES_HEADER)
    for stage in generation.result.stages:
        print(stage_row(stage))
    return 0


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
