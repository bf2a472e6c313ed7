"""What `triptych workers` and `triptych stats` print."""

from __future__ import annotations

from orchestrator.tables import workers_table
from transfer.protocol import InstanceStats


def instance(n: int, name: str, suspect: bool = False) -> InstanceStats:
    return InstanceStats(instance=f"denoiser-{n}", role="denoiser", name=name, address=f"ipc:///tmp/w{n}",
                         session="s", slots_free=1, slots_total=2, prealloc_free=2, prealloc_total=2, served=n,
                         failed=0, alive=True, suspect=suspect)


def test_columns_stay_aligned_with_long_default_names() -> None:
    table = workers_table([instance(12, "denoiser@a-rather-long-hostname:123456:d96f7e"), instance(3, "d0", True)])
    header, *rows = table.splitlines()
    assert [row.index(" 1/2 ") + 1 for row in rows] == [header.index("slots")] * 2  # under its header
    assert [row.split()[0] for row in rows] == ["denoiser-12", "denoiser-3"]
    assert rows[1].endswith("(suspect: no new work)")
