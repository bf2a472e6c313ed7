"""A worker's registration with the daemon, and its watch for the daemon forgetting it."""

from __future__ import annotations

import math
import time

import anyio
import structlog
import zmq.asyncio

from orchestrator.connection_watch import silence_causes
from transfer.protocol import (
    CLIENT_REPLY,
    DAEMON_TO_WORKER,
    DECODE_ERRORS,
    Register,
    Registered,
    RegisterRefused,
    Rejected,
    encode,
)

log = structlog.get_logger()

REGISTER_RETRY_S = 2.0


class WorkerRefused(RuntimeError):
    """The daemon refused this worker for good (bad token or protocol, a name in use, another
    model, a work address it cannot reach); a refusal that says rejoin is not one."""


class DaemonUnreachable(TimeoutError):
    """No daemon answered the registration within ``connect_timeout_s``."""


def decode_reply(frames: list[bytes], endpoint: str) -> Registered | RegisterRefused | None:
    """The daemon's answer; None (logged) for one that cannot be read. An answer in a REQ
    envelope comes from a client or control socket, not the worker socket: ``WorkerRefused``
    says so at once, rather than the worker retrying it until connect_timeout_s."""
    if len(frames) == 2 and frames[0] == b"":
        try:
            answer = CLIENT_REPLY.decode(frames[1])
        except DECODE_ERRORS:
            answer = None
        said = answer.message if isinstance(answer, Rejected) else "something that is no worker socket's answer"
        raise WorkerRefused(f"daemon.worker_endpoint ({endpoint}) is not the daemon's worker socket: it answered "
                            f"{said!r}")
    try:
        return DAEMON_TO_WORKER.decode(frames[-1])
    except DECODE_ERRORS as exc:
        log.warning("worker.bad_reply", error=str(exc))
        return None


async def register(dealer: zmq.asyncio.Socket, hello: Register, endpoint: str, *,
                   patience: tuple[float, str] | None, log: structlog.typing.FilteringBoundLogger) -> Registered:
    """Send ``hello`` to the daemon at ``endpoint`` until it answers ``Registered``: for
    ``patience`` (seconds, and the setting that says so), or for as long as it takes (None)."""
    deadline = math.inf if patience is None else time.monotonic() + patience[0]
    # Retried until the daemon is up; the daemon answers a repeat on a live connection
    # with nothing, so duplicates are harmless.
    tries = 0
    deferred = ""  # the last "not now" the daemon gave
    while time.monotonic() < deadline:
        await dealer.send(encode(hello))
        with anyio.move_on_after(REGISTER_RETRY_S):
            while True:
                reply = decode_reply(await dealer.recv_multipart(), endpoint)
                if isinstance(reply, Registered):
                    return reply
                if isinstance(reply, RegisterRefused) and not reply.rejoin:
                    raise WorkerRefused(reply.message)
                # Any other refusal says rejoin: "not now" (deferred: a live worker holds
                # this one's name or session, said once per reason), or it answers a
                # heartbeat sent before the daemon forgot us, or it is a stopping
                # daemon's farewell, repeated.
                if isinstance(reply, RegisterRefused) and reply.deferred and reply.message != deferred:
                    deferred = reply.message
                    log.warning("worker.registration_deferred", why=deferred)
        tries += 1
        if tries == 1 and not deferred:  # said once: a worker waiting for its daemon is not stuck
            log.info("worker.waiting_for_daemon", endpoint=endpoint,
                     gives_up_in_s=None if patience is None else round(deadline - time.monotonic()))
    assert patience is not None  # only a deadline ends the loop
    waited = f"{patience[0]}s ({patience[1]})"
    if deferred:
        raise WorkerRefused(f"the daemon did not take this worker within {waited}: {deferred}")
    raise DaemonUnreachable(f"no answer from the daemon at {endpoint} within {waited}{silence_causes(endpoint)}")


async def watch_daemon(dealer: zmq.asyncio.Socket, endpoint: str) -> RegisterRefused:
    """Return the refusal that says the daemon forgot this worker; raise on any other."""
    while True:
        reply = decode_reply(await dealer.recv_multipart(), endpoint)
        if isinstance(reply, RegisterRefused):
            if reply.rejoin:
                return reply
            raise WorkerRefused(f"the daemon dropped this worker: {reply.message}")
