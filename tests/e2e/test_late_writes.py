"""Bytes written into a receiver's memory out of turn never reach a client.

A sender frozen mid-write (SIGSTOP, a paused container) goes on with that write when it
wakes, however long after the daemon gave its receiver's memory to other hand-offs. Here
the test process plays that sender at its worst: it keeps writing garbage over the whole
of the decoder's shared pool while requests flow through a real cluster. Every staged
tensor carries a digest of its bytes (transfer/frames.py), so each request either comes back with
exactly the bytes the pipeline makes, or fails ``transfer_failed`` saying why; nothing
is leaked, and once the writes stop the cluster serves as before.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import torch

from orchestrator.client import AsyncClient, Rejection
from orchestrator.cluster import all_free
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, wait_for
from transfer.protocol import GenParams, Reason

CAUGHT = "its bytes are not those its sender staged"


@contextmanager
def writing_over_the_pool_of(pid: int) -> Iterator[None]:
    """A thread writing random bytes over process ``pid``'s shared pool, pass after pass,
    until the block ends."""
    fds = [Path(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    pools = {os.stat(fd).st_ino: fd for fd in fds if "triptych-pool" in os.readlink(fd)}
    [path] = pools.values()  # its own pool: a decoder maps no other
    with path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as pool:
        garbage = [os.urandom(len(pool)) for _ in range(2)]
        stop = threading.Event()

        def write_over() -> None:
            passes = 0
            while not stop.is_set():
                pool[:] = garbage[passes % 2]
                passes += 1

        writer = threading.Thread(target=write_over, daemon=True)
        writer.start()
        try:
            yield
        finally:
            stop.set()
            writer.join(timeout=10)


async def test_bytes_written_over_a_receivers_memory_are_caught_never_served(start_cluster: StartCluster) -> None:
    # Same-host pools live in shared files (transfer/shm.py), which this process can map too.
    cluster = start_cluster(transfer={"same_host_copy": True})
    null = cluster.config.model.null
    requests = [GenParams(prompt=f"late {i}", seed=i, output="raw") for i in range(16)]
    served: dict[int, torch.Tensor] = {}
    caught: list[Rejection] = []

    async def one(client: AsyncClient, params: GenParams) -> None:
        try:
            served[params.seed] = (await client.submit(params, timeout_s=30)).outputs["images"]
        except Rejection as exc:
            caught.append(exc)

    with writing_over_the_pool_of(cluster.workers["decoder0"].pid), anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for params in requests:
                tg.start_soon(one, client, params)

    for params in requests:
        if params.seed in served:
            assert torch.equal(served[params.seed], expected_outputs(params, null)["images"]), params.seed
    assert caught, "no hand-off was written over: the test proved nothing"
    assert all(exc.reason == Reason.TRANSFER_FAILED and CAUGHT in exc.rejected.message for exc in caught), caught
    assert CAUGHT in cluster.log_of("decoder0")

    wait_for(cluster, all_free)
    after = GenParams(prompt="after", seed=99, output="raw")
    async with AsyncClient(cluster.client_endpoint) as client:
        generation = await client.submit(after, timeout_s=30)
    assert torch.equal(generation.outputs["images"], expected_outputs(after, null)["images"])
