"""A new worker is offered work only once its Probe came back, and refused if it never does."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio

from actors.mail import Join, Leave, LimitsChanged, Suspect, Tick
from tests.actors.negotiator_harness import (
    FakeWorker,
    Negotiator,
    fake_worker,
    register,
    registration,
    running_negotiator,
    speak,
    wait_late,
)
from transfer.protocol import DAEMON_TO_WORKER, Heartbeat, Leaving, Probed, RegisterRefused, Step, encode

HEARTBEAT_S = 0.1
MISSES = 3


async def registered_unreached(ctx: zmq.asyncio.Context, n: Negotiator) -> tuple[zmq.asyncio.Socket, str]:
    """A denoiser registered; its pool was told to join and probe it, and nothing else."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(n.endpoint)
    registered = await register(sock, "denoiser", "s", slots=1)
    assert isinstance(n.pools["denoiser"].receive_nowait(), Join)
    assert isinstance(n.frontend.receive_nowait(), LimitsChanged)
    return sock, registered.instance


async def test_a_worker_is_offered_work_once_its_probe_comes_back(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            sock, instance = await registered_unreached(ctx, n)
            with sock:
                await sock.send(encode(Heartbeat()))  # alive, but that says nothing of its work socket
                await sock.send(encode(Probed(instance="denoiser-99")))  # not its own probe
                await speak(n, FakeWorker(sock, instance, "s"))  # read: the reports above were too
                n.assert_silent()
                await sock.send(encode(Probed(instance=instance)))
                assert await n.pools["denoiser"].receive() == Suspect(instance=instance, suspect=False)
                await sock.send(encode(Probed(instance=instance)))  # a repeat changes nothing
                for _ in range(2):
                    await anyio.sleep(MISSES * HEARTBEAT_S * 0.6)
                    await speak(n, FakeWorker(sock, instance, "s"))
                n.inbox.post(Tick())  # joined past the limit, but reached and heard from: it stays
                await n.stats()
                n.assert_silent()


async def test_a_worker_whose_probe_never_arrives_is_refused_naming_its_address(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Its advertised work address does not reach it: registered and heartbeating, it would
    otherwise hold every request sent to it until that request's deadline."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            sock, instance = await registered_unreached(ctx, n)
            with sock:
                worker = FakeWorker(sock, instance, "s")
                await anyio.sleep(MISSES * HEARTBEAT_S * 0.5)
                await speak(n, worker)
                n.inbox.post(Tick())
                await n.stats()
                n.assert_silent()  # not yet
                await anyio.sleep(MISSES * HEARTBEAT_S * 0.6)
                await speak(n, worker)  # it speaks: alive, and its DEALER gets through
                n.inbox.post(Tick())
                leave = await n.pools["denoiser"].receive()
                assert isinstance(leave, Leave) and leave.instance == instance
                refused = DAEMON_TO_WORKER.decode(await sock.recv())
                assert isinstance(refused, RegisterRefused) and not refused.rejoin  # it stops, loudly
                assert "work_address ipc://unused did not arrive" in refused.message
                assert "advertise_host" in refused.message
                assert instance not in (await n.stats()).prealloc


async def test_an_unreached_worker_that_falls_silent_is_evicted_as_silent_and_may_rejoin(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Frozen or cut off before its Probed came back: nothing says its address is wrong."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            sock, instance = await registered_unreached(ctx, n)
            with sock:
                await anyio.sleep(MISSES * HEARTBEAT_S * 1.2)
                n.inbox.post(Tick())
                leave = await n.pools["denoiser"].receive()
                assert isinstance(leave, Leave) and leave.instance == instance and "missed heartbeats" in leave.message
                assert not await sock.poll(100)  # not refused: its next message rejoins it


async def test_reports_waiting_on_the_socket_when_a_tick_refuses_a_worker_are_still_read(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The refusal is a send from outside the socket's reader, and a ZMQ send consumes the
    "something arrived" edge of the socket's FD: the reports already there must not wait for
    a new edge (which never comes while they sit unread), or their worker is evicted as silent."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            async with fake_worker(ctx, n, "encoder") as encoder:
                sock, instance = await registered_unreached(ctx, n)
                with sock:
                    await anyio.sleep(MISSES * HEARTBEAT_S * 1.1)
                    await speak(n, FakeWorker(sock, instance, "s"))
                    await speak(n, encoder)  # not silent: it stays
                    late = (await n.stats()).late_reports
                    await encoder.report(Step(request_id="nobody", step=0, steps=1))
                    time.sleep(0.1)  # the loop blocked: the report lands on the socket, unread
                    n.inbox.post(Tick())  # delivered now: the unreached denoiser is refused
                    assert isinstance(await n.pools["denoiser"].receive(), Leave)
                    with anyio.fail_after(1):
                        await wait_late(n, late + 1)


async def test_a_newcomer_past_max_workers_is_refused_for_now_and_gets_in_once_one_leaves(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Before, registrations went on until the daemon ran out of sockets, and the next one
    killed it (about 1,020 workers)."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, max_workers=2) as n, fake_worker(ctx, n, "encoder"):
            async with fake_worker(ctx, n, "denoiser") as denoiser:
                with ctx.socket(zmq.DEALER) as newcomer:
                    newcomer.setsockopt(zmq.LINGER, 0)
                    newcomer.connect(n.endpoint)
                    await newcomer.send(encode(registration("decoder", "decoder-session", 1)))
                    refused = DAEMON_TO_WORKER.decode(await newcomer.recv())
                    assert isinstance(refused, RegisterRefused) and refused.rejoin and refused.deferred
                    assert "at most 2 workers at once (daemon.max_workers)" in refused.message
                    n.assert_silent()
                    await denoiser.report(Leaving())
                    assert isinstance(await n.pools["denoiser"].receive(), Leave)
                    await register(newcomer, "decoder", "decoder-session", 1)


async def test_a_stall_of_the_daemon_does_not_refuse_a_newcomer_whose_probed_waits_unread(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """The daemon stood still past heartbeat_misses right after a registration: the Probed
    waits in its socket, and the worker would be refused (and exit) naming a wrong address."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            sock, _ = await registered_unreached(ctx, n)
            with sock:
                time.sleep(0.5)  # the loop stands still past heartbeat_s * heartbeat_misses
                n.inbox.post(Tick(gap_s=0.5))
                await n.stats()
                n.assert_silent()
                assert not await sock.poll(100)  # not refused


async def test_an_unreached_newcomer_that_falls_quiet_is_not_refused_as_unreachable(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Joined past heartbeat_misses ago but quiet for over two heartbeats: frozen with its
    Probe unread, maybe; nothing says its work address is wrong. It is evicted as silent
    if it stays so, and may rejoin."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S, heartbeat_misses=MISSES) as n:
            sock, instance = await registered_unreached(ctx, n)
            with sock:
                await anyio.sleep(0.1)
                await speak(n, FakeWorker(sock, instance, "s"))
                await anyio.sleep(0.25)  # joined 0.35 s ago (past 0.3), quiet for 0.25 (past 0.2)
                n.inbox.post(Tick())
                await n.stats()
                n.assert_silent()  # a suspect already, until its Probe comes back
                assert not await sock.poll(100)  # not refused
