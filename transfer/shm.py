"""Same-host hand-offs through shared memory: a copy instead of a loopback transfer.

Mooncake over loopback TCP costs 6-8× a memcpy (docs/benchmarks.md, bench-handoff), and the transport
cannot be told apart from a cross-host one. So a worker's pool lives in an anonymous shared
file (``memfd``), still registered with Mooncake for peers elsewhere; at registration the
worker advertises how a peer on its host opens that file (``/proc/<pid>/fd/<fd>``), which
kernel it runs on (the boot id) and the file's identity (device, inode). When the daemon
orders a push between two workers of one kernel it passes the receiver's ``LocalMemory``
along, and the sender copies straight into the receiver's pages.

The sender trusts nothing it is told: it checks that the opened file is a memfd and is the
one advertised (another pid namespace can show another process under the same path), that
it is still open in its owner's process at each copy, and the target range against the
advertised size; anything off raises ``LocalCopyError`` and the push goes through the
engine instead.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections import OrderedDict
from pathlib import Path

import structlog
import torch

from transfer.protocol import LocalMemory

log = structlog.get_logger()

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Receivers whose pools a sender keeps mapped; a restarted receiver is a new file.
MAPPED_PEERS = 64


class LocalCopyError(Exception):
    """The receiver's shared memory cannot be written from here; use the engine."""


def host_id() -> str:
    """Equal for two processes exactly when they share a kernel (and so can share memory)."""
    return BOOT_ID.read_text().strip()


class SharedRegion:
    """Memory a pool can live in that peers on this host can map: a memfd, mapped here.

    The file lives as long as some process has it open or mapped, so it cannot outlive the
    workers using it, whatever way they exit.
    """

    def __init__(self, size: int) -> None:
        fd = os.memfd_create("triptych-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
            stat = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # kept open: peers open it through /proc/<pid>/fd/<fd>
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self._identity = (f"/proc/{os.getpid()}/fd/{fd}", stat.st_dev, stat.st_ino)

    def describe(self, base: int, size: int) -> LocalMemory:
        """What a peer needs to write ``[base, base + size)`` of this region."""
        path, device, inode = self._identity
        return LocalMemory(host=host_id(), path=path, device=device, inode=inode, base=base, size=size)


def shared_region(size: int) -> SharedRegion | None:
    """A ``SharedRegion``, or None where this host will not make one (no memfd, a sandbox):
    the worker then keeps a private pool and every hand-off goes through the engine."""
    try:
        return SharedRegion(size)
    except OSError as exc:
        log.warning("shm.unavailable", size=size, error=str(exc))
        return None


class LocalWriter:
    """Copies local bytes into same-host receivers' shared pools. A writer is used for one
    copy at a time, whichever thread makes it: it unmaps pools it has not used lately, which
    must not happen under another's copy."""

    def __init__(self) -> None:
        # (path, device, inode) -> (the mapping, its address, its length)
        self._mapped: OrderedDict[tuple[str, int, int], tuple[mmap.mmap, int, int]] = OrderedDict()

    def write(self, target: LocalMemory, src_addr: int, dst_addr: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``src_addr`` here to ``dst_addr`` in the receiver's pool."""
        offset = dst_addr - target.base
        if offset < 0 or offset + nbytes > target.size:
            raise LocalCopyError(f"[{dst_addr}, +{nbytes}) is outside the receiver's pool")
        address, length = self._map(target)
        if offset + nbytes > length:  # a cached mapping, and a target claiming more than its file
            raise LocalCopyError(f"[{dst_addr}, +{nbytes}) is past the {length} bytes of {target.path}")
        ctypes.memmove(address + offset, src_addr, nbytes)

    def _map(self, target: LocalMemory) -> tuple[int, int]:
        if target.host != host_id():
            raise LocalCopyError("the receiver runs on another host")
        key = (target.path, target.device, target.inode)
        if key in self._mapped:
            if not _is_open(key):
                # Its receiver exited: a copy would land in memory nobody reads, and report
                # success. The engine says what became of it instead.
                del self._mapped[key]
                raise LocalCopyError(f"the receiver's pool at {target.path} is gone")
            self._mapped.move_to_end(key)
            _, address, length = self._mapped[key]
            return address, length
        self.forget_gone()
        try:
            fd = os.open(target.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise LocalCopyError(f"cannot open the receiver's pool at {target.path}: {exc}") from exc
        try:
            # What was opened, not what the path names now: only a memfd is a worker's pool
            # (a path to any other file, told by a peer, must not be written).
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                raise LocalCopyError(f"{target.path} is no worker's pool: not a memfd")
            stat = os.fstat(fd)
            if (stat.st_dev, stat.st_ino) != (target.device, target.inode) or stat.st_size < target.size:
                raise LocalCopyError(f"{target.path} is not the receiver's pool (another pid namespace?)")
            region = mmap.mmap(fd, target.size)
        finally:
            os.close(fd)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        self._mapped[key] = (region, address, target.size)
        while len(self._mapped) > MAPPED_PEERS:
            self._mapped.popitem(last=False)  # unmapped: copies run one at a time, never into it
        return address, target.size

    def forget_gone(self) -> None:
        """Unmap the pools of receivers that have exited: the mapping alone would keep their
        pages resident (a whole pool each). Done before mapping a new receiver, which may
        have replaced one, and now and then (``RequestMemory.unmap_gone_receivers``) for
        receivers that left for good. Never while one of the writer's copies runs."""
        for key in [key for key in self._mapped if not _is_open(key)]:
            del self._mapped[key]


def _is_open(key: tuple[str, int, int]) -> bool:
    """Whether ``(path, device, inode)`` still names that file: its process has not exited."""
    path, device, inode = key
    try:
        stat = os.stat(path)
    except OSError:
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)
