"""A worker's name: the daemon evicts a live worker whose name a new registration repeats."""

from __future__ import annotations

from orchestrator.config import Config
from orchestrator.worker import WorkerRuntime


def test_default_names_never_repeat_and_a_given_name_is_kept() -> None:
    """Two containers on the host's network share its hostname and may both be pid 1."""
    first, second = WorkerRuntime("denoiser", Config()), WorkerRuntime("denoiser", Config())
    assert first.name != second.name and first.name.startswith("denoiser@")
    assert WorkerRuntime("denoiser", Config(), name="gpu3").name == "gpu3"
