"""A worker's start, before it registers: a stop while its model loads."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from orchestrator import worker
from orchestrator.config import Config, EncoderWorkerConfig, ModelConfig, WorkersConfig
from orchestrator.watchdog import EXIT_STAGE_HUNG
from orchestrator.worker import WorkerRuntime

CFG = Config(model=ModelConfig(kind="null"))
LOAD_S = 3.0  # how long the stand-in load takes: far past the stop's bound, so a wait for it shows


class Engine:
    session = "127.0.0.1:1"
    write_timeout_s = 5.0


async def test_a_worker_stopped_while_its_model_loads_stops_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model load cannot be interrupted, and may take minutes (real weights from a slow
    disk) or never end (a wedged GPU, before any stage watchdog runs): a stop (SIGTERM, which
    cancels the runtime) waited for it, so the worker could not be stopped short of SIGKILL."""
    loading, release = threading.Event(), threading.Event()

    def load(*_: object, **__: object) -> None:
        loading.set()
        release.wait(LOAD_S)
        raise RuntimeError("the stand-in load ended")  # nothing may use it: the runtime was stopped

    monkeypatch.setattr(worker, "build_stage", load)
    w = WorkerRuntime("encoder", CFG, name="w", engine=Engine())  # type: ignore[arg-type]
    try:
        with anyio.fail_after(2 * LOAD_S):
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(w.run)
                    assert await anyio.to_thread.run_sync(loading.wait, LOAD_S)
                    stopped = time.monotonic()
                    tg.cancel_scope.cancel()  # as run_worker does on SIGTERM
            except* RuntimeError:
                pass  # the load's end, met by a stop that waited for it: the assertion below says so
        took_s = time.monotonic() - stopped
    finally:
        release.set()
    assert took_s < 0.5, f"the stop waited {took_s:.1f}s for the model load"


async def test_a_model_load_that_never_ends_exits_the_worker_as_a_hung_stage_does(
    monkeypatch: pytest.MonkeyPatch, logs: list[dict]
) -> None:
    """The stage watchdog started only once the model had loaded: a load that never returned
    left the worker silent and unregistered for good, its supervisor none the wiser."""
    release = threading.Event()
    monkeypatch.setattr(worker, "build_stage", lambda *_, **__: release.wait(LOAD_S))
    cfg = Config(model=ModelConfig(kind="null"),
                 workers=WorkersConfig(encoder=EncoderWorkerConfig(stage_timeout_s=0.3)))
    w = WorkerRuntime("encoder", cfg, name="w", engine=Engine())  # type: ignore[arg-type]
    exits: list[int] = []
    exited = threading.Event()
    w._exit_at_once = lambda status: (exits.append(status), exited.set())  # type: ignore[method-assign]
    try:
        with anyio.fail_after(2 * LOAD_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(w.run)
                assert await anyio.to_thread.run_sync(exited.wait, 2.0), "the hung load was never noticed"
                tg.cancel_scope.cancel()
    finally:
        release.set()
    assert exits[0] == EXIT_STAGE_HUNG  # from the loop; the watchdog's thread exits too if the loop does not
    [hung] = [line for line in logs if line["event"] == "worker.stage_hung"]
    assert hung["request_id"] == "(the model's load)" and hung["limit_s"] == 0.3
