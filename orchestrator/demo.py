"""The demo: a local cluster (1 encoder, 2 denoisers, 1 decoder) generating images.

Starts the daemon and the four workers as separate processes, submits a handful of prompts
concurrently, writes the PNGs to ``./out/``, checks every image against the answer the
same model gives in one process (bitwise, for the embedded tiny models), prints per-stage
timings, how the last request went (its ``Progress`` messages) and the final stats, then
shuts everything down and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio
import torch

from orchestrator.arguments import at_least
from orchestrator.client import AsyncClient, Generation, Rejection
from orchestrator.cluster import ClusterError, LocalCluster
from orchestrator.config import Config, load_config
from orchestrator.stages.images import decode_png
from orchestrator.tables import STAGES_HEADER, progress_line, stage_row, stats_table
from transfer.protocol import GenParams, Progress

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "a lighthouse on a cliff at dusk",
    "a red fox in fresh snow",
    "a bowl of ramen, studio light",
    "an astronaut riding a horse",
    "a watercolor of a quiet harbour",
    "a robot reading in a library",
]


def expected_images(cfg: Config, params: GenParams) -> torch.Tensor | None:
    """What the images must be, computed in this process; None if the model is too big to."""
    if cfg.model.kind == "null":
        from orchestrator.stages.null import decode, denoise, encode

        null = cfg.model.null
        return decode(params, denoise(params, encode(params, null), null))
    if cfg.model.diffusers.path:
        return None
    from orchestrator.stages.diffusion.reference import monolithic_images

    torch.set_num_threads(cfg.workers.denoiser.torch_threads)  # same as the workers: bitwise
    return monolithic_images(cfg.model.diffusers, params)


async def generate(endpoint: str, requests: list[GenParams],
                   watched: list[Progress]) -> tuple[list[Generation], list[Rejection]]:
    """Every request at once; the last one (the most likely to wait) reports to ``watched``.
    What the daemon refused (a size the model does not take, say) is returned, not raised:
    the demo says why in one line."""
    results: list[Generation | None] = [None] * len(requests)
    refused: list[Rejection] = []

    async def one(client: AsyncClient, i: int) -> None:
        on_progress = watched.append if i == len(requests) - 1 else None
        try:
            results[i] = await client.submit(requests[i], request_id=f"demo-{i}", timeout_s=120,
                                             on_progress=on_progress)
        except Rejection as exc:
            refused.append(exc)

    async with AsyncClient(endpoint) as client, anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, client, i)
    return [r for r in results if r is not None], refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triptych demo", description=__doc__)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "local.toml",
                        help="cluster TOML (default: %(default)s)")
    parser.add_argument("--requests", type=at_least(1), default=len(PROMPTS),
                        help="images to generate (default: %(default)s)")
    parser.add_argument("--steps", type=at_least(1), default=20, help="denoising steps each (default: %(default)s)")
    parser.add_argument("--size", type=at_least(1), default=64,
                        help="width and height in pixels (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out"),
                        help="directory the PNGs are written to (default: %(default)s)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = load_config(args.config)
    requests = [
        GenParams(prompt=PROMPTS[i % len(PROMPTS)], negative_prompt="blurry", seed=1000 + i, steps=args.steps,
                  width=args.size, height=args.size)
        for i in range(args.requests)
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"triptych demo: model {cfg.model.kind}/{cfg.model.diffusers.family}, {args.requests} requests; "
          f"logs in {args.out / 'logs'}", flush=True)
    started = time.monotonic()
    cluster = LocalCluster(args.config, log_dir=args.out / "logs")
    try:
        try:
            cluster.start()
        except ClusterError as exc:
            print(f"demo FAILED: the cluster did not start: {exc}", file=sys.stderr)
            return 1
        print(f"cluster up in {time.monotonic() - started:.1f}s: "
              f"{', '.join(i.instance for i in cluster.control.stats().instances)}", flush=True)
        t0 = time.monotonic()
        watched: list[Progress] = []
        generations, refused = anyio.run(generate, cluster.config.daemon.client_endpoint, requests, watched,
                                         backend="asyncio")
        wall = time.monotonic() - t0
        if refused:
            print(f"demo FAILED: the daemon refused {len(refused)} of {len(requests)} requests: "
                  f"{'; '.join(sorted({str(exc) for exc in refused}))}", file=sys.stderr)
            return 1
        print(f"\n{len(generations)} requests in {wall:.2f}s wall\n")
        print(f"{'request':<8} {STAGES_HEADER}")
        bad = 0
        for params, generation in zip(requests, generations, strict=True):
            result = generation.result
            for stage in result.stages:
                print(f"{result.request_id:<8} {stage_row(stage)}")
            bad += _check_and_write(cfg, params, generation, args.out)
        print(f"\nhow demo-{len(requests) - 1} went, as its client heard it:")
        print("\n".join(map(progress_line, watched)))
        print("\n" + stats_table(cluster.control.stats()))
    finally:
        codes = cluster.stop()
    if bad or any(codes.values()):
        print(f"demo FAILED: {bad} wrong images, exit codes {codes}", file=sys.stderr)
        return 1
    print(f"\nall {len(generations)} images verified; PNGs in {args.out}/")
    return 0


def _check_and_write(cfg: Config, params: GenParams, generation: Generation, out: Path) -> int:
    expected = expected_images(cfg, params)
    wrong = 0
    for i in range(params.num_images):
        name = f"image_{i}.png"
        png = generation.outputs[name]
        path = out / f"{generation.result.request_id}-{i}.png"
        path.write_bytes(png.numpy().tobytes())
        pixels = torch.from_numpy(decode_png(png).copy())
        ok = pixels.shape == (params.height, params.width, 3) and (expected is None or torch.equal(pixels, expected[i]))
        wrong += not ok
        verdict = "matches the one-process pipeline" if expected is not None else "valid PNG"
        print(f"  {path}: {'OK, ' + verdict if ok else 'WRONG'}")
    return wrong


if __name__ == "__main__":
    sys.exit(main())
