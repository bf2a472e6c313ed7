"""Human-readable renderings of ``Stats``, stage timings and ``Progress``."""

from __future__ import annotations

import itertools

from transfer.protocol import LATENCY_BOUNDS_MS, InstanceStats, Latency, Progress, StageLimits, StageTiming, Stats

STAGES_HEADER = (f"{'stage':<9} {'instance':<12} {'queued ms':>10} {'compute ms':>11} {'transfer ms':>12} "
                 f"{'bytes':>8} {'path':>5} {'via':>8}")


def progress_line(progress: Progress) -> str:
    steps = f" step {progress.step}/{progress.steps}" if progress.steps else ""
    waiting = f" (waiting, number {progress.position} in line)" if progress.position else ""
    why = f": {progress.why}" if progress.why else ""
    eta = f", about {_duration(progress.eta_ms)} of work left" if progress.eta_ms is not None else ""
    return f"  {progress.elapsed_ms:9.1f} ms  {progress.state}{steps}{waiting}{eta}{why}"


def stage_row(stage: StageTiming) -> str:
    """One stage of a ``Result``, in the columns of ``STAGES_HEADER``."""
    path = "" if stage.fast_path is None else ("fast" if stage.fast_path else "slow")
    return (f"{stage.role:<9} {stage.instance:<12} {stage.queued_ms:>10.2f} {stage.compute_ms:>11.2f} "
            f"{stage.transfer_ms:>12.2f} {stage.transfer_bytes:>8} {path:>5} {stage.via or '':>8}")


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.1f} s"


def stats_table(stats: Stats) -> str:
    lines = [
        f"uptime {stats.uptime_s:.1f}s  draining={stats.draining}  completed={stats.completed}  "
        f"failed attempts={sum(stats.failed_by_reason.values())} {stats.failed_by_reason or ''} retried={stats.retried}"
        + (f"  replies dropped={stats.replies_dropped}" if stats.replies_dropped else "")
        + (f"  refused at the door={sum(stats.refused.values())} {stats.refused}" if stats.refused else ""),
        f"in flight: {stats.requests_by_state or 'none'}  hand-offs in flight: {stats.handoffs_in_flight}"
        + (f" (held for ended requests' pushes: {stats.handoffs_held})" if stats.handoffs_held else ""),
        f"queues: {stats.queue_depths}",
        f"fast path: {stats.fast_path}  slow path: {stats.slow_path}",
        "",
        workers_table(stats.instances),
    ]
    if stats.latency:
        lines += ["", latency_table(stats.latency, stats.handoff_bytes)]
    return "\n".join(lines)


def _at_most(latency: Latency, quantile: float) -> str:
    """The bucket bound that ``quantile`` of the observations stay within."""
    need = quantile * sum(latency.counts)
    for bound, seen in zip(LATENCY_BOUNDS_MS, itertools.accumulate(latency.counts), strict=False):
        if seen >= need:
            return f"<={bound:g}"
    return f">{LATENCY_BOUNDS_MS[-1]:g}"


def latency_table(latency: dict[str, Latency], handoff_bytes: dict[str, int]) -> str:
    """Where the time goes: requests, each stage's wait and compute, each hop's write."""
    kw = max([len("time (ms)"), *(len(key) for key in latency)])
    lines = [f"{'time (ms)':<{kw}} {'count':>8} {'mean':>10} {'p50':>9} {'p99':>9}  bandwidth"]
    order = ["request", *(f"{role}.{part}" for role in ("encoder", "denoiser", "decoder")
                          for part in ("queued", "compute")), "encoder->denoiser", "denoiser->decoder"]
    for key in sorted(latency, key=lambda k: order.index(k) if k in order else len(order)):
        lat = latency[key]
        count = sum(lat.counts)
        if count == 0:
            continue  # nothing observed: no mean to give
        moved = handoff_bytes.get(key)
        rate = f"  {moved / lat.total_ms / 1000:.1f} MB/s" if moved and lat.total_ms > 0 else ""
        lines.append(f"{key:<{kw}} {count:>8} {lat.total_ms / count:>10.2f} {_at_most(lat, 0.5):>9} "
                     f"{_at_most(lat, 0.99):>9}{rate}")
    return "\n".join(lines)


def limits_table(limits: list[tuple[str, StageLimits]]) -> str:
    """What each instance's model takes: the daemon admits only what all of them take."""
    iw = max([len("instance"), *(len(instance) for instance, _ in limits)])
    mw = max([len("model"), *(len(lim.model) for _, lim in limits)])
    lines = ["limits each worker registered (a request must fit all of them)",
             f"{'instance':<{iw}} {'model':<{mw}} {'width/height':<18} {'steps':>6} {'images':>6} {'frames':>6} "
             f"{'pixels':>10}"]
    for instance, lim in limits:
        sizes = f"{lim.min_size}..{lim.max_size}" + (f" step {lim.size_multiple}" if lim.size_multiple > 1 else "")
        lines.append(f"{instance:<{iw}} {lim.model:<{mw}} {sizes:<18} {lim.max_steps:>6} {lim.max_images:>6} "
                     f"{lim.max_frames:>6} {lim.max_pixels:>10}")
    return "\n".join(lines)


def workers_table(instances: list[InstanceStats]) -> str:
    # Columns as wide as their longest entry: default names (role@host:pid:suffix) are long.
    iw = max([len("instance"), *(len(i.instance) for i in instances)])
    nw = max([len("name"), *(len(i.name) for i in instances)])
    lines = [f"{'instance':<{iw}} {'role':<9} {'name':<{nw}} {'slots':>7} {'prealloc':>9} {'served':>7} {'failed':>7}  "
             "address"]
    for i in sorted(instances, key=lambda i: i.instance):
        lines.append(
            f"{i.instance:<{iw}} {i.role:<9} {i.name:<{nw}} {i.slots_free:>3}/{i.slots_total:<3} "
            f"{i.prealloc_free:>4}/{i.prealloc_total:<4} {i.served:>7} {i.failed:>7}  {i.address}"
            + (f"  ({i.slots_finishing} held by runs of ended requests)" if i.slots_finishing else "")
            + ("  (suspect: no new work)" if i.suspect else "")
        )
    return "\n".join(lines)


def workers_report(instances: list[InstanceStats]) -> str:
    """What `triptych workers` prints: the instances, then the limits each registered."""
    limited = [(i.instance, i.limits) for i in sorted(instances, key=lambda i: i.instance) if i.limits is not None]
    return workers_table(instances) + (f"\n\n{limits_table(limited)}" if limited else "")
