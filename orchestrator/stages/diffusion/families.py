"""What every diffusers family shares; a family adapter adds its encode and denoise loop.

A family is one diffusers pipeline class split three ways. Each role builds a *partial*
pipeline: the family's own pipeline class with only that role's components and ``None``
for the rest. Building it through the class's ``__init__`` applies the same fix-ups the
monolithic pipeline applies (SD rewrites an outdated scheduler config), and lets the
encoder call the pipeline's own ``encode_prompt``, so its defaults are ``__call__``'s.

Adding a family = subclassing ``FamilyAdapter``: name its pipeline class, the components
each role needs, ``encode`` and ``denoise``. The denoise loop is written out, not
delegated to ``__call__``, so it can take one scheduler per request and stop at any step.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import warnings
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import torch
import transformers
from diffusers import DiffusionPipeline
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

from orchestrator.config import DiffusersConfig
from orchestrator.stages.base import ModelUnloadable, StageError, StepFn, Tensors, digest_of
from orchestrator.stages.diffusion import tiny
from transfer.protocol import GenParams, Role, StageLimits

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _quiet_libraries() -> None:
    """Keep diffusers and transformers to errors, without progress bars.

    Loading otherwise prints tqdm bars and advice on stderr, which in a worker carries the
    structured log. Process-wide, which is what a worker process wants.
    """
    for library in (diffusers, transformers):
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()


def _architecture(config: dict[str, Any]) -> dict[str, Any]:
    """A config without what saving it stamps in: the library versions, and the directory
    it was loaded from (``_name_or_path``, written when a loaded model is saved again)."""
    return {key: value for key, value in config.items()
            if not key.startswith("_") and key != "transformers_version"}


class FamilyAdapter:
    """One family's knowledge: components per role, loading, encode, denoise, decode."""

    name: ClassVar[str]
    pipeline_cls: ClassVar[type[DiffusionPipeline]]
    denoiser_model: ClassVar[str]  # the component the denoise loop runs: "unet", "transformer"
    components: ClassVar[dict[Role, tuple[str, ...]]]
    # Constructor arguments that are not components (SD's safety-checker switch).
    pipeline_kwargs: ClassVar[dict[str, Any]] = {}
    # Tensors the denoiser needs from the encoder; negatives only when CFG is on.
    denoiser_inputs: ClassVar[tuple[str, ...]]

    def __init__(self, cfg: DiffusersConfig) -> None:
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        try:
            self.device = torch.device(cfg.device)
        except RuntimeError:
            raise ModelUnloadable(f"device {cfg.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
        self._configs: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ configs, limits

    def config(self, name: str) -> dict[str, Any]:
        """A component's config, read without loading its weights."""
        if name not in self._configs:
            if self.cfg.path:
                filename = "scheduler_config.json" if name == "scheduler" else "config.json"
                self._configs[name] = json.loads((Path(self.cfg.path) / name / filename).read_text())
            else:
                self._configs[name] = tiny.tiny_config(self.name, name)
        return self._configs[name]

    @property
    def vae_scale_factor(self) -> int:
        # The pipelines' own formula; without a VAE they would silently assume 8.
        return 2 ** (len(self.config("vae")["block_out_channels"]) - 1)

    def size_multiple(self) -> int:
        # Both pipelines' check_inputs demand multiples of 8 whatever the VAE.
        return math.lcm(8, self.vae_scale_factor)

    def native_size(self) -> int:
        """The width and height the denoiser was trained at, in pixels."""
        return self.config(self.denoiser_model)["sample_size"] * self.vae_scale_factor

    def min_steps(self) -> int:
        """The fewest denoising steps the pipeline's loop runs with its scheduler, whatever
        the scheduler itself takes (``step_range``)."""
        return 1

    def scheduler_class(self) -> type[SchedulerMixin] | None:
        """The scheduler class the model names (None: one this diffusers lacks)."""
        name = self.config("scheduler").get("_class_name")
        return getattr(diffusers, name, None) if name else tiny.SCHEDULER

    def step_range(self) -> tuple[int, int, tuple[int, ...]]:
        """The fewest and most steps a request may ask for, and the counts between them it may
        not, as the scheduler the pipeline runs (its config fixed up by the pipeline class:
        SD sets ``steps_offset`` 1) sets timesteps for them. An LCM scheduler takes at most
        its ``original_inference_steps``, PNDM with its Runge-Kutta warm-up at least 4: past
        them ``set_timesteps`` raises mid-request, which must be refused up front instead
        (``invalid``). Nor a count whose timesteps leave the trained ones: with SD 1.x's
        offset "leading" spacing, DPM-Solver++, UniPC and DEIS start 999 steps at timestep
        1000 and return NaN there; with "trailing" spacing, 62 counts from 61 up get one
        timestep too many, -1 (a rounding error in diffusers), and UniPC and DEIS return NaN
        for about half of them. Every count is tried: those taken need not be one run."""
        fewest, most = self.min_steps(), self.config("scheduler").get("num_train_timesteps", 1000) - 1
        cls = self.scheduler_class()
        if cls is None:
            return fewest, most, ()
        scheduler = self._pipeline_scheduler(cls)

        def takes(steps: int) -> bool:
            # What it warns of (numpy deprecations) is no refusal, even where warnings raise.
            with warnings.catch_warnings(action="ignore"):
                try:
                    scheduler.set_timesteps(steps)
                except Exception:  # whatever it raises, the count is one it cannot run
                    return False
            trained = getattr(scheduler, "alphas_cumprod", None)  # flow matching has none
            timesteps = scheduler.timesteps
            return trained is None or 0 <= int(timesteps.min()) and int(timesteps.max()) < len(trained)

        taken = [steps for steps in range(fewest, most + 1) if takes(steps)]  # ~0.1 s for 999
        if not taken:
            raise ModelUnloadable(f"the scheduler {cls.__name__} sets timesteps for no step count from "
                                  f"{fewest} to {most}")
        return taken[0], taken[-1], tuple(sorted(set(range(taken[0], taken[-1] + 1)).difference(taken)))

    def _pipeline_scheduler(self, cls: type[SchedulerMixin]) -> SchedulerMixin:
        """The model's scheduler as the pipeline runs it: built through the pipeline class's
        ``__init__`` (every other component None), which fixes up an outdated config."""
        try:
            scheduler = cls.from_config(self.config("scheduler"))
        except ImportError as exc:  # every role's limits need it, and the denoiser runs it
            raise ModelUnloadable(f"the model's scheduler {cls.__name__} cannot be built here: {exc}") from None
        with warnings.catch_warnings(action="ignore"):  # the fix-up's deprecation notice
            return self.pipeline_cls(scheduler=scheduler, **self._absent(("scheduler",)),
                                     **self.pipeline_kwargs).scheduler

    def _absent(self, wanted: tuple[str, ...]) -> dict[str, None]:
        """The pipeline class's components other than ``wanted``, as None: a partial pipeline."""
        names = [p for p in inspect.signature(self.pipeline_cls.__init__).parameters if p != "self"]
        return {n: None for n in names if n not in wanted and n not in self.pipeline_kwargs}

    def limits(self) -> StageLimits:
        multiple = self.size_multiple()
        model = f"{self.name}:{Path(self.cfg.path).name}" if self.cfg.path else f"tiny-{self.name}"
        # Past a few times its training size a model tiles and repeats itself, while its
        # cost grows with the area (attention with its square): 4x per side at most, and
        # at most the pixels of 16 images at the training size in one request.
        native = self.native_size()
        min_steps, max_steps, step_gaps = self.step_range()
        return StageLimits(
            size_multiple=multiple,
            min_size=multiple,
            max_size=4 * native // multiple * multiple,
            max_pixels=16 * native * native,
            max_steps=max_steps,
            min_steps=min_steps,
            step_gaps=step_gaps,
            max_frames=1,
            model=model,
        )

    def digest(self) -> str:
        """What the roles must agree on: every component's config (each role's machine has
        them all, see docs/models.md) and, for the tiny model, the seed of its weights. Not
        the path: one model may sit in different directories on different hosts. Weights
        are not read (a role holds only its own), so two checkpoints of one architecture,
        a model and its fine-tune, give the same digest."""
        configs = {name: _architecture(self.config(name))
                   for name in ("text_encoder", self.denoiser_model, "vae", "scheduler")}
        return digest_of([self.name, configs, None if self.cfg.path else self.cfg.seed])

    def uses_cfg(self, params: GenParams) -> bool:
        """Classifier-free guidance, decided as ``__call__`` decides it."""
        return params.guidance > 1.0

    # ------------------------------------------------------------------ loading

    def check_source(self, role: Role) -> None:
        """Raise ``ModelUnloadable`` naming the first thing ``role`` would fail to load. What
        diffusers says instead (a traceback about a config.json of an unnamed component, or
        advice to fetch from the Hub) does not tell an operator which setting is wrong."""
        if self.device.type == "cuda":
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (self.device.index or 0) >= gpus:
                raise ModelUnloadable(f"device {self.cfg.device!r}, but this machine's torch sees {gpus} CUDA devices")
        if self.device.type == "meta":
            raise ModelUnloadable(f"device {self.cfg.device!r} holds no data: a model there computes nothing")
        try:
            torch.empty(0, device=self.device)  # any other device this torch lacks (mps, xpu, hpu...)
        except Exception as exc:  # RuntimeError, AssertionError, ModuleNotFoundError (hpu): each its own
            raise ModelUnloadable(f"device {self.cfg.device!r} is not usable by this machine's torch: "
                                  f"{type(exc).__name__}: {exc}") from None
        if not self.cfg.path:
            return  # the embedded tiny model: nothing to find
        root = Path(self.cfg.path)
        if not root.is_dir():
            relative = "" if root.is_absolute() else f" (a relative path is taken from the worker's working " \
                                                       f"directory, {Path.cwd()})"
            raise ModelUnloadable(f"model path {str(root)!r} is not a directory{relative}")
        index = root / "model_index.json"
        if not index.is_file():
            raise ModelUnloadable(f"{root} has no model_index.json: not a diffusers-layout directory")
        try:
            parts = json.loads(index.read_text())
        except ValueError as exc:
            raise ModelUnloadable(f"{index} is not readable JSON: {exc}") from None
        held = parts.get("_class_name")
        if held != self.pipeline_cls.__name__:
            raise ModelUnloadable(f"{root} holds a {held}, but family = {self.name!r} loads a "
                                  f"{self.pipeline_cls.__name__}")
        # Every role reads every component's config (limits, latent sizes, the model digest).
        for name in ("text_encoder", self.denoiser_model, "vae", "scheduler"):
            config = root / name / ("scheduler_config.json" if name == "scheduler" else "config.json")
            if not config.is_file():
                raise ModelUnloadable(f"{root} lacks {name}/{config.name}: every role needs every component's config")
        for name in self.components[role]:
            if not (root / name).is_dir():
                raise ModelUnloadable(f"{root} lacks {name}/, which the {role} loads")
        if "tokenizer" in self.components[role]:
            _check_tokenizer_files(root, parts.get("tokenizer"))

    def load(self, role: Role) -> DiffusionPipeline:
        """A partial pipeline holding only ``role``'s components, on the configured device."""
        self.check_source(role)
        _quiet_libraries()
        wanted = self.components[role]
        absent = self._absent(wanted)
        if self.cfg.path:
            try:
                pipe = self.pipeline_cls.from_pretrained(
                    self.cfg.path, **absent, **self.pipeline_kwargs, dtype=self.dtype
                )
            # A part's weights missing or unreadable, say; or a class whose library is not
            # installed (diffusers' placeholder raises ImportError: LMS without scipy).
            except (OSError, ValueError, ImportError) as exc:
                raise ModelUnloadable(f"{self.cfg.path}: the {role}'s components do not load: {exc}") from None
        else:
            built = {n: tiny.build_component(self.name, n, self.cfg.seed, self.dtype) for n in wanted}
            pipe = self.pipeline_cls(**built, **absent, **self.pipeline_kwargs)
        pipe.to(self.device)
        pipe.set_progress_bar_config(disable=True)
        # Without a VAE, __init__ falls back to 8: latents would get the wrong size.
        pipe.vae_scale_factor = self.vae_scale_factor
        return pipe

    # ------------------------------------------------------------------ the three stages

    def encode(self, pipe: DiffusionPipeline, params: GenParams) -> Tensors:
        """Prompt embeddings for one image; the denoiser repeats them per image."""
        raise NotImplementedError

    def denoise(self, pipe: DiffusionPipeline, params: GenParams, inputs: Tensors, on_step: StepFn) -> torch.Tensor:
        """Latents equal to ``pipe(..., output_type="latent")`` for the same request."""
        raise NotImplementedError

    def decode(self, pipe: DiffusionPipeline, latents: torch.Tensor) -> torch.Tensor:
        """uint8 images (N, H, W, 3), equal to ``pipe(..., output_type="pil")``'s pixels."""
        vae = pipe.vae
        latents = latents.to(self.device, vae.dtype)
        if not torch.isfinite(latents).all():
            raise StageError("the latents are not finite (NaN or inf): no image to make of them")
        image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
        array = pipe.image_processor.postprocess(image, output_type="np")
        # VaeImageProcessor.numpy_to_pil's own rounding, so "raw" equals the PIL path.
        return torch.from_numpy((array * 255).round().astype("uint8"))

    # ------------------------------------------------------------------ shared helpers

    def request_embeds(self, pipe: DiffusionPipeline, params: GenParams, inputs: Tensors, name: str) -> torch.Tensor:
        """``inputs[name]`` on the device, repeated per image as ``encode_prompt`` does.

        Embeddings take the denoiser's dtype *before* the noise is drawn: the pipeline draws
        noise in the embeddings' dtype, and fp16 noise cast to fp32 is different noise.
        """
        model = getattr(pipe, self.denoiser_model)
        t = inputs[name].to(self.device)
        if t.is_floating_point():
            t = t.to(model.dtype)
        return t.repeat(params.num_images, *([1] * (t.dim() - 1)))

    def start(
        self, pipe: DiffusionPipeline, params: GenParams, dtype: torch.dtype, channels: int
    ) -> tuple[SchedulerMixin, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """This request's own scheduler, its timesteps, its initial noise and step kwargs.

        A scheduler keeps per-request state (step index, multistep history), so each
        request gets a copy. The generator is a CPU one seeded from the request, so the
        noise is the same on every device; it is also what ancestral ``step``s draw from.
        """
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(params.steps, device=self.device)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        shape = (
            params.num_images,
            channels,
            params.height // pipe.vae_scale_factor,
            params.width // pipe.vae_scale_factor,
        )
        latents = randn_tensor(shape, generator=generator, device=self.device, dtype=dtype)
        latents = latents * scheduler.init_noise_sigma
        accepted = inspect.signature(scheduler.step).parameters
        step_kwargs = {k: v for k, v in (("eta", 0.0), ("generator", generator)) if k in accepted}
        return scheduler, scheduler.timesteps, latents, step_kwargs


def _check_tokenizer_files(root: Path, entry: object) -> None:
    """``ModelUnloadable`` if ``tokenizer/`` lacks the vocabulary its class reads: transformers
    would load it anyway, empty, and every prompt would come out as the same unknown tokens
    (a T5) or fail in every request (a CLIP)."""
    class_name = entry[1] if isinstance(entry, list) and len(entry) == 2 else ""
    files: dict[str, str] = getattr(getattr(transformers, str(class_name), None), "vocab_files_names", None) or {}
    folder = root / "tokenizer"
    if not files or (folder / files.get("tokenizer_file", "tokenizer.json")).is_file():
        return
    missing = [name for key, name in files.items() if key != "tokenizer_file" and not (folder / name).is_file()]
    if missing:
        raise ModelUnloadable(f"{root} lacks tokenizer/{', tokenizer/'.join(missing)} (or tokenizer/tokenizer.json): "
                              f"its {class_name} would have no vocabulary")
