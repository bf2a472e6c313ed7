"""PixArt-α: T5 text encoder, PixArtTransformer2DModel, AutoencoderKL.

The denoise loop restates ``PixArtAlphaPipeline.__call__`` (diffusers 0.42) with
``use_resolution_binning=False`` (Triptych generates the size asked for, and the size
limits say which sizes the model takes) and ``clean_caption=False`` (``__call__`` defaults
to True, which needs bs4 and ftfy; a reference call must pass False too).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import ClassVar

import torch
from diffusers import DiffusionPipeline, PixArtAlphaPipeline
from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device

from orchestrator.stages.base import StepFn, Tensors
from orchestrator.stages.diffusion.families import FamilyAdapter
from transfer.protocol import GenParams, Role

MAX_SEQUENCE_LENGTH = 120  # __call__'s default


class PixArt(FamilyAdapter):
    """PixArt-α (the 256/512/1024 checkpoints); needs ``use_resolution_binning=False``."""

    name: ClassVar[str] = "pixart"
    pipeline_cls: ClassVar[type[DiffusionPipeline]] = PixArtAlphaPipeline
    denoiser_model: ClassVar[str] = "transformer"
    components: ClassVar[dict[Role, tuple[str, ...]]] = {
        "encoder": ("tokenizer", "text_encoder"),
        "denoiser": ("transformer", "scheduler"),
        "decoder": ("vae",),
    }
    denoiser_inputs: ClassVar[tuple[str, ...]] = ("prompt_embeds", "prompt_attention_mask")

    def size_multiple(self) -> int:
        # Latents are cut into patch_size x patch_size tokens.
        return max(super().size_multiple(), self.vae_scale_factor * self.config("transformer")["patch_size"])

    def min_steps(self) -> int:
        # For a single step __call__ takes the step's predicted x0, its second output; the
        # schedulers whose step returns none (DPM-Solver, PNDM, UniPC) cannot do one.
        scheduler = self.scheduler_class()
        return 1 if scheduler is not None and _step_outputs(scheduler) >= 2 else 2

    def encode(self, pipe: DiffusionPipeline, params: GenParams) -> Tensors:
        cfg_on = self.uses_cfg(params)
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            params.prompt,
            cfg_on,
            negative_prompt=params.negative_prompt,
            num_images_per_prompt=1,
            device=self.device,
            clean_caption=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        out = {"prompt_embeds": embeds, "prompt_attention_mask": mask}
        if cfg_on:
            out |= {"negative_prompt_embeds": negative, "negative_prompt_attention_mask": negative_mask}
        return out

    def denoise(self, pipe: DiffusionPipeline, params: GenParams, inputs: Tensors, on_step: StepFn) -> torch.Tensor:
        transformer = pipe.transformer
        cfg_on = self.uses_cfg(params)
        embeds = self.request_embeds(pipe, params, inputs, "prompt_embeds")
        mask = self.request_embeds(pipe, params, inputs, "prompt_attention_mask")
        if cfg_on:
            negative = self.request_embeds(pipe, params, inputs, "negative_prompt_embeds")
            negative_mask = self.request_embeds(pipe, params, inputs, "negative_prompt_attention_mask")
            embeds = torch.cat([negative, embeds])
            mask = torch.cat([negative_mask, mask])
        mask = mask.to(maybe_adjust_dtype_for_device(mask.dtype, mask.device))

        channels = transformer.config.in_channels
        scheduler, timesteps, latents, step_kwargs = self.start(pipe, params, embeds.dtype, channels)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)

        # Micro-conditions exist only on the 1024 model (sample_size 128).
        added_cond: dict[str, torch.Tensor | None] = {"resolution": None, "aspect_ratio": None}
        if transformer.config.sample_size == 128:
            n = params.num_images
            resolution = torch.tensor([params.height, params.width]).repeat(n, 1)
            aspect_ratio = torch.tensor([float(params.height / params.width)]).repeat(n, 1)
            resolution = resolution.to(dtype=embeds.dtype, device=self.device)
            aspect_ratio = aspect_ratio.to(dtype=embeds.dtype, device=self.device)
            if cfg_on:
                resolution, aspect_ratio = torch.cat([resolution] * 2), torch.cat([aspect_ratio] * 2)
            added_cond = {"resolution": resolution, "aspect_ratio": aspect_ratio}

        for i, t in enumerate(timesteps):
            on_step(i, len(timesteps))
            model_input = torch.cat([latents] * 2) if cfg_on else latents
            model_input = scheduler.scale_model_input(model_input, t)
            timestep = t[None].to(model_input.device) if t.dim() == 0 else t
            noise_pred = transformer(
                model_input,
                encoder_hidden_states=embeds,
                encoder_attention_mask=mask,
                timestep=timestep.expand(model_input.shape[0]),
                added_cond_kwargs=added_cond,
                return_dict=False,
            )[0]
            if cfg_on:
                uncond, text = noise_pred.chunk(2)
                noise_pred = uncond + params.guidance * (text - uncond)
            if transformer.config.out_channels // 2 == channels:  # learned sigma: drop it
                noise_pred = noise_pred.chunk(2, dim=1)[0]
            # __call__ takes the predicted x0 (output [1]) when there is a single step.
            output = 0 if params.steps > 1 else 1
            latents = scheduler.step(noise_pred, t, latents, **step_kwargs, return_dict=False)[output]
        return latents


def _step_outputs(scheduler: type) -> int:
    """How many values ``scheduler.step(..., return_dict=False)`` returns: the fields of the
    output dataclass its annotation names (0 when it names none)."""
    try:
        returned = typing.get_type_hints(scheduler.step).get("return")
    except (NameError, TypeError):
        return 0
    outputs = [t for t in (typing.get_args(returned) or (returned,)) if dataclasses.is_dataclass(t)]
    return len(dataclasses.fields(outputs[0])) if outputs else 0
