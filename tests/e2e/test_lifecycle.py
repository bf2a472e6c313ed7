"""Deadlines, duplicates, cancellation, draining, forged peers and lost workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import anyio
import msgspec
import pytest
import torch
import zmq

from orchestrator.client import AsyncClient, Client, Generation, Rejection
from orchestrator.cluster import LocalCluster, all_free
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, cluster_config, config_variant, wait_for
from transfer.protocol import (
    DAEMON_TO_WORKER,
    PROTOCOL_VERSION,
    GenParams,
    InstanceStats,
    Reason,
    Register,
    RegisterRefused,
    Role,
    Staged,
    Stats,
    Submit,
    encode,
)

SLOW = {"model.null": {"denoiser_ms": 1500.0}}


def p(i: int) -> GenParams:
    return GenParams(prompt=f"slow {i}", seed=i, output="raw")


def with_finished_runs(stats: Stats) -> Stats:
    """``stats`` as if every run of an ended request still computing were over."""
    return msgspec.structs.replace(stats, instances=[
        msgspec.structs.replace(i, slots_free=i.slots_free + i.slots_finishing, slots_finishing=0)
        for i in stats.instances])


def test_deadline_mid_pipeline_times_out_and_frees_everything(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**{"model.null": {"decoder_ms": 5000.0}})  # one pass: a stop cannot cut it short
    endpoint = cluster.client_endpoint
    with Client(endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(p(1), timeout_s=0.5)
    expired = time.monotonic()
    assert caught.value.reason == Reason.TIMED_OUT
    assert "decoding" in caught.value.rejected.message
    # The request holds nothing any more; the decoder's pass, which cannot stop, keeps the
    # one capacity slot it computes in (slots_finishing) until it ends.
    freed = wait_for(cluster, lambda s: all_free(with_finished_runs(s)), timeout_s=3)
    assert time.monotonic() - expired < 4, "released at expiry, not when the decoder finished"
    assert freed.failed_by_reason == {"timed_out": 1}
    assert [(i.role, i.slots_finishing) for i in freed.instances if i.slots_finishing] == [("decoder", 1)]
    assert "worker.output_dropped" not in cluster.log_of("decoder0")  # still running
    # The decoder finishes its run later; aborted meanwhile, it drops its output, and its
    # slot comes back.
    deadline = time.monotonic() + 15
    while "worker.output_dropped" not in cluster.log_of("decoder0"):
        assert time.monotonic() < deadline, "the decoder never finished its run"
        time.sleep(0.05)
    after = wait_for(cluster, all_free, timeout_s=3)
    assert after.completed == 0 and after.failed_by_reason == {"timed_out": 1}
    assert after.late_reports == 0
    with Client(endpoint) as client:
        assert client.submit(p(2), timeout_s=20).result.request_id
    final = wait_for(cluster, all_free)
    assert final.completed == 1 and final.failed_by_reason == {"timed_out": 1}


def test_a_request_that_ends_mid_denoise_stops_the_denoiser_at_its_next_step(start_cluster: StartCluster) -> None:
    """The stage's thread cannot be cancelled; the worker asks it to stop, and the GPU is free
    for the next request at once instead of after the rest of the loop."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.null": {"denoiser_ms": 3000.0}})
    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(p(1), timeout_s=0.5)
        assert "denoising" in caught.value.rejected.message
        started = time.monotonic()
        client.submit(p(2), timeout_s=20)  # the same denoiser, free since the stop
    # One denoise (3 s), not also the 2.5 s the first had left (5.5 s in all): the bound
    # sits between, leaving the pipeline around the denoise 2 s on a loaded machine.
    assert time.monotonic() - started < 5.0
    stopped = [json.loads(line) for line in cluster.log_of("denoiser0").splitlines() if "worker.stage_stopped" in line]
    assert len(stopped) == 1 and stopped[0]["ran_ms"] < 1500
    stats = wait_for(cluster, all_free)
    assert (stats.completed, stats.failed_by_reason, stats.late_reports) == (1, {"timed_out": 1}, 0)


def test_a_request_that_ends_mid_decode_holds_the_decoders_slot_until_the_pass_ends(
    start_cluster: StartCluster
) -> None:
    """A decoder pass cannot stop early: its slot is the pass's until the worker says it
    ended, so the next request waits at the daemon (where any decoder that frees may take
    it), not inside a worker that is busy with nobody's image."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1}, **{
        "model.null": {"decoder_ms": 2000.0}, "workers.decoder": {"capacity": 1}})

    def decoder(stats: Stats) -> InstanceStats:
        return next(i for i in stats.instances if i.role == "decoder")

    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(p(1), timeout_s=0.6)
        assert "decoding" in caught.value.rejected.message
        ended = time.monotonic()

        def submit_another() -> Generation:
            with Client(cluster.client_endpoint) as other:
                return other.submit(p(2), timeout_s=20)

        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(submit_another)
            busy = wait_for(cluster, lambda s: s.queue_depths["decoder"] == 1, timeout_s=1.0)
            assert (decoder(busy).slots_free, decoder(busy).slots_finishing) == (0, 1)
            wait_for(cluster, lambda s: decoder(s).slots_finishing == 0)
            assert time.monotonic() - ended > 0.8  # not before the ~1.4 s the pass had left
            assert second.result().result.request_id  # on the slot the pass gave back
    stats = wait_for(cluster, all_free)
    assert (stats.completed, stats.failed_by_reason, stats.late_reports) == (1, {"timed_out": 1}, 0)


def test_stats_count_the_preallocated_slot_a_running_stage_holds(start_cluster: StartCluster) -> None:
    """While the denoiser runs, the embeddings it reads hold one of its preallocated slots:
    without a state where free and total differ, no check of them could fail."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1}, **SLOW)
    slots = cluster.config.workers.denoiser.prealloc_slots

    def denoiser(stats: Stats) -> InstanceStats:
        return next(i for i in stats.instances if i.role == "denoiser")

    with ThreadPoolExecutor(1) as pool, Client(cluster.client_endpoint) as client:
        done = pool.submit(client.submit, p(1), timeout_s=20)
        running = wait_for(cluster, lambda s: s.requests_by_state.get("denoising") == 1)
        assert (denoiser(running).prealloc_free, denoiser(running).prealloc_total) == (slots - 1, slots)
        assert done.result().result.request_id
    assert denoiser(wait_for(cluster, all_free)).prealloc_free == slots


async def test_duplicate_in_flight_request_id_is_rejected(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**SLOW)
    endpoint = cluster.client_endpoint
    with anyio.fail_after(30):
        async with AsyncClient(endpoint) as first, AsyncClient(endpoint) as second:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(first.submit, p(1), request_id="same-id"))
                await anyio.to_thread.run_sync(wait_for, cluster, lambda s: sum(s.requests_by_state.values()) == 1)
                with pytest.raises(Rejection) as caught:
                    await second.submit(p(2), request_id="same-id")
    assert caught.value.reason == Reason.DUPLICATE
    # The first one was not disturbed and completed.
    assert wait_for(cluster, all_free).completed == 1


def test_an_id_is_free_again_once_its_request_ended_even_after_a_late_cancel(start_cluster: StartCluster) -> None:
    """A Cancel that finds nothing is remembered a moment (it may have overtaken its Submit),
    but not one that came after its request ended: the id's next request runs."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    with Client(cluster.client_endpoint) as client:
        first = client.submit(p(1), request_id="job-7", timeout_s=30)
        assert client.cancel("job-7") is False
        again = client.submit(p(1), request_id="job-7", timeout_s=30)
    assert again.result.request_id == "job-7" and again.result.outputs == first.result.outputs
    assert not cluster.control.stats().refused


async def test_cancel_stops_the_request_and_frees_its_slots(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**SLOW)
    endpoint = cluster.client_endpoint
    with anyio.fail_after(30):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            outcome: list[Reason] = []

            async def submit() -> None:
                with pytest.raises(Rejection) as caught:
                    await client.submit(p(1), request_id="to-cancel")
                outcome.append(caught.value.reason)

            tg.start_soon(submit)
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 1)
            async with AsyncClient(endpoint) as stranger:  # knows the id, not the submitter's token
                with pytest.raises(PermissionError, match="only its submitter may cancel it"):
                    await stranger.cancel("to-cancel")
            assert await client.cancel("to-cancel") is True
            assert await client.cancel("never-existed") is False
    assert outcome == [Reason.CANCELLED]
    assert wait_for(cluster, all_free).failed_by_reason == {"cancelled": 1}
    # Stopped at its next step, not run to its end (1.5 s) with the answer dropped.
    stopped = [json.loads(line) for name in ("denoiser0", "denoiser1")
               for line in cluster.log_of(name).splitlines() if "worker.stage_stopped" in line]
    assert len(stopped) == 1 and stopped[0]["ran_ms"] < 1500


async def test_a_request_its_caller_abandons_is_cancelled_at_the_daemon(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**SLOW)
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client:
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(client.submit, p(1), request_id="abandoned"))
                await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 1)
                tg.cancel_scope.cancel()  # the caller gives up, as an HTTP handler whose client left
            # Freed at once, not when the 1.5 s denoise would have ended.
            stats = await anyio.to_thread.run_sync(partial(wait_for, cluster, all_free, timeout_s=1.0))
            assert stats.failed_by_reason == {"cancelled": 1}
            generation = await client.submit(p(2), timeout_s=20)  # the client is still good
            assert generation.result.request_id


def test_a_client_killed_mid_request_has_its_request_cancelled_at_once(start_cluster: StartCluster,
                                                                      tmp_path: Path) -> None:
    """`triptych submit` killed mid-denoise, without --progress: the daemon hears its
    connection close (the client socket's monitor) and cancels the request, which stops its
    denoiser, instead of the denoiser finishing an image nobody will receive."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.null": {"denoiser_ms": 3000.0}})
    submit = subprocess.Popen([sys.executable, "-m", "orchestrator", "submit", "--config", str(cluster.config_path),
                               "--prompt", "p", "--request-id", "killed", "--out", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(cluster, lambda s: s.requests_by_state.get("denoising") == 1, timeout_s=20)
    finally:
        submit.kill()
        submit.wait()
    gone = time.monotonic()
    stats = wait_for(cluster, all_free, timeout_s=2.0)  # against 3 s of denoising
    assert time.monotonic() - gone < 2.0
    # The daemon knew the client was gone: the end of its own cancel is no reply lost.
    assert (stats.completed, stats.failed_by_reason, stats.replies_dropped) == (0, {"cancelled": 1}, 0)
    gone_lines = [json.loads(line) for line in cluster.log_of("daemon").splitlines() if '"client.gone"' in line]
    assert [line["cancelled"] for line in gone_lines] == [["killed"]]
    stopped = [json.loads(line) for line in cluster.log_of("denoiser0").splitlines() if "worker.stage_stopped" in line]
    assert len(stopped) == 1 and stopped[0]["ran_ms"] < 2500


async def test_sigterm_drains_in_flight_work_and_refuses_new(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**SLOW)
    endpoint = cluster.client_endpoint
    results = []
    with anyio.fail_after(60):
        async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(_append, results, client.submit(p(i), timeout_s=30))
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: sum(s.requests_by_state.values()) == 3)
            assert cluster.daemon is not None
            cluster.daemon.send_signal(signal.SIGTERM)
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.draining)
            with pytest.raises(Rejection) as caught:
                await client.submit(p(9), timeout_s=5)
            assert caught.value.reason == Reason.DRAINING
        code = await anyio.to_thread.run_sync(partial(cluster.daemon.wait, timeout=30))  # exits by itself
    assert len(results) == 3
    assert code == 0
    assert '"event":"daemon.signal"' in cluster.log_of("daemon")
    assert '"event":"daemon.drained"' in cluster.log_of("daemon")
    d = cluster.config.daemon  # its ipc:// socket files went with it
    assert not [e for e in (d.client_endpoint, d.control_endpoint, d.worker_endpoint)
                if Path(e.removeprefix("ipc://")).exists()]


@pytest.mark.parametrize(("signals", "drain_timeout_s", "says", "event"), [
    (1, 1.0, "drain ran out of time", "daemon.drain_timeout"),
    (2, 60.0, "told to stop at once (a second signal)", "daemon.drain_cut_short"),
], ids=["drain timeout", "second signal"])
async def test_a_drain_that_runs_out_of_time_or_is_cut_short_still_answers_every_request(
        start_cluster: StartCluster, signals: int, drain_timeout_s: float, says: str, event: str) -> None:
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.null": {"denoiser_ms": 5000.0}, "daemon": {"drain_timeout_s": drain_timeout_s}})
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client:
            async with anyio.create_task_group() as tg:
                outcome: list[BaseException] = []
                served: list[object] = []

                async def submit() -> None:
                    try:
                        served.append(await client.submit(p(1), timeout_s=20))
                    except Rejection as exc:
                        outcome.append(exc)

                # A hundred in flight: their answers leave in one burst, more than ZMQ queues
                # for one connection, and the daemon must not exit with some still held.
                for _ in range(100):
                    tg.start_soon(submit)
                await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising")
                                               and sum(s.requests_by_state.values()) + s.completed == 100)
                assert cluster.daemon is not None
                started = time.monotonic()
                for _ in range(signals):
                    cluster.daemon.send_signal(signal.SIGTERM)
                    await anyio.sleep(0.3)
            waited = time.monotonic() - started
        code = await anyio.to_thread.run_sync(partial(cluster.daemon.wait, timeout=10))
    assert len(outcome) + len(served) == 100 and len(outcome) > 90  # a few may finish first (5 s each)
    assert all(r.reason == Reason.DRAINING and says in r.rejected.message for r in outcome)
    assert waited < 4, "answered when the drain gave up (1 s or the second signal), not at the request's deadline"
    assert code == 0
    assert f'"event":"{event}"' in cluster.log_of("daemon")
    assert '"event":"negotiator.farewell"' in cluster.log_of("daemon")  # the workers were told


async def test_a_signal_after_a_control_drain_lets_that_drain_finish(start_cluster: StartCluster) -> None:
    """`triptych drain`, then the supervisor's SIGTERM (a preStop hook, `systemctl stop`):
    one signal, so the work in flight still finishes; only a second one cuts it short."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.null": {"denoiser_ms": 300.0}, "daemon": {"drain_timeout_s": 60.0}})
    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client:
            served: list[Generation] = []

            async def one(seed: int) -> None:
                served.append(await client.submit(p(seed), timeout_s=50))

            async with anyio.create_task_group() as tg:
                for seed in range(12):  # 3 rounds of the denoiser's 4 at a time
                    tg.start_soon(one, seed)
                await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising"))
                assert (await anyio.to_thread.run_sync(cluster.control.drain)).in_flight == 12
                assert cluster.daemon is not None
                cluster.daemon.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(partial(cluster.daemon.wait, timeout=30))
    assert len(served) == 12 and code == 0
    log = cluster.log_of("daemon")
    assert log.count('"event":"daemon.signal"') == 1 and '"draining":true' in log
    assert '"event":"daemon.drained"' in log and "drain_cut_short" not in log


def test_a_second_signal_while_the_daemon_sends_its_last_answers_is_not_its_death(start_cluster: StartCluster) -> None:
    """The drain is over, but the daemon is still handing a client that has not read them
    its last replies (up to a second): a second SIGTERM then cuts that short, as during
    the drain, and the daemon still exits 0 (it used to die of the signal, status -15)."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            daemon={"client_send_hwm": 2})
    ctx = zmq.Context()
    deaf = ctx.socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.setsockopt(zmq.LINGER, 0)
    try:
        deaf.connect(cluster.client_endpoint)
        for i in range(30):  # 768 KiB raw images: replies past ZMQ's queue wait in the daemon
            submit = Submit(protocol=PROTOCOL_VERSION, request_id=f"deaf-{i}", timeout_s=30,
                            params=GenParams(prompt="p", seed=i, width=512, height=512, output="raw"))
            deaf.send_multipart([b"", encode(submit)])
        wait_for(cluster, lambda s: s.completed == 30, timeout_s=60)
        assert cluster.daemon is not None
        cluster.daemon.send_signal(signal.SIGTERM)
        wait_for_log(cluster, '"event":"daemon.drained"')
        cluster.daemon.send_signal(signal.SIGTERM)
        assert cluster.daemon.wait(timeout=10) == 0
        assert cluster.log_of("daemon").count('"event":"daemon.signal"') == 2
    finally:
        deaf.close()
        ctx.term()


def test_a_hangup_stops_cleanly_and_a_burst_of_stop_signals_ends_the_daemon_with_exit_0(
    start_cluster: StartCluster
) -> None:
    """SIGHUP (a terminal closed) stops a worker and the daemon as SIGTERM does: before, it
    killed them (status -1) without a word, a crash to the rest of the cluster. The daemon's
    first signal drains (nothing in flight: at once); the rest land while it stops, after it
    stopped watching for them: before, one then killed it (status -15)."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    assert cluster.daemon is not None
    decoder = cluster.workers["decoder0"]
    decoder.send_signal(signal.SIGHUP)
    assert decoder.wait(timeout=20) == 0
    cluster.daemon.send_signal(signal.SIGHUP)
    for _ in range(40):
        cluster.daemon.send_signal(signal.SIGTERM)
        time.sleep(0.005)
    assert cluster.daemon.wait(timeout=10) == 0
    assert '"signal":"SIGHUP"' in cluster.log_of("daemon")


def _wait_catching(pid: int, signum: signal.Signals, timeout_s: float = 30.0) -> None:
    """Until process ``pid`` catches ``signum``. Python's own start-up comes first, and no
    program can handle a signal before its first line runs: on a loaded host that alone
    can outlast a fixed delay."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signum - 1)):
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not catch {signum.name} within {timeout_s} s")


def test_a_worker_stopped_while_it_starts_exits_0_saying_so(tmp_path: Path) -> None:
    """SIGTERM while its imports run (two seconds of torch): before, it died of the signal
    (status -15) without a line."""
    path, _ = cluster_config(tmp_path)
    worker = subprocess.Popen([sys.executable, "-m", "orchestrator", "worker", "--role", "encoder",
                               "--config", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_catching(worker.pid, signal.SIGTERM)  # kept from here on; torch still to import
    worker.send_signal(signal.SIGTERM)
    output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    assert '"event":"worker.signal"' in output and '"during_start_up":true' in output


def wait_for_log(cluster: LocalCluster, line: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in cluster.log_of("daemon"):
        assert time.monotonic() < deadline, f"{line} not logged within {timeout_s}s"
        time.sleep(0.01)


async def _append(results: list, awaitable) -> None:
    results.append(await awaitable)


def _dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_forged_registration_and_reports_are_refused(start_cluster: StartCluster) -> None:
    cluster = start_cluster()
    before = cluster.control.stats()
    sock = _dealer(cluster.config.daemon.worker_endpoint)
    try:
        forged = Register(protocol=PROTOCOL_VERSION, token="guess", role="decoder", name="intruder",
                          work_address="tcp://127.0.0.1:1", session="127.0.0.1:1", pool_base=0, pool_size=0,
                          slots=[], capacity=1, write_timeout_s=5.0)
        sock.send(encode(forged))
        assert sock.poll(5000)
        reply = DAEMON_TO_WORKER.decode(sock.recv())
        assert isinstance(reply, RegisterRefused) and "token" in reply.message
        sock.send(encode(Staged(request_id="x", nbytes=1, manifest=[], compute_ms=0)))
        assert sock.poll(5000)
        assert isinstance(DAEMON_TO_WORKER.decode(sock.recv()), RegisterRefused)
    finally:
        sock.close()
    after = cluster.control.stats()
    assert [i.instance for i in after.instances] == [i.instance for i in before.instances]
    with Client(cluster.client_endpoint) as client:
        client.submit(p(1), timeout_s=10)


# A firewall between the daemon and a work socket is out of reach of the checks a worker
# makes of its own addresses as it starts: this build skips them, so that a bind_host that
# does not listen where its advertise_host leads stands in for one.
FIREWALLED_WORKER = """
import sys
import orchestrator.worker
from orchestrator.entry import main

orchestrator.worker.check_own_addresses = lambda *args: None
sys.exit(main())
"""


def test_a_worker_the_daemon_cannot_reach_is_refused_and_stops(start_cluster: StartCluster, tmp_path: Path) -> None:
    """Its work socket listens on 127.0.0.1 but it advertises 127.0.0.2, unchecked: it
    registers and heartbeats, yet no order could reach it. It must never be given work,
    and must stop saying why instead of looking healthy."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    raw = msgspec.toml.decode(cluster.config_path.read_bytes())
    raw["workers"]["decoder"]["advertise_host"] = "127.0.0.2"
    config = tmp_path / "unreachable.toml"
    config.write_bytes(msgspec.toml.encode(raw))
    worker = subprocess.Popen([sys.executable, "-c", FIREWALLED_WORKER, "worker", "--role", "decoder", "--name",
                               "unreachable", "--config", str(config)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(cluster, lambda s: any(i.name == "unreachable" and i.suspect for i in s.instances), timeout_s=60)
        with Client(cluster.client_endpoint) as client:
            for seed in range(4):  # the decoder that was reached serves them all
                client.submit(p(seed), timeout_s=20)
        output, _ = worker.communicate(timeout=30)
    finally:
        worker.kill()
    assert worker.returncode == 1
    assert "work_address tcp://127.0.0.2:" in output and "did not arrive" in output
    assert '"process.failed"' in output and "Traceback" not in output  # a refusal, not a crash
    stats = wait_for(cluster, lambda s: all(i.name != "unreachable" for i in s.instances))
    assert [i.served for i in stats.instances if i.role == "decoder"] == [4]


# A worker build with a bug: one field of its Staged reports is out of the wire's bounds.
GARBLING_WORKER = """
import math, sys
import msgspec
import orchestrator.worker
from orchestrator.entry import main
from transfer.protocol import Staged, encode

orchestrator.worker.encode = lambda msg: encode(
    msgspec.structs.replace(msg, compute_ms=math.nan) if isinstance(msg, Staged) else msg)
sys.exit(main())
"""


async def test_a_worker_whose_reports_the_daemon_cannot_read_is_dropped_and_its_requests_retried(
    start_cluster: StartCluster,
) -> None:
    """What its report said is unknown (its stage's end?): rather than leave what it holds
    to the deadlines, the daemon drops it, the requests go to the other encoder, and the
    worker stops saying why."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    null_cfg = cluster.config.model.null
    worker = subprocess.Popen([sys.executable, "-c", GARBLING_WORKER, "worker", "--role", "encoder", "--name",
                               "garbling", "--config", str(cluster.config_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        await anyio.to_thread.run_sync(partial(
            wait_for, cluster, lambda s: any(i.name == "garbling" and not i.suspect for i in s.instances),
            timeout_s=60))
        with anyio.fail_after(30):
            async with AsyncClient(cluster.client_endpoint) as client:
                generations: list[Generation | None] = [None] * 8

                async def one(seed: int) -> None:
                    generations[seed] = await client.submit(p(seed), timeout_s=20)

                async with anyio.create_task_group() as tg:
                    for seed in range(8):  # both encoders take some: 4 fill one
                        tg.start_soon(one, seed)
        output, _ = await anyio.to_thread.run_sync(partial(worker.communicate, timeout=30))
    finally:
        worker.kill()
    for seed, generation in enumerate(generations):
        assert generation is not None and torch.equal(generation.outputs["images"],
                                                      expected_outputs(p(seed), null_cfg)["images"])
    assert worker.returncode == 1
    assert "sent a report the daemon cannot read" in output and "$.compute_ms" in output
    assert '"process.failed"' in output and "Traceback" not in output  # a refusal, not a crash
    stats = wait_for(cluster, all_free)
    assert all(i.name != "garbling" for i in stats.instances)
    assert stats.retried >= 1 and stats.failed_by_reason == {"worker_lost": stats.retried}


def test_a_dead_worker_is_evicted_and_a_restart_replaces_it(start_cluster: StartCluster) -> None:
    cluster = start_cluster()
    victim = cluster.workers["denoiser0"]
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    stats = wait_for(cluster, lambda s: sum(i.role == "denoiser" for i in s.instances) == 1, timeout_s=15)
    assert all(i.name != "denoiser0" for i in stats.instances)
    with Client(cluster.client_endpoint) as client:
        client.submit(p(1), timeout_s=10)  # the surviving denoiser serves
    cluster.start_worker("denoiser", 0)
    stats = wait_for(cluster, lambda s: sum(i.role == "denoiser" for i in s.instances) == 2, timeout_s=60)
    names = sorted(i.name for i in stats.instances if i.role == "denoiser")
    assert names == ["denoiser0", "denoiser1"]
    assert wait_for(cluster, all_free)


@pytest.mark.parametrize("role", ["encoder", "denoiser"], ids=["another-role", "a-second-process-of-its-role"])
def test_a_worker_taking_a_live_workers_name_is_refused_and_the_other_serves_on(
    start_cluster: StartCluster, tmp_path: Path, role: Role
) -> None:
    """Before, the newcomer took the name and the live denoiser stopped for good; two live
    processes under one --name in restart loops (a copied unit file) evicted each other
    every few seconds, and what each held failed worker_lost. Now the newcomer waits for
    the name (the holder may be a dead process not yet evicted) for its connect_timeout_s,
    then exits naming why."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    before = {i.instance for i in cluster.control.stats().instances}
    patient = config_variant(cluster, tmp_path / "patient.toml", f"workers.{role}", {"connect_timeout_s": 3.0})
    clash = cluster.start_worker(role, 1, name="denoiser0", config_path=patient)
    assert clash.wait(timeout=60) == 1
    log = cluster.log_of(f"{role}1")
    assert "worker.registration_deferred" in log and "the name 'denoiser0' is held by" in log
    assert f"the daemon did not take this worker within 3.0s (workers.{role}.connect_timeout_s)" in log
    assert cluster.workers["denoiser0"].poll() is None
    assert {i.instance for i in cluster.control.stats().instances} == before
    with Client(cluster.client_endpoint) as client:
        assert client.submit(p(1), timeout_s=20).result.request_id


def test_an_output_no_receiver_can_take_is_invalid_at_once_and_not_retried(start_cluster: StartCluster) -> None:
    """The encoder's output is larger than every denoiser's whole pool: no retry can mend
    that, so the request fails ``invalid`` as soon as the output is staged, without an
    alloc round trip or a second encoder pass."""
    cluster = start_cluster(**{"model.null": {"embed_shape": [1, 1024, 1024]},  # 4 MiB of embeddings
                               "workers.encoder": {"pool_bytes": 16 * 2**20},
                               "workers.denoiser": {"pool_bytes": 2**20, "prealloc_slots": 0}})
    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:
            client.submit(p(1), timeout_s=20)
    assert caught.value.reason == Reason.INVALID
    assert caught.value.rejected.message == (f"its {4 * 2**20}-byte output fits no denoiser's memory pool "
                                             f"(the most one ever registered takes is {2**20} bytes: "
                                             "workers.denoiser.pool_bytes past its preallocated slots, or "
                                             "prealloc_slot_bytes)")
    stats = wait_for(cluster, all_free)
    assert (stats.slow_path, stats.fast_path, stats.retried) == ({}, {}, 0)


def test_a_retry_goes_to_another_worker_than_the_one_that_failed_it(
    start_cluster: StartCluster, tmp_path: Path
) -> None:
    """encoder1 has no room to stage any output, and has the most free slots, so least_loaded
    offers it every request first: each fails there once, and its retry goes to encoder0.
    Before, the retry went to encoder1 again and every request failed."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.encoder": {"capacity": 1}})
    cramped = config_variant(cluster, tmp_path / "cramped.toml", "workers.encoder",
                             {"capacity": 8, "pool_bytes": 16384})  # embeddings: 19,712 bytes
    cluster.start_worker("encoder", 1, config_path=cramped)
    cluster.wait_registered(4, timeout_s=60)
    with Client(cluster.client_endpoint) as client:
        served_by = {next(s.instance for s in client.submit(p(i), timeout_s=20).result.stages
                          if s.role == "encoder") for i in range(3)}
    names = {i.instance: i.name for i in cluster.control.stats().instances}
    assert {names[instance] for instance in served_by} == {"encoder0"}
    stats = wait_for(cluster, all_free)
    assert stats.retried == 3 and stats.failed_by_reason == {"transfer_failed": 3} and stats.completed == 3


def test_a_receiver_too_small_for_an_input_is_never_offered_it(start_cluster: StartCluster, tmp_path: Path) -> None:
    """denoiser1's whole pool is 4 KiB, less than any request's embeddings, and it has the
    most free slots. Before, least_loaded placed every request there first, and each failed
    its hand-off (transfer_failed, "can never fit") and was computed again; now the pool
    places by what a receiver can hold, and denoiser0 serves them all at the first try."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.denoiser": {"capacity": 1}})
    cramped = config_variant(cluster, tmp_path / "cramped.toml", "workers.denoiser",
                             {"capacity": 8, "pool_bytes": 4096, "prealloc_slots": 0})
    cluster.start_worker("denoiser", 1, config_path=cramped)
    cluster.wait_registered(4, timeout_s=60)
    with ThreadPoolExecutor(3) as pool:
        # Three at once: two wait in the daemon for the one denoiser that fits, while the
        # other has room.
        done = list(pool.map(lambda i: _submit(cluster, p(i)), range(3)))
    served_by = {next(s.instance for s in generation.result.stages if s.role == "denoiser") for generation in done}
    names = {i.instance: i.name for i in cluster.control.stats().instances}
    assert {names[instance] for instance in served_by} == {"denoiser0"}
    stats = wait_for(cluster, all_free)
    assert (stats.retried, stats.failed_by_reason, stats.completed) == (0, {}, 3)


def test_inputs_only_a_slot_holds_wait_for_one_on_a_worker_with_fewer_slots_than_capacity(
    start_cluster: StartCluster,
) -> None:
    """One 32 KiB slot, a region of 8 KiB and capacity 3: the 19,712-byte embeddings fit only
    the slot. Before, the second and third requests, placed while the first held it, were
    asked to allocate in the region, refused ("can never fit"), and failed or were computed
    again. Now each waits for the slot and is pushed into it when the one before moves on."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.null": {"denoiser_ms": 300.0},
                               "workers.denoiser": {"capacity": 3, "prealloc_slots": 1,
                                                    "prealloc_slot_bytes": 32768, "pool_bytes": 32768 + 8192}})
    small = [msgspec.structs.replace(p(i), width=64, height=64) for i in range(3)]  # 1 KiB of latents
    with ThreadPoolExecutor(3) as pool:
        done = list(pool.map(partial(_submit, cluster), small))
    for params, generation in zip(small, done, strict=True):
        assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
    stats = wait_for(cluster, all_free)
    assert (stats.retried, stats.failed_by_reason, stats.completed) == (0, {}, 3)
    assert stats.fast_path["encoder->denoiser"] == 3 and "encoder->denoiser" not in stats.slow_path


def _submit(cluster: LocalCluster, params: GenParams) -> Generation:
    with Client(cluster.client_endpoint) as client:
        return client.submit(params, timeout_s=30)


def test_a_taken_port_stops_the_daemon_loudly(start_cluster: StartCluster) -> None:
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    second = subprocess.run([sys.executable, "-m", "orchestrator", "serve", "--config", str(cluster.config_path)],
                            capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    output = second.stdout + second.stderr
    assert '"process.failed"' in output and "Address already in use" in output and "Traceback" not in output
    cluster.control.stats()  # the first daemon is unaffected


def test_a_stop_signal_during_start_up_is_a_drain_of_nothing(tmp_path: Path) -> None:
    """SIGTERM while the daemon still imports and reads its config: before, the default
    disposition killed it (exit 143, not a line logged)."""
    config_path, _ = cluster_config(tmp_path)
    daemon = subprocess.Popen([sys.executable, "-m", "orchestrator", "serve", "--config", str(config_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_catching(daemon.pid, signal.SIGTERM)  # kept from here on, long before the loop watches
    daemon.send_signal(signal.SIGTERM)
    output, _ = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, output
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    assert [(line["signal"], line["during_start_up"]) for line in lines if line["event"] == "daemon.signal"] == [
        ("SIGTERM", True)]
    assert lines[-1]["event"] == "daemon.stopped"


async def test_allocs_and_pushes_are_answered_while_the_worker_computes(start_cluster: StartCluster) -> None:
    """One denoiser busy for 1.5 s still takes the next request's input at once (slow path)."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1}, **SLOW,
                            **{"workers.denoiser": {"prealloc_slots": 0, "capacity": 2}})
    generations = []
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(_append, generations, client.submit(p(1), request_id="first"))
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 1)
            tg.start_soon(_append, generations, client.submit(p(2), request_id="second"))
    second = next(g for g in generations if g.result.request_id == "second")
    encoder_stage = second.result.stages[0]
    assert encoder_stage.fast_path is False
    # The hand-off (alloc round trip + push) did not wait for the 1.5 s computation.
    assert encoder_stage.queued_ms + encoder_stage.transfer_ms < 500, encoder_stage


def test_a_worker_with_no_daemon_says_it_waits_then_gives_up_in_one_line(tmp_path: Path) -> None:
    path, _ = cluster_config(tmp_path, **{"workers.encoder": {"connect_timeout_s": 4.0}})
    done = subprocess.run([sys.executable, "-m", "orchestrator", "worker", "--role", "encoder", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    waiting = [e for e in events if e["event"] == "worker.waiting_for_daemon"]
    assert len(waiting) == 1 and waiting[0]["endpoint"] == f"ipc://{tmp_path}/workers"
    assert done.returncode == 1 and events[-1]["event"] == "process.failed"
    assert ("no answer from the daemon" in events[-1]["error"]
            and "workers.encoder.connect_timeout_s" in events[-1]["error"])


@pytest.mark.parametrize("socket", ["client", "control"])
def test_a_worker_sent_to_another_daemon_socket_says_so_at_once(start_cluster: StartCluster, tmp_path: Path,
                                                                socket: str) -> None:
    """Not "no answer from the daemon" after connect_timeout_s (60 s) of retrying: the socket
    answered, saying which it is."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    endpoint = getattr(cluster.config.daemon, f"{socket}_endpoint")
    # Its own copy of the config names no socket twice (that is refused as it loads).
    astray = config_variant(cluster, tmp_path / "astray.toml", "daemon",
                            {"worker_endpoint": endpoint, f"{socket}_endpoint": f"ipc://{tmp_path}/elsewhere"})
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrator", "worker", "--role", "encoder", "--config",
                           str(astray)], capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert done.returncode == 1 and events[-1]["event"] == "process.failed", done.stderr[-2000:]
    assert events[-1]["error"] == (
        f"WorkerRefused: daemon.worker_endpoint ({endpoint}) is not the daemon's worker socket: it answered "
        f"\"this is the daemon's {socket} socket; this message goes to its worker socket (daemon.worker_endpoint)\"")
    assert time.monotonic() - started < 30  # a model load, then one answer


def test_a_worker_whose_writes_could_outlast_the_daemons_quarantine_is_refused(start_cluster: StartCluster,
                                                                              tmp_path: Path) -> None:
    """Its host's copy of the config loads on its own (its MC_TRANSFER_TIMEOUT below its
    own push_quarantine_s), but the daemon holds a lost sender's memory for less: a write
    it gave up on could land in memory given to another request. Was never checked."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    quarantine_s = cluster.config.daemon.push_quarantine_s
    raw = msgspec.toml.decode(cluster.config_path.read_bytes())
    raw["daemon"]["push_quarantine_s"] = quarantine_s + 20
    raw["transfer"]["env"] = {**raw["transfer"]["env"], "MC_TRANSFER_TIMEOUT": str(quarantine_s + 10)}
    (copy := tmp_path / "another-hosts.toml").write_bytes(msgspec.toml.encode(raw))
    done = subprocess.run([sys.executable, "-m", "orchestrator", "worker", "--role", "decoder", "--config", str(copy)],
                          capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert done.returncode == 1 and events[-1]["event"] == "process.failed", done.stderr[-2000:]
    assert (f"Mooncake write timeout ({quarantine_s + 10:g} s, transfer.env.MC_TRANSFER_TIMEOUT) is not below the "
            f"daemon's push_quarantine_s ({quarantine_s:g} s)") in events[-1]["error"]
    assert [i.role for i in cluster.control.stats().instances].count("decoder") == 1


@pytest.mark.parametrize(("setting", "says"), [
    ({"workers.encoder": {"pool_bytes": 1 << 60}}, "workers.encoder.pool_bytes (1152921504606846976) is more than "
                                                   "this machine's memory"),
    ({"transfer": {"metadata_server": "etcd://127.0.0.1:1"}}, "EngineUnusable: mooncake initialize failed"),
    # Mooncake starts on any name: a decoder so registered failed every request sent to it.
    ({"transfer": {"local_hostname": "192.0.2.1"}}, "transfer.local_hostname (192.0.2.1) is not an address of "
                                                    "this host: every write its peers made to 192.0.2.1 would fail"),
    # Was found only after 2.5 s of registration, and blamed on advertise_host.
    ({"workers.encoder": {"advertise_host": "127.0.0.2"}}, "workers.encoder.bind_host (127.0.0.1) is not where "
                                                           "advertise_host (127.0.0.2) leads"),
    ({"daemon": {"worker_endpoint": "tcp://*:5557", "token": "a-secret-of-our-own"}},
     "daemon.worker_endpoint (tcp://*:5557) is an address for the daemon to bind, not one to connect to"),
])
def test_a_worker_its_machine_cannot_serve_as_configured_says_why_in_one_line(tmp_path: Path, setting: dict,
                                                                            says: str) -> None:
    """A setting the machine cannot meet is the operator's to change: one line naming it,
    not a crash's traceback."""
    path, _ = cluster_config(tmp_path, **setting)
    done = subprocess.run([sys.executable, "-m", "orchestrator", "worker", "--role", "encoder", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert done.returncode == 1 and events[-1]["event"] == "process.failed", done.stderr[-2000:]
    assert says in events[-1]["error"] and "Traceback" not in done.stderr


def test_a_cluster_whose_process_is_killed_takes_every_process_it_started_with_it(tmp_path: Path) -> None:
    """A demo killed with SIGKILL (or SIGTERM, or its terminal closed) runs no cleanup: the
    daemon it started, in a session of its own, went on serving, and held the ports the next
    demo needed. It now drains and exits, and the workers go with their fork server."""
    path, _ = cluster_config(tmp_path)
    script = f"""
import os, signal
from orchestrator.cluster import LocalCluster
cluster = LocalCluster({str(path)!r}, log_dir={str(tmp_path / "logs")!r})
cluster.start(timeout_s=120)
print(cluster.daemon.pid, *(proc.pid for proc in cluster.workers.values()), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == -signal.SIGKILL, done.stderr
    pids = [int(pid) for pid in done.stdout.split()]
    assert len(pids) == 5  # the daemon and four workers

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().split(") ")[1][0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running: {left}"
