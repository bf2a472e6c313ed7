"""Same-host copies: a worker's pool in shared memory, written by a peer that opens it by path
and trusts nothing it was told without checking."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import pytest
import torch

from transfer.pool import MemoryPool
from transfer.shm import LocalCopyError, LocalWriter, SharedRegion, shared_region

SIZE = 1 << 16


def test_a_peer_process_writes_into_the_region_through_its_path() -> None:
    region = SharedRegion(SIZE)
    pool = MemoryPool(SIZE, memory=region.tensor)
    target = region.describe(pool.base, pool.size)
    assert pool.base == region.tensor.data_ptr() and target.size == SIZE
    peer = f"""
import msgspec, torch
from transfer.protocol import LocalMemory
from transfer.shm import LocalWriter
target = msgspec.json.decode({msgspec.json.encode(target).decode()!r}, type=LocalMemory)
src = torch.arange(256, dtype=torch.uint8)
LocalWriter().write(target, src.data_ptr(), target.base + 4096, 256)
"""
    subprocess.run([sys.executable, "-c", peer], check=True, timeout=60)
    assert torch.equal(pool.buffer[4096:4352], torch.arange(256, dtype=torch.uint8))
    assert not pool.buffer[:4096].any() and not pool.buffer[4352:].any()


def test_a_write_that_cannot_be_trusted_is_refused() -> None:
    region = SharedRegion(SIZE)
    target = region.describe(region.tensor.data_ptr(), SIZE)
    src = torch.ones(64, dtype=torch.uint8)
    writer = LocalWriter()
    with pytest.raises(LocalCopyError, match="outside"):
        writer.write(target, src.data_ptr(), target.base + SIZE - 32, 64)
    with pytest.raises(LocalCopyError, match="outside"):
        writer.write(target, src.data_ptr(), target.base - 1, 64)
    with pytest.raises(LocalCopyError, match="another host"):
        writer.write(msgspec.structs.replace(target, host="elsewhere"), src.data_ptr(), target.base, 64)
    with pytest.raises(LocalCopyError, match="not the receiver's pool"):
        writer.write(msgspec.structs.replace(target, inode=target.inode + 1), src.data_ptr(), target.base, 64)
    with pytest.raises(LocalCopyError, match="cannot open"):
        writer.write(msgspec.structs.replace(target, path="/proc/self/fd/999999"), src.data_ptr(), target.base, 64)
    with tempfile.NamedTemporaryFile() as other:  # a file that is no pool, told with its true identity
        other.truncate(SIZE)
        stat = os.fstat(other.fileno())
        with pytest.raises(LocalCopyError, match="not a memfd"):
            writer.write(msgspec.structs.replace(target, path=other.name, device=stat.st_dev, inode=stat.st_ino),
                         src.data_ptr(), target.base, 64)
        assert not Path(other.name).read_bytes().strip(b"\0")
    assert not region.tensor.any()  # nothing was written by any of them
    writer.write(target, src.data_ptr(), target.base, 64)
    assert int(region.tensor.sum()) == 64


def test_a_pool_lives_in_the_memory_it_is_given_only_if_it_fits_and_is_aligned() -> None:
    region = SharedRegion(SIZE)
    with pytest.raises(ValueError, match="aligned"):
        MemoryPool(SIZE, memory=region.tensor[1:])
    with pytest.raises(ValueError, match="aligned"):
        MemoryPool(SIZE * 2, memory=region.tensor)


def test_a_host_that_cannot_share_memory_gets_no_region_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                       logs: list[dict]) -> None:
    def refuse(*_: object) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "memfd_create", refuse)
    assert shared_region(SIZE) is None
    assert [entry["event"] for entry in logs] == ["shm.unavailable"]


def test_a_mapped_pool_is_not_written_past_its_file_whatever_a_later_order_claims() -> None:
    """The first copy maps the file at its true size; a later target naming the same file
    with a larger size must not turn that mapping into a write past its end."""
    region = SharedRegion(SIZE)
    target = region.describe(region.tensor.data_ptr(), SIZE)
    src = torch.ones(4096, dtype=torch.uint8)
    writer = LocalWriter()
    writer.write(target, src.data_ptr(), target.base, 64)  # mapped now
    lying = msgspec.structs.replace(target, size=SIZE * 1024)
    with pytest.raises(LocalCopyError, match="past the"):
        writer.write(lying, src.data_ptr(), target.base + SIZE, 4096)
    assert int(region.tensor.sum()) == 64


def test_the_pool_of_a_receiver_that_exited_is_unmapped_when_another_is_mapped() -> None:
    """A mapping keeps a dead receiver's pages resident; its /proc path is gone with it."""
    writer = LocalWriter()
    src = torch.ones(64, dtype=torch.uint8)
    gone = SharedRegion(SIZE)
    writer.write(gone.describe(gone.tensor.data_ptr(), SIZE), src.data_ptr(), gone.tensor.data_ptr(), 64)
    os.close(gone._fd)  # as if its process exited: the path no longer names the file
    other = SharedRegion(SIZE)
    writer.write(other.describe(other.tensor.data_ptr(), SIZE), src.data_ptr(), other.tensor.data_ptr(), 64)
    assert [path for path, _, _ in writer._mapped] == [other.describe(0, SIZE).path]


def test_a_copy_to_a_receiver_that_exited_fails_even_with_its_pool_mapped() -> None:
    """It would land in memory nobody reads and report success: the push goes through the
    engine instead, which says what became of the receiver."""
    writer = LocalWriter()
    src = torch.ones(64, dtype=torch.uint8)
    gone = SharedRegion(SIZE)
    target = gone.describe(gone.tensor.data_ptr(), SIZE)
    writer.write(target, src.data_ptr(), target.base, 64)  # mapped now
    os.close(gone._fd)  # as if its process exited
    with pytest.raises(LocalCopyError, match="is gone"):
        writer.write(target, src.data_ptr(), target.base + 64, 64)
    assert int(gone.tensor.sum()) == 64 and not writer._mapped
