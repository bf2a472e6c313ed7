"""What `triptych workers` and `triptych stats` print."""

from __future__ import annotations

import msgspec

from orchestrator.tables import latency_table, progress_line, workers_report, workers_table
from transfer.protocol import LATENCY_BOUNDS_MS, InstanceStats, Latency, Progress, StageLimits


def instance(n: int, name: str, suspect: bool = False, finishing: int = 0) -> InstanceStats:
    return InstanceStats(instance=f"denoiser-{n}", role="denoiser", name=name, address=f"ipc:///tmp/w{n}",
                         session="s", slots_free=1, slots_total=2, slots_finishing=finishing, prealloc_free=2,
                         prealloc_total=2, served=n, failed=0, alive=True, suspect=suspect)


def test_columns_stay_aligned_with_long_default_names() -> None:
    table = workers_table([instance(12, "denoiser@a-rather-long-hostname:123456:d96f7e"),
                           instance(3, "d0", True, finishing=1)])
    header, *rows = table.splitlines()
    assert [row.index(" 1/2 ") + 1 for row in rows] == [header.index("slots")] * 2  # under its header
    assert [row.split()[0] for row in rows] == ["denoiser-12", "denoiser-3"]
    assert rows[1].endswith("(1 held by runs of ended requests)  (suspect: no new work)")


def test_the_limits_each_worker_registered_follow_the_instances() -> None:
    tight = msgspec.structs.replace(instance(2, "d2"), limits=StageLimits(model="tiny-sd15", size_multiple=8,
                                                                         min_size=64, max_size=512, max_steps=50))
    table = workers_report([instance(1, "d1"), tight])
    assert table.splitlines()[-3:] == [
        "limits each worker registered (a request must fit all of them)",
        "instance   model     width/height        steps images frames     pixels",
        "denoiser-2 tiny-sd15 64..512 step 8         50     16      1   16777216",
    ]  # none known for denoiser-1 (it left while the stats were gathered): no row


def test_the_latency_table_gives_means_bucket_bounds_and_each_hops_bandwidth() -> None:
    counts = [0] * (len(LATENCY_BOUNDS_MS) + 1)
    counts[LATENCY_BOUNDS_MS.index(5)] = 98
    counts[LATENCY_BOUNDS_MS.index(500)] = 1
    counts[-1] = 1  # past every bound
    hop = Latency(counts=counts, total_ms=400.0)
    table = latency_table({"encoder->denoiser": hop, "request": hop}, {"encoder->denoiser": 40_000_000})
    header, request, handoff = table.splitlines()
    assert header.split() == ["time", "(ms)", "count", "mean", "p50", "p99", "bandwidth"]
    assert request.split() == ["request", "100", "4.00", "<=5", "<=500"]  # 99 of 100 within 500 ms
    assert handoff.split() == ["encoder->denoiser", "100", "4.00", "<=5", "<=500", "100.0", "MB/s"]


def test_a_progress_line_says_the_work_left_in_ms_below_a_second_and_in_s_above() -> None:
    def line(eta_ms: float | None) -> str:
        return progress_line(Progress(request_id="r", state="denoising", elapsed_ms=12.0, step=3, steps=20,
                                      eta_ms=eta_ms))

    assert line(None).split() == ["12.0", "ms", "denoising", "step", "3/20"]
    assert line(30.4).endswith("denoising step 3/20, about 30 ms of work left")
    assert line(2345.0).endswith("denoising step 3/20, about 2.3 s of work left")


def test_the_latency_table_skips_what_has_no_observation_and_takes_an_empty_book() -> None:
    empty = Latency(counts=[0] * (len(LATENCY_BOUNDS_MS) + 1), total_ms=0.0)
    assert latency_table({"request": empty}, {}).splitlines()[1:] == []
    assert latency_table({}, {}).split() == ["time", "(ms)", "count", "mean", "p50", "p99", "bandwidth"]
