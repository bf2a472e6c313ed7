"""The split on a CUDA device, with the Mooncake build for GPU machines moving the hand-offs:
every image equals the one the monolithic pipeline makes on the same device and dtype, bit
for bit. Skipped where torch sees no GPU (CI has none); run on a GPU machine, where a torch
that sees none fails instead of skipping. Where there is none, a worker put on one still
shows it was started as a process of its own, not forked.

On one device both sides run the same kernels on the same shapes (each request unbatched,
noise from a CPU generator), so equality is exact there too, half precision included."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest
import torch

from orchestrator.client import AsyncClient, Generation
from orchestrator.cluster import ClusterError, LocalCluster, all_free
from orchestrator.stages.diffusion.reference import monolithic_images
from tests.e2e.conftest import StartCluster, cluster_config, wait_for
from transfer.protocol import GenParams

GPU = torch.cuda.is_available()
# Asked apart from torch: a CPU build of torch, or a driver too old for its CUDA, sees no
# GPU on a machine that has one, and every test here would skip or pass without one.
HAS_GPU = shutil.which("nvidia-smi") is not None and subprocess.run(
    ["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not HAS_GPU, reason="nvidia-smi sees no GPU")
def test_a_gpu_machine_has_a_torch_that_sees_the_gpu_and_mooncakes_gpu_build() -> None:
    assert GPU, "nvidia-smi sees a GPU, torch does not: a CPU build of torch, or a driver too old for its CUDA"
    assert importlib.metadata.version("mooncake-transfer-engine-cuda13"), "scripts/_env.sh installs it on a GPU"


REQUESTS = [
    GenParams(prompt="a red fox in snow", negative_prompt="blurry", seed=21, steps=4, width=32, height=32,
              output="raw"),
    GenParams(prompt="Lighthouse at dusk", seed=22, steps=3, width=48, height=32, guidance=7.5, output="raw"),
    GenParams(prompt="two cats", seed=23, steps=2, width=32, height=32, num_images=2, guidance=1.0, output="raw"),
]


@pytest.mark.skipif(not GPU, reason="needs a CUDA device")
@pytest.mark.usefixtures("same_threads_as_workers")
@pytest.mark.parametrize(("family", "dtype"),
                         [("sd15", "float32"), ("sd15", "float16"), ("pixart", "float32"), ("pixart", "bfloat16")])
async def test_images_on_cuda_equal_the_monolithic_pipeline(start_cluster: StartCluster, family: str,
                                                            dtype: str) -> None:
    cluster = start_cluster(**{"model": {"kind": "diffusers"},
                               "model.diffusers": {"family": family, "dtype": dtype, "device": "cuda"}})
    cfg = cluster.config.model.diffusers
    outcomes: dict[int, Generation] = {}

    async def one(client: AsyncClient, i: int) -> None:
        outcomes[i] = await client.submit(REQUESTS[i], timeout_s=120)

    with anyio.fail_after(180):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for i in range(len(REQUESTS)):
                tg.start_soon(one, client, i)

    for i, params in enumerate(REQUESTS):
        images = outcomes[i].outputs["images"]
        assert images.shape == (params.num_images, params.height, params.width, 3)
        assert torch.equal(images, monolithic_images(cfg, params)), f"request {i} differs from its monolithic twin"
    wait_for(cluster, all_free)


@pytest.mark.skipif(GPU, reason="on a GPU machine such workers start: the test above")
def test_a_worker_on_a_gpu_is_started_as_a_process_of_its_own(tmp_path: Path) -> None:
    """A fork of the fork server could not use CUDA: the worker is the cluster's own child,
    and it is its failure to find a GPU, not the fork server's, that the cluster reports."""
    path, _ = cluster_config(tmp_path, model={"kind": "diffusers"}, **{"model.diffusers": {"device": "cuda"}})
    cluster = LocalCluster(path, layout={"encoder": 1}, log_dir=tmp_path / "logs")
    try:
        with pytest.raises(ClusterError, match="encoder0 exited with 1.*sees 0 CUDA devices"):
            cluster.start(timeout_s=60)
    finally:
        cluster.stop(timeout_s=10)
    assert isinstance(cluster.workers["encoder0"], subprocess.Popen)
    assert not (tmp_path / "logs" / "fork-server.log").exists()
