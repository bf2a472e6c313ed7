"""Real diffusion stages: a diffusers pipeline split into encoder, denoiser and decoder.

``build_diffusion_stage(role, cfg, torch_threads)`` is the one entry point the worker needs.
With ``cfg.path`` empty it builds the embedded tiny pipeline of ``cfg.family`` (random
seeded weights, no download); otherwise it loads that role's subfolders of a local
diffusers-layout directory.
"""

from __future__ import annotations

from orchestrator.config import DiffusersConfig
from orchestrator.stages.base import Stage
from orchestrator.stages.diffusion.families import FamilyAdapter
from orchestrator.stages.diffusion.pixart import PixArt
from orchestrator.stages.diffusion.sd15 import SD15
from orchestrator.stages.diffusion.stages import DiffusionDecoder, DiffusionDenoiser, DiffusionEncoder, DiffusionStage
from transfer.protocol import Role

FAMILIES: dict[str, type[FamilyAdapter]] = {cls.name: cls for cls in (SD15, PixArt)}

__all__ = [
    "FAMILIES",
    "DiffusionDecoder",
    "DiffusionDenoiser",
    "DiffusionEncoder",
    "DiffusionStage",
    "FamilyAdapter",
    "adapter_for",
    "build_diffusion_stage",
]


def adapter_for(cfg: DiffusersConfig) -> FamilyAdapter:
    try:
        return FAMILIES[cfg.family](cfg)
    except KeyError:
        raise ValueError(f"unknown diffusers family {cfg.family!r}; known: {sorted(FAMILIES)}") from None


def build_diffusion_stage(role: Role, cfg: DiffusersConfig, torch_threads: int = 1, *, fail_marker: str = "") -> Stage:
    """Load ``role``'s components of ``cfg``'s model (only those) as a ``Stage``."""
    adapter = adapter_for(cfg)
    match role:
        case "encoder":
            return DiffusionEncoder(adapter, torch_threads)
        case "denoiser":
            return DiffusionDenoiser(adapter, torch_threads, fail_marker=fail_marker)
        case "decoder":
            return DiffusionDecoder(adapter, torch_threads)
    raise ValueError(f"unknown role {role!r}")
