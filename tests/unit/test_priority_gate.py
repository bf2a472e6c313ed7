"""PriorityGate: compute slots taken by priority, then arrival; a cancelled waiter loses nothing."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from orchestrator.priority_gate import PriorityGate


async def test_waiters_go_in_by_priority_then_arrival() -> None:
    gate = PriorityGate(1)
    order: list[str] = []
    holding = anyio.Event()
    release = anyio.Event()

    async def hold() -> None:
        async with gate.slot(0):
            holding.set()
            await release.wait()

    async def take(name: str, priority: int) -> None:
        async with gate.slot(priority):
            order.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await holding.wait()
            for name, priority in (("low1", -5), ("mid1", 0), ("high", 9), ("low2", -5), ("mid2", 0)):
                tg.start_soon(take, name, priority)
                await anyio.sleep(0.01)  # arrived in this order
            release.set()
    assert order == ["high", "mid1", "mid2", "low1", "low2"]


async def test_at_most_slots_holders_at_once() -> None:
    gate = PriorityGate(2)
    inside, most = 0, 0

    async def take(priority: int) -> None:
        nonlocal inside, most
        async with gate.slot(priority):
            inside += 1
            most = max(most, inside)
            await anyio.sleep(0.01)
            inside -= 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for priority in range(10):
                tg.start_soon(take, priority % 3)
    assert (most, inside) == (2, 0)


async def test_a_waiter_cancelled_before_or_as_its_turn_comes_passes_the_slot_on() -> None:
    gate = PriorityGate(1)
    got: list[str] = []

    async def take(name: str) -> None:
        async with gate.slot(0):
            got.append(name)

    with anyio.fail_after(5):
        async with gate.slot(0):
            waiting = asyncio.create_task(take("cancelled while waiting"))
            granted = asyncio.create_task(take("cancelled as granted"))
            await asyncio.sleep(0.01)
            waiting.cancel()
            await asyncio.sleep(0.01)
        # Leaving handed the slot to the second waiter, which has not run since: cancelled
        # now, it holds a slot it never used, and must pass it on.
        granted.cancel()
        for task in (waiting, granted):
            with pytest.raises(asyncio.CancelledError):
                await task
        await take("next")
        async with gate.slot(0):  # nothing leaked: the one slot is free again
            pass
    assert got == ["next"]
