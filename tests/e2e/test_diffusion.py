"""Real diffusers stages in three kinds of worker process, tensors moved by Mooncake:
every image equals the one the monolithic pipeline makes in this process, bit for bit.

Bitwise holds on CPU float32 because every process (workers and this test) runs torch at
the same thread count and each request is denoised unbatched with its own scheduler and
CPU generator (see ../shared/DIFFUSERS.md: thread count changes reduction order)."""

from __future__ import annotations

import anyio
import pytest
import torch

from orchestrator.client import AsyncClient, Rejection
from orchestrator.cluster import all_free
from orchestrator.stages.diffusion.reference import monolithic_images
from tests.conftest import outcome_of
from tests.e2e.conftest import StartCluster, wait_for
from transfer.protocol import GenParams, Reason

FAIL_MARKER = "please fail"


pytestmark = pytest.mark.usefixtures("same_threads_as_workers")


def requests() -> list[GenParams]:
    return [
        GenParams(prompt="a red fox in snow", negative_prompt="blurry", seed=11, steps=4, width=32, height=32,
                  output="raw"),
        GenParams(prompt="Lighthouse at dusk", seed=12, steps=3, width=48, height=32, guidance=7.5, output="raw"),
        GenParams(prompt="two cats", seed=13, steps=2, width=32, height=32, num_images=2, guidance=1.0,
                  output="raw"),
    ]


@pytest.mark.parametrize("family", ["sd15", "pixart"])
async def test_images_equal_the_monolithic_pipeline(start_cluster: StartCluster, family: str) -> None:
    cluster = start_cluster(**{"model": {"kind": "diffusers"}, "model.diffusers": {"family": family},
                               "model.faults": {"fail_prompt": FAIL_MARKER}})
    cfg = cluster.config.model.diffusers
    batch = requests()
    outcomes: dict[int, object] = {}

    async def one(client: AsyncClient, i: int, params: GenParams) -> None:
        outcomes[i] = await outcome_of(client.submit(params, timeout_s=60))

    failing = GenParams(prompt=f"{FAIL_MARKER} mid-loop", seed=5, steps=4, width=32, height=32, output="raw")
    with anyio.fail_after(120):
        async with AsyncClient(cluster.client_endpoint) as client, anyio.create_task_group() as tg:
            for i, params in enumerate(batch):
                tg.start_soon(one, client, i, params)
            tg.start_soon(one, client, -1, failing)

    denoisers = set()
    for i, params in enumerate(batch):
        generation = outcomes[i]
        images = generation.outputs["images"]
        assert images.shape == (params.num_images, params.height, params.width, 3)
        assert torch.equal(images, monolithic_images(cfg, params)), f"request {i} differs from its monolithic twin"
        denoisers.update(s.instance for s in generation.result.stages if s.role == "denoiser")
    assert len(denoisers) == 2, "the concurrent requests were spread over both denoisers"

    failed = outcomes[-1]
    assert failed.reason == Reason.STAGE_FAILED and "fail marker" in failed.message
    wait_for(cluster, all_free)


async def test_png_output_and_unhonourable_size(start_cluster: StartCluster) -> None:
    cluster = start_cluster(**{"model": {"kind": "diffusers"}}, layout={"encoder": 1, "denoiser": 1, "decoder": 1})
    from orchestrator.stages.images import decode_png

    params = GenParams(prompt="a harbour", seed=3, steps=2, width=32, height=32)
    with anyio.fail_after(60):
        async with AsyncClient(cluster.client_endpoint) as client:
            generation = await client.submit(params)
            with pytest.raises(Rejection) as caught:
                await client.submit(GenParams(prompt="odd", width=36, height=32))
    raw = monolithic_images(cluster.config.model.diffusers, params)
    assert torch.equal(torch.from_numpy(decode_png(generation.outputs["image_0.png"]).copy()), raw[0])
    assert caught.value.reason == Reason.INVALID and "multiple of 8" in caught.value.rejected.message
