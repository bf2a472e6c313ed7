"""The shipped tools run as a user runs them: the demo, the benchmark and the hand-off
benchmark, each a real cluster of processes, each with an exit status that means something."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from tests.e2e.conftest import CONFIGS

# A bare environment, but for where this interpreter finds its packages and libraries
# (a machine that installs them through these variables runs the tools through them too).
FOUND_THROUGH = ("PYTHONPATH", "LD_LIBRARY_PATH")


def run_tool(module: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"} | {k: os.environ[k] for k in FOUND_THROUGH
                                                              if k in os.environ}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s,
                          env=env)


def local_config(tmp_path: Path) -> Path:
    """configs/local.toml as shipped (tiny diffusers model, 1/2/1 workers), on ipc endpoints
    so it cannot collide with anything listening on its ports."""
    raw = msgspec.toml.decode((CONFIGS / "local.toml").read_bytes())
    raw["daemon"].update(client_endpoint=f"ipc://{tmp_path}/c", control_endpoint=f"ipc://{tmp_path}/k",
                         worker_endpoint=f"ipc://{tmp_path}/w")
    config = tmp_path / "local.toml"
    config.write_bytes(msgspec.toml.encode(raw))
    return config


def test_the_demo_generates_images_equal_to_the_one_process_pipeline(tmp_path: Path) -> None:
    config = local_config(tmp_path)
    out = tmp_path / "out"
    done = run_tool("orchestrator.demo", "--config", str(config), "--requests", "3", "--steps", "3",
                    "--size", "32", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("OK, matches the one-process pipeline") == 3
    assert "all 3 images verified" in done.stdout
    assert sorted(p.name for p in out.glob("*.png")) == ["demo-0-0.png", "demo-1-0.png", "demo-2-0.png"]


def test_a_demo_whose_requests_the_model_refuses_says_why_in_one_line(tmp_path: Path) -> None:
    done = run_tool("orchestrator.demo", "--config", str(local_config(tmp_path)), "--requests", "2",
                    "--size", "60", "--out", str(tmp_path / "out"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "demo FAILED: the daemon refused 2 of 2 requests: invalid: width 60 is not a multiple of 8" in done.stderr


def test_the_tools_refuse_counts_they_cannot_run_with_as_usage_errors() -> None:
    for args, says in ((("orchestrator.handoff_bench", "--requests", "1"), "expected at least 2, got 1"),
                       (("orchestrator.handoff_bench", "--mib", "0"), "expected at least 1, got 0"),
                       (("orchestrator.demo", "--steps", "x"), "expected a whole number, got 'x'"),
                       (("orchestrator.soak", "--rate", "0"), "expected a positive number a second, got '0'")):
        done = run_tool(*args)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_benchmark_completes_every_request_and_prints_its_figures() -> None:
    done = run_tool("orchestrator.bench", "--requests", "300")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every request completed" in done.stdout
    for line in ("daemon alone: instant protocol workers", "full stack: real workers",
                 "daemon alone, added p50 at concurrency 1:", "backlog / concurrency-64 ratio"):
        assert line in done.stdout


def test_the_benchmark_refuses_too_few_requests_to_measure() -> None:
    done = run_tool("orchestrator.bench", "--requests", "30")
    assert done.returncode == 2 and "--requests must be at least 300" in done.stderr


def test_the_handoff_benchmark_compares_both_paths() -> None:
    done = run_tool("orchestrator.handoff_bench", "--mib", "1", "--requests", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mooncake" in done.stdout and "memcpy" in done.stdout
    assert "same-host copy is" in done.stdout
    assert "its digest costs the sender" in done.stdout


def test_the_soak_judges_every_answer_through_kills_faults_and_a_daemon_restart() -> None:
    # Seed 40's first round draws a SIGTERM, then a device fault, then a SIGKILL. The faulty
    # request's answer depends on timing (stage_failed, or worker_lost if the SIGKILL hits
    # the denoiser holding it): the soak's own verdict judges it.
    done = run_tool("orchestrator.soak", "--rounds", "1", "--round-s", "10", "--seed", "40", "--restart-every", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    for said in ("SIGTERM", "SIGKILL", "daemon restart", "'fault:", "'plain:ok'", "problems 0"):
        assert said in done.stdout, done.stdout
    assert "PROBLEM" not in done.stdout
