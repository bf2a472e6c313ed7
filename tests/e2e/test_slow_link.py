"""A worker whose link to the daemon is slow: what crosses it slowly must not read as death,
and a decoder told to stop hands over what it has made first."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import torch

from orchestrator.client import AsyncClient, Client
from orchestrator.cluster import LocalCluster, all_free
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, config_variant, wait_for
from tests.e2e.slow_link import SlowLink, free_port
from transfer.protocol import GenParams

RATE = 4 << 20  # bytes per second, each connection, decoder to daemon
# 6 MiB of raw image: 1.5 s across RATE, twice the 0.75 s of silence (heartbeat_s ×
# heartbeat_misses below) that evicts a worker.
PARAMS = GenParams(prompt="far away", seed=3, width=2048, height=1024, output="raw")


def start_far_decoder(start_cluster: StartCluster, tmp_path: Path, link_port: int, daemon_port: int) -> LocalCluster:
    """An encoder and a denoiser beside the daemon, and a decoder whose connections to it
    cross the SlowLink on ``link_port``."""
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1},
                            daemon={"worker_endpoint": f"tcp://127.0.0.1:{daemon_port}", "heartbeat_s": 0.25,
                                    "heartbeat_misses": 3})
    far = config_variant(cluster, tmp_path / "decoder.toml", "daemon", {"worker_endpoint": f"tcp://127.0.0.1:{link_port}"})
    cluster.start_worker("decoder", 0, config_path=far)
    cluster.wait_registered(3, timeout_s=60)
    return cluster


def assert_expected(images: torch.Tensor, cluster: LocalCluster) -> None:
    assert images.numel() == 2048 * 1024 * 3
    assert torch.equal(images, expected_outputs(PARAMS, cluster.config.model.null)["images"])


def test_a_decoder_sending_an_output_slower_than_its_heartbeat_timeout_is_not_evicted(
    start_cluster: StartCluster, tmp_path: Path,
) -> None:
    """The decoder's heartbeats do not wait behind its output: its outputs travel on a
    connection of their own."""
    port = free_port()
    with SlowLink(port, bytes_per_s=RATE) as link:
        cluster = start_far_decoder(start_cluster, tmp_path, link.port, port)
        with Client(cluster.client_endpoint) as client:
            result = client.submit(PARAMS, timeout_s=15)
        assert_expected(result.outputs["images"], cluster)
        stats = wait_for(cluster, all_free)
    assert stats.retried == 0 and stats.completed == 1 and stats.failed_by_reason == {}
    decoder = next(i for i in stats.instances if i.role == "decoder")
    assert decoder.served == 1 and decoder.instance == "decoder-3"  # the first one: never evicted


async def test_a_decoder_told_to_stop_while_its_output_crosses_hands_it_over_first(
    start_cluster: StartCluster, tmp_path: Path,
) -> None:
    """SIGTERM once the output has begun to cross: the decoder says Stopping (no new work),
    then heartbeats on until the daemon answers its Leaving, which follows the output, so
    the request ends there, not computed again elsewhere (with no other decoder it would
    have timed out)."""
    port = free_port()
    with SlowLink(port, bytes_per_s=RATE) as link:
        cluster = start_far_decoder(start_cluster, tmp_path, link.port, port)
        decoder = cluster.workers["decoder0"]
        before = link.forwarded
        exits: list[tuple[int | None, float]] = []

        async def stop_the_decoder_mid_output() -> None:
            while link.forwarded - before < 1 << 20:  # the output is crossing: it has been made
                await anyio.sleep(0.01)
            decoder.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            # It said Stopping: no new work while it hands over (its heartbeats go on).
            await anyio.to_thread.run_sync(lambda: wait_for(
                cluster, lambda s: any(i.role == "decoder" and i.suspect for i in s.instances)))
            code = await anyio.to_thread.run_sync(decoder.wait)
            exits.append((code, time.monotonic() - stopped))

        with anyio.fail_after(60):
            async with AsyncClient(cluster.client_endpoint) as client, \
                    anyio.create_task_group() as tg:
                tg.start_soon(stop_the_decoder_mid_output)
                generation = await client.submit(PARAMS, timeout_s=30)
        assert_expected(generation.outputs["images"], cluster)
        [(code, took_s)] = exits
        assert code == 0 and 0.5 < took_s < cluster.config.workers.decoder.stop_flush_s
    stats = wait_for(cluster, lambda s: all_free(s) and len(s.instances) == 2)
    assert stats.retried == 0 and stats.completed == 1 and stats.failed_by_reason == {}
    assert "decoder-3 left: its process is stopping" in cluster.log_of("daemon")
