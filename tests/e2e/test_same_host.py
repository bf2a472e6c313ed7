"""Workers of one host hand off through each other's shared pools (transfer/shm.py): the
bytes are right, every hand-off says it was a copy, and everything ends free."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import torch

from orchestrator.client import AsyncClient
from orchestrator.cluster import all_free
from orchestrator.stages.null import expected_outputs
from orchestrator.worker_memory import UNMAP_GONE_S
from tests.e2e.conftest import StartCluster, wait_for
from transfer.protocol import GenParams


async def test_same_host_hand_offs_are_copies_into_shared_memory(start_cluster: StartCluster) -> None:
    # Embeddings of 1.2 MiB are copied on the sender's push thread, the small latents on its
    # event loop (orchestrator/worker_memory.py, INLINE_COPY_BYTES): both ways are covered.
    cluster = start_cluster(transfer={"same_host_copy": True}, **{"model.null": {"embed_shape": [1, 77, 4096]}})
    null = cluster.config.model.null
    requests = [GenParams(prompt=f"shared {i}", seed=i, width=64 if i % 2 else 256, height=48 if i % 2 else 128,
                          output="raw") for i in range(12)]
    results = {}

    async def one(client: AsyncClient, params: GenParams) -> None:
        results[params.seed] = await client.submit(params, timeout_s=30)

    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for params in requests:
                tg.start_soon(one, client, params)
    for params in requests:
        generation = results[params.seed]
        assert torch.equal(generation.outputs["images"], expected_outputs(params, null)["images"])
        assert [s.via for s in generation.result.stages] == ["memcpy", "memcpy", None]
    stats = wait_for(cluster, all_free)
    assert stats.slow_path.get("denoiser->decoder", 0) > 0  # into allocations too, not only slots
    assert "worker.local_copy_failed" not in "".join(cluster.log_of(name) for name in cluster.workers)

    # The decoder dies for good: within a sweep its senders unmap its pool, which their
    # mappings alone kept resident (each sender keeps only its own pool mapped).
    senders = [cluster.workers[name].pid for name in ("denoiser0", "denoiser1")]
    assert sum(map(pools_mapped, senders)) > 2
    decoder = cluster.workers["decoder0"]
    decoder.send_signal(signal.SIGKILL)
    decoder.wait(timeout=10)
    deadline = time.monotonic() + UNMAP_GONE_S + 10
    while sum(map(pools_mapped, senders)) > 2:
        assert time.monotonic() < deadline, "a dead receiver's pool is still mapped by its senders"
        time.sleep(0.2)


def pools_mapped(pid: int) -> int:
    """The shared pools (transfer/shm.py) mapped into process ``pid``: its own, and its
    receivers' that it copied into."""
    return sum("triptych-pool" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())
