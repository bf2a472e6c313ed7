"""The command line and the control socket against a real cluster."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from functools import partial

import anyio
import pytest
import torch

from orchestrator.client import AsyncClient, Client
from orchestrator.cluster import all_free
from orchestrator.stages.images import decode_png
from orchestrator.stages.null import expected_outputs
from orchestrator.tables import STAGES_HEADER
from tests.e2e.conftest import StartCluster, assert_torch_free, wait_for
from transfer.protocol import GenParams, Progress

SMALL = {"encoder": 1, "denoiser": 1, "decoder": 1}


def triptych(*args: str, config) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=60)


def triptych_importing(*args: str, config) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """``triptych(*args)``, and the modules it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    return done, {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
                  if line.startswith("import time:")}


def test_submit_writes_the_png_and_stats_report_it(start_cluster: StartCluster, tmp_path) -> None:
    cluster = start_cluster(layout=SMALL)
    out = tmp_path / "out"
    done, imported = triptych_importing("submit", "--prompt", "a harbour", "--seed", "4", "--width", "32", "--height",
                                        "24", "--request-id", "cli-1", "--priority", "5", "--out", str(out),
                                        config=cluster.config_path)
    assert done.returncode == 0, done.stderr
    assert "orchestrator.client" in imported and "torch" not in imported  # it writes bytes: no torch to load
    png = (out / "cli-1-image_0.png").read_bytes()
    expected = expected_outputs(GenParams(prompt="a harbour", seed=4, width=32, height=24, output="raw"),
                                cluster.config.model.null)["images"][0]
    assert torch.equal(torch.from_numpy(decode_png(png).copy()), expected)
    # One line per stage under the table's header, in order, each with its instance and its times.
    lines = done.stdout.splitlines()
    stages = [line.split()[:2] for line in lines[lines.index(STAGES_HEADER) + 1:]]
    assert [role for role, _ in stages] == ["encoder", "denoiser", "decoder"]
    assert all(instance.startswith(f"{role}-") for role, instance in stages)
    # An id is any string: one with a slash names a file inside --out all the same.
    again = triptych("submit", "--prompt", "a harbour", "--request-id", "../cli-2", "--out", str(out),
                     config=cluster.config_path)
    assert again.returncode == 0, again.stderr
    assert [p.name.startswith(".._cli-2~") for p in sorted(out.iterdir())] == [True, False]  # none overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # The longest id there is (128 characters of 4 bytes each) still names a file.
    longest = triptych("submit", "--prompt", "a harbour", "--request-id", "🦊" * 128, "--out", str(out),
                       config=cluster.config_path)
    assert longest.returncode == 0, longest.stderr
    assert len(list(out.iterdir())) == 3
    # Raw tensors land as their bytes, their dtype and shape said beside the file's name.
    raw = triptych("submit", "--prompt", "a harbour", "--seed", "4", "--width", "32", "--height", "24", "--output",
                   "raw", "--request-id", "cli-raw", "--out", str(out), config=cluster.config_path)
    assert raw.returncode == 0, raw.stderr
    assert f"{out / 'cli-raw-images.bin'}  uint8 (1, 24, 32, 3)" in raw.stdout.splitlines()
    assert (out / "cli-raw-images.bin").read_bytes() == expected.numpy().tobytes()

    # An operator's command that reads numbers starts without torch (2.5 s of CPU before).
    asked, imported = triptych_importing("stats", "--json", config=cluster.config_path)
    assert "orchestrator.control_client" in imported and "torch" not in imported
    stats = json.loads(asked.stdout)
    assert stats["completed"] == 4 and len(stats["instances"]) == 3
    # Where the time went: every stage of the three requests, and the bytes of each hop.
    latency = {key: sum(lat["counts"]) for key, lat in stats["latency"].items()}
    assert latency == {key: 4 for key in ("request", "encoder.queued", "encoder.compute", "encoder->denoiser",
                                          "denoiser.queued", "denoiser.compute", "denoiser->decoder",
                                          "decoder.queued", "decoder.compute")}
    assert stats["latency"]["denoiser.compute"]["total_ms"] >= 4 * cluster.config.model.null.denoiser_ms * 0.9
    assert stats["handoff_bytes"]["encoder->denoiser"] > 0 and stats["handoff_bytes"]["denoiser->decoder"] > 0
    table = triptych("stats", config=cluster.config_path).stdout
    assert "completed=4" in table and "denoiser" in table
    assert [line.split()[:2] for line in table.splitlines() if line.startswith(("request ", "denoiser->decoder"))] \
        == [["request", "4"], ["denoiser->decoder", "4"]] and "MB/s" in table


def test_submit_reports_a_rejection_and_exits_nonzero(start_cluster: StartCluster, tmp_path) -> None:
    cluster = start_cluster(layout=SMALL)
    done = triptych("submit", "--prompt", "x", "--width", "30", "--out", str(tmp_path), config=cluster.config_path)
    assert done.returncode == 2
    assert "rejected (invalid)" in done.stderr and "multiple of 8" in done.stderr
    huge = triptych("submit", "--prompt", "x", "--seed", str(2**70), "--out", str(tmp_path), config=cluster.config_path)
    assert huge.returncode == 2 and "rejected (invalid): not sent" in huge.stderr
    # Control commands pointed at the client socket, and a submit at the control socket: the
    # daemon's refusal says which socket it is, in one line, exit 1 as for the worker socket.
    lost = triptych("stats", "--endpoint", cluster.client_endpoint, config=cluster.config_path)
    assert lost.returncode == 1 and lost.stderr == (
        f"triptych stats: {cluster.client_endpoint} is not a control socket: this is the daemon's client socket; "
        "this message goes to its control socket (daemon.control_endpoint)\n")
    # Either client, at once (the DEALER of --progress once waited out the request's deadline).
    control_endpoint = cluster.config.daemon.control_endpoint
    for progress in ([], ["--progress"]):
        started = time.monotonic()
        astray = triptych("submit", "--prompt", "x", "--out", str(tmp_path), *progress, "--endpoint",
                          control_endpoint, config=cluster.config_path)
        assert astray.returncode == 1 and time.monotonic() - started < 15 and astray.stderr == (
            f"triptych submit: {control_endpoint} is not a Triptych client socket: this is the daemon's control "
            "socket; this message goes to its client socket (daemon.client_endpoint)\n"), astray.stderr
    # ...and at the worker socket: its answer says which socket it is, at once.
    worker_endpoint = cluster.config.daemon.worker_endpoint
    started = time.monotonic()
    astray = triptych("stats", "--endpoint", worker_endpoint, config=cluster.config_path)
    assert astray.returncode == 1 and time.monotonic() - started < 5
    assert astray.stderr.startswith(f"triptych stats: {worker_endpoint} is not a control "
                                    "socket: this is the daemon's worker socket")
    for progress in ([], ["--progress"]):
        started = time.monotonic()
        astray = triptych("submit", "--prompt", "x", "--out", str(tmp_path), *progress, "--endpoint",
                          worker_endpoint, config=cluster.config_path)
        assert astray.returncode == 1 and time.monotonic() - started < 15
        assert f"{worker_endpoint} is not a Triptych client socket: this is the daemon's worker socket" \
            in astray.stderr, astray.stderr
    # The metrics exporter, which would otherwise say triptych_up 0 on every scrape, refuses
    # either at start, in one line.
    for which in ("client", "worker"):
        endpoint = getattr(cluster.config.daemon, f"{which}_endpoint")
        exporter = triptych("metrics", "--port", "0", "--endpoint", endpoint, config=cluster.config_path)
        assert exporter.returncode == 1 and exporter.stdout == ""
        assert exporter.stderr.startswith(f"triptych metrics: {endpoint} is not a control socket: ")
        assert exporter.stderr.count("\n") == 1
    # The daemon counted what it refused at its door: the width, and each control request
    # at the client socket (the worker socket's refusals are no client's).
    table = triptych("stats", config=cluster.config_path)
    assert "refused at the door=3 {'invalid': 3}" in table.stdout, table.stdout


@pytest.mark.parametrize(("signum", "status", "said"), [(signal.SIGINT, 130, "interrupted"),
                                                         (signal.SIGTERM, 143, "terminated")], ids=["int", "term"])
@pytest.mark.parametrize("progress", [False, True], ids=["req", "dealer"])
def test_a_stop_signal_on_submit_cancels_the_request(start_cluster: StartCluster, tmp_path, progress: bool,
                                                     signum: signal.Signals, status: int, said: str) -> None:
    """Ctrl-C, or the SIGTERM of `timeout`, systemd or Kubernetes, cancels the request at the
    daemon, which would otherwise run it to the end for nobody."""
    cluster = start_cluster(layout=SMALL, **{"model.null": {"denoiser_ms": 20000.0}})
    submit = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "submit", "--prompt", "x", "--out", str(tmp_path),
         "--config", str(cluster.config_path), *(["--progress"] if progress else [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(cluster, lambda s: s.requests_by_state.get("denoising") == 1, timeout_s=20)
    submit.send_signal(signum)
    _, stderr = submit.communicate(timeout=20)
    assert submit.returncode == status, stderr
    assert "Traceback" not in stderr and f"{said}: request" in stderr and stderr.strip().endswith("cancelled")
    stats = wait_for(cluster, all_free)
    assert stats.failed_by_reason == {"cancelled": 1}
    # Its Rejected(cancelled) found the process gone: a reply nobody waited for, not one lost.
    assert stats.replies_dropped == 0 and "client.reply_dropped" not in cluster.log_of("daemon")


async def test_workers_and_drain_commands_list_the_instances_then_finish_work_and_exit(
    start_cluster: StartCluster,
) -> None:
    # Long enough to be in flight still once the drain command's process has started.
    cluster = start_cluster(layout=SMALL, **{"model.null": {"denoiser_ms": 5000.0}})
    listed = json.loads(triptych("workers", "--json", config=cluster.config_path).stdout)
    assert sorted((i["role"], i["name"]) for i in listed["instances"]) == [
        ("decoder", "decoder0"), ("denoiser", "denoiser0"), ("encoder", "encoder0")]
    table = triptych("workers", config=cluster.config_path).stdout
    assert all(name in table for name in ("encoder0", "denoiser0", "decoder0"))
    assert "limits each worker registered (a request must fit all of them)" in table
    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            tg.start_soon(client.submit, GenParams(prompt="slow", output="raw"))
            await anyio.to_thread.run_sync(wait_for, cluster, lambda s: sum(s.requests_by_state.values()) == 1)
            drained = await anyio.to_thread.run_sync(lambda: triptych("drain", config=cluster.config_path))
            assert drained.returncode == 0 and "requests in flight: 1." in drained.stdout
        assert cluster.daemon is not None
        assert await anyio.to_thread.run_sync(lambda: cluster.daemon.wait(timeout=30)) == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _scrape(url: str, *, timeout_s: float = 30.0) -> str:
    """The exporter's page, once it is up (it starts in its own process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as page:
                return page.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_the_metrics_exporter_serves_the_daemons_stats_to_prometheus(start_cluster: StartCluster) -> None:
    cluster = start_cluster(layout=SMALL)
    port = _free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "orchestrator", "metrics", "--port", str(port),
                                 "--config", str(cluster.config_path)], stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert "triptych_requests_completed_total 0.0" in _scrape(url)
        with Client(cluster.client_endpoint) as client:
            client.submit(GenParams(prompt="scraped", output="raw"), timeout_s=20)
        page = _scrape(url)
        assert_torch_free(exporter.pid)  # it runs beside the daemon for good, reading numbers
        assert "triptych_up 1.0" in page and "triptych_requests_completed_total 1.0" in page
        assert 'triptych_worker_served_total{instance="' in page and 'name="denoiser0"' in page
        assert "triptych_request_duration_seconds_count 1.0" in page
        assert 'triptych_stage_duration_seconds_count{part="compute",role="decoder"} 1.0' in page
        assert 'triptych_handoff_duration_seconds_bucket{hop="denoiser->decoder",le="+Inf"} 1.0' in page
        assert 'triptych_handoff_bytes_total{hop="encoder->denoiser"}' in page
        assert cluster.stop_daemon() == 0
        assert "triptych_up 0.0" in _scrape(url)  # the exporter outlives the daemon and says so
    finally:
        exporter.send_signal(signal.SIGTERM)
        assert exporter.wait(timeout=10) == 0


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two"])
def test_every_dispatch_policy_serves_correctly_over_both_denoisers(start_cluster: StartCluster, policy: str) -> None:
    cluster = start_cluster(**{"daemon": {"dispatch": policy}})
    served: set[str] = set()
    with Client(cluster.client_endpoint) as client:
        for i in range(16):  # power of two: all on one denoiser has odds 2^-15
            params = GenParams(prompt=f"p{i}", seed=i, output="raw")
            generation = client.submit(params, timeout_s=20)
            assert torch.equal(generation.outputs["images"],
                               expected_outputs(params, cluster.config.model.null)["images"])
            served.update(s.instance for s in generation.result.stages if s.role == "denoiser")
    assert len(served) == 2
    wait_for(cluster, all_free)


async def test_the_benchmarks_instant_workers_serve_through_the_real_daemon(start_cluster: StartCluster) -> None:
    """``triptych instant-workers`` registers 1/2/1 zero-work peers that the daemon drives
    like real workers: every request completes over both hops, and everything ends free."""
    cluster = start_cluster(instant=True)
    assert sorted(i.role for i in cluster.control.workers().instances) == ["decoder", "denoiser", "denoiser", "encoder"]
    results = []
    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            async def one(i: int) -> None:
                results.append(await client.submit(GenParams(prompt="instant", seed=i, output="raw"), timeout_s=30))

            for i in range(40):
                tg.start_soon(one, i)
    assert len(results) == 40
    for generation in results:
        assert [s.role for s in generation.result.stages] == ["encoder", "denoiser", "decoder"]
        assert torch.equal(generation.outputs["out"], torch.zeros(16))
    stats = wait_for(cluster, all_free)
    assert stats.completed == 40 and not stats.failed_by_reason
    assert all(stats.fast_path.get(hop, 0) > 0 for hop in ("encoder->denoiser", "denoiser->decoder"))


async def test_progress_follows_a_request_through_every_stage_and_step(start_cluster: StartCluster,
                                                                       tmp_path) -> None:
    """An AsyncClient that asks hears each stage and the denoiser's steps, then the right bytes;
    ``triptych submit --progress`` prints them."""
    cluster = start_cluster(layout=SMALL, **{"model.null": {"denoiser_ms": 1000.0},
                                             "workers.denoiser": {"progress_interval_s": 0.1}})
    params = GenParams(prompt="watched", seed=3, steps=10, output="raw")
    heard: list[Progress] = []
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client:
            generation = await client.submit(params, on_progress=heard.append)
    assert torch.equal(generation.outputs["images"], expected_outputs(params, cluster.config.model.null)["images"])
    assert all(p.request_id == generation.result.request_id for p in heard)
    states = [p.state for p in heard]
    assert states[0] == "encoding" and states[-1] == "decoding" and "denoising" in states
    steps = [p.step for p in heard if p.steps]
    assert all(p.steps == 10 for p in heard if p.steps) and len(steps) >= 3 and steps == sorted(steps)
    assert [p.elapsed_ms for p in heard] == sorted(p.elapsed_ms for p in heard)
    assert all(p.position == 0 for p in heard)  # nothing else ran: it never waited for a slot
    assert heard[0].eta_ms is None  # the first request: nothing to estimate by

    # The next is told at once about how long its work takes, and less and less after.
    heard.clear()
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client:
            generation = await client.submit(params, on_progress=heard.append)
    etas = [p.eta_ms for p in heard]
    assert all(eta is not None for eta in etas) and etas[-1] < etas[0]
    assert 0.5 < etas[0] / generation.result.total_ms < 1.5, (etas, generation.result.total_ms)

    # One more than the denoiser's capacity (3): the last one waits, and hears its place.
    capacity = cluster.config.workers.denoiser.capacity
    waits: list[Progress] = []
    with anyio.fail_after(30):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for i in range(capacity + 1):
                tg.start_soon(partial(client.submit, GenParams(prompt=f"crowd {i}", steps=10, output="raw"),
                                      on_progress=lambda p: waits.append(p) if p.position else None))
    assert [(p.state, p.position) for p in waits] == [("denoising", 1)]

    done = triptych("submit", "--prompt", "watched", "--steps", "10", "--progress", "--out", str(tmp_path),
                    config=cluster.config_path)
    assert done.returncode == 0, done.stderr
    assert "denoising step" in done.stderr and "decoding" in done.stderr and "of work left" in done.stderr
    assert wait_for(cluster, all_free).completed == capacity + 4
