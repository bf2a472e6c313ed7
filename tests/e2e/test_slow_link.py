"""A worker whose link to the daemon is slow: what crosses it slowly must not read as death."""

from __future__ import annotations

from pathlib import Path

import torch

from orchestrator.client import Client
from orchestrator.cluster import all_free
from orchestrator.stages.null import expected_outputs
from tests.e2e.conftest import StartCluster, config_variant, wait_for
from tests.e2e.slow_link import SlowLink, free_port
from transfer.protocol import GenParams

RATE = 4 << 20  # bytes per second, each connection, decoder to daemon


def test_a_decoder_sending_an_output_slower_than_its_heartbeat_timeout_is_not_evicted(
    start_cluster: StartCluster, tmp_path: Path,
) -> None:
    """A 6 MiB output takes 1.5 s to cross a 4 MiB/s link, twice the 0.75 s of silence
    (heartbeat_s × heartbeat_misses) that evicts a worker. The decoder's heartbeats do not
    wait behind it: its outputs travel on a connection of their own."""
    port = free_port()
    cluster = start_cluster(layout={"encoder": 1, "denoiser": 1},
                            daemon={"worker_endpoint": f"tcp://127.0.0.1:{port}", "heartbeat_s": 0.25,
                                    "heartbeat_misses": 3})
    with SlowLink(port, bytes_per_s=RATE) as link:
        slow = config_variant(cluster, tmp_path / "decoder.toml", "daemon",
                              {"worker_endpoint": f"tcp://127.0.0.1:{link.port}"})
        cluster.start_worker("decoder", 0, config_path=slow)
        cluster.wait_registered(3, timeout_s=60)
        params = GenParams(prompt="far away", seed=3, width=2048, height=1024, output="raw")
        with Client(cluster.config.daemon.client_endpoint) as client:
            result = client.submit(params, timeout_s=15)
        images = result.outputs["images"]
        assert images.numel() == 2048 * 1024 * 3
        assert torch.equal(images, expected_outputs(params, cluster.config.model.null)["images"])
        stats = wait_for(cluster, all_free)
    assert stats.retried == 0 and stats.completed == 1 and stats.failed_by_reason == {}
    decoder = next(i for i in stats.instances if i.role == "decoder")
    assert decoder.served == 1 and decoder.instance == "decoder-3"  # the first one: never evicted
