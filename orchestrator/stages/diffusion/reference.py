"""The answer Triptych must reproduce: the same request through the whole diffusers
pipeline in one process. Used by the demo and the tests to check split results bitwise."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from orchestrator.config import DiffusersConfig
from orchestrator.stages.diffusion import tiny
from transfer.protocol import GenParams

# What the split stages pass that __call__ would otherwise default differently.
CALL_KWARGS: dict[str, dict[str, Any]] = {"pixart": {"use_resolution_binning": False, "clean_caption": False}}


def monolithic(cfg: DiffusersConfig, params: GenParams, output_type: str) -> Any:
    """``pipe(...).images`` for the embedded tiny pipeline of ``cfg``, on its device and dtype."""
    if cfg.path:
        raise ValueError("the in-process reference is built for the embedded tiny pipelines only")
    pipe = tiny.build_pipeline(cfg.family, cfg.seed, getattr(torch, cfg.dtype)).to(cfg.device)
    return pipe(
        params.prompt,
        negative_prompt=params.negative_prompt,
        width=params.width,
        height=params.height,
        num_inference_steps=params.steps,
        guidance_scale=params.guidance,
        num_images_per_prompt=params.num_images,
        generator=torch.Generator("cpu").manual_seed(params.seed),
        output_type=output_type,
        **CALL_KWARGS.get(cfg.family, {}),
    ).images


def monolithic_images(cfg: DiffusersConfig, params: GenParams) -> torch.Tensor:
    """The reference images as uint8 (N, H, W, 3), what ``output="raw"`` returns."""
    return torch.from_numpy(np.stack([np.asarray(image) for image in monolithic(cfg, params, "pil")]))
