"""RoleQueue: highest priority first, FIFO within a priority, removal from anywhere, and a
lost job's return to the front of its priority, behind those lost before it."""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.admission import RoleQueue
from actors.mail import Job
from transfer.protocol import GenParams

PARAMS = GenParams(prompt="p")


def job(rid: str, priority: int = 0) -> Job:
    return Job(request_id=rid, role="encoder", params=PARAMS, deadline=math.inf, priority=priority)


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


def test_jobs_sent_back_together_keep_their_order() -> None:
    """Two dispatches bounce (their instance left), in the order they went out: they come
    back in that order, both before the jobs that had no turn yet."""
    q = queue_of("a", "b")
    q.push(job("lost1"), front=True)
    q.push(job("lost2"), front=True)
    assert drain(q) == ["lost1", "lost2", "a", "b"]


def test_len_counts_jobs() -> None:
    q = queue_of("a", "b")
    assert len(q) == 2
    q.pop()
    assert len(q) == 1
    assert not queue_of()


def test_pop_of_an_empty_queue_raises() -> None:
    with pytest.raises(IndexError):
        RoleQueue().pop()


def test_higher_priority_goes_first_and_equals_keep_their_order() -> None:
    q = RoleQueue()
    for rid, priority in [("low1", -5), ("mid1", 0), ("high", 7), ("mid2", 0), ("low2", -5)]:
        q.push(job(rid, priority))
    assert drain(q) == ["high", "mid1", "mid2", "low1", "low2"]


def test_push_front_goes_first_among_its_priority_only() -> None:
    q = RoleQueue()
    for rid, priority in [("high", 3), ("a", 0), ("b", 0)]:
        q.push(job(rid, priority))
    q.push(job("lost", 0), front=True)
    assert drain(q) == ["high", "lost", "a", "b"]


def test_removing_the_last_job_of_a_priority_lets_the_next_one_lead() -> None:
    q = RoleQueue()
    for rid, priority in [("a", 0), ("top", 9)]:
        q.push(job(rid, priority))
    assert q.remove("top")
    q.push(job("b", 0))
    assert drain(q) == ["a", "b"]


class RoleQueueMachine(RuleBasedStateMachine):
    """RoleQueue against a list model kept in pop order: push (back or front, any of a few
    priorities), pop, remove."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = RoleQueue()
        # (priority, sent back, request id), in the order pops must see
        self.model: list[tuple[int, bool, str]] = []
        self.next_id = 0

    @rule(front=st.booleans(), priority=st.integers(-2, 2))
    def push(self, front: bool, priority: int) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        # Back: after every job of this priority or higher; front (sent back): after those of
        # its priority sent back before it, before the rest of its priority.
        at = next((i for i, (p, back, _) in enumerate(self.model)
                   if p < priority or (front and p == priority and not back)), len(self.model))
        assert self.queue.push(job(rid, priority), front=front) == at  # how many leave before it
        self.model.insert(at, (priority, front, rid))

    @precondition(lambda self: self.model)
    @rule()
    def pop(self) -> None:
        assert self.queue.pop().request_id == self.model.pop(0)[2]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.model))
        assert self.queue.remove(entry[2])
        self.model.remove(entry)

    @invariant()
    def same_jobs(self) -> None:
        assert len(self.queue) == len(self.model)
        assert all(rid in self.queue for _, _, rid in self.model) and "never-pushed" not in self.queue


TestRoleQueueMachine = RoleQueueMachine.TestCase
TestRoleQueueMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
