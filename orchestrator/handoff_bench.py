"""Data-plane benchmark: how long one hand-off of a large tensor takes between two workers
on this host, through Mooncake (loopback TCP) and as a copy into shared memory.

1 encoder / 1 denoiser / 1 decoder with null stages whose encoder output is ``--mib`` MiB;
requests one at a time, so each hand-off has the link to itself. Prints the median and p90
of the encoder -> denoiser transfer time (``StageTiming.transfer_ms``: the sender's push,
from its start to the write's completion) for each path, and their ratio. Then what each
hand-off's digest (transfer/frames.py) adds to staging it: the sender's pack against a bare
copy of the same bytes, the receiver's checked copy-out against an unchecked one (best of
``--requests`` each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import torch

from orchestrator.arguments import at_least
from orchestrator.bench import kept_on_failure
from orchestrator.client import AsyncClient
from orchestrator.cluster import LocalCluster, ipc_config
from orchestrator.config import MiB
from transfer import frames
from transfer.protocol import GenParams, Via

LAYOUT = {"encoder": 1, "denoiser": 1, "decoder": 1}
FLOAT32 = 4


async def transfer_times(endpoint: str, requests: int, via: Via, nbytes: int) -> list[float]:
    """The encoder -> denoiser transfer time of each request, in ms (the first one warms up).
    Each must have moved ``nbytes`` by ``via``: a worker without shared memory falls back to
    Mooncake, and its times would pass for the other path's."""
    times = []
    async with AsyncClient(endpoint) as client:
        for i in range(requests + 1):
            generation = await client.submit(GenParams(prompt="handoff", seed=i, width=8, height=8, steps=1,
                                                       output="raw"), timeout_s=60)
            stage = generation.result.stages[0]
            if (stage.role, stage.via, stage.transfer_bytes) != ("encoder", via, nbytes):
                raise SystemExit(f"the hand-off was not the one measured: {stage.role} moved {stage.transfer_bytes} "
                                 f"bytes by {stage.via}, not {nbytes} by {via} (see the workers' logs)")
            times.append(stage.transfer_ms)
    return times[1:]


def measure(tmp: Path, mib: int, requests: int, same_host_copy: bool) -> list[float]:
    name = "memcpy" if same_host_copy else "mooncake"

    def sized(raw: dict) -> None:
        raw["model"]["null"]["embed_shape"] = [mib * MiB // FLOAT32]
        for role in LAYOUT:
            raw["workers"][role]["pool_bytes"] = 4 * mib * MiB  # the staged output and an allocation, with room
        raw["transfer"]["same_host_copy"] = same_host_copy

    path = ipc_config("bench.toml", tmp, name, sized)
    with LocalCluster(path, layout=LAYOUT, log_dir=tmp / "logs" / name) as cluster:
        times = anyio.run(transfer_times, cluster.config.daemon.client_endpoint, requests, name, mib * MiB,
                          backend="asyncio")
        stats = cluster.control.stats()
    if stats.failed_by_reason:
        raise SystemExit(f"requests failed: {stats.failed_by_reason}")
    return times


def staging_ms(mib: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` ms to stage and to take a ``mib`` MiB hand-off, with its digest and
    without: pack against a bare copy, copy-out checked against unchecked."""
    tensors = {"embeds": torch.randn(mib * MiB // FLOAT32)}
    specs, nbytes = frames.layout(tensors)
    block = torch.empty(nbytes, dtype=torch.uint8)
    digested = frames.pack(block, tensors, specs)
    unchecked = [msgspec.structs.replace(spec, xxh3=None) for spec in digested]
    raw = tensors["embeds"].view(torch.uint8)

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
        return min(times)

    return {"pack": best(lambda: frames.pack(block, tensors, specs)),
            "bare copy in": best(lambda: block[: raw.numel()].copy_(raw)),
            "copy-out, checked": best(lambda: frames.unpack(block, digested)),
            "copy-out, unchecked": best(lambda: frames.unpack(block, unchecked))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triptych bench-handoff", description=__doc__)
    parser.add_argument("--mib", type=at_least(1), default=16, help="size of the handed-off tensor")
    parser.add_argument("--requests", type=at_least(2), default=20, help="at least 2: the p90 needs two")
    args = parser.parse_args(argv)
    with kept_on_failure("triptych-handoff-") as tmp:
        results = {name: measure(tmp, args.mib, args.requests, name == "memcpy") for name in ("mooncake", "memcpy")}
    print(f"\none {args.mib} MiB hand-off, encoder -> denoiser on one host, {args.requests} requests one at a time")
    print(f"{'path':<10} {'p50 ms':>8} {'p90 ms':>8} {'GB/s at p50':>12}")
    for name, times in results.items():
        p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
        print(f"{name:<10} {p50:>8.2f} {p90:>8.2f} {args.mib * MiB / p50 / 1e6:>12.2f}")
    ratio = statistics.median(results["mooncake"]) / statistics.median(results["memcpy"])
    print(f"\nsame-host copy is {ratio:.1f}x faster than Mooncake's loopback transfer at the median")
    staging = staging_ms(args.mib, args.requests)
    print(f"\nstaging one {args.mib} MiB hand-off, best of {args.requests} (ms): "
          + ", ".join(f"{name} {ms:.2f}" for name, ms in staging.items()))
    print(f"its digest costs the sender {staging['pack'] / staging['bare copy in']:.2f}x a bare copy and the "
          f"receiver {staging['copy-out, checked'] / staging['copy-out, unchecked']:.2f}x an unchecked copy-out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
