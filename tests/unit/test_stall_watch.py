"""When a worker's loop stood still, as its pushes ask (orchestrator/stall_watch.py)."""

from __future__ import annotations

import anyio

from orchestrator.stall_watch import StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def running(watch: StallWatch, clock: Clock, seconds: float) -> None:
    """The loop runs, its watch looking every half limit."""
    for _ in range(round(seconds / (watch.limit_s / 2))):
        clock.now += watch.limit_s / 2
        watch.look()


def test_a_loop_that_keeps_running_never_stood_still() -> None:
    clock = Clock()
    watch = StallWatch(1.0, clock=clock)
    running(watch, clock, 30.0)
    assert not watch.stood_still_near(watch.look()) and watch.stall_ended is None


def test_what_was_read_before_a_stall_or_just_after_it_stood_still_and_later_reads_did_not() -> None:
    clock = Clock()
    watch = StallWatch(1.0, clock=clock)
    before = watch.look()
    clock.now += 4.0  # stopped
    just_after = watch.look()  # the first look after it notices it, whoever looks
    assert (watch.stall_ended, watch.stalled_s, watch.count) == (just_after, 4.0, 1)
    assert watch.stood_still_after(0) and not watch.stood_still_after(1)
    assert watch.stood_still_near(before) and watch.stood_still_near(just_after)
    clock.now += 0.5  # a message that came during the stall, read moments later
    assert watch.stood_still_near(clock.now)
    running(watch, clock, 2.0)
    assert not watch.stood_still_near(watch.look())


def test_the_first_look_after_a_stall_notices_it_even_when_a_read_comes_first() -> None:
    """No tick of the watch's own task came between: the push's own look notices it."""
    clock = Clock()
    watch = StallWatch(1.0, clock=clock)
    clock.now += 3.0
    assert watch.stood_still_near(watch.look())


async def test_its_task_looks_often_enough_that_ordinary_running_is_no_stall() -> None:
    watch = StallWatch(0.05)
    with anyio.move_on_after(0.5):
        await watch.run()
    assert watch.stall_ended is None


def test_a_stall_only_a_little_past_the_limit_is_one() -> None:
    """The limit is the line, not a rough scale: a gap of half again it is a stall, noticed
    as a long one is (the other tests' stalls are several limits long)."""
    clock = Clock()
    watch = StallWatch(1.0, clock=clock)
    before = watch.look()
    clock.now += 1.5
    assert watch.stood_still_near(before) and (watch.stalled_s, watch.count) == (1.5, 1)
