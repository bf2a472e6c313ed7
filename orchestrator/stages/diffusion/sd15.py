"""Stable Diffusion 1.x: CLIP text encoder, UNet2DConditionModel, AutoencoderKL.

The denoise loop restates ``StableDiffusionPipeline.__call__`` (diffusers 0.42) for one
prompt, without IP-Adapter, LoRA scale, clip skip or guidance rescale (all off by default).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline

from orchestrator.stages.base import StepFn, Tensors
from orchestrator.stages.diffusion.families import FamilyAdapter
from transfer.protocol import GenParams, Role


class SD15(FamilyAdapter):
    """Stable Diffusion 1.x (and 2.x, which shares the pipeline)."""

    name: ClassVar[str] = "sd15"
    pipeline_cls: ClassVar[type[DiffusionPipeline]] = StableDiffusionPipeline
    denoiser_model: ClassVar[str] = "unet"
    components: ClassVar[dict[Role, tuple[str, ...]]] = {
        "encoder": ("tokenizer", "text_encoder"),
        "denoiser": ("unet", "scheduler"),
        "decoder": ("vae",),
    }
    pipeline_kwargs: ClassVar[dict[str, Any]] = {"requires_safety_checker": False}
    denoiser_inputs: ClassVar[tuple[str, ...]] = ("prompt_embeds",)

    def uses_cfg(self, params: GenParams) -> bool:
        # LCM-style UNets take guidance as an embedding instead of a second batch half.
        return params.guidance > 1.0 and self.config("unet").get("time_cond_proj_dim") is None

    def encode(self, pipe: DiffusionPipeline, params: GenParams) -> Tensors:
        cfg_on = self.uses_cfg(params)
        positive, negative = pipe.encode_prompt(
            params.prompt, self.device, 1, cfg_on, params.negative_prompt or None
        )
        out = {"prompt_embeds": positive}
        if cfg_on:
            out["negative_prompt_embeds"] = negative
        return out

    def denoise(self, pipe: DiffusionPipeline, params: GenParams, inputs: Tensors, on_step: StepFn) -> torch.Tensor:
        unet = pipe.unet
        cfg_on = self.uses_cfg(params)
        embeds = self.request_embeds(pipe, params, inputs, "prompt_embeds")
        if cfg_on:
            # One batched forward, negative half first: two batch-1 calls are not bitwise equal.
            negative = self.request_embeds(pipe, params, inputs, "negative_prompt_embeds")
            embeds = torch.cat([negative, embeds])
        scheduler, timesteps, latents, step_kwargs = self.start(
            pipe, params, embeds.dtype, unet.config.in_channels
        )

        timestep_cond = None
        if unet.config.time_cond_proj_dim is not None:
            scale = torch.tensor(params.guidance - 1).repeat(params.num_images)
            timestep_cond = pipe.get_guidance_scale_embedding(
                scale, embedding_dim=unet.config.time_cond_proj_dim
            ).to(device=self.device, dtype=latents.dtype)

        for i, t in enumerate(timesteps):
            on_step(i, len(timesteps))
            model_input = torch.cat([latents] * 2) if cfg_on else latents
            model_input = scheduler.scale_model_input(model_input, t)
            noise_pred = unet(
                model_input, t, encoder_hidden_states=embeds, timestep_cond=timestep_cond, return_dict=False
            )[0]
            if cfg_on:
                uncond, text = noise_pred.chunk(2)
                noise_pred = uncond + params.guidance * (text - uncond)
            latents = scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[0]
        return latents
