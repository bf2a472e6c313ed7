"""Null stages: a configured time, then a deterministic output of a configured shape.

Each output is a pure function of the request (seed, prompt) *and of the stage's input*,
so a client can recompute the whole chain with ``expected_outputs`` and compare bytes: a
corrupted hand-off or one request's tensors landing in another's slot changes the result.

The denoiser spends its time in ``params.steps`` steps, reporting each and stopping between
them as a real one does; the encoder and the decoder check for a stop only before they
start, as one forward pass cannot be interrupted.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time

import torch

from orchestrator.config import FaultsConfig, NullStageConfig
from orchestrator.stages.base import UNATTENDED, RunControl, Stage, StageError, Tensors, digest_of
from orchestrator.stages.images import image_outputs
from transfer.protocol import GenParams, StageLimits

LATENT_FACTOR = 8
LIMITS = StageLimits(size_multiple=LATENT_FACTOR, min_size=8, max_size=4096, max_frames=1, model="null")


def _bytes(params: GenParams, salt: str, n: int) -> bytes:
    """``n`` bytes decided by the request and ``salt`` alone: SHAKE-256's output, the same on
    every machine. (torch's CPU randn is not: from 16 elements on it takes a vectorised path
    whose low bits differ between CPUs, so a client would see its own recomputation differ
    from a worker's on another kind of CPU.)"""
    return hashlib.shake_256(f"{salt}\0{params.seed}\0{params.prompt}".encode()).digest(n)


def _noise(params: GenParams, salt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 noise of ``shape``, roughly N(0, 1.15): each value the sum of four random
    bytes, centred, over 128. Whole numbers and a power of two: exact on every machine."""
    n = math.prod(shape)
    raw = torch.frombuffer(bytearray(_bytes(params, salt, 4 * n)), dtype=torch.uint8).reshape(n, 4)
    return ((raw.to(torch.int32).sum(1) - 510).to(torch.float32) / 128).reshape(shape)


def encode(params: GenParams, cfg: NullStageConfig) -> Tensors:
    return {"embeds": _noise(params, "encoder", cfg.embed_shape)}


def _digest(t: torch.Tensor) -> str:
    """A digest of every byte of ``t``, in order."""
    return hashlib.blake2b(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
                           digest_size=8).hexdigest()


def denoise(params: GenParams, inputs: Tensors, cfg: NullStageConfig) -> Tensors:
    shape = (params.num_images, cfg.latent_channels, params.height // LATENT_FACTOR, params.width // LATENT_FACTOR)
    # Salting with a digest of the input's bytes makes the output depend on every bit that
    # arrived, in order, while keeping latents near N(0, 1) so decoded images are not saturated.
    return {"latents": _noise(params, f"denoiser\0{_digest(inputs['embeds'])}", shape)}


def decode(params: GenParams, inputs: Tensors) -> torch.Tensor:
    latents = inputs["latents"]
    # Three of the channels, mapped linearly onto 0-255 (a power of two, an addition, a
    # clamp, a product: correctly rounded IEEE operations, the same bits on every CPU).
    rgb = (latents[:, :3] / 8 + 0.5).clamp(0, 1).repeat_interleave(LATENT_FACTOR, 2).repeat_interleave(LATENT_FACTOR, 3)
    image = (rgb * 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    # The low bit of each pixel comes from a digest of every input byte, so a hand-off that
    # corrupts any of them (the fourth channel, a low mantissa bit) changes the image too.
    noise = torch.frombuffer(bytearray(_bytes(params, f"decoder\0{_digest(latents)}", image.numel())),
                             dtype=torch.uint8).reshape(image.shape)
    return (image & 0xFE) | (noise & 1)


def expected_outputs(params: GenParams, cfg: NullStageConfig) -> Tensors:
    """What the decoder must return for ``params``: the whole chain, computed locally."""
    return image_outputs(decode(params, denoise(params, encode(params, cfg), cfg)), params)


class _NullStage(Stage):
    def __init__(self, cfg: NullStageConfig) -> None:
        self._cfg = cfg

    def model_limits(self) -> StageLimits:
        return LIMITS

    def model_digest(self) -> str:
        # What shapes the tensors handed on, and the version of the functions that fill them
        # (2: SHAKE-256 noise); the times and test prompts may differ per worker.
        return digest_of(["null", 2, self._cfg.embed_shape, self._cfg.latent_channels])

    @staticmethod
    def _forward(ms: float, control: RunControl) -> None:
        control.check()
        time.sleep(ms / 1000)


class NullEncoder(_NullStage):
    role = "encoder"

    def run(self, params: GenParams, inputs: Tensors, *, control: RunControl = UNATTENDED) -> Tensors:
        self.check(params)
        self._forward(self._cfg.encoder_ms, control)
        return encode(params, self._cfg)


class NullDenoiser(_NullStage):
    role = "denoiser"

    def __init__(self, cfg: NullStageConfig, faults: FaultsConfig | None = None) -> None:
        super().__init__(cfg)
        self._faults = faults or FaultsConfig()

    def run(self, params: GenParams, inputs: Tensors, *, control: RunControl = UNATTENDED) -> Tensors:
        self.check(params)
        if self._faults.hang_prompt and self._faults.hang_prompt in params.prompt:
            threading.Event().wait()  # never set: only the worker's stage watchdog ends this
        for done in range(params.steps):
            control.step(done, params.steps)
            control.sleep(self._cfg.denoiser_ms / 1000 / params.steps)
        if self._faults.fail_prompt and self._faults.fail_prompt in params.prompt:
            raise StageError(f"null denoiser told to fail on prompt {params.prompt!r}")
        if self._faults.device_error_prompt and self._faults.device_error_prompt in params.prompt:
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (null denoiser, "
                                         f"told to on prompt {params.prompt!r})")
        if "embeds" not in inputs:
            raise StageError(f"denoiser input lacks 'embeds' (got {sorted(inputs)})")
        return denoise(params, inputs, self._cfg)


class NullDecoder(_NullStage):
    role = "decoder"

    def run(self, params: GenParams, inputs: Tensors, *, control: RunControl = UNATTENDED) -> Tensors:
        self.check(params)
        self._forward(self._cfg.decoder_ms, control)
        if "latents" not in inputs:
            raise StageError(f"decoder input lacks 'latents' (got {sorted(inputs)})")
        return image_outputs(decode(params, inputs), params)
