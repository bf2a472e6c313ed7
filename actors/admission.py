"""AdmissionActor: one queue per role (highest priority first, FIFO within a priority),
drained as that role's capacity frees. A job whose deadline has passed is dropped, never
started.

It never looks at instances. Pools send ``Credit`` when slots free up (or vanish with a
worker) and admission hands the first waiting job to the pool for each credit, so a
queued request never spins and an idle pool never waits on a poll. A job whose client asked
for progress and that has to wait is reported to the tracker with how many wait before it.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import assert_never

import anyio
import msgspec

from actors.base import reply_once, serve_mailbox
from actors.mail import AdmissionMail, Credit, Dispatch, Enqueue, Forget, Job, PoolMail, QueryStats, Queued, TrackerMail
from actors.mailbox import Mailbox, MailboxCounts
from transfer.protocol import ROLES, Role


class AdmissionStats(msgspec.Struct, frozen=True):
    queue_depths: dict[str, int]
    credits: dict[str, int]
    mailbox: MailboxCounts


@dataclass(slots=True)
class _Line:
    """One priority's jobs: those a pool sent back (first, in the order they came back), then
    those waiting their first turn, oldest first."""

    returned: OrderedDict[str, Job] = field(default_factory=OrderedDict)
    waiting: OrderedDict[str, Job] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self.returned) + len(self.waiting)


class RoleQueue:
    """Jobs for one role: highest priority first, FIFO within a priority, with O(1) removal
    from anywhere (timeouts, cancels).

    Each priority in use has a ``_Line`` (its OrderedDicts keep insertion order: the first
    key is the oldest job); the priorities in use are kept sorted. Submit allows 201 of
    them, so finding the highest is cheap however many jobs wait. A job sent back (its
    instance was lost between dispatch and placement) goes before those of its priority
    that have not had a turn, and after any sent back before it: jobs that bounce together
    keep their order.
    """

    def __init__(self) -> None:
        self._lines: dict[int, _Line] = {}
        self._priorities: list[int] = []  # those with jobs, ascending
        self._priority_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._priority_of

    def push(self, job: Job, *, front: bool = False) -> int:
        """Queue ``job`` (``front``: sent back by a pool); returns how many jobs will leave before it."""
        line = self._lines.get(job.priority)
        if line is None:
            line = self._lines[job.priority] = _Line()
            bisect.insort(self._priorities, job.priority)
        (line.returned if front else line.waiting)[job.request_id] = job
        self._priority_of[job.request_id] = job.priority
        higher = self._priorities[bisect.bisect_right(self._priorities, job.priority):]
        return sum(len(self._lines[p]) for p in higher) + (len(line.returned) if front else len(line)) - 1

    def pop(self) -> Job:
        if not self._priorities:
            raise IndexError("pop from an empty RoleQueue")
        priority = self._priorities[-1]
        line = self._lines[priority]
        rid, job = (line.returned or line.waiting).popitem(last=False)
        self._forget(rid, priority)
        return job

    def remove(self, request_id: str) -> bool:
        priority = self._priority_of.get(request_id)
        if priority is None:
            return False
        line = self._lines[priority]
        if line.returned.pop(request_id, None) is None:
            del line.waiting[request_id]
        self._forget(request_id, priority)
        return True

    def _forget(self, request_id: str, priority: int) -> None:
        del self._priority_of[request_id]
        if not self._lines[priority]:
            del self._lines[priority]
            self._priorities.remove(priority)


class AdmissionActor:
    """Owns the waiting queues and each role's count of unclaimed free slots."""

    def __init__(self, inbox: Mailbox[AdmissionMail], pools: dict[Role, Mailbox[PoolMail]],
                 tracker: Mailbox[TrackerMail]) -> None:
        self._inbox = inbox
        self._pools = pools
        self._tracker = tracker
        self._queues: dict[Role, RoleQueue] = {role: RoleQueue() for role in ROLES}
        # Free slots the pool has reported and admission has not yet handed a job for.
        # Negative after a worker leaves with dispatches still in flight to it.
        self._credits: dict[Role, int] = {role: 0 for role in ROLES}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_mailbox(self._inbox, self._handle, task_status=task_status)

    def _handle(self, mail: AdmissionMail) -> None:
        match mail:
            case Enqueue(job=job, front=front):
                ahead = self._queues[job.role].push(job, front=front or job.again)
                self._dispatch(job.role)
                if job.progress and job.request_id in self._queues[job.role]:
                    self._tracker.post(Queued(request_id=job.request_id, role=job.role, position=ahead + 1))
            case Credit(role=role, delta=delta):
                self._credits[role] += delta
                self._dispatch(role)
            case Forget(request_id=rid):
                for queue in self._queues.values():
                    if queue.remove(rid):
                        break
                for pool in self._pools.values():
                    pool.post(mail)
            case QueryStats(reply=reply):
                reply_once(
                    reply,
                    AdmissionStats(
                        {role: len(q) for role, q in self._queues.items()},
                        dict(self._credits),
                        self._inbox.counts(),
                    ),
                )
            case _:
                assert_never(mail)

    def _dispatch(self, role: Role) -> None:
        queue = self._queues[role]
        while queue and self._credits[role] > 0:
            job = queue.pop()
            if job.deadline <= time.monotonic():
                # Past its deadline: the tracker's next tick ends it (its Forget finds
                # nothing here). Starting it would only spend a worker on an abort.
                continue
            self._credits[role] -= 1
            self._pools[role].post(Dispatch(job=job))
