"""Control-plane benchmark: how much the daemon costs per request, and how that scales.

1 encoder / 2 denoisers / 1 decoder, measured twice: with instant protocol workers, which
answer every order at once and move no data (the daemon alone, as the reference head was
measured), and with real worker processes running zero-work null stages and real Mooncake
hand-offs (the whole stack). Closed-loop clients at concurrency 1, 16 and 64, then a
backlog of 2,048 requests submitted at once. For each: requests per second, p50/p99
latency; the daemon's CPU time per request read from /proc (user + system of all its
threads, so a noisy machine still compares), and of that the main thread's user time (the
daemon's own work; the rest is the kernel's, mostly waking threads); the daemon's wake-ups
per request (voluntary context switches of all its threads, ZMQ's I/O thread included: what
costs most on a VM); the mail its actors handled per request (its internal hops, from
``Stats.mail_handled``); and its resident memory at its peak. It also times one hop between
actors in this process.

"Added p50" is the daemon-alone p50 at concurrency 1 minus the p50 of the same client
against a stand-in daemon in another process that answers each request at once with the
Result the instant workers' requests get: what is left is the daemon's. A do-nothing ROUTER
answering a raw socket gives the floor of the sockets alone, and the CPU per round trip
the daemon's CPU is compared with.

The backlog is real: the workers are paused (SIGSTOP) until all 2,048 requests are in the
daemon, its memory is read then, and the workers resumed; the row's req/s is the drain.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import anyio

from actors.mailbox import Mailbox, Switchboard
from orchestrator import bench_perf
from orchestrator.bench_peers import echo_floor, stand_in
from orchestrator.client import AsyncClient
from orchestrator.cluster import LocalCluster, ipc_config
from orchestrator.proc_stats import CLK_TCK, RssPeak, context_switches, cpu_seconds, main_thread_user_seconds, rss_mib
from transfer.protocol import GenParams, StageTiming

MIN_REQUESTS = 300  # a third of them at concurrency 1 still spend several clock ticks

# The design Triptych replaces ("the reference head"), as published for a 2-core machine
# with zero-work workers; docs/benchmarks.md sets them side by side.
REFERENCE_CPU_MS = {"1": 0.685, "16": 0.50, "64": 0.51, "backlog 2048": 0.92}
REFERENCE_ADDED_P50_MS = 1.0
BUDGET_CPU_MS = 0.15
BUDGET_ADDED_P50_MS = 0.3


def params(i: int) -> GenParams:
    return GenParams(prompt="bench", seed=i, width=8, height=8, steps=1, output="raw")


async def closed_loop(endpoint: str, concurrency: int, total: int) -> tuple[list[float], list[list[StageTiming]]]:
    """Each request's latency (s) and its per-stage timings, ``concurrency`` at a time."""
    latencies: list[float] = []
    stages: list[list[StageTiming]] = []
    counter = iter(range(total))

    async def loop(client: AsyncClient) -> None:
        for i in counter:
            t0 = time.perf_counter()
            generation = await client.submit(params(i), timeout_s=120)
            latencies.append(time.perf_counter() - t0)
            stages.append(generation.result.stages)

    async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(loop, client)
    return latencies, stages


@contextlib.contextmanager
def kept_on_failure(prefix: str) -> Iterator[Path]:
    """A scratch folder for a run's configs, sockets and logs: removed after a run that
    succeeded, kept and named on stderr after one that failed, for its logs."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    except BaseException:
        print(f"its configs and logs are kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)


def client_floor(endpoint: str, n: int) -> float:
    """p50 latency (ms) of ``closed_loop`` at concurrency 1 against an instant daemon."""
    with stand_in("instant_daemon", endpoint):
        anyio.run(closed_loop, endpoint, 1, 20, backend="asyncio")  # warm up
        latencies, _ = anyio.run(closed_loop, endpoint, 1, n, backend="asyncio")
    return statistics.median(latencies) * 1000


def hop_us(hops: int = 200_000) -> float:
    """CPU µs of one hop between two actors on a switchboard (a post and its handling)."""
    board = Switchboard()
    ping, pong = board.mailbox("ping", 8), board.mailbox("pong", 8)

    def bounce(to: Mailbox[int]) -> Callable[[int], None]:
        def handle(left: int) -> None:
            if left:
                to.post(left - 1)
        return handle

    with ping.owned_by(bounce(pong)), pong.owned_by(bounce(ping)):
        t0 = time.process_time()
        for _ in range(hops // 1000):
            ping.post(999)
        elapsed = time.process_time() - t0
    return elapsed / (ping.handled + pong.handled) * 1e6


async def held_backlog(cluster: LocalCluster, total: int) -> tuple[list[float], list[list[StageTiming]], float, float]:
    """``total`` requests at once, the workers paused (SIGSTOP) until every one is in the
    daemon: their latencies and stage timings, how long the daemon took to serve them all
    once the workers resumed (s), and its resident memory holding them all (MiB)."""
    assert cluster.daemon is not None
    cfg = cluster.config.daemon
    workers = list(cluster.workers.values())
    served: list[tuple[list[float], list[list[StageTiming]]]] = []

    async def submit_all() -> None:
        served.append(await closed_loop(cfg.client_endpoint, total, total))

    for worker in workers:
        worker.send_signal(signal.SIGSTOP)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit_all)
            # Within two heartbeats: a worker silent longer becomes a suspect (then evicted).
            with anyio.fail_after(2 * cfg.heartbeat_s):
                while sum((await anyio.to_thread.run_sync(cluster.control.stats)).requests_by_state.values()) < total:
                    await anyio.sleep(0.02)
            rss = rss_mib(cluster.daemon.pid)
            resumed = time.perf_counter()
            for worker in workers:
                worker.send_signal(signal.SIGCONT)
    finally:
        for worker in workers:  # resumed already, unless the wait failed
            worker.send_signal(signal.SIGCONT)
    return *served[0], time.perf_counter() - resumed, rss


def measure(cluster: LocalCluster, name: str, concurrency: int, total: int, *,
            backlog: bool = False) -> dict[str, float]:
    """One closed loop (or, ``backlog``, ``total`` requests held until all are in) through
    ``cluster``, after a warm-up: the row the tables print."""
    assert cluster.daemon is not None
    pid = cluster.daemon.pid
    endpoint = cluster.config.daemon.client_endpoint
    anyio.run(closed_loop, endpoint, min(concurrency, 64), min(total, 200), backend="asyncio")  # warm up
    handled0 = sum(cluster.control.stats().mail_handled.values())
    peak = RssPeak(pid)
    peak.start()
    cpu0, user0, switches0, t0 = (cpu_seconds(pid), main_thread_user_seconds(pid), context_switches(pid),
                                  time.perf_counter())
    if backlog:
        latencies, stages, serving_s, held_rss = anyio.run(held_backlog, cluster, total, backend="asyncio")
    else:
        latencies, stages = anyio.run(closed_loop, endpoint, concurrency, total, backend="asyncio")
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    user = main_thread_user_seconds(pid) - user0
    switches = context_switches(pid) - switches0
    peak.stop.set()
    peak.join()
    hops = sum(cluster.control.stats().mail_handled.values()) - handled0
    latencies.sort()
    return {
        "name": name, "requests": total, "req_s": total / (serving_s if backlog else wall),
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
        "cpu_ms": cpu / total * 1000, "user_ms": user / total * 1000, "wakeups": switches / total,
        "rss_mib": held_rss if backlog else peak.peak, "stages": stages,
        "hops": hops / total,
    }


def print_table(title: str, rows: list[dict[str, float]], *, reference: bool) -> None:
    """The rows; ``reference``: with the reference head's CPU over ours, for the daemon-alone
    rows only (it was measured with zero-work workers, as they are)."""
    print(f"\n{title}")
    versus = f"{'vs reference':>13} " if reference else ""
    print(f"{'concurrency':<13} {'requests':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'daemon CPU ms/req':>18} "
          f"{versus}{'main user ms':>13} {'wake-ups/req':>13} {'hops/req':>9} {'daemon RSS MiB':>15}")
    for row in rows:
        versus = f"{REFERENCE_CPU_MS[row['name']] / row['cpu_ms']:>12.1f}x " if reference else ""
        print(f"{row['name']:<13} {row['requests']:>8} {row['req_s']:>8.0f} {row['p50_ms']:>8.2f} "
              f"{row['p99_ms']:>8.2f} {row['cpu_ms']:>18.3f} {versus}{row['user_ms']:>13.3f} "
              f"{row['wakeups']:>13.1f} {row['hops']:>9.1f} {row['rss_mib']:>15.1f}")


def print_stage_breakdown(title: str, row: dict) -> None:
    """Median ms per stage; "queued" is the stage's wall time less compute and transfer: the
    waits, messages and thread hops around them."""
    print(f"\n{title}")
    print(f"{'stage':<9} {'queued ms':>10} {'compute ms':>11} {'transfer ms':>12}")
    by_role: dict[str, list[StageTiming]] = {}
    for request in row["stages"]:
        for stage in request:
            by_role.setdefault(stage.role, []).append(stage)
    for role, timings in by_role.items():
        print(f"{role:<9} {statistics.median(t.queued_ms for t in timings):>10.3f} "
              f"{statistics.median(t.compute_ms for t in timings):>11.3f} "
              f"{statistics.median(t.transfer_ms for t in timings):>12.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triptych bench", description=__doc__)
    parser.add_argument("--requests", type=int, default=3000, help="per closed-loop level")
    parser.add_argument("--log-level", default="info", help="the daemon's log level (info logs one line per request)")
    parser.add_argument("--perf", action="store_true",
                        help="also sample the daemon alone with Linux perf at concurrency 64 and 1: where its CPU goes")
    args = parser.parse_args(argv)
    if args.requests < MIN_REQUESTS:
        parser.error(f"--requests must be at least {MIN_REQUESTS}: the daemon's CPU time is read in "
                     f"{1000 // CLK_TCK} ms clock ticks, and fewer requests round it to nothing")
    if args.perf and not bench_perf.available():
        parser.error("--perf needs Linux perf on the PATH (apt-get install linux-perf)")
    with kept_on_failure("triptych-bench-") as tmp:
        report(tmp, args)
    return 0


def report(tmp: Path, args: argparse.Namespace) -> None:
    path = ipc_config("bench.toml", tmp, "bench", lambda raw: raw["log"].update(level=args.log_level))
    floor_ms, echo_cpu_1_ms = echo_floor(f"ipc://{tmp}/echo1", 2000, 1)
    _, echo_cpu_16_ms = echo_floor(f"ipc://{tmp}/echo16", 16000, 16)
    client_ms = client_floor(f"ipc://{tmp}/floor", args.requests // 3)

    tables, profiles = {}, {}
    for instant in (True, False):
        rows = []
        with LocalCluster(path, log_dir=tmp / "logs" / ("instant" if instant else "real"), instant=instant) as cluster:
            for concurrency in (1, 16, 64):
                total = args.requests // 3 if concurrency == 1 else args.requests
                rows.append(measure(cluster, str(concurrency), concurrency, total))
            rows.append(measure(cluster, "backlog 2048", 2048, 2048, backlog=True))
            if args.perf and instant:
                for concurrency in (64, 1):
                    total = args.requests // 3 if concurrency == 1 else args.requests
                    profiles[concurrency] = bench_perf.profile(cluster.daemon.pid, partial(
                        anyio.run, closed_loop, cluster.config.daemon.client_endpoint, concurrency, total,
                        backend="asyncio"))
            stats = cluster.control.stats()
        if stats.failed_by_reason:
            raise SystemExit(f"requests failed: {stats.failed_by_reason}")
        tables[instant] = rows
    print(f"\ndaemon log level {args.log_level}; every request completed")
    print(f"the same client against a stand-in that answers at once: p50 {client_ms:.3f} ms at concurrency 1")
    print(f"do-nothing ROUTER in its own process: p50 {floor_ms:.3f} ms at concurrency 1; its CPU per round trip "
          f"(one receive + one send) {echo_cpu_1_ms * 1000:.0f} us at concurrency 1, "
          f"{echo_cpu_16_ms * 1000:.0f} us at 16")
    print_table("daemon alone: instant protocol workers (as the reference head was measured)", tables[True],
                reference=True)
    print_table("full stack: real workers, null stages, Mooncake hand-offs", tables[False], reference=False)
    print_stage_breakdown("full stack, concurrency 1: where a request's time goes, medians", tables[False][0])
    for concurrency, profile in profiles.items():
        bench_perf.print_profile(f"daemon alone, concurrency {concurrency}: where its CPU goes (perf, every thread)",
                                 profile)
    rows = tables[True]
    added = rows[0]["p50_ms"] - client_ms
    worst_cpu = max(row["cpu_ms"] for row in rows)
    print(f"\ndaemon alone, added p50 at concurrency 1: {added:.3f} ms over the stand-in (reference "
          f"{REFERENCE_ADDED_P50_MS} ms, budget {BUDGET_ADDED_P50_MS} ms)")
    print(f"daemon alone, CPU per request: worst {worst_cpu:.3f} ms (budget {BUDGET_CPU_MS} ms); backlog / "
          f"concurrency-64 ratio {rows[3]['cpu_ms'] / rows[2]['cpu_ms']:.2f} (1.0 = no growth with the backlog)")
    # The daemon moves 12 socket messages per request (6 in, 6 out; 13-14 on a slow path): compare it
    # with what a do-nothing ROUTER spends on 6 round trips at the same concurrency, in this run.
    for row, echo_ms in ((rows[0], echo_cpu_1_ms), (rows[1], echo_cpu_16_ms)):
        print(f"daemon alone, CPU per request at concurrency {row['name']} = {row['cpu_ms'] / (6 * echo_ms):.1f}x "
              f"the CPU a do-nothing ROUTER spends on the same 12 socket messages")
    hop = hop_us()
    print(f"one hop between actors costs {hop:.2f} us of CPU here, so the {rows[2]['hops']:.1f} hops of a request "
          f"cost {hop * rows[2]['hops']:.1f} us of the {BUDGET_CPU_MS * 1000:.0f} us budget")


if __name__ == "__main__":
    sys.exit(main())
