"""The decoder's client-facing output: PNG files or raw uint8 frames, made on the worker."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from orchestrator.stages.base import Tensors
from transfer.protocol import GenParams


def image_outputs(images: torch.Tensor, params: GenParams) -> Tensors:
    """``images`` is uint8 (N, H, W, 3). PNG: one 1-D uint8 tensor of file bytes per image."""
    if params.output == "raw":
        return {"images": images.contiguous()}
    outputs: Tensors = {}
    for i, image in enumerate(images.numpy()):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        outputs[f"image_{i}.png"] = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    return outputs


def decode_png(data: torch.Tensor | bytes) -> np.ndarray:
    """PNG bytes back to uint8 (H, W, 3), for clients and tests."""
    raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else data
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
