"""Dispatch policies: only instances with a free slot are picked, each policy by its rule."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.dispatch import POLICIES, DispatchPolicy, LeastLoaded, PowerOfTwo, RoundRobin, make_policy

NAMES = sorted(POLICIES)


def policy(name: str) -> DispatchPolicy:
    if name == "power_of_two":
        return PowerOfTwo(random.Random(0))  # seeded: a failure must replay
    return make_policy(name)


@pytest.mark.parametrize("name", NAMES)
def test_pick_is_none_when_empty(name: str) -> None:
    assert policy(name).pick() is None


@pytest.mark.parametrize("name", NAMES)
def test_pick_is_none_when_nothing_is_free(name: str) -> None:
    p = policy(name)
    p.update("a", 0)
    p.update("b", 2)
    p.update("b", 0)
    assert p.pick() is None


@pytest.mark.parametrize("name", NAMES)
def test_never_picks_a_full_instance(name: str) -> None:
    p = policy(name)
    p.update("full", 0)
    p.update("free", 1)
    assert {p.pick() for _ in range(20)} == {"free"}


@pytest.mark.parametrize("name", NAMES)
def test_removed_instance_is_never_picked(name: str) -> None:
    p = policy(name)
    p.update("a", 3)
    p.update("b", 1)
    p.remove("a")
    assert {p.pick() for _ in range(20)} == {"b"}


@pytest.mark.parametrize("name", NAMES)
def test_removed_instance_can_rejoin(name: str) -> None:
    p = policy(name)
    p.update("a", 1)
    p.remove("a")
    p.update("a", 1)
    assert p.pick() == "a"


@pytest.mark.parametrize("name", NAMES)
def test_pick_does_not_spend_a_slot(name: str) -> None:
    p = policy(name)
    p.update("a", 1)
    assert [p.pick() for _ in range(3)] == ["a", "a", "a"]


def test_unknown_policy_name_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        make_policy("random")


# --------------------------------------------------------------------------- round robin


def test_round_robin_alternates() -> None:
    p = RoundRobin()
    for name in ("a", "b", "c"):
        p.update(name, 5)
    assert [p.pick() for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_asking_for_room_moves_no_turn() -> None:
    """The pool asks whether any instance has room when none fits a job: the ring turned."""
    p = RoundRobin()
    p.update("a", 1)
    p.update("b", 1)
    assert p.pick() == "a"
    assert p.has_room()
    assert p.pick() == "b"


def test_round_robin_skips_full_instances() -> None:
    p = RoundRobin()
    for name in ("a", "b", "c"):
        p.update(name, 1)
    p.update("b", 0)
    assert [p.pick() for _ in range(4)] == ["a", "c", "a", "c"]


def test_round_robin_still_alternates_after_a_slot_frees() -> None:
    """An instance that went full and freed again before the next pick keeps one turn, not two."""
    p = RoundRobin()
    p.update("a", 1)
    p.update("b", 1)
    p.update("a", 0)  # a job dispatched to a took its only slot...
    p.update("a", 1)  # ...and finished before the next pick
    assert [p.pick() for _ in range(4)] == ["a", "b", "a", "b"]


def test_round_robin_ring_stays_bounded_under_churn() -> None:
    """Dispatch then release on a one-slot worker, many times: the ring must not grow per job.

    Reads the private ring: a leak is invisible to ``pick`` until memory runs out.
    """
    p = RoundRobin()
    p.update("a", 1)
    for _ in range(1000):
        assert p.pick() == "a"
        p.update("a", 0)  # the pool took the slot
        p.update("a", 1)  # the worker finished
    assert len(p._ring) <= 1


def test_round_robin_ring_stays_bounded_as_workers_come_and_go_while_idle() -> None:
    """Each restarted worker joins under a new instance id; with no job picked meanwhile,
    the departed ones must not pile up in the ring (the next pick would step over them all)."""
    p = RoundRobin()
    p.update("a", 1)
    p.update("b", 1)
    for i in range(1000):
        p.update(f"gone-{i}", 2)
        p.remove(f"gone-{i}")
    assert len(p._ring) <= 12
    assert [p.pick() for _ in range(4)] == ["a", "b", "a", "b"]


# --------------------------------------------------------------------------- least loaded


def test_least_loaded_picks_the_most_free() -> None:
    p = LeastLoaded()
    p.update("a", 1)
    p.update("b", 3)
    p.update("c", 2)
    assert p.pick() == "b"
    p.update("b", 1)
    assert p.pick() == "c"


def test_least_loaded_compaction_keeps_every_instance_with_a_free_slot() -> None:
    """Updates pile stale entries into the heap until it is rebuilt from the counts: one
    free slot is as pickable after that as before."""
    p = LeastLoaded()
    p.update("one", 1)
    for i in range(200):
        p.update("busy", i % 3)
    p.update("busy", 0)
    assert len(p._heap) < 100  # rebuilt at least once
    assert p.pick() == "one"


def test_least_loaded_breaks_ties_by_longest_wait() -> None:
    """``a`` just served a job and got its slot back; ``b`` has waited longer at the same count."""
    p = LeastLoaded()
    p.update("a", 2)
    p.update("b", 2)
    assert p.pick() == "a"
    p.update("a", 1)
    p.update("a", 2)
    assert p.pick() == "b"


def test_least_loaded_ignores_a_stale_higher_count() -> None:
    p = LeastLoaded()
    p.update("a", 5)
    p.update("b", 2)
    p.update("a", 1)
    assert p.pick() == "b"


# --------------------------------------------------------------------------- power of two


def test_power_of_two_prefers_more_free_when_both_sampled() -> None:
    """With two candidates, ``b`` loses only when both samples land on ``a``, or ties."""
    p = PowerOfTwo(random.Random(1))
    p.update("a", 4)
    p.update("b", 1)
    picks = [p.pick() for _ in range(400)]
    assert picks.count("a") > picks.count("b") * 2


def test_power_of_two_drops_an_instance_that_went_full() -> None:
    p = PowerOfTwo(random.Random(2))
    p.update("a", 1)
    p.update("b", 1)
    p.update("c", 1)
    p.update("b", 0)
    assert "b" not in {p.pick() for _ in range(50)}


class _Unscannable(list[str]):
    """A candidate list that refuses to be walked: indexing only."""

    def __iter__(self):  # type: ignore[override]
        raise AssertionError("the pick walked every candidate")


def test_power_of_two_retry_skips_the_avoided_without_walking_the_pool() -> None:
    """A retry's pick costs steps for the instances it avoids, not for the pool's size."""
    p = PowerOfTwo(random.Random(3))
    for i in range(10_000):
        p.update(f"w{i}", 1)
    p._candidates = _Unscannable(p._candidates)
    avoid = {f"w{i}" for i in range(0, 10_000, 1000)}
    picks = {p.pick(avoid) for _ in range(200)}
    assert picks and not picks & avoid


def test_power_of_two_retry_draws_every_allowed_instance() -> None:
    p = PowerOfTwo(random.Random(4))
    for name in "abcdef":
        p.update(name, 1)
    assert {p.pick({"a", "c", "f"}) for _ in range(300)} == {"b", "d", "e"}
    assert {p.pick(set("abcdef")) for _ in range(300)} == set("abcdef")  # all avoided: any


# --------------------------------------------------------------------------- any sequence


ops = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.sampled_from("abcde"), st.integers(0, 4)),
        st.tuples(st.just("remove"), st.sampled_from("abcde"), st.just(0)),
        st.tuples(st.just("pick"), st.sampled_from(["", "a", "ab", "abcde"]), st.just(0)),  # what to avoid
    ),
    max_size=60,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150)
@given(ops=ops)
def test_any_sequence_picks_only_free_instances(name: str, ops: list[tuple[str, str, int]]) -> None:
    """After any updates, removals and picks, ``pick`` names an instance with a free slot, or
    None if none has; one not to avoid if any such has a free slot (a retry's pick);
    ``has_room`` says whether any has one."""
    p = policy(name)
    free: dict[str, int] = {}
    for op, instance, n in ops:
        assert p.has_room() == any(n > 0 for n in free.values())
        if op == "update":
            p.update(instance, n)
            free[instance] = n
        elif op == "remove":
            p.remove(instance)
            free.pop(instance, None)
        else:
            avoid = set(instance)
            picked = p.pick(avoid)
            if picked is None:
                assert all(n == 0 for n in free.values())
                continue
            assert free.get(picked, 0) > 0
            allowed = {i: n for i, n in free.items() if n > 0 and i not in avoid} or free
            assert picked in allowed
            if name == "least_loaded":
                assert free[picked] == max(allowed.values())
