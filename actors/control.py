"""ControlActor: sole owner of the control socket; gathers ``Stats`` from the owners.

No number is kept here. Each query fans out to the actors that own the numbers, each
answering from its own fields, and the answers are merged into one typed snapshot.
"""

from __future__ import annotations

import time
from typing import Any, assert_never

import anyio
import zmq
import zmq.asyncio

from actors.admission import AdmissionStats
from actors.base import ask_stats
from actors.frontend import FrontendStats
from actors.mailbox import Mailbox
from actors.negotiator import NegotiatorStats
from actors.pools import PoolStats
from actors.tracker import TrackerStats
from transfer.binding import bound_router
from transfer.protocol import (
    CONTROL_REQUEST,
    DECODE_ERRORS,
    ControlReply,
    Drain,
    Draining,
    GetStats,
    InstanceStats,
    ListWorkers,
    Reason,
    Rejected,
    Stats,
    Workers,
    encode,
    wrong_socket,
)
from transfer.sockets import recv_cut

QUERY_TIMEOUT_S = 5.0
CONTROL_SEND_HWM = 100
CONTROL_MAX_MESSAGE_BYTES = 64 * 1024  # a control request is a few bytes
# The frames of a control message read, its identity included (a valid one has 3); any more
# are dropped unread, a batch at a time, so that no message of millions of empty frames
# (each within the size limit) holds the daemon's loop.
CONTROL_FRAMES_READ = 8


class ControlActor:
    """Owns the control socket."""

    def __init__(
        self,
        *,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        owners: dict[str, Mailbox[Any]],
        drain_requested: anyio.Event,
        query_timeout_s: float = QUERY_TIMEOUT_S,
    ) -> None:
        self._ctx = ctx
        self._endpoint = endpoint
        self._owners = owners  # "frontend", "tracker", "admission", "negotiator", "pool.<role>"
        self._drain_requested = drain_requested
        self._query_timeout_s = query_timeout_s
        self._started = time.monotonic()

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        with bound_router(self._ctx, self._endpoint, send_hwm=CONTROL_SEND_HWM,
                          max_message_bytes=CONTROL_MAX_MESSAGE_BYTES) as (sock, bound):
            task_status.started(bound)
            while True:
                frames = await recv_cut(sock, CONTROL_FRAMES_READ)
                try:
                    reply = await self._answer(frames)
                except TimeoutError:
                    # An actor too busy to answer in time is news for the operator, not a crash.
                    begun = "; the drain has begun" if self._drain_requested.is_set() else ""
                    reply = Rejected(request_id="", reason=Reason.OVERLOADED,
                                     message=f"an actor did not answer the stats query within "
                                             f"{self._query_timeout_s}s{begun}")
                await sock.send_multipart([frames[0], b"", encode(reply)])

    async def _answer(self, frames: list[bytes]) -> ControlReply:
        if len(frames) != 3 or frames[1] != b"":
            return Rejected(request_id="", reason=Reason.INVALID, message=wrong_socket("control", frames[-1])
                            or "invalid control request: expected [empty, body]")
        try:
            msg = CONTROL_REQUEST.decode(frames[2])
        except DECODE_ERRORS as exc:
            return Rejected(request_id="", reason=Reason.INVALID,
                            message=wrong_socket("control", frames[2]) or f"invalid control request: {exc}")
        match msg:
            case GetStats():
                return await self.stats()
            case ListWorkers():
                return Workers(instances=(await self.stats()).instances)
            case Drain():
                # First, so that an actor too busy to be counted cannot hold the drain back.
                self._drain_requested.set()
                return Draining(in_flight=sum((await self.stats()).requests_by_state.values()))
            case _:
                assert_never(msg)

    async def stats(self) -> Stats:
        answers: dict[str, Any] = {}

        async def ask(owner: str) -> None:
            answers[owner] = await ask_stats(self._owners[owner])

        # One deadline around the whole fan-out, so a slow owner surfaces as TimeoutError.
        with anyio.fail_after(self._query_timeout_s):
            async with anyio.create_task_group() as tg:
                for owner in self._owners:
                    tg.start_soon(ask, owner)
        frontend: FrontendStats = answers["frontend"]
        tracker: TrackerStats = answers["tracker"]
        admission: AdmissionStats = answers["admission"]
        negotiator: NegotiatorStats = answers["negotiator"]
        instances: list[InstanceStats] = []
        queue_depths = dict(admission.queue_depths)
        for owner, answer in answers.items():
            if not owner.startswith("pool."):
                continue
            pool: PoolStats = answer
            queue_depths[pool.role] += pool.waiting  # queued too: for a worker that can hold their input
            for slots in pool.instances:
                prealloc = negotiator.prealloc.get(slots.instance)
                instances.append(
                    InstanceStats(
                        instance=slots.instance,
                        role=pool.role,
                        name=slots.name,
                        address=slots.address,
                        session=slots.session,
                        slots_free=slots.slots_free,
                        slots_total=slots.slots_total,
                        slots_finishing=slots.slots_finishing,
                        prealloc_free=prealloc.free if prealloc else 0,
                        prealloc_total=prealloc.total if prealloc else 0,
                        served=slots.served,
                        failed=slots.failed,
                        alive=prealloc is not None,
                        suspect=slots.suspect,
                        limits=negotiator.limits.get(slots.instance),
                    )
                )
        mailboxes = {owner: answer.mailbox.peak for owner, answer in answers.items()}
        return Stats(
            uptime_s=time.monotonic() - self._started,
            draining=frontend.draining,
            instances=instances,
            queue_depths=queue_depths,
            handoffs_in_flight=negotiator.handoffs_in_flight,
            handoffs_held=negotiator.handoffs_held,
            fast_path=negotiator.fast_path,
            slow_path=negotiator.slow_path,
            requests_by_state=tracker.by_state,
            completed=tracker.completed,
            failed_by_reason=tracker.failed_by_reason,
            late_reports=negotiator.late_reports,
            retried=frontend.retried,
            replies_dropped=frontend.replies_dropped,
            refused=frontend.refused,
            latency=tracker.latency,
            handoff_bytes=tracker.handoff_bytes,
            mailboxes=mailboxes,
            mail_handled={owner: answer.mailbox.handled for owner, answer in answers.items()},
        )
