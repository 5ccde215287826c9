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


def check_bad_image_requests(engine, tok, ids: list[int], inputs) -> None:
    """An engine refuses, in one ``ValueError`` each, images in another number than the prompts,
    placeholders not expanded, and placeholders missing; a prompt without images beside one with
    them (a ``None`` entry) is served as text. ``ids``: a one-image prompt, expanded."""
    import pytest

    from async_rl.generators.base import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=2, stop_token_ids=(tok.eos_token_id,))
    with pytest.raises(ValueError, match="2 image entries for 1 prompts"):
        engine.generate([ids], 1, params, images=[inputs, inputs])
    collapsed = [t for i, t in enumerate(ids) if t != IMAGE_TOKEN or ids[i - 1] != IMAGE_TOKEN]
    with pytest.raises(ValueError, match="placeholders do not match"):
        engine.generate([collapsed], 1, params, images=[inputs])  # not expanded
    with pytest.raises(ValueError, match="placeholders for 0 of its 1 images"):
        engine.generate([[t for t in ids if t != IMAGE_TOKEN]], 1, params, images=[inputs])
    out = engine.generate([ids, [5, 6, 7]], 1, params, images=[inputs, None])
    assert all(len(g[0].response_ids) > 0 for g in out)


def check_text_model_refusal(engine_cls, ids: list[int], inputs) -> None:
    """An engine of a text model refuses images in one line, before any engine call (an engine
    object that never started suffices)."""
    import pytest

    from async_rl.generators.base import SamplingParams

    text_engine = object.__new__(engine_cls)
    text_engine.image_token_id, text_engine.model_path, text_engine._unusable = None, "tiny-qwen2", None
    with pytest.raises(ValueError, match="text model") as err:
        text_engine.generate([ids], 1, SamplingParams(max_tokens=2, stop_token_ids=(1,)), images=[inputs])
    assert "\n" not in str(err.value)
