"""A registration that claims what a live worker holds (its name as another process, its
Mooncake session under another name) is refused; the live worker serves on. Claimed from a
worker gone silent, it is a restart, and the newcomer replaces the old one."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.mail import Join, Leave, LimitsChanged
from actors.negotiator import PreallocCounts
from tests.actors.negotiator_harness import (
    encoder_and_denoiser,
    fake_worker,
    registration,
    running_negotiator,
    shared_pool,
    speak,
)
from transfer.protocol import DAEMON_TO_WORKER, Register, Registered, RegisterRefused, Role, encode

HEARTBEAT_S = 0.05


async def claim(ctx: zmq.asyncio.Context, endpoint: str, hello: Register) -> tuple[zmq.asyncio.Socket, object]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    await sock.send(encode(hello))
    return sock, DAEMON_TO_WORKER.decode(await sock.recv())


@pytest.mark.parametrize("role", ["encoder", "denoiser"], ids=["another-role", "another-process-of-its-role"])
async def test_a_live_workers_name_claimed_by_another_process_is_refused_and_the_live_one_serves_on(
    ctx: zmq.asyncio.Context, tmp_path: Path, role: Role
) -> None:
    """Before, the newcomer took the name and the live denoiser was told to stop for good;
    two such processes under restart loops (a copied unit file) evicted each other every few
    seconds, failing what each held."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2) as (n, _, denoiser):
            hello = msgspec.structs.replace(registration(role, "other-session", 0), name="denoiser-worker")
            sock, reply = await claim(ctx, n.endpoint, hello)
            with sock:
                assert isinstance(reply, RegisterRefused) and reply.rejoin and reply.deferred  # in once it is silent
                assert reply.message == (f"the name 'denoiser-worker' is held by {denoiser.instance}, "
                                         "a live denoiser worker: worker names must be unique")
            assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
            assert not await denoiser.sock.poll(50)  # told nothing
            n.assert_silent()


async def test_a_live_workers_session_is_refused_until_that_worker_falls_silent(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """Two links on one session would have pushes for one pool land in the other's memory.
    A restart whose predecessor still counts as live gets in once that one is silent."""
    with anyio.fail_after(5):
        async with encoder_and_denoiser(ctx, tmp_path, slots=2, heartbeat_s=HEARTBEAT_S) as (n, _, denoiser):
            hello = msgspec.structs.replace(registration("denoiser", denoiser.session, 1), name="restarted")
            await speak(n, denoiser)
            sock, reply = await claim(ctx, n.endpoint, hello)
            with sock:
                assert isinstance(reply, RegisterRefused) and reply.rejoin and reply.deferred
                assert f"registered by {denoiser.instance} ('denoiser-worker'), which is still heard" in reply.message
                assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
                n.assert_silent()
                await anyio.sleep(3 * HEARTBEAT_S)  # the old process is dead: it says nothing more
                await sock.send(encode(hello))  # the worker's registration retry
                registered = DAEMON_TO_WORKER.decode(await sock.recv())
                assert isinstance(registered, Registered)
                leave, join = n.take("denoiser")[:2]
                assert isinstance(leave, Leave) and leave.instance == denoiser.instance
                assert isinstance(join, Join) and join.instance == registered.instance
                assert [m.instance for m in n.take("frontend") if isinstance(m, LimitsChanged)] == [
                    denoiser.instance, registered.instance]
                assert denoiser.instance not in (await n.stats()).prealloc


async def test_a_live_workers_shared_pool_is_refused_under_another_name_and_session(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    """A same-host push copies into the file the receiver advertised: two links advertising one
    file would have copies meant for one worker's slots land in the other's, as two on one
    session would. Before, the second was registered, and its pushes overwrote the first's inputs."""
    with anyio.fail_after(5):
        async with running_negotiator(ctx, tmp_path, heartbeat_s=HEARTBEAT_S) as n, \
                fake_worker(ctx, n, "denoiser", slots=2, host="host-a") as denoiser:
            shared = shared_pool("host-a", "denoiser")
            hello = msgspec.structs.replace(registration("denoiser", "own-session", 2, local=shared), name="other")
            await speak(n, denoiser)
            sock, reply = await claim(ctx, n.endpoint, hello)
            with sock:
                assert isinstance(reply, RegisterRefused) and reply.rejoin and reply.deferred
                assert reply.message == (f"the shared memory {shared.path} is registered by {denoiser.instance} "
                                         "('denoiser-worker'), which is still heard from: it is one worker's pool")
                assert (await n.stats()).prealloc[denoiser.instance] == PreallocCounts(2, 2)
                n.assert_silent()
                await anyio.sleep(3 * HEARTBEAT_S)  # silent now: the file's old owner is taken for dead
                await sock.send(encode(hello))
                registered = DAEMON_TO_WORKER.decode(await sock.recv())
                assert isinstance(registered, Registered)
                leave = n.take("denoiser")[0]
                assert isinstance(leave, Leave) and leave.instance == denoiser.instance
                told = DAEMON_TO_WORKER.decode(await denoiser.sock.recv())
                assert told == RegisterRefused(message=f"another worker registered the shared memory {shared.path}")
