"""The data plane: one-sided writes from our registered pool into a peer's.

``Engine`` is the interface the worker runtime codes against; ``MooncakeEngine`` implements
it over Mooncake's TransferEngine (TCP in CI, RDMA in production), and tests may supply a
loopback fake. Facts measured on Mooncake that shaped this wrapper:

* A write is ``transfer_submit_write`` plus our own ``transfer_check_status`` poll, which
  sleeps between checks. ``transfer_sync_write`` busy-spins a core in C++ until the TCP ack
  arrives; on a 2-core box the peer whose ack it waits for needs that same CPU, so a 64-byte
  push cost the sender ~2 ms of CPU and several ms of wall.
* The id is a raw pointer that ``transfer_check_status`` frees when it returns 1 (done) or -1
  (failed): re-polling it reads freed memory (``0`` forever, or SIGSEGV), as does a bogus id.
  So an id is polled only by the ``write`` that submitted it, and never after 1 or -1. A failed
  submit returns 0, which is not an id.
* Status 1 means the bytes are in the peer's memory (TCP protocol v2 acks after the last chunk
  lands; RDMA completion), so the caller may tell the receiver then.
* A hung peer does not fail fast: the status stays 0 until Mooncake's TCP progress timeout
  (30 s) turns it into -1. We stop polling at our own deadline (``MC_TRANSFER_TIMEOUT`` + 1 ns
  per byte + 1 s) or on status -2, and then leave the id alone: Mooncake keeps that request in
  flight (a small leak) and may still read the source bytes later, as a timed-out sync write
  would too.
* The first write to a peer shakes hands with it (its segment descriptor, over its RPC port)
  inside the submit. A peer that takes the connection but does not answer holds that for
  about a minute, after which the write would still go ahead: so an empty write goes first
  (``_open``), and no write starts whose deadline passed meanwhile.
* TCP accepts an unregistered local source that RDMA would reject, so we check the source
  range ourselves: a missing registration fails in CI, not first in production.
* After a peer rejects a write the connection's lanes are torn down; once all are gone the
  next write fails at once with -1 and a retry succeeds after a ~1 s reconnect. Hence one
  retry after a failure (not after a timeout), and no more: a dead peer fails both attempts
  within about a millisecond. A -1 that comes only after a write was stuck for a while is
  a timeout in disguise, in doubt like one.

Threads: transfer calls release the GIL and ``write`` blocks (sleeping) until done, so it runs
on a worker thread. Use at most one concurrent writer per engine (the worker runtime has one
push thread): parallel writers on one engine were several times slower than one.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol, runtime_checkable

import structlog

from orchestrator.config import TransferConfig, transfer_timeout_s

log = structlog.get_logger()

P2P = "P2PHANDSHAKE"

# transfer_check_status results (for single-entry ids only: it looks at task 0).
_DONE, _PENDING, _FAILED, _TIMED_OUT = 1, 0, -1, -2
# Poll backoff: check at once, then sleep 20 us, 40 us, ... up to 1 ms between checks. A small
# loopback write lands in ~50 us, so most are seen done at the first or second check.
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 1e-3
_GRACE_S = 1.0  # our deadline trails Mooncake's own timeout by this much


def write_limit_s(write_timeout_s: float, nbytes: int) -> float:
    """How long a write of ``nbytes`` may take before it is given up on: Mooncake's own
    timeout, 1 ns a byte, and a grace. The daemon times a sender's push report by it too."""
    return write_timeout_s + nbytes * 1e-9 + _GRACE_S


# A write refused or cut off fails within milliseconds (a rejected range, a dead peer). One
# that fails only after this long was stuck: what it sent may wait in a stalled peer's
# socket buffers and land when the peer resumes (measured: a SIGSTOPped peer's write gave
# -1 at Mooncake's 30 s timeout, and the bytes landed at SIGCONT). So it is in doubt.
_STUCK_S = 1.0
# A batch id is a user-space pointer. Anything outside this range is a failure code (0 from
# this wheel; some Mooncake builds return -1 as an unsigned id), and polling it would segfault.
_MAX_ID = 1 << 57

# Mooncake's register_memory codes we can explain (others are reported raw).
_REGISTER_ERRORS = {
    -7: "overlaps a range already registered (Mooncake refuses overlapping regions)",
}


class TransferError(Exception):
    """The data plane could not start, register, or complete a write."""


class EngineUnusable(TransferError):
    """The engine cannot start here, or take this process's memory: a setup problem (its
    settings, a metadata server, the machine), said in one line as the worker starts."""


class TransferInDoubt(TransferError):
    """A write we stopped waiting for: Mooncake may still complete it, so the destination
    must not be reused until its own timeout has surely passed (``push_quarantine_s``)."""


@runtime_checkable
class Engine(Protocol):
    """What the worker runtime needs from a data plane."""

    session: str  # the segment name peers use to write to us
    write_timeout_s: float  # how long a write is waited for before it is in doubt

    def register(self, base: int, size: int) -> None: ...

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        """Blocking write of local bytes to a peer's registered memory; TransferError on failure."""
        ...

    def close(self) -> None: ...


class MooncakeEngine:
    """Owns one Mooncake TransferEngine and the local ranges registered with it."""

    def __init__(self, cfg: TransferConfig) -> None:
        # Mooncake reads its knobs from the environment when the engine starts, so export
        # them first. The config overrides the shell (no setdefault): the file is the one
        # place that decides the transport. Keys the config does not name are left alone.
        # The environment is process-wide: every engine in this process sees these values.
        os.environ.update(cfg.env)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            # Not installed, or a library its engine links is missing (libibverbs1 and the like).
            raise EngineUnusable(
                f"the mooncake transfer engine cannot be imported ({exc}): scripts/_env.sh installs it "
                "(mooncake-transfer-engine-non-cuda, or -cuda13 where nvidia-smi sees a GPU) and names the "
                "Debian libraries it needs"
            ) from exc

        self._te = TransferEngine()
        rc = self._te.initialize(cfg.local_hostname, cfg.metadata_server, cfg.protocol, cfg.device_name)
        if rc != 0:
            raise EngineUnusable(
                f"mooncake initialize failed (rc={rc}) with local_hostname={cfg.local_hostname!r} "
                f"metadata_server={cfg.metadata_server!r} protocol={cfg.protocol!r} "
                f"device_name={cfg.device_name!r}; MC_FORCE_HCA without an RNIC, an unreachable "
                "metadata server, or a duplicate segment name all cause this"
            )
        if cfg.metadata_server == P2P:
            # Peer-to-peer handshake: Mooncake ignores any port in local_hostname and picks a
            # free RPC port; that port is part of the name peers must use.
            self.session = f"{cfg.local_host}:{self._te.get_rpc_port()}"
        else:
            # With a metadata server the hostname string itself is the (unique) segment name.
            self.session = cfg.local_hostname
        # Mooncake has just read MC_TRANSFER_TIMEOUT from the environment; our deadline follows it.
        self.write_timeout_s = transfer_timeout_s(os.environ.get("MC_TRANSFER_TIMEOUT"))
        # Replaced, never mutated, so a writer thread always sees a consistent tuple.
        self._ranges: tuple[tuple[int, int], ...] = ()
        self._opened: set[str] = set()  # sessions shaken hands with (``_open``)
        self._closed = False

    def register(self, base: int, size: int) -> None:
        """Register ``[base, base+size)`` as a source and a target of transfers.

        Register before pushing starts; keep the memory alive until ``close()``.
        """
        self._check_open()
        if size <= 0:
            raise TransferError(f"cannot register {size} bytes at {base:#x}")
        # location "*": Mooncake finds the memory's NUMA node (CPU) or device (CUDA) itself.
        rc = self._te.register_memory(base, size, "*")
        if rc != 0:
            why = _REGISTER_ERRORS.get(rc, "see the Mooncake log")
            raise EngineUnusable(f"register [{base:#x}, +{size}) failed (rc={rc}): {why}")
        self._ranges = (*self._ranges, (base, size))

    def write(self, session: str, local_addr: int, remote_addr: int, nbytes: int) -> None:
        """Copy ``nbytes`` from our registered memory to ``remote_addr`` in ``session``.

        Blocks until the bytes are in the peer's memory. Call from a worker thread.
        """
        self._check_open()
        if nbytes < 0:
            raise TransferError(f"cannot write {nbytes} bytes")
        if nbytes == 0:
            return
        if not any(b <= local_addr and local_addr + nbytes <= b + s for b, s in self._ranges):
            raise TransferError(
                f"local source [{local_addr:#x}, +{nbytes}) is not inside one registered range "
                f"(RDMA would reject it; registered: {[(hex(b), s) for b, s in self._ranges]})"
            )
        te = self._te  # held for the whole write, so a concurrent close() cannot pull it away
        limit_s = write_limit_s(self.write_timeout_s, nbytes)
        deadline = time.monotonic() + limit_s
        if session not in self._opened:
            self._open(te, session, local_addr, remote_addr, nbytes, limit_s)
        if not self._attempt(te, session, local_addr, remote_addr, nbytes, deadline):
            log.warning("transfer.retry", session=session, nbytes=nbytes)
            if not self._attempt(te, session, local_addr, remote_addr, nbytes, deadline):
                raise TransferError(
                    f"write of {nbytes} bytes from {local_addr:#x} to {session} at {remote_addr:#x} "
                    "failed twice: peer unreachable or dead, or remote range not registered there"
                )

    def _open(self, te: Any, session: str, local_addr: int, remote_addr: int, nbytes: int, limit_s: float) -> None:
        """Shake hands with ``session`` before the first byte goes there.

        Mooncake does it inside the first write's submit, and a peer that takes the
        connection but does not answer (stopped, frozen, its handshake port held by idle
        connections) holds that handshake for up to a minute: a write that then went ahead
        would land long after the daemon gave up on it, in memory it may have handed to
        another request meanwhile. So an empty write goes first (Mooncake's own lookup call,
        ``get_first_buffer_address``, holds the GIL all that time: the worker's loop would
        stop), and a write whose deadline passed during it never starts. A peer that cannot
        be opened at all fails the empty write at once and is left to the real one, which
        fails at once too (and is retried once, as any quick failure).
        """
        started = time.monotonic()
        try:
            opened = self._attempt(te, session, local_addr, remote_addr, 0, started + limit_s)
        except TransferError:  # stuck, then failed or timed out: an empty write lands nothing
            opened = False
        took_s = time.monotonic() - started
        if took_s >= limit_s:
            raise TransferError(f"write of {nbytes} bytes to {session}: the handshake with it took {took_s:.1f} s, "
                                f"past the write's {limit_s:.1f} s: not started (a peer that does not answer)")
        if opened:
            self._opened.add(session)

    def _attempt(self, te: Any, session: str, local_addr: int, remote_addr: int, nbytes: int,
                 deadline: float) -> bool:
        """Submit one write and poll it until ``deadline`` (monotonic): True when done, False
        when it failed (worth one retry).

        Raises TransferInDoubt when it times out, leaving the id to Mooncake untouched, and
        TransferError, submitting nothing, once ``deadline`` has passed: a write started then
        (after a handshake, a retry, or the worker standing still) could land after the
        daemon has handed its target to another request.
        """
        submitted_at = time.monotonic()
        if submitted_at >= deadline:
            raise TransferError(f"write of {nbytes} bytes to {session}: its deadline passed before it was submitted "
                                "(a slow handshake, or the worker stood still): not started")
        batch_id = te.transfer_submit_write(session, local_addr, remote_addr, nbytes)
        if not 0 < batch_id < _MAX_ID:  # nothing was submitted, so there is no id to poll
            took_s = time.monotonic() - submitted_at
            if took_s < _STUCK_S:
                return False
            # A handshake with a peer that does not answer (see _open): a retry would wait as long.
            raise TransferError(f"write of {nbytes} bytes to {session}: the submit failed after {took_s:.1f} s "
                                "(the handshake with a peer that does not answer)")
        started = time.monotonic()
        sleep_s = _FIRST_SLEEP_S
        while True:
            status = te.transfer_check_status(batch_id)
            # _DONE and _FAILED have freed the id: return without touching it again.
            if status == _DONE:
                return True
            now = time.monotonic()
            pending_s = now - started
            if status == _FAILED and pending_s < _STUCK_S:
                return False
            if status != _PENDING or now >= deadline:
                if status == _PENDING:
                    why = f"not done after {pending_s:.1f} s"
                elif status == _TIMED_OUT:
                    why = "Mooncake reported a timeout"
                elif status == _FAILED:
                    why = f"failed only after {pending_s:.1f} s: stuck, not refused"
                else:
                    why = f"unexpected status {status}"
                raise TransferInDoubt(
                    f"write of {nbytes} bytes from {local_addr:#x} to {session} at {remote_addr:#x} "
                    f"timed out ({why}): peer hung or overloaded. Mooncake may still hold the "
                    "request and read the source bytes later"
                )
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)

    def close(self) -> None:
        """Unregister everything and drop the engine, which stops its RPC server.

        Dropping the Mooncake engine holds the GIL for about a second while its threads
        join; this is a shutdown-only call.
        """
        if self._closed:
            return
        self._closed = True
        for base, size in self._ranges:
            rc = self._te.unregister_memory(base)
            if rc != 0:  # shutting down anyway: report and carry on
                log.warning("transfer.unregister_failed", base=hex(base), size=size, rc=rc)
        self._ranges = ()
        del self._te

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"engine {self.session} is closed")


