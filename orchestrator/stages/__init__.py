"""Stages: the compute a worker runs. ``build_stage`` picks one from the config."""

from __future__ import annotations

from orchestrator.config import ModelConfig
from orchestrator.limits import UnsatisfiableLimits, unsatisfiable
from orchestrator.stages.base import UNATTENDED, RunControl, Stage, StageError, StageStopped, Tensors
from transfer.protocol import Role

__all__ = ["UNATTENDED", "RunControl", "Stage", "StageError", "StageStopped", "Tensors", "build_stage"]


def build_stage(role: Role, model: ModelConfig, *, torch_threads: int) -> Stage:
    """Load only what ``role`` needs of the configured model, under the operator's caps."""
    stage: Stage
    if model.kind == "null":
        from orchestrator.stages import null

        if role == "denoiser":
            stage = null.NullDenoiser(model.null, model.faults)  # the one that injects faults
        else:
            stage = {"encoder": null.NullEncoder, "decoder": null.NullDecoder}[role](model.null)
    else:
        # Imported here so null-stage workers and the daemon never pay for diffusers' import.
        from orchestrator.stages.diffusion import build_diffusion_stage

        stage = build_diffusion_stage(role, model.diffusers, torch_threads, fail_marker=model.faults.fail_prompt)
    stage.caps = model.limits
    problem = unsatisfiable(stage.limits())
    if problem:
        raise UnsatisfiableLimits(f"[model.limits] leave nothing to admit: {problem}")
    return stage
