"""Workers outlive the daemon forgetting them: after an eviction or a daemon restart the same
processes (stage still loaded) register again and serve, once receive memory is safe."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch

from orchestrator.client import AsyncClient, Rejection
from orchestrator.cluster import LocalCluster, all_free
from orchestrator.config import LOCAL_MOONCAKE_ENV
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, wait_for
from transfer.protocol import GenParams, Progress, Reason, Stats

# Receivers wait push_quarantine_s before rejoining, which must outlast a transfer.
QUICK_REJOIN = {"daemon": {"push_quarantine_s": 1.5},
                "transfer": {"env": {**LOCAL_MOONCAKE_ENV, "MC_TRANSFER_TIMEOUT": "1"}}}


def denoisers(stats: Stats) -> dict[str, str]:
    return {i.name: i.instance for i in stats.instances if i.role == "denoiser"}


async def serve_correctly(cluster: LocalCluster, count: int) -> None:
    """``count`` concurrent requests come back with the bytes the null pipeline must produce."""

    async def one(client: AsyncClient, params: GenParams) -> None:
        generation = await client.submit(params, timeout_s=30)
        assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])

    async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, client, GenParams(prompt=f"rejoin {i}", seed=i, output="raw"))


async def test_an_evicted_worker_rejoins_in_the_same_process_holding_nothing(start_cluster: StartCluster) -> None:
    """Stopped mid-denoise past its heartbeats: evicted, its request fails (retries off here:
    tests/e2e/test_worker_loss.py has them); resumed, it finishes the stage it was running,
    learns it was forgotten, frees that output and rejoins."""
    no_retry = {"daemon": {**QUICK_REJOIN["daemon"], "retries": 0}}
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{**QUICK_REJOIN, **no_retry}, **{"model.null": {"denoiser_ms": 1500.0}})
    victim = cluster.workers["denoiser0"]
    before = denoisers(cluster.control.stats())["denoiser0"]

    async def stop_mid_denoise() -> None:
        await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 1)
        os.kill(victim.pid, signal.SIGSTOP)  # silent past heartbeat_s * heartbeat_misses: evicted

    with anyio.fail_after(60):
        try:
            async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
                tg.start_soon(stop_mid_denoise)
                with pytest.raises(Rejection) as caught:
                    await client.submit(GenParams(prompt="stopped", output="raw"), timeout_s=30)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        assert caught.value.reason == Reason.WORKER_LOST
        stats = await anyio.to_thread.run_sync(
            lambda: wait_for(cluster, lambda s: list(denoisers(s)) == ["denoiser0"], timeout_s=30))
        assert denoisers(stats)["denoiser0"] != before  # a new registration...
        assert victim.poll() is None  # ...by the same process
        rejoining = [line for line in cluster.log_of("denoiser0").splitlines() if "worker.rejoining" in line]
        assert len(rejoining) == 1 and json.loads(rejoining[0])["blocks_held"] == 0
        assert json.loads(rejoining[0])["level"] == "warning"  # evicted: an incident
        # The answers to heartbeats it sent before the daemon forgot it are no deferral.
        assert "worker.registration_deferred" not in cluster.log_of("denoiser0")
        await serve_correctly(cluster, 4)
    assert wait_for(cluster, all_free)


async def test_a_daemon_stopped_past_every_workers_heartbeats_evicts_nobody_on_waking(
    start_cluster: StartCluster
) -> None:
    """A pause of the daemon (SIGSTOP here; a frozen VM, a long collection) is not its
    workers' silence: their heartbeats wait unread in its socket. Before, it evicted every
    worker on waking, and the denoisers and decoder sat out push_quarantine_s (60 s)."""
    cluster = start_cluster()
    before = {i.name: i.instance for i in cluster.control.stats().instances}
    assert cluster.daemon is not None
    os.kill(cluster.daemon.pid, signal.SIGSTOP)
    try:
        await anyio.sleep(4.0)  # heartbeat_s * heartbeat_misses is 3 s here
    finally:
        os.kill(cluster.daemon.pid, signal.SIGCONT)
    await anyio.sleep(1.0)  # awake for two heartbeats
    assert {i.name: i.instance for i in cluster.control.stats().instances} == before
    log = cluster.log_of("daemon")
    assert "daemon.stalled" in log and "worker.evicted" not in log
    await serve_correctly(cluster, 4)


async def test_workers_rejoin_a_restarted_daemon(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**QUICK_REJOIN)
    await serve_correctly(cluster, 2)
    assert cluster.daemon is not None
    cluster.daemon.kill()  # a crash: nothing is drained, nobody is told
    cluster.daemon.wait(timeout=10)
    workers = dict(cluster.workers)
    cluster.start_daemon()
    stats = cluster.wait_registered(4, timeout_s=60)
    assert sorted(i.name for i in stats.instances) == ["decoder0", "denoiser0", "denoiser1", "encoder0"]
    assert cluster.workers == workers and all(proc.poll() is None for proc in workers.values())
    await serve_correctly(cluster, 8)
    assert wait_for(cluster, all_free)


async def test_after_a_clean_stop_workers_rejoin_the_next_daemon_at_once(start_cluster: StartCluster) -> None:
    """A drained daemon says farewell: receivers nothing is written into skip
    push_quarantine_s (the default 60 s here), and rejoining waits for the next daemon
    past connect_timeout_s, as long as it takes to come."""
    patient = {f"workers.{role}": {"connect_timeout_s": 1.0} for role in ("encoder", "denoiser", "decoder")}
    cluster = start_cluster(**patient)
    assert cluster.config.daemon.push_quarantine_s == 60.0
    await serve_correctly(cluster, 2)
    assert cluster.stop_daemon() == 0
    await anyio.sleep(2.5)
    workers = dict(cluster.workers)
    cluster.start_daemon()
    stats = cluster.wait_registered(4, timeout_s=30)  # well inside the 60 s quarantine
    assert sorted(i.name for i in stats.instances) == ["decoder0", "denoiser0", "denoiser1", "encoder0"]
    assert cluster.workers == workers and all(proc.poll() is None for proc in workers.values())
    for name in ("denoiser0", "decoder0"):
        [rejoining] = [json.loads(line) for line in cluster.log_of(name).splitlines() if "worker.rejoining" in line]
        assert rejoining["wait_s"] == 0.0
        assert rejoining["level"] == "info"  # the daemon's farewell: a planned end, no warning
    await serve_correctly(cluster, 4)
    assert wait_for(cluster, all_free)


async def test_a_push_a_frozen_sender_reads_after_its_eviction_writes_nothing(start_cluster: StartCluster) -> None:
    """An encoder stopped (SIGSTOP) with its output staged is told to push it while frozen,
    then evicted, and the memory the push names is handed out again once push_quarantine_s
    has passed: here to another request's latents, staged for the busy decoder. Woken, the
    encoder reads the old Push. Before, it wrote: that request came back a Result with wrong
    bytes. (The denoiser holds one request at a time, so every block of its region starts
    at one address: the Push's and the victim's.)"""
    cluster = start_cluster(layout={"encoder": 2, "denoiser": 1, "decoder": 1}, **QUICK_REJOIN, **{
        "workers.denoiser": {"capacity": 1, "prealloc_slots": 0},  # the slow path: blocks of its region
        "workers.decoder": {"capacity": 1},
        "model.null": {"encoder_ms": 20.0, "denoiser_ms": 1000.0, "decoder_ms": 3000.0}})
    wrong: list[str] = []
    waiting_for_decoder = anyio.Event()

    async def check(client: AsyncClient, rid: str, seed: int) -> None:
        params = GenParams(prompt=rid, seed=seed, output="raw")

        def heard(progress: Progress) -> None:
            if progress.state == "decoding" and progress.position:
                waiting_for_decoder.set()  # its latents staged at the denoiser

        generation = await client.submit(params, request_id=rid, timeout_s=60,
                                         on_progress=heard if rid == "victim" else None)
        if not torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"]):
            wrong.append(rid)

    def stats_until(check: Callable[[Stats], bool]) -> Awaitable[Stats]:
        return anyio.to_thread.run_sync(lambda: wait_for(cluster, check, timeout_s=30))

    frozen = None
    with anyio.fail_after(90):
        try:
            async with AsyncClient(cluster.client_endpoint) as client:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(check, client, "first", 9)  # holds the only denoiser unit for 1 s
                    await stats_until(lambda s: s.requests_by_state.get("denoising") == 1)
                    tg.start_soon(check, client, "pushed-late", 0)
                    stats = await stats_until(lambda s: s.handoffs_in_flight == 1)  # staged, waiting
                    [name] = [i.name for i in stats.instances if i.role == "encoder" and i.slots_free < i.slots_total]
                    frozen = cluster.workers[name]
                    os.kill(frozen.pid, signal.SIGSTOP)
                    # Its Push is sent once "first" is denoised; then it is evicted, its
                    # request starts again on the other encoder, and the quarantine ends.
                    await stats_until(lambda s: name not in {i.name for i in s.instances} and s.handoffs_held == 0)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(check, client, "blocker", 1)
                    await stats_until(lambda s: s.requests_by_state.get("decoding") == 1)
                    tg.start_soon(check, client, "victim", 2)
                    await waiting_for_decoder.wait()
                    os.kill(frozen.pid, signal.SIGCONT)
        finally:
            if frozen is not None:
                os.kill(frozen.pid, signal.SIGCONT)
    assert wrong == []
    assert "worker.stale_push_refused" in cluster.log_of(name)
    assert wait_for(cluster, all_free, timeout_s=30)


async def test_an_idle_receiver_frozen_past_its_heartbeats_rejoins_without_waiting_out_the_quarantine(
    start_cluster: StartCluster
) -> None:
    """Nothing was being written into it when it was evicted, so nothing can land there later:
    it rejoins on waking, not push_quarantine_s (60 s here) after."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    assert cluster.config.daemon.push_quarantine_s == 60.0
    victim = cluster.workers["denoiser0"]
    before = denoisers(cluster.control.stats())["denoiser0"]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        await anyio.to_thread.run_sync(lambda: wait_for(cluster, lambda s: not denoisers(s), timeout_s=30))
    finally:
        os.kill(victim.pid, signal.SIGCONT)
    stats = await anyio.to_thread.run_sync(
        lambda: wait_for(cluster, lambda s: "denoiser0" in denoisers(s), timeout_s=20))  # well inside 60 s
    assert denoisers(stats)["denoiser0"] != before and victim.poll() is None
    [rejoining] = [json.loads(line) for line in cluster.log_of("denoiser0").splitlines() if "worker.rejoining" in line]
    assert rejoining["wait_s"] == 0.0
    await serve_correctly(cluster, 2)
    assert wait_for(cluster, all_free)
