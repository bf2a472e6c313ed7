"""RoleQueue: FIFO order, removal from anywhere, and a lost job's return to the front."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.admission import RoleQueue
from actors.mail import Job
from transfer.protocol import GenParams

PARAMS = GenParams(prompt="p")


def job(rid: str) -> Job:
    return Job(request_id=rid, role="encoder", params=PARAMS)


def queue_of(*rids: str) -> RoleQueue:
    q = RoleQueue()
    for rid in rids:
        q.push(job(rid))
    return q


def drain(q: RoleQueue) -> list[str]:
    return [q.pop().request_id for _ in range(len(q))]


def test_pop_is_fifo() -> None:
    assert drain(queue_of("a", "b", "c")) == ["a", "b", "c"]


def test_remove_from_the_middle_keeps_the_order() -> None:
    q = queue_of("a", "b", "c")
    assert q.remove("b")
    assert drain(q) == ["a", "c"]


def test_remove_of_an_absent_job_is_false() -> None:
    q = queue_of("a")
    assert not q.remove("zzz")
    assert len(q) == 1


def test_push_front_goes_first() -> None:
    q = queue_of("a", "b")
    q.push(job("lost"), front=True)
    assert drain(q) == ["lost", "a", "b"]


def test_len_counts_jobs() -> None:
    q = queue_of("a", "b")
    assert len(q) == 2
    q.pop()
    assert len(q) == 1
    assert not queue_of()


def test_pop_of_an_empty_queue_raises() -> None:
    with pytest.raises(StopIteration):
        RoleQueue().pop()


class RoleQueueMachine(RuleBasedStateMachine):
    """RoleQueue against a list model: push (back or front), pop, remove."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = RoleQueue()
        self.model: list[str] = []
        self.next_id = 0

    @rule(front=st.booleans())
    def push(self, front: bool) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        self.queue.push(job(rid), front=front)
        if front:
            self.model.insert(0, rid)
        else:
            self.model.append(rid)

    @precondition(lambda self: self.model)
    @rule()
    def pop(self) -> None:
        assert self.queue.pop().request_id == self.model.pop(0)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.model))
        assert self.queue.remove(rid)
        self.model.remove(rid)

    @invariant()
    def same_length(self) -> None:
        assert len(self.queue) == len(self.model)


TestRoleQueueMachine = RoleQueueMachine.TestCase
TestRoleQueueMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
