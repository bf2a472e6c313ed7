"""A storm: every way a request can end, at once, on one cluster, with a worker killed and
restarted in the middle of it.

Each test elsewhere checks one way of ending alone. Here they overlap, the way a busy
service meets them: requests that finish, expire mid-pipeline, are cancelled or abandoned
at random moments, fail in their stage, reuse an id in flight, or are garbage, from several
clients, on both paths of both hops, while a denoiser dies and comes back. What must hold:
every caller gets exactly one answer, of a kind its request allows; every output is the
right bytes; afterwards every slot, preallocated slot and queue is free, the daemon's counts
add up to what it admitted, and it still serves.
"""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from dataclasses import dataclass, field

import anyio
import torch

from orchestrator.client import AsyncClient, Client, Rejection
from orchestrator.cluster import LocalCluster, all_free
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import RawClient, StartCluster, wait_for
from transfer.protocol import GenParams, Reason, Rejected, Stats

REQUESTS = 160
SEED = 20261202
FATES = {"finish": 50, "deadline": 14, "cancel": 12, "abandon": 10, "fail": 5, "duplicate": 5, "garbage": 4}
# What losing a worker mid-request may do to any request then in flight: its retry can meet
# the same loss (a push into the dead receiver, or the retry's own worker).
LOSS = {Reason.WORKER_LOST, Reason.TRANSFER_FAILED}
ALLOWED: dict[str, set[Reason]] = {
    "finish": LOSS,
    "deadline": {Reason.TIMED_OUT} | LOSS,
    "cancel": {Reason.CANCELLED} | LOSS,
    "fail": {Reason.STAGE_FAILED} | LOSS,
    "duplicate": {Reason.DUPLICATE} | LOSS,
    "abandon": LOSS,  # an answer that beat the caller's giving up
    "garbage": {Reason.INVALID},
}


@dataclass
class Ledger:
    """What the callers saw: per fate, the answers; and anything that should not happen."""

    answers: dict[str, Counter[str]] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    admitted: int = 0  # submits the daemon could have admitted (not garbage, not a duplicate's twin)

    def saw(self, fate: str, answer: str) -> None:
        self.answers.setdefault(fate, Counter())[answer] += 1


def params(i: int, fate: str) -> GenParams:
    # Alternate sizes so both hops take both paths (a decoder slot holds 4 KiB of latents).
    width, height = (64, 48) if i % 2 == 0 else (256, 128)
    prompt = f"please fail {i}" if fate == "fail" else f"storm {i}"
    return GenParams(prompt=prompt, seed=i, width=width, height=height, output="raw")


async def one(cluster: LocalCluster, clients: tuple[AsyncClient, ...], i: int, fate: str,
              rng: random.Random, ledger: Ledger) -> None:
    client, other = clients[i % len(clients)], clients[(i + 1) % len(clients)]
    p = params(i, fate)
    rid = f"storm-{i}"
    null_cfg = cluster.config.model.null

    async def submit(request_id: str, timeout_s: float = 30.0, via: AsyncClient = client) -> None:
        try:
            generation = await via.submit(p, request_id=request_id, timeout_s=timeout_s,
                                             priority=rng.randrange(3))
        except Rejection as exc:
            if exc.reason not in ALLOWED[fate]:
                ledger.wrong.append(f"{rid} ({fate}): {exc.reason} {exc.rejected.message}")
            ledger.saw(fate, str(exc.reason))
            return
        if fate == "fail":
            ledger.wrong.append(f"{rid}: a stage told to fail succeeded")
        elif not torch.equal(generation.outputs["images"], expected_outputs(p, null_cfg)["images"]):
            ledger.wrong.append(f"{rid} ({fate}): wrong bytes")
        ledger.saw(fate, "ok")

    match fate:
        case "finish" | "fail":
            ledger.admitted += 1
            await submit(rid)
        case "deadline":
            ledger.admitted += 1
            await submit(rid, timeout_s=rng.uniform(0.01, 0.2))
        case "cancel":
            ledger.admitted += 1
            async with anyio.create_task_group() as tg:
                tg.start_soon(submit, rid)
                await anyio.sleep(rng.uniform(0.0, 0.2))
                await client.cancel(rid)  # found or not: the request may have finished first
        case "abandon":
            ledger.admitted += 1
            # Not before the Submit is out: a request never sent is never admitted.
            with anyio.move_on_after(rng.uniform(0.01, 0.2)):
                await submit(rid)
        case "duplicate":
            # From two clients at once, well within a request's life: whichever the daemon
            # reads second is refused.
            ledger.admitted += 1
            async with anyio.create_task_group() as tg:
                tg.start_soon(submit, rid)
                tg.start_soon(submit, rid, 30.0, other)
        case "garbage":
            with RawClient(cluster.client_endpoint) as raw:
                reply = await anyio.to_thread.run_sync(raw.send_raw, [b"\x93storm", b"junk"])
            if not (isinstance(reply, Rejected) and reply.reason == Reason.INVALID):
                ledger.wrong.append(f"{rid}: garbage got {reply!r}")
            ledger.saw(fate, str(getattr(reply, "reason", reply)))


def busy(stats: Stats, name: str) -> bool:
    return any(i.name == name and i.slots_free < i.slots_total for i in stats.instances)


async def kill_and_restart_a_denoiser(cluster: LocalCluster, after_s: float, down_s: float) -> None:
    await anyio.sleep(after_s)
    await anyio.to_thread.run_sync(lambda: wait_for(cluster, lambda s: busy(s, "denoiser1")))
    victim = cluster.workers["denoiser1"]
    os.kill(victim.pid, signal.SIGKILL)
    await anyio.to_thread.run_sync(victim.wait)
    await anyio.sleep(down_s)
    cluster.start_worker("denoiser", 1)


async def test_a_storm_of_every_ending_leaves_nothing_behind(start_cluster: StartCluster) -> None:
    # The killed denoiser may be evicted as silent before its restart registers (a slow
    # start): then what it was pushing into waits out push_quarantine_s, kept short here
    # (above the 5 s transfer timeout) so "afterwards" comes within the test's wait.
    cluster = start_cluster(**{"model.null": {"encoder_ms": 5.0, "denoiser_ms": 40.0, "decoder_ms": 5.0},
                               "daemon": {"push_quarantine_s": 6.0}})
    rng = random.Random(SEED)
    fates = rng.choices(list(FATES), weights=list(FATES.values()), k=REQUESTS)
    ledger = Ledger()
    endpoint = cluster.client_endpoint
    with anyio.fail_after(120):
        async with AsyncClient(endpoint) as a, AsyncClient(endpoint) as b, AsyncClient(endpoint) as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(kill_and_restart_a_denoiser, cluster, 1.0, 1.5)
                for i, fate in enumerate(fates):
                    tg.start_soon(one, cluster, (a, b, c), i, fate, rng, ledger)
                    await anyio.sleep(rng.expovariate(60.0))  # about 60 arrivals a second
    assert not ledger.wrong, ledger.wrong
    # Every fate happened, and ended in more than one way where timing decides.
    assert set(FATES) - {"abandon"} <= set(ledger.answers), ledger.answers
    assert ledger.answers["finish"]["ok"] > 0 and ledger.answers["duplicate"]["duplicate"] > 0, ledger.answers
    assert ledger.answers["deadline"]["timed_out"] > 0 and ledger.answers["cancel"]["cancelled"] > 0, ledger.answers

    stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 4, timeout_s=30)
    # Each admission ends once, as completed or as one failure; a retry is a new admission.
    assert stats.completed + sum(stats.failed_by_reason.values()) == ledger.admitted + stats.retried, stats
    assert stats.failed_by_reason.get("cancelled", 0) >= ledger.answers["cancel"]["cancelled"]
    # It was busy when killed: running a request (worker_lost), or taking one's input (a push
    # into it fails: transfer_failed), whichever the timing made it.
    hit = stats.failed_by_reason.get("worker_lost", 0) + stats.failed_by_reason.get("transfer_failed", 0)
    assert hit >= 1, "the kill hit no request"
    with Client(endpoint) as client:
        after = params(REQUESTS, "finish")
        generation = client.submit(after, timeout_s=30)
    assert torch.equal(generation.outputs["images"], expected_outputs(after, cluster.config.model.null)["images"])
    assert {i.name for i in wait_for(cluster, all_free).instances} == {"encoder0", "denoiser0", "denoiser1", "decoder0"}
