"""Null stages: deterministic, input-sensitive outputs; and the limits every stage checks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch

from orchestrator.config import FaultsConfig, LimitsConfig, ModelConfig, NullStageConfig
from orchestrator.limits import capped
from orchestrator.stages import build_stage
from orchestrator.stages.base import UNATTENDED, RunControl, StageError, StageStopped, limits_violation
from orchestrator.stages.images import decode_png
from orchestrator.stages.null import (
    LIMITS,
    NullDecoder,
    NullDenoiser,
    NullEncoder,
    decode,
    denoise,
    encode,
    expected_outputs,
)
from transfer.protocol import GenParams, Reason, StageLimits

# No simulated time, and small tensors: these tests are about values, not timing.
CFG = NullStageConfig(encoder_ms=0, denoiser_ms=0, decoder_ms=0, embed_shape=(1, 4, 8))
FAULTS = FaultsConfig(fail_prompt="please fail")


def params(**overrides: object) -> GenParams:
    return GenParams(**({"prompt": "a cat", "width": 16, "height": 24, "seed": 7} | overrides))


def chain(p: GenParams) -> dict[str, torch.Tensor]:
    return NullDecoder(CFG).run(p, NullDenoiser(CFG).run(p, NullEncoder(CFG).run(p, {})))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- determinism


def test_encoder_is_deterministic() -> None:
    assert same(encode(params(), CFG), encode(params(), CFG))


def test_whole_chain_is_deterministic() -> None:
    assert same(chain(params()), chain(params()))


def test_different_seeds_differ() -> None:
    assert not same(encode(params(seed=1), CFG), encode(params(seed=2), CFG))


def test_different_prompts_differ() -> None:
    assert not same(encode(params(prompt="a cat"), CFG), encode(params(prompt="a dog"), CFG))


def test_prompt_and_seed_do_not_blur_together() -> None:
    """("1", seed 23) and ("12", seed 3) must not share a generator."""
    assert not same(encode(params(prompt="1", seed=23), CFG), encode(params(prompt="12", seed=3), CFG))


def test_encoder_output_has_the_configured_shape() -> None:
    assert encode(params(), CFG)["embeds"].shape == (1, 4, 8)


def test_denoiser_output_shape_follows_the_request() -> None:
    p = params(num_images=2, width=32, height=16)
    latents = denoise(p, encode(p, CFG), CFG)["latents"]
    assert latents.shape == (2, CFG.latent_channels, 2, 4)


# --------------------------------------------------------------------------- hand-off mix-ups


def test_denoiser_output_changes_with_its_input() -> None:
    """Another request's embeds landing in this request's slot changes the result."""
    p = params()
    mine = denoise(p, encode(p, CFG), CFG)
    theirs = denoise(p, encode(params(seed=99), CFG), CFG)
    assert not same(mine, theirs)


def test_denoiser_output_changes_when_its_input_is_scrambled() -> None:
    """A hand-off that delivers the right values in the wrong order is a corruption too."""
    p = params()
    embeds = torch.arange(32, dtype=torch.float32).reshape(CFG.embed_shape)  # exact sums: no rounding luck
    scrambled = embeds.flatten().flip(0).reshape(CFG.embed_shape)
    assert not same(denoise(p, {"embeds": embeds}, CFG), denoise(p, {"embeds": scrambled}, CFG))


def test_final_images_differ_across_requests() -> None:
    """With the default config, eight seeds give eight different images.

    Otherwise a mix-up between two requests on the denoiser -> decoder hop returns bytes
    that still match ``expected_outputs`` and the end-to-end check cannot see it.
    """
    cfg = NullStageConfig()
    images = [expected_outputs(params(seed=seed, output="raw"), cfg)["images"] for seed in range(8)]
    clashes = [(i, j) for i in range(8) for j in range(i + 1, 8) if torch.equal(images[i], images[j])]
    assert clashes == []


def test_decoder_output_changes_with_its_input() -> None:
    p = params(output="raw")
    latents = denoise(p, encode(p, CFG), CFG)["latents"]
    assert not torch.equal(decode(p, {"latents": latents}), decode(p, {"latents": -latents}))


# --------------------------------------------------------------------------- expected outputs


@pytest.mark.parametrize("output", ["png", "raw"])
def test_expected_outputs_match_the_stage_chain(output: str) -> None:
    p = params(output=output, num_images=2)
    assert same(expected_outputs(p, CFG), chain(p))


# Golden digests of what each null stage returns for two fixed requests, computed once from the
# code at the time: they pin the null stages' bytes, which the comparison above cannot, as both
# its sides run the same functions. Clients and the e2e tests trust expected_outputs to be what
# workers computed, so a change to any of these bytes (a salt, the latent factor, the decoder's
# mapping or low bit) must be deliberate: then recompute them.
GOLDEN_CFG = NullStageConfig(encoder_ms=0, denoiser_ms=0, decoder_ms=0)
GOLDEN = [
    (GenParams(prompt="a cat", seed=7, width=64, height=48, output="raw"), {
        "embeds": ((1, 77, 64), "9ce991f8493fc368c32f77c8679f85ea"),
        "latents": ((1, 4, 6, 8), "e3c627a679c21ec3fb2ea3078c255c24"),
        "images": ((1, 48, 64, 3), "e660cbd3a54d33275f4061a716584368"),
    }),
    (GenParams(prompt="a red bicycle", seed=123456789, width=40, height=32, num_images=3, output="raw"), {
        "embeds": ((1, 77, 64), "22611f17cbd105d3053b3dc648c4410d"),
        "latents": ((3, 4, 4, 5), "fde32ce1c173b611d6aecb66d6d9cd64"),
        "images": ((3, 32, 40, 3), "d283a3a7e90fec3448426190b6d71f4d"),
    }),
]


def fingerprint(outputs: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor's shape and a digest of its bytes, in order."""
    return {name: (tuple(t.shape), hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest())
            for name, t in outputs.items()}


def golden_fingerprints() -> list[dict[str, tuple[tuple[int, ...], str]]]:
    found = []
    for p, _ in GOLDEN:
        embeds = NullEncoder(GOLDEN_CFG).run(p, {})
        latents = NullDenoiser(GOLDEN_CFG).run(p, embeds)
        found.append(fingerprint(embeds | latents | NullDecoder(GOLDEN_CFG).run(p, latents)))
        assert fingerprint(expected_outputs(p, GOLDEN_CFG)) == {"images": found[-1]["images"]}
    return found


def test_the_null_stages_bytes_match_their_golden_digests() -> None:
    assert golden_fingerprints() == [golden for _, golden in GOLDEN]


def test_a_cpu_without_vector_units_computes_the_same_bytes() -> None:
    """A client checks a worker's output by computing it again, maybe on another kind of CPU:
    torch's scalar kernels (ATEN_CPU_CAPABILITY=default) must give the bits its AVX2/AVX-512
    ones give. (torch's randn did not: its vectorised path has other low bits.)"""
    script = ("import json; from tests.unit.test_null_stages import golden_fingerprints; "
              "print(json.dumps(golden_fingerprints()))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"ATEN_CPU_CAPABILITY": "default"}, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    elsewhere = [{name: (tuple(shape), digest) for name, (shape, digest) in found.items()}
                 for found in json.loads(done.stdout)]
    assert elsewhere == [golden for _, golden in GOLDEN]


def test_png_outputs_decode_to_the_raw_images() -> None:
    raw = expected_outputs(params(output="raw", num_images=2), CFG)["images"]
    png = expected_outputs(params(output="png", num_images=2), CFG)
    assert sorted(png) == ["image_0.png", "image_1.png"]
    for i in range(2):
        assert (decode_png(png[f"image_{i}.png"]) == raw[i].numpy()).all()


def test_raw_output_is_uint8_nhwc() -> None:
    images = expected_outputs(params(output="raw", width=16, height=24), CFG)["images"]
    assert images.dtype == torch.uint8
    assert images.shape == (1, 24, 16, 3)


# --------------------------------------------------------------------------- failures


def test_fail_prompt_raises_stage_error() -> None:
    p = params(prompt="oh please fail now")
    with pytest.raises(StageError, match="told to fail") as info:
        NullDenoiser(CFG, FAULTS).run(p, encode(p, CFG))
    assert info.value.reason == Reason.STAGE_FAILED


def test_denoiser_without_embeds_raises_stage_error() -> None:
    with pytest.raises(StageError, match="embeds"):
        NullDenoiser(CFG).run(params(), {"latents": torch.zeros(1)})


def test_decoder_without_latents_raises_stage_error() -> None:
    with pytest.raises(StageError, match="latents"):
        NullDecoder(CFG).run(params(), {"embeds": torch.zeros(1)})


def test_encoder_refuses_params_outside_its_limits() -> None:
    with pytest.raises(StageError, match="width 12 is not a multiple of 8") as info:
        NullEncoder(CFG).run(params(width=12), {})
    assert info.value.reason == Reason.INVALID


def test_null_stages_report_the_null_limits() -> None:
    assert NullEncoder(CFG).limits() == LIMITS
    assert LIMITS.model == "null"


# --------------------------------------------------------------------------- limits


LIMITS_UNDER_TEST = StageLimits(size_multiple=8, min_size=16, max_size=64, max_steps=50, max_images=4,
                                max_frames=2, model="m", max_pixels=64 * 16 * 4 * 2)


def test_params_inside_the_limits_pass() -> None:
    assert limits_violation(LIMITS_UNDER_TEST, params(width=64, height=16, steps=50, num_images=4, frames=2)) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"width": 20}, "width 20 is not a multiple of 8 for model 'm'"),
        ({"height": 36}, "height 36 is not a multiple of 8 for model 'm'"),
        ({"width": 8}, "width 8 is outside [16, 64] for model 'm'"),
        ({"height": 72}, "height 72 is outside [16, 64] for model 'm'"),
        ({"steps": 51}, "steps 51 exceeds 50 for model 'm'"),
        ({"num_images": 5}, "num_images 5 exceeds 4 for model 'm'"),
        ({"frames": 3}, "frames 3 exceeds 2 for model 'm'"),
        ({"width": 64, "height": 64, "num_images": 2, "frames": 2},
         "width x height x frames x num_images = 16384 pixels exceeds 8192 for model 'm'"),
    ],
)
def test_limits_violation_names_the_problem(overrides: dict[str, int], message: str) -> None:
    assert limits_violation(LIMITS_UNDER_TEST, params(**({"width": 16, "height": 16} | overrides))) == message


# --------------------------------------------------------------------------- stopping


def test_the_denoiser_steps_and_stops_between_steps_and_the_others_check_before_starting() -> None:
    slow = NullStageConfig(encoder_ms=0, denoiser_ms=5000, decoder_ms=0, embed_shape=(1, 4, 8))
    seen: list[tuple[int, int]] = []
    control = RunControl(on_step=lambda done, total: seen.append((done, total)))
    timer = threading.Timer(0.3, control.stop)
    timer.start()
    started = time.monotonic()
    with pytest.raises(StageStopped):
        NullDenoiser(slow).run(params(steps=10), encode(params(), slow), control=control)
    assert time.monotonic() - started < 2.5  # of 5 s
    assert seen == [(i, 10) for i in range(len(seen))] and 1 <= len(seen) < 10  # 0.5 s a step
    timer.join()
    with pytest.raises(StageStopped):
        NullEncoder(slow).run(params(), {}, control=control)
    with pytest.raises(StageStopped):
        NullDecoder(slow).run(params(), {"latents": torch.zeros(1, 4, 3, 2)}, control=control)


def test_the_shared_unattended_control_cannot_be_stopped() -> None:
    with pytest.raises(RuntimeError, match="shared"):
        UNATTENDED.stop()
    UNATTENDED.step(0, 1)  # and so never stops anything


def test_the_operators_caps_lower_a_stages_limits_and_its_own_check_applies_them() -> None:
    caps = LimitsConfig(max_size=32, max_images=2, max_pixels=32 * 32)
    stage = build_stage("denoiser", ModelConfig(kind="null", limits=caps), torch_threads=1)
    limits = stage.limits()
    assert (limits.max_size, limits.max_images, limits.max_pixels) == (32, 2, 32 * 32)
    assert limits.max_steps == LIMITS.max_steps and limits.size_multiple == LIMITS.size_multiple  # 0: the model's
    with pytest.raises(StageError) as err:
        stage.run(params(width=64, height=32), {"embeds": torch.zeros(1, 4, 8)})
    assert err.value.reason is Reason.INVALID and "width 64 is outside [8, 32]" in str(err.value)
    # A cap above the model's limit leaves the model's.
    assert capped(LIMITS, LimitsConfig(max_size=1 << 20)).max_size == LIMITS.max_size
    # A cap between two sizes the model takes names the lower one: 100 admits 96 at most.
    assert capped(LIMITS, LimitsConfig(max_size=100)).max_size == 96
    # A step cap on a count the scheduler cannot run names the next one below that it can.
    gapped = msgspec.structs.replace(LIMITS, step_gaps=(61, 62, 103))
    assert capped(gapped, LimitsConfig(max_steps=62)).max_steps == 60
    assert capped(gapped, LimitsConfig(max_steps=64)).max_steps == 64


@pytest.mark.parametrize(("caps", "problem"), [
    (LimitsConfig(max_size=4), "max_size 4 is below the smallest size 8 model 'null' takes"),
    (LimitsConfig(max_pixels=63), "max_pixels 63 is below one 8x8 image of model 'null'"),
])
def test_caps_that_would_refuse_every_request_stop_the_worker_at_start(caps: LimitsConfig, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"[model.limits] leave nothing to admit: {problem}")):
        build_stage("encoder", ModelConfig(kind="null", limits=caps), torch_threads=1)


@pytest.mark.parametrize("where", ["the fourth channel's last byte", "a low mantissa bit"])
def test_the_null_decoder_shows_every_bit_it_received(where: str) -> None:
    """A hand-off that corrupts any byte must change the image the tests compare; before, the
    decoder read three channels of four and rounded away all but eight bits of each."""
    params = GenParams(prompt="p", width=16, height=16)
    latents = denoise(params, encode(params, CFG), CFG)["latents"]
    corrupted = latents.clone()
    raw = corrupted.reshape(-1).view(torch.uint8)
    raw[-1 if where.startswith("the fourth") else 0] ^= 1
    assert not torch.equal(decode(params, {"latents": corrupted}), decode(params, {"latents": latents}))
