"""A worker killed mid-request: the request starts again on the workers left (within its
deadline) and its client gets the right bytes, not an error; nothing leaks."""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial
from pathlib import Path

import anyio
import pytest
import torch

from orchestrator.client import AsyncClient, Client, Rejection
from orchestrator.cluster import all_free
from orchestrator.stages.null import expected_outputs
from orchestrator.tables import stats_table
from orchestrator.watchdog import EXIT_DEVICE_BROKEN, EXIT_STAGE_HUNG
from tests.e2e.conftest import StartCluster, wait_for
from transfer.protocol import GenParams, Progress, Reason, Stats


def denoising_instance(stats: Stats) -> str | None:
    """The name of the denoiser holding a request, if one does."""
    busy = [i.name for i in stats.instances if i.role == "denoiser" and i.slots_free < i.slots_total]
    return busy[0] if len(busy) == 1 and stats.requests_by_state.get("denoising") == 1 else None


async def test_a_request_whose_denoiser_dies_is_retried_on_the_other_one(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**{"model.null": {"denoiser_ms": 1500.0}})
    params = GenParams(prompt="survivor", seed=7, output="raw")
    killed: list[str] = []
    heard: list[Progress] = []

    async def kill_its_denoiser() -> None:
        stats = await anyio.to_thread.run_sync(lambda: wait_for(cluster, lambda s: denoising_instance(s) is not None))
        name = denoising_instance(stats)
        assert name is not None
        os.kill(cluster.workers[name].pid, signal.SIGKILL)
        killed.append(name)

    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(kill_its_denoiser)
            generation = await client.submit(params, timeout_s=30, on_progress=heard.append)
    assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
    # Its client watched it fail over: why, then the stages again, times counting from its submit.
    states = [p.state for p in heard]
    retry = states.index("retrying")
    assert "missed heartbeats" in heard[retry].why
    assert states[retry + 1] == "encoding" and states[-1] == "decoding"
    elapsed = [p.elapsed_ms for p in heard]
    assert elapsed == sorted(elapsed) and generation.result.total_ms >= elapsed[-1]
    served_by = {stats.instance for stats in generation.result.stages if stats.role == "denoiser"}
    stats = wait_for(cluster, all_free)
    survivor = [i for i in stats.instances if i.role == "denoiser"]
    assert [i.name for i in survivor] != killed and {i.instance for i in survivor} == served_by
    assert stats.retried == 1 and stats.failed_by_reason == {"worker_lost": 1}
    assert "retried=1" in stats_table(stats)  # what `triptych stats` prints
    assert "request.retried" in cluster.log_of("daemon")


def test_a_dead_receiver_fails_no_request_and_takes_no_more_work(start_cluster: StartCluster) -> None:
    """A push into a dead denoiser fails at once; the request starts again on the other one,
    and the dead one gets nothing more while the daemon waits out two heartbeats, not all
    ``heartbeat_misses`` (set high here so the two cannot be confused)."""
    # Suspected for 3 s (two heartbeats), where a plain eviction would take 60 s of silence.
    cluster = start_cluster(daemon={"heartbeat_s": 1.5, "heartbeat_misses": 40})
    [(dead, address)] = [(i.instance, i.address) for i in cluster.control.stats().instances if i.name == "denoiser1"]
    victim = cluster.workers["denoiser1"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    null_cfg = cluster.config.model.null
    with Client(cluster.client_endpoint) as client:
        for i in range(8):
            params = GenParams(prompt=f"after the crash {i}", seed=i, output="raw")
            generation = client.submit(params, timeout_s=10)
            assert torch.equal(generation.outputs["images"], expected_outputs(params, null_cfg)["images"])
            assert dead not in {s.instance for s in generation.result.stages}
    meanwhile = cluster.control.stats()
    [suspect] = [i for i in meanwhile.instances if i.suspect]
    assert suspect.instance == dead and suspect.slots_free == suspect.slots_total  # it holds nothing
    [line] = [line for line in stats_table(meanwhile).splitlines() if line.startswith(f"{dead} ")]
    assert line.endswith("(suspect: no new work)")  # what `triptych stats` prints
    stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 3, timeout_s=10)
    assert "denoiser1" not in {i.name for i in stats.instances}
    assert (stats.failed_by_reason, stats.retried) == ({"transfer_failed": 1}, 1)
    assert "went silent after a push into it failed" in cluster.log_of("daemon")
    # Its ipc socket file outlived it; the next worker started on this host removes it.
    socket_file = Path(address.removeprefix("ipc://"))
    assert socket_file.exists()
    cluster.start_worker("denoiser", 2)
    wait_for(cluster, lambda s: "denoiser2" in {i.name for i in s.instances}, timeout_s=60)
    assert not socket_file.exists()


def test_a_hung_stage_takes_its_worker_down_and_nothing_else(start_cluster: StartCluster) -> None:
    """A stage deaf to stops (a wedged GPU) outlives workers.denoiser.stage_timeout_s, though
    its request ended long before: its worker exits with status 70 for a supervisor to
    replace, the daemon evicts it when it goes silent, and the other denoiser keeps serving.
    A request still waiting when its stage hangs fails stage_failed: started again, it would
    hang the next denoiser too (an audit: one request took down both)."""
    cluster = start_cluster(**{"workers.denoiser": {"stage_timeout_s": 1.0}, "model.faults": {"hang_prompt": "wedge"}})
    addresses = {i.name: i.address for i in cluster.control.stats().instances}
    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(GenParams(prompt="wedge the gpu", seed=1, output="raw"), timeout_s=0.5)
        assert caught.value.reason == Reason.TIMED_OUT  # the stop it was sent changed nothing
        wait_for(cluster, lambda _: any(p.poll() is not None for p in cluster.workers.values()))
        [(name, hung)] = [(n, p) for n, p in cluster.workers.items() if p.poll() is not None]
        assert name.startswith("denoiser") and hung.returncode == EXIT_STAGE_HUNG
        [event] = [json.loads(line) for line in cluster.log_of(name).splitlines() if "worker.stage_hung" in line]
        assert event["limit_s"] == 1.0 and event["ran_s"] >= 1.0
        assert not Path(addresses[name].removeprefix("ipc://")).exists()  # its socket file went with it
        params = GenParams(prompt="an ordinary request", seed=2, output="raw")
        generation = client.submit(params, timeout_s=20)
        assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
        stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 3)
        assert name not in {i.name for i in stats.instances}

        cluster.start_worker("denoiser", 2)  # as its supervisor would
        wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 4, timeout_s=60)
        with pytest.raises(Rejection) as caught:
            client.submit(GenParams(prompt="wedge it while I wait", seed=3, output="raw"), timeout_s=30)
        assert caught.value.reason == Reason.STAGE_FAILED
        assert "the stage ran past workers.denoiser.stage_timeout_s (1 s) and its worker exits" in str(caught.value)
        stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 3)
        assert stats.retried == 0
        [survivor] = [i for i in stats.instances if i.role == "denoiser"]
        [second] = {"denoiser0", "denoiser1", "denoiser2"} - {name, survivor.name}
        assert cluster.workers[second].wait(timeout=10) == EXIT_STAGE_HUNG
        generation = client.submit(params, timeout_s=20)
        assert survivor.instance in {s.instance for s in generation.result.stages}


def test_a_cuda_error_fails_its_request_and_takes_only_its_worker_down(start_cluster: StartCluster) -> None:
    """A kernel fault leaves a GPU context unusable: its worker exits with status 71 for a
    supervisor to replace. Its request fails with stage_failed, said before the exit: started
    again on the other denoiser, a request that faults the device would take that one down too."""
    cluster = start_cluster(**{"model.faults": {"device_error_prompt": "fault"}})
    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(GenParams(prompt="fault the kernel", seed=1, output="raw"), timeout_s=30)
        assert caught.value.reason == Reason.STAGE_FAILED
        assert "the device failed and its worker exits: CUDA error: an illegal memory access" in str(caught.value)
        [broken] = [name for name in ("denoiser0", "denoiser1") if "worker.device_broken" in cluster.log_of(name)]
        assert cluster.workers[broken].wait(timeout=10) == EXIT_DEVICE_BROKEN
        params = GenParams(prompt="an ordinary request", seed=2, output="raw")
        generation = client.submit(params, timeout_s=30)
    assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
    stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 3)
    assert broken not in {i.name for i in stats.instances}
    assert all(proc.poll() is None for name, proc in cluster.workers.items() if name != broken)


def test_a_worker_told_to_stop_during_a_hung_stage_still_exits(start_cluster: StartCluster) -> None:
    """SIGTERM cancels a worker's tasks, then waits for its stage threads: a hung one would
    keep the process alive for good, but the watchdog, a thread of its own, still ends it."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.denoiser": {"stage_timeout_s": 2.0}, "model.faults": {"hang_prompt": "wedge"}})
    with Client(cluster.client_endpoint) as client, pytest.raises(Rejection):
        client.submit(GenParams(prompt="wedge the gpu", seed=1, output="raw"), timeout_s=0.5)
    denoiser = cluster.workers["denoiser0"]
    denoiser.send_signal(signal.SIGTERM)  # well before the stage's 2 s are up
    assert denoiser.wait(timeout=10) == EXIT_STAGE_HUNG
    assert "worker.signal" in cluster.log_of("denoiser0") and "worker.stage_hung" in cluster.log_of("denoiser0")


def test_a_frozen_worker_gets_no_new_work_until_it_thaws(start_cluster: StartCluster) -> None:
    """Silent for two heartbeats, a worker is a suspect: work sent to it would only wait for
    its eviction (heartbeat_misses, here 20 s away). Heard from again, it is trusted again."""
    cluster = start_cluster(daemon={"heartbeat_misses": 40})
    [frozen] = [i.instance for i in cluster.control.stats().instances if i.name == "denoiser1"]
    endpoint = cluster.client_endpoint
    null_cfg = cluster.config.model.null

    def served_by(client: Client, i: int) -> set[str]:
        params = GenParams(prompt=f"frozen {i}", seed=i, output="raw")
        generation = client.submit(params, timeout_s=10)
        assert torch.equal(generation.outputs["images"], expected_outputs(params, null_cfg)["images"])
        return {s.instance for s in generation.result.stages}

    os.kill(cluster.workers["denoiser1"].pid, signal.SIGSTOP)
    try:
        wait_for(cluster, lambda s: [i.instance for i in s.instances if i.suspect] == [frozen])
        with Client(endpoint) as client:
            assert not any(frozen in served_by(client, i) for i in range(6))
    finally:
        os.kill(cluster.workers["denoiser1"].pid, signal.SIGCONT)
    wait_for(cluster, lambda s: not any(i.suspect for i in s.instances))
    with Client(endpoint) as client:
        assert any(frozen in served_by(client, i) for i in range(6, 12))
    stats = wait_for(cluster, all_free)
    assert (stats.failed_by_reason, len(stats.instances)) == ({}, 4)


async def test_a_worker_stopped_with_sigterm_says_so_and_its_request_starts_again_at_once(
    start_cluster: StartCluster,
) -> None:
    """Its last message (Leaving) evicts it at once: the request does not wait for
    heartbeat_misses (here 20 s of silence) to start again on the other denoiser."""
    cluster = start_cluster(daemon={"heartbeat_misses": 40}, **{"model.null": {"denoiser_ms": 1500.0}})
    params = GenParams(prompt="stopped mid-denoise", seed=3, output="raw")
    stopped: list[int] = []

    async def stop_its_denoiser() -> None:
        stats = await anyio.to_thread.run_sync(lambda: wait_for(cluster, lambda s: denoising_instance(s) is not None))
        name = denoising_instance(stats)
        assert name is not None
        proc = cluster.workers[name]
        proc.send_signal(signal.SIGTERM)
        stopped.append(await anyio.to_thread.run_sync(proc.wait))

    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(stop_its_denoiser)
            started = time.monotonic()
            generation = await client.submit(params, timeout_s=30)
            took_s = time.monotonic() - started
    assert stopped == [0]
    assert took_s < 6  # 1.5 s of denoise at most twice, and no 20 s wait for an eviction
    assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
    stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 3)
    assert (stats.retried, stats.failed_by_reason) == (1, {"worker_lost": 1})
    assert "left: its process is stopping" in cluster.log_of("daemon")


async def test_a_retry_goes_before_requests_that_have_not_had_their_turn_at_every_stage(
    start_cluster: StartCluster,
) -> None:
    """A runs on one denoiser, B on the other, C and D wait for one. A's denoiser stops: A
    starts again, and having waited its turn once, it is next at the denoiser (not behind
    C and D, whose deadlines have had less of their time spent)."""
    cluster = start_cluster(workers={"denoiser": {"capacity": 1}}, **{"model.null": {"denoiser_ms": 1000.0}})
    order: list[str] = []
    with anyio.fail_after(40):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:

            async def one(rid: str, seed: int) -> None:
                await client.submit(GenParams(prompt=rid, seed=seed, output="raw"), request_id=rid, timeout_s=30)
                order.append(rid)

            tg.start_soon(one, "A", 1)
            stats = await anyio.to_thread.run_sync(
                lambda: wait_for(cluster, lambda s: denoising_instance(s) is not None))
            running_a = denoising_instance(stats)
            assert running_a is not None
            tg.start_soon(one, "B", 2)
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 2)
            for seed, rid in enumerate("CD", start=3):
                tg.start_soon(one, rid, seed)
                await anyio.to_thread.run_sync(wait_for, cluster, lambda s, n=seed - 2: s.queue_depths["denoiser"] == n)
            cluster.workers[running_a].send_signal(signal.SIGTERM)
    assert order == ["B", "A", "C", "D"]
    assert wait_for(cluster, all_free).retried == 1


async def test_a_sender_stuck_on_a_frozen_receiver_gets_no_new_work_until_its_push_ends(
    start_cluster: StartCluster,
) -> None:
    """A denoiser frozen (stopped, not dead: its kernel still takes connections) before any
    encoder wrote to it: the first write there waits a minute in Mooncake's handshake, and
    that encoder's later writes wait behind it. Past the push's due time (here 5 + 2 s) the
    daemon sends that encoder no new work, so the other one serves what comes meanwhile;
    before, it kept taking requests whose pushes queued behind the stuck one."""
    cluster = start_cluster(layout={"encoder": 2, "denoiser": 1, "decoder": 1})
    frozen = cluster.workers["denoiser0"]
    null_cfg = cluster.config.model.null
    endpoint = cluster.client_endpoint
    async with AsyncClient(endpoint) as client:
        os.kill(frozen.pid, signal.SIGSTOP)
        try:
            async with anyio.create_task_group() as tg:
                # Placed before the silence makes the denoiser a suspect: its push will hang.
                tg.start_soon(partial(client.submit, GenParams(prompt="first", seed=1, output="raw"), timeout_s=60))
                await anyio.sleep(0.3)
                cluster.start_worker("denoiser", 1)
                stats = await anyio.to_thread.run_sync(lambda: wait_for(
                    cluster, lambda s: any(i.suspect for i in s.instances if i.role == "encoder")
                    and any(i.name == "denoiser1" and not i.suspect for i in s.instances), timeout_s=30))
                [stuck] = [i.instance for i in stats.instances if i.role == "encoder" and i.suspect]
                for i in range(8):  # each within a deadline far shorter than the stuck write's minute
                    params = GenParams(prompt=f"meanwhile {i}", seed=i, output="raw")
                    generation = await client.submit(params, timeout_s=5)
                    assert torch.equal(generation.outputs["images"], expected_outputs(params, null_cfg)["images"])
                    assert stuck not in {s.instance for s in generation.result.stages}
                # The first request's first try ended with the frozen denoiser's eviction, its
                # push still hanging: no hand-off under way, one holding where it may write.
                stats = await anyio.to_thread.run_sync(lambda: wait_for(
                    cluster, lambda s: not s.requests_by_state, timeout_s=30))
                assert (stats.handoffs_in_flight, stats.handoffs_held) == (0, 1)
        finally:
            os.kill(frozen.pid, signal.SIGCONT)  # its handshake answers: the stuck write ends, unstarted
    stats = wait_for(cluster, lambda s: all_free(s) and not any(i.suspect for i in s.instances), timeout_s=30)
    # The first request's denoiser missed its heartbeats: it started again on the new one.
    assert (stats.completed, stats.failed_by_reason, stats.retried) == (9, {"worker_lost": 1}, 1)
    assert stuck in {i.instance for i in stats.instances}  # its loop never stopped: never evicted
    overdue = [line for line in map(json.loads, cluster.log_of("daemon").splitlines())
               if line["event"] == "worker.push_overdue"]
    assert [line["instance"] for line in overdue] == [stuck]
