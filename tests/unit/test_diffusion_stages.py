"""The diffusers stages, split three ways, against the monolithic pipeline: bitwise equal.

Each stage object is built on its own, as its worker process would build it, and every
hand-off goes tensor -> raw bytes -> tensor through ``transfer.frames``' staged-block layout.
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may download

import diffusers
import msgspec
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, UNet2DConditionModel
from PIL import Image

from orchestrator.config import DiffusersConfig
from orchestrator.stages.base import ModelUnloadable, RunControl, Stage, StageError, StageStopped, Tensors
from orchestrator.stages.diffusion import adapter_for, build_diffusion_stage, tiny
from orchestrator.stages.diffusion.reference import monolithic
from transfer.frames import layout, pack, unpack
from transfer.protocol import GenParams, Reason, Role

FAMILIES = ("sd15", "pixart")
THREADS = 1  # the reference pipeline must run at the workers' thread count


@pytest.fixture(autouse=True, scope="module")
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


_stages: dict[tuple[DiffusersConfig, Role], Stage] = {}


def stage(cfg: DiffusersConfig, role: Role, **kwargs) -> Stage:
    """One stage object per (config, role), shared by the tests of this module."""
    if kwargs:
        return build_diffusion_stage(role, cfg, THREADS, **kwargs)
    if (cfg, role) not in _stages:
        _stages[cfg, role] = build_diffusion_stage(role, cfg, THREADS)
    return _stages[cfg, role]


def round_trip(tensors: Tensors) -> Tensors:
    """Through raw bytes, as a Mooncake write into a registered pool would carry them."""
    specs, nbytes = layout(tensors)
    block = torch.zeros(nbytes, dtype=torch.uint8)
    return unpack(block, pack(block, tensors, specs))


def run_split(cfg: DiffusersConfig, params: GenParams) -> tuple[Tensors, Tensors, Tensors]:
    embeds = round_trip(stage(cfg, "encoder").run(params, {}))
    latents = round_trip(stage(cfg, "denoiser").run(params, embeds))
    return embeds, latents, stage(cfg, "decoder").run(params, latents)


def run_monolithic(family: str, weights_seed: int, params: GenParams, output_type: str):
    return monolithic(DiffusersConfig(family=family, seed=weights_seed), params, output_type)


CASES = {
    # weights seed, request: CFG with a negative prompt / no CFG, 2 images / non-square
    "cfg-64px": (0, GenParams(prompt="a red fox in snow", negative_prompt="blurry", steps=3, seed=0, output="raw")),
    "nocfg-2img-32px": (
        1,
        GenParams(prompt="a cat", width=32, height=32, steps=2, guidance=1.0, seed=1, num_images=2, output="raw"),
    ),
    "cfg-48x32": (2, GenParams(prompt="Lighthouse, dusk!", width=48, height=32, steps=4, guidance=7.5, seed=2,
                               output="raw")),
    # One step: PixArt's __call__ then returns the scheduler's predicted x0, not x_{t-1}.
    "cfg-1step": (0, GenParams(prompt="one step", width=32, height=32, steps=1, seed=3, output="raw")),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_equals_monolithic_bitwise(family: str, case: str) -> None:
    weights_seed, params = CASES[case]
    cfg = DiffusersConfig(family=family, seed=weights_seed)
    embeds, latents, out = run_split(cfg, params)

    assert ("negative_prompt_embeds" in embeds) == (params.guidance > 1)
    assert all(t.shape[0] == 1 for t in embeds.values()), "embeddings travel once, not per image"
    reference_latents = run_monolithic(family, weights_seed, params, "latent")
    assert torch.equal(latents["latents"], reference_latents)

    reference = np.stack([np.asarray(image) for image in run_monolithic(family, weights_seed, params, "pil")])
    assert out["images"].dtype == torch.uint8
    assert out["images"].shape == (params.num_images, params.height, params.width, 3)
    assert np.array_equal(out["images"].numpy(), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_png_decodes_to_raw_pixels(family: str) -> None:
    cfg = DiffusersConfig(family=family)
    params = GenParams(prompt="two images", width=32, height=32, steps=2, num_images=2, seed=5, output="png")
    _, latents, png = run_split(cfg, params)
    raw = stage(cfg, "decoder").run(msgspec.structs.replace(params, output="raw"), latents)["images"]

    assert sorted(png) == ["image_0.png", "image_1.png"]
    for i in range(2):
        blob = png[f"image_{i}.png"]
        assert blob.dtype == torch.uint8 and blob.dim() == 1
        with Image.open(io.BytesIO(blob.numpy().tobytes())) as image:
            assert image.format == "PNG"
            assert np.array_equal(np.asarray(image.convert("RGB")), raw[i].numpy())


@pytest.mark.parametrize("role", ["encoder", "denoiser", "decoder"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_size_is_invalid_before_compute(family: str, role: Role, monkeypatch: pytest.MonkeyPatch) -> None:
    s = stage(DiffusersConfig(family=family), role)
    assert s.limits().size_multiple == 8
    for method in ("encode", "denoise", "decode"):
        monkeypatch.setattr(s.adapter, method, lambda *a: pytest.fail("computed before checking"))
    with pytest.raises(StageError) as err:
        s.run(GenParams(prompt="x", width=60, height=64), {})
    assert err.value.reason is Reason.INVALID
    assert "width 60" in str(err.value)


@pytest.mark.parametrize(("family", "native"), [("sd15", 32 * 2), ("pixart", 8 * 2)])  # sample_size x VAE factor
def test_sizes_and_pixels_are_bounded_by_the_models_training_size(family: str, native: int) -> None:
    s = stage(DiffusersConfig(family=family), "denoiser")
    assert s.adapter.native_size() == native
    limits = s.limits()
    assert (limits.max_size, limits.max_pixels) == (4 * native, 16 * native * native)
    with pytest.raises(StageError) as err:
        s.run(GenParams(prompt="x", width=4 * native, height=4 * native, num_images=2), {})
    assert err.value.reason is Reason.INVALID and "pixels exceeds" in str(err.value)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_steps_admitted_stop_short_of_the_schedule_s_length(family: str) -> None:
    """All num_train_timesteps crash SD 1.x's offset schedule and turn multistep solvers' latents to NaN."""
    s = stage(DiffusersConfig(family=family), "denoiser")
    assert s.limits().max_steps == s.pipe.scheduler.config.num_train_timesteps - 1


def test_latents_that_are_not_finite_fail_the_decoder_instead_of_making_an_image() -> None:
    decoder = stage(DiffusersConfig(family="sd15"), "decoder")
    params = GenParams(prompt="x", width=64, height=64, output="raw")
    with pytest.raises(StageError, match="not finite"):
        decoder.run(params, {"latents": torch.full((1, 4, 32, 32), float("nan"))})


@pytest.mark.parametrize("family", FAMILIES)
def test_fail_marker_fails_mid_loop(family: str) -> None:
    cfg = DiffusersConfig(family=family)
    denoiser = stage(cfg, "denoiser", fail_marker="@@fail@@")
    model = denoiser.pipe.unet if family == "sd15" else denoiser.pipe.transformer
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    params = GenParams(prompt="boom @@fail@@", width=32, height=32, steps=4)
    embeds = stage(cfg, "encoder").run(params, {})

    with pytest.raises(StageError) as err:
        denoiser.run(params, embeds)
    assert err.value.reason is Reason.STAGE_FAILED
    assert len(forwards) == 1, "step 0 ran, step 1 failed"
    assert denoiser.run(msgspec.structs.replace(params, prompt="fine"), embeds)["latents"].shape == (1, 4, 16, 16)


class StopAtCheck(RunControl):
    """Asks to stop at its ``at``-th check: a stop arriving mid-loop, without any timing."""

    def __init__(self, at: int) -> None:
        super().__init__(on_step=lambda done, total: self.steps.append((done, total)))
        self.checks, self._at = 0, at
        self.steps: list[tuple[int, int]] = []

    def check(self) -> None:
        self.checks += 1
        if self.checks == self._at:
            self.stop()
        super().check()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_denoising_loop_reports_each_step_and_stops_before_the_next(family: str) -> None:
    cfg = DiffusersConfig(family=family)
    denoiser = stage(cfg, "denoiser")
    model = denoiser.pipe.unet if family == "sd15" else denoiser.pipe.transformer
    forwards = []
    model.register_forward_hook(lambda *a: forwards.append(1))
    params = GenParams(prompt="stop me", width=32, height=32, steps=10)
    embeds = stage(cfg, "encoder").run(params, {})

    control = StopAtCheck(at=4)  # the check before the run, then before steps 0, 1 and 2
    with pytest.raises(StageStopped):
        denoiser.run(params, embeds, control=control)
    assert (control.checks, len(forwards)) == (4, 2), "steps 0 and 1 ran; step 2 stopped before its forward"
    assert control.steps == [(0, 10), (1, 10)]  # each step reported before it ran


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Heun's set_timesteps trips numpy's
def test_steps_are_reported_in_the_steps_asked_for_with_a_second_order_scheduler(tmp_path) -> None:
    """Heun runs 2n-1 timesteps for n steps: the client asked for n and hears of n, each
    count once reached, never of 2n-1 (which read as "step 7 of 5")."""
    pipe = tiny.build_pipeline("sd15", seed=0)
    pipe.scheduler = diffusers.HeunDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.save_pretrained(tmp_path)
    cfg = DiffusersConfig(family="sd15", path=str(tmp_path))
    params = GenParams(prompt="x", width=16, height=16, steps=5)
    control = StopAtCheck(at=0)  # never stops: only records the steps
    stage(cfg, "denoiser").run(params, stage(cfg, "encoder").run(params, {}), control=control)
    assert len(control.steps) == 9, "one report per timestep, 2n-1 of them"
    assert sorted(set(control.steps)) == [(done, 5) for done in range(5)]
    assert control.steps == sorted(control.steps)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_stage_loads_only_its_components(family: str) -> None:
    cfg = DiffusersConfig(family=family)
    held = {role: stage(cfg, role).components for role in ("encoder", "denoiser", "decoder")}
    denoiser_model = "unet" if family == "sd15" else "transformer"

    assert set(held["encoder"]) == {"tokenizer", "text_encoder"}
    assert set(held["denoiser"]) == {denoiser_model, "scheduler"}
    assert set(held["decoder"]) == {"vae"}
    encoder_modules = [type(m) for m in held["encoder"]["text_encoder"].modules()]
    assert not any(issubclass(t, AutoencoderKL | UNet2DConditionModel) for t in encoder_modules)
    # The denoiser sizes latents from the VAE's config, never from a loaded VAE.
    assert stage(cfg, "denoiser").pipe.vae_scale_factor == 2


def test_missing_input_tensor_is_a_stage_error() -> None:
    with pytest.raises(StageError, match="negative_prompt_embeds"):
        stage(DiffusersConfig(), "denoiser").run(GenParams(prompt="x"), {"prompt_embeds": torch.zeros(1, 77, 8)})


@pytest.mark.parametrize("family", FAMILIES)
def test_local_directory_loads_the_same_model(family: str, tmp_path) -> None:
    """The real-weights path (``from_pretrained`` of each role's subfolders) on a saved tiny model."""
    tiny.build_pipeline(family, seed=4).save_pretrained(tmp_path)
    params = GenParams(prompt="saved and loaded", width=32, height=32, steps=2, seed=3, output="raw")
    loaded = run_split(DiffusersConfig(family=family, path=str(tmp_path)), params)[2]["images"]
    built = run_split(DiffusersConfig(family=family, seed=4), params)[2]["images"]
    assert torch.equal(loaded, built)
    limits = build_diffusion_stage("encoder", DiffusersConfig(family=family, path=str(tmp_path))).limits()
    assert limits.model == f"{family}:{tmp_path.name}" and limits.size_multiple == 8


@pytest.mark.parametrize(("scheduler", "fewest"), [("DDIMScheduler", 1), ("DPMSolverMultistepScheduler", 2)])
def test_pixart_takes_one_step_only_with_a_scheduler_that_predicts_x0(tmp_path, scheduler: str, fewest: int) -> None:
    """For a single step PixArt's __call__ takes the step's predicted x0, which DPM-Solver
    does not return: one step is refused up front (invalid), not a crash mid-request."""
    pipe = tiny.build_pipeline("pixart", seed=0)
    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config)
    pipe.save_pretrained(tmp_path)
    s = stage(DiffusersConfig(family="pixart", path=str(tmp_path)), "denoiser")
    assert s.limits().min_steps == fewest
    one_step = GenParams(prompt="x", width=16, height=16, steps=1)
    if fewest > 1:
        with pytest.raises(StageError, match="steps 1 is below 2") as err:
            s.check(one_step)
        assert err.value.reason is Reason.INVALID
    else:
        s.check(one_step)
    assert stage(DiffusersConfig(family="sd15"), "denoiser").limits().min_steps == 1


# Trained on 100 timesteps, not SD's 1,000: the edges run end to end in a tenth of the time.
@pytest.mark.parametrize(("scheduler", "config", "steps"), [
    ("LCMScheduler", {"original_inference_steps": 50}, (1, 50)),
    ("PNDMScheduler", {"skip_prk_steps": False, "num_train_timesteps": 100}, (4, 99)),
    # SD 1.x's offset, leading schedule: 99 steps would start at timestep 100, past the
    # trained ones (NaN: as 999 of SD's 1,000). Its set_timesteps trips a numpy deprecation
    # (silent outside tests: Python's default filter).
    pytest.param("DPMSolverMultistepScheduler",
                 {"steps_offset": 1, "timestep_spacing": "leading", "num_train_timesteps": 100}, (1, 98),
                 marks=pytest.mark.filterwarnings("ignore::DeprecationWarning")),
])
def test_steps_are_bounded_by_what_the_scheduler_takes(tmp_path, scheduler: str, config: dict,
                                                       steps: tuple[int, int]) -> None:
    """A count the scheduler sets no timesteps for (past an LCM scheduler's original steps,
    under PNDM's Runge-Kutta warm-up), or sets some past the trained ones for, is refused at
    the door as invalid, by every role's limits, not failed mid-request by the denoiser
    (stage_failed)."""
    pipe = tiny.build_pipeline("sd15", seed=0)
    pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config, **config)
    pipe.save_pretrained(tmp_path)
    cfg = DiffusersConfig(family="sd15", path=str(tmp_path))
    denoiser = stage(cfg, "denoiser")
    for role in ("encoder", "denoiser", "decoder"):
        limits = stage(cfg, role).limits()
        assert (limits.min_steps, limits.max_steps) == steps, role
    fewest, most = steps
    for outside in (fewest - 1, most + 1):
        if outside >= 1:
            with pytest.raises(StageError) as err:
                denoiser.check(GenParams(prompt="x", width=16, height=16, steps=outside))
            assert err.value.reason is Reason.INVALID
    for edge in (fewest, most):  # the edges it admits run
        images = run_split(cfg, GenParams(prompt="x", width=16, height=16, steps=edge, output="raw"))[2]["images"]
        assert images.shape == (1, 16, 16, 3)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the fix-up's deprecation notice, as the denoiser loads
def test_limits_are_those_of_the_scheduler_as_the_pipeline_fixes_it_up(tmp_path) -> None:
    """SD's pipeline sets an outdated steps_offset 0 to 1, and with it 999 "leading" steps
    would start at timestep 1000 (NaN with DPM-Solver++): the limits read the raw config and
    admitted 999, which the denoiser ran to the end and failed (stage_failed; an audit)."""
    pipe = tiny.build_pipeline("sd15", seed=0)
    pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, steps_offset=0,
                                                                        timestep_spacing="leading")
    pipe.save_pretrained(tmp_path)
    cfg = DiffusersConfig(family="sd15", path=str(tmp_path))
    assert stage(cfg, "denoiser").pipe.scheduler.config.steps_offset == 1
    assert stage(cfg, "encoder").limits().max_steps == 998


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # UniPC's set_timesteps trips numpy's (as above)
def test_counts_whose_timesteps_leave_the_trained_ones_are_refused_between_those_taken(tmp_path) -> None:
    """With "trailing" spacing diffusers gives 62 counts from 61 up one timestep too many,
    -1, and UniPC returns NaN for about half of them (926 among them): the limits assumed
    the counts taken were one run, admitted every one, and the request failed after its
    whole denoise (stage_failed; an audit). The counts around a gap run."""
    pipe = tiny.build_pipeline("sd15", seed=0)
    pipe.scheduler = diffusers.UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                                   timestep_spacing="trailing")
    pipe.save_pretrained(tmp_path)
    cfg = DiffusersConfig(family="sd15", path=str(tmp_path))
    denoiser = stage(cfg, "denoiser")
    limits = denoiser.limits()
    assert (limits.min_steps, limits.max_steps) == (1, 999)
    assert {61, 926} <= set(limits.step_gaps) and 60 not in limits.step_gaps and 62 not in limits.step_gaps
    with pytest.raises(StageError, match="steps 61 is a count the scheduler of model .* cannot run .*: 60 or 62 can") \
            as err:
        denoiser.check(GenParams(prompt="x", width=16, height=16, steps=61))
    assert err.value.reason is Reason.INVALID
    images = run_split(cfg, GenParams(prompt="x", width=16, height=16, steps=62, output="raw"))[2]["images"]
    assert images.shape == (1, 16, 16, 3)


def test_a_scheduler_whose_library_is_missing_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' placeholder for a scheduler whose library is not installed (LMS without
    scipy) raises ImportError when built: every role's limits build it."""
    def missing(*args, **kwargs):
        raise ImportError("DDIMScheduler requires the scipy library but it was not found in your environment")

    monkeypatch.setattr(diffusers.DDIMScheduler, "from_config", missing)
    with pytest.raises(ModelUnloadable, match="the model's scheduler DDIMScheduler cannot be built here: .*scipy"):
        adapter_for(DiffusersConfig(family="sd15")).limits()


def test_a_component_whose_library_is_missing_is_named_in_one_line(saved_sd15: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args, **kwargs):
        raise ImportError("LMSDiscreteScheduler requires the scipy library")

    monkeypatch.setattr(diffusers.StableDiffusionPipeline, "from_pretrained", missing)
    with pytest.raises(ModelUnloadable, match="the denoiser's components do not load: .*scipy"):
        build_diffusion_stage("denoiser", DiffusersConfig(family="sd15", path=str(saved_sd15)))


def test_tiny_components_build_alone_identically() -> None:
    """A process building only the UNet gets the UNet the whole pipeline has."""
    alone = tiny.build_component("sd15", "unet", seed=9)
    whole = tiny.build_pipeline("sd15", seed=9).unet
    for (name, a), (_, b) in zip(alone.state_dict().items(), whole.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_digest_is_one_per_model_whatever_the_role_or_directory(family: str, tmp_path) -> None:
    """What the daemon compares across workers: every role of one model gives one digest,
    wherever the model sits; another tiny seed or an edited config gives another."""
    one, other = tmp_path / "one", tmp_path / "other"
    tiny.build_pipeline(family, seed=4).save_pretrained(one)
    # Loaded and saved again, as a copy often is: diffusers then stamps in where it came from.
    DiffusionPipeline.from_pretrained(one).save_pretrained(other)
    assert '"_name_or_path"' in (other / "vae" / "config.json").read_text()
    digests = {build_diffusion_stage(role, DiffusersConfig(family=family, path=str(directory))).model_digest()
               for role in ("encoder", "denoiser", "decoder") for directory in (one, other)}
    assert len(digests) == 1
    vae_config = other / "vae" / "config.json"
    vae_config.write_text(vae_config.read_text().replace('"latent_channels": 4', '"latent_channels": 8'))
    assert adapter_for(DiffusersConfig(family=family, path=str(other))).digest() not in digests
    assert len({adapter_for(DiffusersConfig(family=family, seed=seed)).digest() for seed in (0, 1)}) == 2


@pytest.fixture(scope="module")
def saved_sd15(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "sd15"
    tiny.build_pipeline("sd15", seed=4).save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("role", "change", "says"), [
    ("decoder", {"path": "no/such/dir"}, "model path 'no/such/dir' is not a directory (a relative path is taken from"),
    ("decoder", {"path": "/no/such/dir"}, "model path '/no/such/dir' is not a directory$"),  # no hint: not relative
    ("denoiser", {"family": "pixart"}, "holds a StableDiffusionPipeline, but family = 'pixart' loads a PixArtAlpha"),
    ("decoder", {"rm": "vae"}, "lacks vae/config.json: every role needs every component's config"),
    ("decoder", {"rm": "text_encoder"}, "lacks text_encoder/config.json"),
    ("encoder", {"rm": "tokenizer"}, "lacks tokenizer/, which the encoder loads"),
    ("encoder", {"rm": "tokenizer/tokenizer.json"},  # what is left loads, with no vocabulary
     "lacks tokenizer/vocab.json, tokenizer/merges.txt (or tokenizer/tokenizer.json): its CLIPTokenizer would have "
     "no vocabulary"),
    ("encoder", {"rm": "model_index.json"}, "has no model_index.json: not a diffusers-layout directory"),
    ("encoder", {"device": "banana"}, "device 'banana' is not a torch device"),
    ("encoder", {"device": "cuda:7"}, "device 'cuda:7', but this machine's torch sees"),
    ("encoder", {"device": "mps"}, "device 'mps' is not usable by this machine's torch"),
    ("decoder", {"device": "hpu"}, "device 'hpu' is not usable by this machine's torch: ModuleNotFoundError"),
    ("denoiser", {"device": "meta"}, "device 'meta' holds no data"),
    ("denoiser", {"rm": "unet/diffusion_pytorch_model.safetensors"}, "the denoiser's components do not load"),
    ("decoder", {"garble": "model_index.json"}, "model_index.json is not readable JSON"),
])
def test_a_model_that_cannot_load_is_named_in_one_line(saved_sd15: Path, tmp_path: Path, role: Role,
                                                        change: dict[str, str], says: str) -> None:
    """Said before diffusers is asked, which would say something about a config.json of an
    unnamed part, or advise fetching from the Hub."""
    directory = tmp_path / "copy"
    shutil.copytree(saved_sd15, directory)
    removed = directory / change.pop("rm", "nothing")
    if removed.is_dir():
        shutil.rmtree(removed)
    elif removed.exists():
        removed.unlink()
    if "garble" in change:
        (directory / change.pop("garble")).write_text("{not json")
    cfg = DiffusersConfig(**{"family": "sd15", "path": str(directory), **change})
    with pytest.raises(ModelUnloadable, match=re.escape(says.removesuffix("$")) + "$" * says.endswith("$")):
        build_diffusion_stage(role, cfg)
