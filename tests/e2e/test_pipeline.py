"""The whole path under normal and bad conditions, with null stages."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
import torch
import zmq

from orchestrator.client import AsyncClient, Client, Generation, Rejection
from orchestrator.cluster import LocalCluster, all_free
from orchestrator.fork_server import ForkServer
from orchestrator.stages.null import expected_outputs
from tests.conftest import outcome_of
from tests.e2e.conftest import RawClient, StartCluster, assert_torch_free, config_variant, wait_for
from transfer.protocol import (
    PROTOCOL_VERSION,
    Cancelled,
    GenParams,
    GetStats,
    Progress,
    Reason,
    Rejected,
    Submit,
    encode,
)

HOPS = ("encoder->denoiser", "denoiser->decoder")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer):
    from tests.e2e.conftest import assert_no_crash, cluster_config

    tmp = tmp_path_factory.mktemp("p")
    path, _ = cluster_config(tmp)
    with LocalCluster(path, log_dir=tmp / "logs", forks=forks) as running:
        yield running
    assert_no_crash(running)


def params(i: int, **kw: object) -> GenParams:
    # Odd requests make 8 KiB latents, more than a decoder's 4 KiB preallocated slot.
    width, height = (64, 48) if i % 2 == 0 else (256, 128)
    return GenParams(prompt=f"prompt {i}", seed=i, width=width, height=height, output="raw", **kw)


async def test_fifty_concurrent_requests_return_correct_bytes(cluster: LocalCluster) -> None:
    """50 requests through 1/2/1 workers: every output is exactly what its request should give."""
    null_cfg = cluster.config.model.null
    failures: list[str] = []
    served_by: set[str] = set()
    moved_by: set[str | None] = set()

    async def one(client: AsyncClient, i: int) -> None:
        generation = await client.submit(params(i), timeout_s=30)
        expected = expected_outputs(params(i), null_cfg)
        if not torch.equal(generation.outputs["images"], expected["images"]):
            failures.append(f"request {i}: wrong bytes")
        served_by.update(s.instance for s in generation.result.stages if s.role == "denoiser")
        moved_by.update(s.via for s in generation.result.stages if s.role != "decoder")

    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(one, client, i)
    assert not failures
    assert len(served_by) == 2, "both denoisers served"
    assert moved_by == {"mooncake"}, "every hand-off a real Mooncake write (configs/test.toml: same_host_copy = false)"
    stats = wait_for(cluster, all_free)
    for hop in HOPS:
        assert stats.fast_path.get(hop, 0) > 0, f"fast path unused on {hop}: {stats}"
        assert stats.slow_path.get(hop, 0) > 0, f"slow path unused on {hop}: {stats}"


def test_everything_is_free_after_the_work_ends(cluster: LocalCluster) -> None:
    with Client(cluster.client_endpoint) as client:
        for i in range(3):
            client.submit(params(100 + i), timeout_s=10)
    stats = wait_for(cluster, all_free)
    assert stats.handoffs_in_flight == 0
    assert {i.role for i in stats.instances} == {"encoder", "denoiser", "decoder"}


def test_a_fast_path_request_makes_a_fixed_number_of_internal_hops(cluster: LocalCluster) -> None:
    """The daemon's cost per request is counted in mail between its actors (actors/mailbox.py)."""
    before = wait_for(cluster, all_free)
    with Client(cluster.client_endpoint) as client:
        client.submit(params(200), timeout_s=10)
    after = wait_for(cluster, all_free)
    for hop in HOPS:
        assert after.fast_path[hop] == before.fast_path.get(hop, 0) + 1
    hops = {actor: after.mail_handled[actor] - before.mail_handled[actor] - 1 for actor in after.mail_handled}
    # Less the stats query each actor answered. The tracker and the negotiator also take
    # timer ticks, so only the others have an exact count: the result delivered (frontend),
    # three jobs queued and three slots credited back (admission), and per pool a dispatch,
    # its orders (Work or Ready, then Push; the decoder has no push) and the slot's release.
    assert {actor: n for actor, n in hops.items() if actor not in ("tracker", "negotiator")} == {
        "frontend": 1, "admission": 6, "pool.encoder": 4, "pool.denoiser": 4, "pool.decoder": 3,
    }
    assert hops["negotiator"] >= 3  # a placement per stage
    assert hops["tracker"] >= 4  # admitted, two hand-offs, finished


async def test_a_failing_stage_fails_only_that_request(cluster: LocalCluster) -> None:
    failing = GenParams(prompt="please fail now", seed=7, output="raw")
    outcomes: dict[str, object] = {}

    async def one(client: AsyncClient, name: str, p: GenParams) -> None:
        outcomes[name] = await outcome_of(client.submit(p, timeout_s=20))

    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(one, client, "bad", failing)
            for i in range(6):
                tg.start_soon(one, client, f"good{i}", params(200 + i))
    bad = outcomes.pop("bad")
    assert isinstance(bad, Rejected) and bad.reason == Reason.STAGE_FAILED
    assert "told to fail" in bad.message and "denoiser" in bad.message
    assert all(not isinstance(o, Rejected) for o in outcomes.values())
    wait_for(cluster, all_free)


def test_garbage_wrong_type_and_bad_field_get_typed_rejections(cluster: LocalCluster) -> None:
    before = cluster.control.stats()
    with RawClient(cluster.client_endpoint) as client:
        garbage = client.send_raw([b"\xff\x00 definitely not msgpack"])
        assert isinstance(garbage, Rejected) and garbage.reason == Reason.INVALID
        assert "invalid request" in garbage.message

        wrong_type = client.send_raw([encode(Cancelled(request_id="r", found=True))])  # a reply, not a request
        assert isinstance(wrong_type, Rejected) and wrong_type.reason == Reason.INVALID
        assert "Cancelled" in wrong_type.message

        astray = client.send_raw([encode(GetStats())])  # another socket's request: named
        assert isinstance(astray, Rejected) and astray.reason == Reason.INVALID
        assert astray.message == ("this is the daemon's client socket; this message goes to its control socket "
                                  "(daemon.control_endpoint)")

        bad_field = client.send_raw([encode(Submit(protocol=PROTOCOL_VERSION, params=params(0)))
                                     .replace(b"\xa5width@", b"\xa5width\xd0\xfb")])  # width = -5
        assert isinstance(bad_field, Rejected) and bad_field.reason == Reason.INVALID
        assert "$.params.width" in bad_field.message

        too_many_frames = client.send_raw([b"a", b"b"])
        assert isinstance(too_many_frames, Rejected) and too_many_frames.reason == Reason.INVALID

        unhonourable = client.send_raw([encode(Submit(protocol=PROTOCOL_VERSION,
                                                      params=GenParams(prompt="x", width=60, height=64)))])
        assert isinstance(unhonourable, Rejected) and unhonourable.reason == Reason.INVALID
        assert "multiple of 8" in unhonourable.message

        # And the daemon keeps serving.
        generation = client.submit(params(5), timeout_s=10)
    assert torch.equal(generation.outputs["images"], expected_outputs(params(5), cluster.config.model.null)["images"])
    # Each refusal counted, at the door: none was admitted, so none failed.
    after = cluster.control.stats()
    assert after.refused.get("invalid", 0) - before.refused.get("invalid", 0) == 6
    assert after.failed_by_reason == before.failed_by_reason


def _peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def test_an_oversized_message_is_refused_unread(cluster: LocalCluster) -> None:
    """64 MiB to the client socket (limit 256 KiB): ZMQ drops the sender, the daemon never holds it."""
    assert cluster.daemon is not None
    before = _peak_rss_mib(cluster.daemon.pid)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.client_endpoint)
    try:
        sock.send_multipart([b"", b"\x00" * (64 << 20)])
        assert not sock.poll(2000)  # disconnected, not answered
    finally:
        sock.close()
    with Client(cluster.client_endpoint) as client:
        generation = client.submit(params(7), timeout_s=10)
    assert torch.equal(generation.outputs["images"], expected_outputs(params(7), cluster.config.model.null)["images"])
    assert _peak_rss_mib(cluster.daemon.pid) - before < 32


def test_wrong_protocol_version_is_unsupported(cluster: LocalCluster) -> None:
    with RawClient(cluster.client_endpoint) as client:
        reply = client.send_raw([encode(Submit(protocol=PROTOCOL_VERSION + 1, params=params(1)))])
    assert isinstance(reply, Rejected) and reply.reason == Reason.UNSUPPORTED


@pytest.mark.parametrize("capacity", [1, 4], ids=["waiting at the daemon", "waiting in the worker"])
async def test_a_higher_priority_request_overtakes_queued_ones_at_a_busy_stage(
    start_cluster: StartCluster, capacity: int
) -> None:
    """One denoiser, busy: two requests wait for it, then an urgent one arrives and goes next.

    The priority travels from the Submit to the encoder's job and on, through the
    negotiator, to the denoiser's queue, where it decides the order; and to the denoiser,
    which holds up to its capacity and computes one at a time: those waiting there go in by
    it too. The time a request's embeddings waited is the denoiser's queueing in its Result,
    not the encoder's.
    """
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.denoiser": {"capacity": capacity}, "model.null": {"denoiser_ms": 2000.0}})
    finished: dict[str, Generation] = {}
    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            async def submit(rid: str, priority: int) -> None:
                finished[rid] = await client.submit(params(0), request_id=rid, priority=priority, timeout_s=30)

            tg.start_soon(submit, "first", 0)
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: s.requests_by_state.get("denoising") == 1)
            for rid in ("later-1", "later-2"):
                tg.start_soon(submit, rid, 0)
            await anyio.to_thread.run_sync(wait_for, cluster,
                                           lambda s: s.queue_depths.get("denoiser") == 2 if capacity == 1
                                           else s.requests_by_state.get("denoising") == 3)
            tg.start_soon(submit, "urgent", 10)
    assert list(finished) == ["first", "urgent", "later-1", "later-2"]
    encoder, denoiser, _ = finished["later-2"].result.stages
    assert encoder.queued_ms < 1000 and denoiser.queued_ms > 4000, (encoder, denoiser)  # behind three of 2 s


def test_the_operators_caps_refuse_a_request_at_the_door(start_cluster: StartCluster) -> None:
    """[model.limits] lowers what the workers register; the daemon refuses past it, and no
    worker computes anything for the refused request."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"model.limits": {"max_size": 32, "max_pixels": 32 * 32 * 2}})
    with Client(cluster.client_endpoint) as client:
        for too_much, problem in [({"width": 40, "height": 32}, "width 40 is outside [8, 32]"),
                                  ({"num_images": 3, "width": 32, "height": 32}, "pixels exceeds 2048")]:
            with pytest.raises(Rejection) as caught:
                client.submit(GenParams(prompt="p", **too_much), timeout_s=10)
            assert caught.value.reason == Reason.INVALID and problem in caught.value.rejected.message
        client.submit(GenParams(prompt="p", width=32, height=32, num_images=2), timeout_s=10)
    stats = cluster.control.stats()
    assert stats.completed == 1 and [i.served for i in stats.instances] == [1, 1, 1]


def test_the_door_admits_what_every_registered_worker_takes(start_cluster: StartCluster, tmp_path: Path) -> None:
    """Workers of one role with different [model.limits]: the door admits only what all of
    them take (dispatch may pick any), whichever registered last; once the tighter one
    leaves, its caps no longer bind."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    capped = config_variant(cluster, tmp_path / "capped.toml", "model.limits", {"max_size": 32})
    wide = GenParams(prompt="p", width=40, height=32)
    with Client(cluster.client_endpoint) as client:
        client.submit(wide, timeout_s=10)
        tight = cluster.start_worker("denoiser", 1, config_path=capped)
        cluster.wait_registered(4, timeout_s=60)
        cluster.start_worker("denoiser", 2)  # registers last, with the model's own limits
        cluster.wait_registered(5, timeout_s=60)
        # Each instance's limits are in the control socket's list, as it registered them.
        max_sizes = {i.name: i.limits.max_size for i in cluster.control.workers().instances
                     if i.role == "denoiser" and i.limits}
        assert max_sizes["denoiser1"] == 32 and max_sizes["denoiser0"] == max_sizes["denoiser2"] > 32
        with pytest.raises(Rejection) as caught:
            client.submit(wide, timeout_s=10)
        assert caught.value.reason == Reason.INVALID and "width 40 is outside [8, 32]" in caught.value.rejected.message
        tight.terminate()
        assert tight.wait(timeout=20) == 0
        wait_for(cluster, lambda s: len(s.instances) == 4)
        client.submit(wide, timeout_s=10)


def test_a_worker_of_another_model_is_refused_and_the_cluster_serves_on(start_cluster: StartCluster,
                                                                       tmp_path: Path) -> None:
    """A denoiser whose encoder embeddings would have another shape stops at registration,
    naming both models; it never gets a request."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    other = config_variant(cluster, tmp_path / "other.toml", "model.null", {"embed_shape": [1, 77, 32]})
    stranger = cluster.start_worker("denoiser", 1, config_path=other)
    assert stranger.wait(timeout=60) == 1
    assert "is not the model the registered workers serve" in cluster.log_of("denoiser1")
    with Client(cluster.client_endpoint) as client:
        client.submit(params(0), timeout_s=10)
    assert len(cluster.control.stats().instances) == 3


def test_a_client_that_never_reads_makes_the_daemon_hold_only_so_much(start_cluster: StartCluster) -> None:
    """Its replies past ZMQ's queue (client_send_hwm) and the daemon's (client_held_bytes,
    here one reply) are dropped and counted: that is all it can make the daemon keep,
    whatever it asks for."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            daemon={"client_send_hwm": 2, "client_held_bytes": 1})
    ctx = zmq.Context()
    deaf = ctx.socket(zmq.DEALER)
    deaf.setsockopt(zmq.RCVHWM, 1)
    deaf.setsockopt(zmq.LINGER, 0)
    try:
        deaf.connect(cluster.client_endpoint)
        for i in range(30):  # 768 KiB raw images: a few fill the socket buffers
            submit = Submit(protocol=PROTOCOL_VERSION, request_id=f"deaf-{i}", timeout_s=30,
                            params=GenParams(prompt="p", seed=i, width=512, height=512, output="raw"))
            deaf.send_multipart([b"", encode(submit)])
        stats = wait_for(cluster, lambda s: s.completed == 30, timeout_s=60)
        assert 0 < stats.replies_dropped <= 30 - 3
        received = 0
        while deaf.poll(500):
            deaf.recv_multipart()
            received += 1
        assert received + stats.replies_dropped == 30
    finally:
        deaf.close()
        ctx.term()
    assert all_free(cluster.control.stats())


def test_an_output_larger_than_the_daemon_takes_fails_its_request_only(start_cluster: StartCluster,
                                                                        tmp_path: Path) -> None:
    """A decoder output past daemon.worker_max_message_bytes would get the decoder cut off
    unread by the daemon's socket (and taken for dead, its other requests with it): a raw
    one, whose size the request says, is refused at the door before any stage runs; a PNG,
    known only once encoded, the decoder refuses, naming the limit, and serves on. The limit
    is the daemon's, said at registration: this decoder's own config has the default, 1,024
    times larger."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1}, daemon={"worker_max_message_bytes": 1 << 20})
    own = config_variant(cluster, tmp_path / "decoder.toml", "daemon", {"worker_max_message_bytes": 1 << 30})
    cluster.start_worker("decoder", 0, config_path=own)
    cluster.wait_registered(3, timeout_s=60)
    limit = "more than the daemon takes in one frame (daemon.worker_max_message_bytes = 1048576)"
    with Client(cluster.client_endpoint) as client:
        with pytest.raises(Rejection) as caught:  # 1024 x 1024 x 3 bytes
            client.submit(GenParams(prompt="p", width=1024, height=1024, output="raw"), timeout_s=20)
        assert caught.value.reason == Reason.INVALID
        assert f"output 'images' would be 3145728 bytes, {limit}" in caught.value.rejected.message
        assert all(i.served == i.failed == 0 for i in cluster.control.stats().instances)  # nothing computed
        with pytest.raises(Rejection) as caught:  # PNG of noise: about 1.6 MB
            client.submit(GenParams(prompt="p", width=2048, height=1024), timeout_s=20)
        assert caught.value.reason == Reason.INVALID
        assert limit in caught.value.rejected.message and "decoder" in caught.value.rejected.message
        client.submit(GenParams(prompt="p", width=256, height=256, output="raw"), timeout_s=20)
    stats = wait_for(cluster, all_free)
    assert stats.retried == 0 and len(stats.instances) == 3 and not any(i.suspect for i in stats.instances)
    assert stats.refused == {"invalid": 1} and stats.failed_by_reason == {"invalid": 1}


def test_a_worker_without_room_to_stage_its_output_fails_the_hand_off_which_is_retried(
    start_cluster: StartCluster,
) -> None:
    """The sender's pool is half of every hand-off: no room there is a failed hand-off
    (transfer_failed, started again on the workers left), as no room at the receiver is."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.encoder": {"pool_bytes": 16384}})  # embeddings: 19,712 bytes
    with Client(cluster.client_endpoint) as client, pytest.raises(Rejection) as caught:
        client.submit(params(0), timeout_s=20)
    assert caught.value.reason == Reason.TRANSFER_FAILED
    assert caught.value.rejected.message.endswith(
        "no room to stage its output: 19712 bytes can never fit: the allocatable region is 16384 bytes "
        "(pool 16384, prealloc slots 0) (workers.encoder.pool_bytes)")  # the setting to raise, named
    stats = wait_for(cluster, all_free)
    assert stats.retried == 1 and stats.failed_by_reason == {"transfer_failed": 2}


async def test_a_burst_of_refusals_reaches_a_client_that_reads(start_cluster: StartCluster) -> None:
    """300 submits at once past max_in_flight: 299 replies leave in one turn, ten times
    what ZMQ queues for one connection, and every one arrives."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            daemon={"max_in_flight": 1}, **{"model.null": {"denoiser_ms": 2000.0}})
    outcomes: list[str] = []

    async def submit(client: AsyncClient, i: int) -> None:
        try:
            await client.submit(GenParams(prompt="burst", seed=i, output="raw"), timeout_s=20)
            outcomes.append("result")
        except Rejection as refused:
            outcomes.append(refused.reason)

    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for i in range(300):
                tg.start_soon(submit, client, i)
    assert sorted(outcomes) == [Reason.OVERLOADED] * 299 + ["result"]
    assert cluster.control.stats().replies_dropped == 0


async def test_a_denoiser_with_two_compute_threads_runs_two_requests_at_once(start_cluster: StartCluster) -> None:
    """workers.<role>.compute_threads: two requests' denoising loops run interleaved."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1},
                            **{"workers.denoiser": {"capacity": 2, "compute_threads": 2},
                               "model.null": {"denoiser_ms": 2000.0}})
    events: list[tuple[str, str]] = []

    async def one(client: AsyncClient, rid: str) -> None:
        def heard(progress: Progress) -> None:
            if progress.steps:
                events.append((rid, "stepping"))

        await client.submit(params(0), request_id=rid, timeout_s=30, on_progress=heard)
        events.append((rid, "done"))

    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for rid in ("a", "b"):
                tg.start_soon(one, client, rid)
    # One thread would run them one after the other: every step report of the second
    # after the last of the first. Two interleave them.
    steps = [rid for rid, what in events if what == "stepping"]
    first, second = steps[0], ("b" if steps[0] == "a" else "a")
    assert steps.index(second) < len(steps) - 1 - steps[::-1].index(first)


def test_the_daemon_never_loads_torch(cluster: LocalCluster) -> None:
    """It never touches a tensor. Loading torch anyway (once, through an import in the
    CLI every process runs) cost it 190 MiB and 4x the CPU per request: each garbage
    collection walked torch's objects."""
    assert cluster.daemon is not None
    assert_torch_free(cluster.daemon.pid)


def test_a_request_that_times_out_for_want_of_a_stage_says_so(start_cluster: StartCluster) -> None:
    """It waits rather than being refused (a restarting worker costs no request), and its
    timeout names the role nobody serves."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    denoiser = cluster.workers["denoiser0"]
    denoiser.send_signal(signal.SIGTERM)
    assert denoiser.wait(timeout=20) == 0
    wait_for(cluster, lambda s: len(s.instances) == 2)
    with Client(cluster.client_endpoint) as client, pytest.raises(Rejection) as caught:
        client.submit(params(0), timeout_s=1.5)
    assert caught.value.reason == Reason.TIMED_OUT
    assert "; no denoiser worker is registered (this daemon started" in caught.value.rejected.message
