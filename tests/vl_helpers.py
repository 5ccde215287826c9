"""What the engine tests of the vision-language model share (vLLM's and SGLang's): random
pictures, transformers' own fp32 forward as the reference, and a perturbed copy of the tiny
Qwen2-VL for weight-update tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from async_rl.utils.vision import input_only_token_ids

IMAGE_TOKEN = 264
"""``<|image_pad|>`` of the built-in tiny Qwen2-VL's tokenizer."""


def random_image(seed: int, width: int = 112, height: int = 84):
    """An RGB ``PIL.Image`` of uniform noise (every patch differs), ``width x height`` pixels."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(height, width, 3) * 255).astype(np.uint8))


def hf_model(path: str):
    """transformers' fp32 model of the VL checkpoint at ``path``, in eval mode."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int], inputs) -> torch.Tensor:
    """transformers' fp32 logits ``[len(ids), V]`` of ``ids`` with ``inputs``' images
    (``ImageInputs``; placeholders already expanded in ``ids``)."""
    full = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=full, pixel_values=torch.from_numpy(inputs.pixel_values),
                     image_grid_thw=torch.from_numpy(inputs.image_grid_thw),
                     mm_token_type_ids=(full == IMAGE_TOKEN).long()).logits[0].float()


def hf_logprobs(model, ids: list[int], inputs, response: list[int]) -> list[float]:
    """transformers' log-probs (nats) of ``response`` after prompt ``ids``, the input-only markup
    given probability 0 as every engine does (``utils.vision.input_only_token_ids``)."""
    logits = hf_logits(model, ids + response, inputs)[len(ids) - 1 : -1]
    markup = torch.tensor(input_only_token_ids(model.config))
    lp = torch.log_softmax(logits.index_fill(-1, markup, float("-inf")), dim=-1)
    return lp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def perturbed(vl_path: str, out_dir: Path):
    """The tiny Qwen2-VL with noise on every vision and language weight, saved as a model
    directory (with the tokenizer and image processor files); returns (model, dir)."""
    torch.manual_seed(1)
    model = hf_model(vl_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir)
    for f in Path(vl_path).iterdir():
        if f.is_file() and not (out_dir / f.name).exists():
            shutil.copy(f, out_dir / f.name)
    return model, str(out_dir)


def checkpoint_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``path/model.safetensors``, sorted by name."""
    from safetensors.torch import load_file

    return sorted(load_file(str(Path(path) / "model.safetensors")).items())
