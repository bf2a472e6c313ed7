"""AdmissionActor: one FIFO queue per role, drained as that role's capacity frees.

It never looks at instances. Pools send ``Credit`` when slots free up (or vanish with a
worker) and admission hands the oldest waiting job to the pool for each credit, so a
queued request never spins and an idle pool never waits on a poll.
"""

from __future__ import annotations

from collections import OrderedDict

import anyio
import msgspec
import structlog

from actors.base import reply_once, serve_mailbox
from actors.mail import AdmissionMail, Credit, Dispatch, Enqueue, Forget, Job, PoolMail, QueryStats
from actors.mailbox import Mailbox
from transfer.protocol import ROLES, Role

log = structlog.get_logger()


class AdmissionStats(msgspec.Struct, frozen=True):
    queue_depths: dict[str, int]
    credits: dict[str, int]
    mailbox: int


class RoleQueue:
    """FIFO of jobs for one role with O(1) removal from anywhere (timeouts, cancels).

    An OrderedDict keeps insertion order, so its first key is the oldest job.
    """

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, Job] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def push(self, job: Job, *, front: bool = False) -> None:
        self._jobs[job.request_id] = job
        if front:  # a pool lost the instance it was going to use
            self._jobs.move_to_end(job.request_id, last=False)

    def pop(self) -> Job:
        rid = next(iter(self._jobs))
        return self._jobs.pop(rid)

    def remove(self, request_id: str) -> bool:
        return self._jobs.pop(request_id, None) is not None


class AdmissionActor:
    """Owns the waiting queues and each role's count of unclaimed free slots."""

    def __init__(self, inbox: Mailbox[AdmissionMail], pools: dict[Role, Mailbox[PoolMail]]) -> None:
        self._inbox = inbox
        self._pools = pools
        self._queues: dict[Role, RoleQueue] = {role: RoleQueue() for role in ROLES}
        # Free slots the pool has reported and admission has not yet handed a job for.
        # Negative after a worker leaves with dispatches still in flight to it.
        self._credits: dict[Role, int] = {role: 0 for role in ROLES}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await serve_mailbox(self._inbox, self._handle, task_status=task_status)

    def _handle(self, mail: AdmissionMail) -> None:
        match mail:
            case Enqueue(job=job, front=front):
                self._queues[job.role].push(job, front=front)
                self._dispatch(job.role)
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
                        self._inbox.peak,
                    ),
                )

    def _dispatch(self, role: Role) -> None:
        queue = self._queues[role]
        while queue and self._credits[role] > 0:
            self._credits[role] -= 1
            self._pools[role].post(Dispatch(job=queue.pop()))
