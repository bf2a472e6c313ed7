"""The embedded default model: tiny diffusers pipelines built offline from configs.

Weights are random but seeded: ``torch.manual_seed(seed + SEED_OFFSETS[name])`` runs right
before each component is built, so a process that builds only the denoiser's UNet gets the
same UNet as a process that builds the whole pipeline. Tokenizers are made in memory (no
hub): a byte-level CLIP vocabulary with no merges, and a character-level T5 Unigram model.

The configs follow diffusers' own ``get_dummy_components`` fast tests, with these changes:
hub-free tokenizers and a local ``T5Config``; the SD scheduler is stored already fixed up
(``steps_offset=1``), as ``save_pretrained`` would write it; PixArt's VAE uses two blocks
(scale factor 2) like SD's, not ``AutoencoderKL()``'s factor 1.
"""

from __future__ import annotations

import string
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    PixArtAlphaPipeline,
    PixArtTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

Family = str  # "sd15" | "pixart"

# Added to the configured seed before building each component. A component's weights
# depend only on (seed, its offset, its config), never on what was built before it.
SEED_OFFSETS = {"text_encoder": 0, "unet": 1, "transformer": 1, "vae": 2}

_VAE = {
    "block_out_channels": [4, 8],
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"],
    "latent_channels": 4,
    "norm_num_groups": 2,
}

# CLIP byte-level vocabulary: 256 byte symbols, their 256 end-of-word forms, bos, eos.
_CLIP_BOS, _CLIP_EOS = 512, 513
_T5_PIECES = ["<pad>", "</s>", "<unk>", "▁"] + [c for c in string.printable if not c.isspace()]

CONFIGS: dict[Family, dict[str, dict[str, Any]]] = {
    "sd15": {
        "text_encoder": {
            "bos_token_id": _CLIP_BOS,
            "eos_token_id": _CLIP_EOS,
            "pad_token_id": _CLIP_EOS,
            "hidden_size": 8,
            "intermediate_size": 37,
            "layer_norm_eps": 1e-05,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 514,
            "max_position_embeddings": 77,
        },
        "unet": {
            "block_out_channels": [4, 8],
            "layers_per_block": 1,
            "sample_size": 32,
            "in_channels": 4,
            "out_channels": 4,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
            "cross_attention_dim": 8,
            "norm_num_groups": 2,
        },
        "vae": _VAE,
        "scheduler": {
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "beta_schedule": "scaled_linear",
            "clip_sample": False,
            "set_alpha_to_one": False,
            "steps_offset": 1,
        },
    },
    "pixart": {
        "text_encoder": {
            "vocab_size": len(_T5_PIECES),
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 37,
            "num_layers": 2,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "decoder_start_token_id": 0,
        },
        "transformer": {
            "sample_size": 8,
            "num_layers": 2,
            "patch_size": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 3,
            "caption_channels": 32,
            "in_channels": 4,
            "cross_attention_dim": 24,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-6,
        },
        "vae": _VAE,
        "scheduler": {},
    },
}


# Both tiny families' scheduler (their configs name no class, as a saved one's would).
SCHEDULER = DDIMScheduler


def tiny_config(family: Family, name: str) -> dict[str, Any]:
    """The config a tiny component is built from (a copy; the denoiser reads the VAE's)."""
    return dict(CONFIGS[family][name])


def _clip_tokenizer() -> CLIPTokenizer:
    # GPT-2's byte -> printable-unicode table, as CLIP's vocab.json spells bytes.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": 256 + i for i, s in enumerate(symbols)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = _CLIP_BOS, _CLIP_EOS
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer() -> T5Tokenizer:
    # transformers 5's T5Tokenizer is a `tokenizers` Unigram model (Metaspace, "</s>"
    # appended) behind the fast-tokenizer API: exactly what a real T5 checkpoint loads into.
    pieces = [(p, 0.0 if i < 3 else -1.0) for i, p in enumerate(_T5_PIECES)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=120)


def build_component(family: Family, name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """One component of a tiny pipeline, alone. Modules come back in eval mode on CPU, in
    ``dtype`` (built in float32, cast only if another: diffusers warns at every cast)."""
    if family not in CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; known: {sorted(CONFIGS)}")
    if name == "tokenizer":
        return _clip_tokenizer() if family == "sd15" else _t5_tokenizer()
    if name == "scheduler":
        return SCHEDULER(**tiny_config(family, name))
    config = tiny_config(family, name)
    torch.manual_seed(seed + SEED_OFFSETS[name])
    module: torch.nn.Module
    match family, name:
        case "sd15", "text_encoder":
            module = CLIPTextModel(CLIPTextConfig(**config))
        case "pixart", "text_encoder":
            module = T5EncoderModel(T5Config(**config))
        case "sd15", "unet":
            module = UNet2DConditionModel(**config)
        case "pixart", "transformer":
            module = PixArtTransformer2DModel(**config)
        case _, "vae":
            module = AutoencoderKL(**config)
        case _:
            raise ValueError(f"tiny {family} has no component {name!r}")
    if dtype != torch.float32:
        module.to(dtype=dtype)
    # Built modules start in train mode; dropout (T5 has 0.1) would make outputs random.
    return module.eval().requires_grad_(False)


def component_names(family: Family) -> tuple[str, ...]:
    return ("tokenizer", *CONFIGS[family])


def build_pipeline(family: Family, seed: int = 0, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """The whole monolithic tiny pipeline: the reference the split stages must match."""
    components = {name: build_component(family, name, seed, dtype) for name in component_names(family)}
    if family == "sd15":
        components.update(safety_checker=None, feature_extractor=None, image_encoder=None)
        pipe = StableDiffusionPipeline(**components, requires_safety_checker=False)
    else:
        pipe = PixArtAlphaPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe
