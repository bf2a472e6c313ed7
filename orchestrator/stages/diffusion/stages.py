"""The three diffusers stages. Each loads only its own components, through a family adapter.

Hand-offs are flat ``dict[str, Tensor]``:

* encoder -> denoiser: ``prompt_embeds`` (+ ``negative_prompt_embeds`` when CFG is on),
  plus the family's extras (PixArt: ``prompt_attention_mask``, ``negative_...``), for ONE
  image: the denoiser repeats them per image, so ``num_images`` costs no transfer;
* denoiser -> decoder: ``latents`` (num_images, C, H/f, W/f), what ``output_type="latent"`` gives;
* decoder -> client: ``image_{i}.png`` (uint8 1-D, the PNG file) per image, or ``images``
  (uint8 N x H x W x 3) for ``output="raw"``.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import torch

from orchestrator.stages.base import UNATTENDED, RunControl, Stage, StageError, Tensors
from orchestrator.stages.diffusion.families import FamilyAdapter
from orchestrator.stages.images import image_outputs
from transfer.protocol import GenParams, Role, StageLimits


class DiffusionStage(Stage):
    """Common to the three roles: load the role's partial pipeline, check, run without grad."""

    role: ClassVar[Role]

    def __init__(self, adapter: FamilyAdapter, torch_threads: int = 1) -> None:
        # Same thread count in every process: reductions split differently across threads
        # change float results in the last bits (measured: 1 pixel in a tiny SD image).
        torch.set_num_threads(torch_threads)
        self.adapter = adapter
        self.pipe = adapter.load(self.role)
        self._limits = adapter.limits()

    @property
    def components(self) -> dict[str, Any]:
        """The components this stage holds (the rest of the pipeline is ``None``)."""
        return {name: c for name, c in self.pipe.components.items() if c is not None}

    def model_limits(self) -> StageLimits:
        return self._limits

    def model_digest(self) -> str:
        return self.adapter.digest()

    def run(self, params: GenParams, inputs: Tensors, *, control: RunControl = UNATTENDED) -> Tensors:
        self.check(params)
        control.check()
        with torch.inference_mode():
            return self._run(params, inputs, control)

    def _run(self, params: GenParams, inputs: Tensors, control: RunControl) -> Tensors:
        raise NotImplementedError

    @staticmethod
    def _require(inputs: Tensors, names: tuple[str, ...]) -> None:
        missing = [n for n in names if n not in inputs]
        if missing:
            raise StageError(f"missing input tensors {missing}; got {sorted(inputs)}")


class DiffusionEncoder(DiffusionStage):
    """Prompt -> text embeddings. Holds the tokenizer(s) and text encoder(s) only."""

    role: ClassVar[Role] = "encoder"

    def __init__(self, adapter: FamilyAdapter, torch_threads: int = 1) -> None:
        super().__init__(adapter, torch_threads)
        # A transformers tokenizer sets padding and truncation on its shared Rust backend
        # before each call, so two threads tokenizing at once can pad each other's prompts.
        self._lock = threading.Lock()

    def _run(self, params: GenParams, inputs: Tensors, control: RunControl) -> Tensors:
        with self._lock:
            control.check()  # stopped while it waited for the lock
            out = self.adapter.encode(self.pipe, params)
        return {k: v.contiguous() for k, v in out.items()}


class DiffusionDenoiser(DiffusionStage):
    """Embeddings -> latents. Holds the UNet/transformer and the scheduler config only.

    ``fail_marker``: a prompt containing it makes the loop raise at step 1 (or at step 0
    of a one-step request), so tests and demos can fail a request mid-loop.
    """

    role: ClassVar[Role] = "denoiser"

    def __init__(self, adapter: FamilyAdapter, torch_threads: int = 1, *, fail_marker: str = "") -> None:
        super().__init__(adapter, torch_threads)
        self.fail_marker = fail_marker

    def _run(self, params: GenParams, inputs: Tensors, control: RunControl) -> Tensors:
        names = self.adapter.denoiser_inputs
        if self.adapter.uses_cfg(params):
            names += tuple(f"negative_{n}" for n in names)
        self._require(inputs, names)
        fail = bool(self.fail_marker) and self.fail_marker in params.prompt

        def on_step(i: int, total: int) -> None:
            # ``total`` counts the scheduler's timesteps: 2n-1 for the second-order ones (Heun,
            # KDPM2). The client asked for ``params.steps`` and hears of those.
            control.step(i * params.steps // total, params.steps)  # an abandoned request frees the GPU here
            if fail and i == min(1, total - 1):
                raise StageError(f"prompt contains the fail marker; failed at step {i} of {total}")

        latents = self.adapter.denoise(self.pipe, params, inputs, on_step)
        return {"latents": latents.contiguous()}


class DiffusionDecoder(DiffusionStage):
    """Latents -> images (PNG files or raw uint8). Holds the VAE only."""

    role: ClassVar[Role] = "decoder"

    def _run(self, params: GenParams, inputs: Tensors, control: RunControl) -> Tensors:
        self._require(inputs, ("latents",))
        latents = inputs["latents"]
        factor = self.adapter.vae_scale_factor
        expected = (params.num_images, params.height // factor, params.width // factor)
        if latents.dim() != 4 or (latents.shape[0], *latents.shape[2:]) != expected:
            raise StageError(f"latents {tuple(latents.shape)} do not fit {expected} (images, height, width)")
        return image_outputs(self.adapter.decode(self.pipe, latents), params)
