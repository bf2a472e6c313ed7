"""Workers outlive the daemon forgetting them: after an eviction or a daemon restart the same
processes (stage still loaded) register again and serve, once receive memory is safe."""

from __future__ import annotations

import os
import signal

import anyio
import torch

from orchestrator.client import AsyncClient
from orchestrator.cluster import LocalCluster
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, all_free, wait_for
from transfer.protocol import GenParams, Stats

QUICK_REJOIN = {"daemon": {"push_quarantine_s": 1.0}}


def denoisers(stats: Stats) -> dict[str, str]:
    return {i.name: i.instance for i in stats.instances if i.role == "denoiser"}


def serve_correctly(cluster: LocalCluster, count: int) -> None:
    """``count`` concurrent requests come back with the bytes the null pipeline must produce."""

    async def run() -> None:
        async with AsyncClient(cluster.config.daemon.client_endpoint) as client, anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, client, GenParams(prompt=f"rejoin {i}", seed=i, output="raw"))

    async def one(client: AsyncClient, params: GenParams) -> None:
        generation = await client.submit(params, timeout_s=30)
        assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])

    anyio.run(run)


def test_an_evicted_worker_rejoins_under_its_name_in_the_same_process(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**QUICK_REJOIN)
    victim = cluster.workers["denoiser0"]
    before = denoisers(cluster.control.stats())["denoiser0"]
    os.kill(victim.pid, signal.SIGSTOP)  # silent past heartbeat_s * heartbeat_misses: evicted
    try:
        wait_for(cluster, lambda s: list(denoisers(s)) == ["denoiser1"], timeout_s=15)
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    stats = wait_for(cluster, lambda s: sorted(denoisers(s)) == ["denoiser0", "denoiser1"], timeout_s=30)
    assert denoisers(stats)["denoiser0"] != before  # a new registration...
    assert victim.poll() is None  # ...by the same process
    serve_correctly(cluster, 8)
    assert wait_for(cluster, all_free)
    assert "worker.rejoin_wait" in cluster.log_of("denoiser0")


def test_workers_rejoin_a_restarted_daemon(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**QUICK_REJOIN)
    serve_correctly(cluster, 2)
    assert cluster.daemon is not None
    cluster.daemon.kill()  # a crash: nothing is drained, nobody is told
    cluster.daemon.wait(timeout=10)
    workers = dict(cluster.workers)
    cluster.start_daemon()
    stats = cluster.wait_registered(4, timeout_s=60)
    assert sorted(i.name for i in stats.instances) == ["decoder0", "denoiser0", "denoiser1", "encoder0"]
    assert cluster.workers == workers and all(proc.poll() is None for proc in workers.values())
    serve_correctly(cluster, 8)
    assert wait_for(cluster, all_free)
