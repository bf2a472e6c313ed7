"""RecentIds: what was added within the window, in bounded memory."""

from __future__ import annotations

from actors.recent import RecentIds


def test_an_id_is_held_for_the_window_and_taken_once() -> None:
    recent = RecentIds(1.0, most=10)
    recent.add("a", now=100.0)
    assert recent.holds("a", 100.9) and not recent.holds("a", 101.0) and not recent.holds("b", 100.0)
    assert recent.take("a", 100.5) and not recent.take("a", 100.5)  # forgotten once taken
    recent.add("b", now=100.0)
    assert not recent.take("b", 101.5)


def test_past_its_size_the_oldest_are_forgotten_and_expired_ones_go_first() -> None:
    recent = RecentIds(1.0, most=3)
    for i, key in enumerate("abcd"):
        recent.add(key, now=100.0 + i / 100)
    assert [recent.holds(k, 100.05) for k in "abcd"] == [False, True, True, True]
    recent.add("b", now=100.06)  # added again: now the newest
    recent.add("e", now=100.07)
    assert [recent.holds(k, 100.08) for k in "bcde"] == [True, False, True, True]
    assert len(recent) == 3
    recent.add("f", now=105.0)  # the rest have expired: only f is kept
    assert len(recent) == 1
