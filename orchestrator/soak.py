"""The chaos soak: a local cluster (1 encoder, 2 denoisers, 1 decoder, null stages) under
mixed traffic while its workers are killed, frozen and made to fault, and its daemon
restarted (orchestrator/chaos.py); every answer judged.

Each round sends requests at ``--rate`` a second for ``--round-s`` seconds, of every kind a
serving system sees: plain ones, ones watching progress, ones with deadlines shorter than
the pipeline, ones cancelled part way, ones the denoiser fails, and blocking-client ones
with long and short deadlines; random sizes, image counts, PNG or raw, priorities. A result
must be byte-exact (the null stages are deterministic) and for its own request; an error
must be one that request's kind and the round's faults explain, and come within its
deadline (plus 3 s). After each round every worker is back, every slot and preallocated
slot is free within 15 s, no reply was dropped and no process logged a crash. The daemon's
resident memory is printed per round. Exit 0 only if nothing went wrong; each problem is
printed as it is found.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import anyio
import anyio.abc
import torch

from orchestrator.arguments import at_least, positive_rate, positive_seconds
from orchestrator.chaos import Chaos, worker_key
from orchestrator.client import AsyncClient, Client, Generation, Rejection
from orchestrator.cluster import LocalCluster, all_free, ipc_config
from orchestrator.proc_stats import rss_mib
from orchestrator.stages.null import expected_outputs
from transfer.protocol import GenParams, Progress

# What may end a request of each kind. A lost worker or a failed write can end any (the
# chaos causes both); answers around a daemon restart may also be those of a drain or a
# dropped connection.
LOSS = {"worker_lost", "transfer_failed"}
ALLOWED = {
    "plain": {"ok"} | LOSS,
    "progress": {"ok"} | LOSS,
    "short": {"ok", "timed_out"} | LOSS,
    "cancel": {"ok", "cancelled"} | LOSS,
    "fail": {"stage_failed"} | LOSS,
    "fault": {"stage_failed"} | LOSS,
    "blocking": {"ok"} | LOSS,
    "blocking_short": {"ok", "timed_out"} | LOSS,
}
AROUND_RESTART = {"draining", "ConnectionError", "worker_lost", "transfer_failed", "timed_out"}
MIX = {"plain": 40, "progress": 15, "short": 12, "cancel": 12, "fail": 5, "blocking": 6, "blocking_short": 10}
LATE_S = 3.0  # an answer this long past its deadline is a problem
SETTLE_S = 15.0  # for every slot to be free once a round's traffic is over
DRAIN_S = 120.0  # for a round's last requests to end


def verdict(kind: str, outcome: str, *, elapsed_s: float, timeout_s: float, around_restart: bool,
            message: str = "") -> str | None:
    """What is wrong with a request of ``kind`` ending in ``outcome`` (a reason, "ok", or the
    client's exception) after ``elapsed_s``, or None."""
    if outcome not in ALLOWED[kind] | (AROUND_RESTART if around_restart else set()):
        return f"{outcome} (deadline {timeout_s:.2f}s, took {elapsed_s:.2f}s): {message[:300]}"
    if kind == "fault" and outcome == "stage_failed" and "the device failed" not in message:
        return f"a device fault failed as {message[:200]!r}"
    if elapsed_s > timeout_s + LATE_S:
        return f"answered {outcome} after {elapsed_s:.2f}s, deadline {timeout_s:.2f}s"
    return None


class Ledger:
    """What the soak saw: outcomes by kind, faults inflicted, problems."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.problems: list[str] = []

    def note(self, line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    def problem(self, line: str) -> None:
        self.problems.append(line)
        self.note("PROBLEM " + line)


class Round:
    """One round's traffic against ``cluster``, with its chaos."""

    def __init__(self, cluster: LocalCluster, n: int, args: argparse.Namespace, *, restart_daemon: bool,
                 ledger: Ledger) -> None:
        self._cluster = cluster
        self._n = n
        self._args = args
        self._rng = random.Random(f"{args.seed} traffic {n}")
        self._ledger = ledger
        self._null = cluster.config.model.null
        self._pending = 0
        start = time.monotonic()
        self._end = start + args.round_s
        faults = random.Random(f"{args.seed} faults {n}")
        self.chaos = Chaos(cluster, faults, start=start + faults.uniform(0.05, 0.15) * args.round_s,
                           end=start + 0.85 * args.round_s, restart_daemon=restart_daemon, counts=ledger.faults,
                           faulty_request=self._faulty_request, note=self._note, problem=self._problem)

    def _note(self, line: str) -> None:
        self._ledger.note(f"r{self._n} {line}")

    def _problem(self, line: str) -> None:
        self._ledger.problem(f"r{self._n} {line}")

    async def run(self) -> None:
        endpoint = self._cluster.config.daemon.client_endpoint
        async with AsyncClient(endpoint) as first, AsyncClient(endpoint) as second:
            self._clients = (first, second)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self.chaos.supervise, tg)
                tg.start_soon(self.chaos.run)
                i = 0
                while time.monotonic() < self._end:
                    kind = self._rng.choices(list(MIX), weights=list(MIX.values()))[0]
                    if kind.startswith("blocking"):
                        self._start(anyio.to_thread.run_sync(self._blocking, kind, i))
                    else:
                        self._start(self._asynchronous(self._rng.choice(self._clients), kind, i))
                    i += 1
                    await anyio.sleep(self._rng.expovariate(self._args.rate))
                with anyio.fail_after(DRAIN_S):
                    while self._pending or not self.chaos.over:
                        await anyio.sleep(0.2)
                tg.cancel_scope.cancel()  # the supervisor: the round's workers are settled next

    def _start(self, request: Awaitable[None]) -> None:
        async def counted() -> None:
            self._pending += 1
            try:
                await request
            finally:
                self._pending -= 1
        self._tg.start_soon(counted)

    def _faulty_request(self, index: int) -> None:
        self._start(self._asynchronous(self._clients[0], "fault", 1_000_000 + index))

    def _params(self, kind: str, i: int) -> GenParams:
        prompt = {"fail": f"boom {i}", "fault": f"fault {i}"}.get(kind, f"soak {self._n} {i} {self._rng.random():.6f}")
        width, height = self._rng.choice([(64, 48), (256, 128), (64, 64), (128, 128)])
        return GenParams(prompt=prompt, seed=self._rng.randrange(2**40), width=width, height=height,
                         steps=self._rng.choice([1, 4, 20]), num_images=self._rng.choice([1, 1, 2]),
                         output=self._rng.choice(["raw", "png"]))

    def _timeout_s(self, kind: str) -> float:
        return self._rng.uniform(0.03, 0.4) if kind.endswith("short") else 30.0

    async def _asynchronous(self, client: AsyncClient, kind: str, i: int) -> None:
        rid, params, timeout_s = f"r{self._n}-{i}-{kind}", self._params(kind, i), self._timeout_s(kind)
        watch = kind == "progress" or self._rng.random() < 0.2
        priority = self._rng.randrange(-5, 6)

        def on_progress(progress: Progress) -> None:
            if progress.request_id != rid:
                self._problem(f"{rid}: progress for {progress.request_id}")

        async def submit() -> Generation:
            return await client.submit(params, request_id=rid, timeout_s=timeout_s, priority=priority,
                                       on_progress=on_progress if watch else None)

        async def submit_and_cancel() -> Generation:
            done: list[Generation] = []

            async def keep() -> None:
                done.append(await submit())
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(keep)
                    await anyio.sleep(self._rng.uniform(0, 0.3))
                    try:
                        await client.cancel(rid, timeout_s=10)
                    except (TimeoutError, ConnectionError) as exc:
                        self._note(f"{rid}: cancel raised {type(exc).__name__}: {exc}")
            except ExceptionGroup as group:
                raise group.exceptions[0] from None  # the submit's own answer: a refusal, say
            return done[0]

        began = time.monotonic()
        try:
            answer: Generation | Exception = await (submit_and_cancel() if kind == "cancel" else submit())
        except Exception as exc:
            answer = exc
        self._judge(kind, rid, params, timeout_s, began, answer)

    def _blocking(self, kind: str, i: int) -> None:
        rid, timeout_s = f"r{self._n}-{i}-{kind}", self._timeout_s(kind)
        params = GenParams(prompt=f"blocking {self._n} {i} {self._rng.random():.6f}", seed=self._rng.randrange(2**40),
                           width=64, height=64, steps=self._rng.choice([1, 20]), output="raw")
        priority = self._rng.randrange(-3, 4)
        began = time.monotonic()
        try:
            with Client(self._cluster.config.daemon.client_endpoint) as client:
                answer: Generation | Exception = client.submit(params, request_id=rid, timeout_s=timeout_s,
                                                               priority=priority)
        except Exception as exc:
            answer = exc
        self._judge(kind, rid, params, timeout_s, began, answer)

    def _judge(self, kind: str, rid: str, params: GenParams, timeout_s: float, began: float,
               answer: Generation | Exception) -> None:
        ended = time.monotonic()
        match answer:
            case Generation():
                outcome, message = "ok", ""
                self._check(rid, params, answer)
            case Rejection():
                outcome, message = str(answer.reason), answer.rejected.message
                if answer.rejected.request_id != rid:
                    self._problem(f"{rid}: Rejected for {answer.rejected.request_id}")
            case TimeoutError() | ConnectionError():
                outcome, message = type(answer).__name__, str(answer)
            case _:  # the client broke: a problem whatever the kind
                outcome, message = type(answer).__name__, "".join(traceback.format_exception(answer))[-800:]
        self._ledger.outcomes[f"{kind}:{outcome}"] += 1
        if (wrong := verdict(kind, outcome, elapsed_s=ended - began, timeout_s=timeout_s, message=message,
                             around_restart=self.chaos.overlaps_daemon_restart(began, ended))) is not None:
            self._problem(f"{rid} ({kind}): {wrong}")

    def _check(self, rid: str, params: GenParams, generation: Generation) -> None:
        if generation.result.request_id != rid:
            self._problem(f"{rid}: the Result of {generation.result.request_id}")
        expected, got = expected_outputs(params, self._null), generation.outputs
        if set(expected) != set(got) or not all(torch.equal(expected[k], got[k]) for k in expected):
            self._problem(f"{rid}: wrong bytes for prompt {params.prompt!r}")


def settle(cluster: LocalCluster, n: int, ledger: Ledger) -> None:
    """After round ``n``: every worker back and registered, then everything free and no
    reply dropped; one line of the round's counts."""
    for name, proc in cluster.workers.items():
        if proc.poll() is not None:
            cluster.start_worker(*worker_key(name))
    cluster.wait_registered(len(cluster.workers), timeout_s=60)
    began = time.monotonic()
    stats = cluster.control.stats()
    while not (all_free(stats) and len(stats.instances) == len(cluster.workers)):
        if time.monotonic() - began > SETTLE_S:
            ledger.problem(f"r{n}: not everything free {SETTLE_S:.0f}s after the round: {stats}")
            break
        time.sleep(0.1)
        stats = cluster.control.stats()
    if stats.replies_dropped:
        ledger.problem(f"r{n}: {stats.replies_dropped} replies dropped")
    ledger.note(f"r{n}: settled in {time.monotonic() - began:.1f}s; daemon: completed={stats.completed} "
                f"failed={dict(stats.failed_by_reason)} retried={stats.retried} refused={dict(stats.refused)} "
                f"late reports={stats.late_reports}")


class LogWatch:
    """Finds in the cluster's logs the lines a process writes when it crashes, or when a
    worker's input is not the bytes its sender staged: no sender is frozen past
    push_quarantine_s here (configs/soak.toml, orchestrator/chaos.py), so no write may land
    late, and a digest that does not match is a hand-off bug, not the safety net at work."""

    MARKS = ("process.crashed", "Traceback", "worker.input_corrupted")

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._read: dict[str, int] = {}  # bytes of each log already read

    def scan(self, ledger: Ledger) -> None:
        for log in sorted(self._log_dir.glob("*.log")):
            with log.open("rb") as file:
                file.seek(self._read.get(log.name, 0))
                fresh = file.read()
            self._read[log.name] = self._read.get(log.name, 0) + len(fresh)
            for line in fresh.decode(errors="replace").splitlines():
                if any(mark in line for mark in self.MARKS):
                    ledger.problem(f"{log.name}: {line[:1500]}")


def soak(args: argparse.Namespace, folder: Path) -> Ledger:
    path = ipc_config("soak.toml", folder, "soak", lambda raw: None)
    ledger = Ledger()
    torch.set_num_threads(1)  # as the workers: the expected bytes are computed here
    with LocalCluster(path, log_dir=folder / "logs") as cluster:
        ledger.note(f"cluster up; logs in {cluster.log_dir} (removed after a run with no problems)")
        logs = LogWatch(cluster.log_dir)
        for n in range(args.rounds):
            restart = args.restart_every > 0 and n % args.restart_every == args.restart_every - 1
            anyio.run(Round(cluster, n, args, restart_daemon=restart, ledger=ledger).run)
            settle(cluster, n, ledger)
            logs.scan(ledger)
            assert cluster.daemon is not None
            ledger.note(f"r{n} done: daemon resident {rss_mib(cluster.daemon.pid):.1f} MiB; faults so far "
                        f"{dict(ledger.faults)}; problems {len(ledger.problems)}")
    return ledger


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triptych soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=at_least(1), default=20, help="rounds to run (default: %(default)s)")
    parser.add_argument("--round-s", type=positive_seconds, default=55.0,
                        help="seconds of traffic and faults per round (default: %(default)s)")
    parser.add_argument("--rate", type=positive_rate, default=10.0,
                        help="requests per second, a Poisson stream (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1,
                        help="the same seed draws the same requests and faults, their timing varies "
                             "(default: %(default)s)")
    parser.add_argument("--restart-every", type=at_least(0), default=6,
                        help="restart the daemon in every N-th round, 0: never (default: %(default)s)")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="triptych-soak-"))
    try:
        ledger = soak(args, folder)
    except BaseException:
        print(f"its config and logs are kept in {folder}", file=sys.stderr)
        raise
    total = sum(ledger.outcomes.values())
    ledger.note(f"outcomes by kind: {dict(sorted(ledger.outcomes.items()))}")
    ledger.note(f"{args.rounds} rounds, {total} requests, faults {dict(ledger.faults)}, "
                f"problems {len(ledger.problems)}")
    if ledger.problems:
        print(f"its config and logs are kept in {folder}", file=sys.stderr)
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
