"""Vision-language models: loading the right transformers class, and the image inputs of a
forward pass.

A vision-language checkpoint (its config has a ``vision_config``: Qwen2-VL, Qwen2.5-VL, ...)
loads with ``AutoModelForImageTextToText``; a text model with ``AutoModelForCausalLM``. A prompt's
images travel as ``async_rl.data.images.ImageInputs`` (``pixel_values`` ``[N, D]`` float32,
``image_grid_thw`` ``[I, 3]`` int64); a forward pass over several rows takes the rows' patches
concatenated in row order, their grids likewise, and ``mm_token_type_ids`` (1 at image
placeholder tokens, 0 elsewhere), from which transformers' Qwen2-VL computes its multimodal
rotary positions (M-RoPE; Wang et al. 2024, "Qwen2-VL", arXiv 2409.12191, section 2.1).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["check_images", "image_kwargs", "image_token_id", "input_only_token_ids",
           "is_vision_language", "load_policy_model", "stack_images", "suppress_input_only", "zero_input_only_labels"]


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def image_token_id(config: Any) -> int | None:
    """The image placeholder token id of a vision-language config (``image_token_id``, or
    ``image_token_index`` in LLaVA-style configs); ``None`` for a text model or a config without one."""
    if not is_vision_language(config):
        return None
    value = getattr(config, "image_token_id", None)
    if value is None:
        value = getattr(config, "image_token_index", None)
    return None if value is None else int(value)


def load_policy_model(model_path: str, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """The policy at ``model_path``: ``AutoModelForImageTextToText`` for a vision-language
    checkpoint, else ``AutoModelForCausalLM`` (``kwargs`` go to ``from_pretrained``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    cls = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return cls.from_pretrained(model_path, dtype=dtype, **kwargs)


def check_images(images: Sequence[Any] | None, num_prompts: int, token_id: int | None,
                 what: str) -> Sequence[Any] | None:
    """``images`` of a ``generate`` call checked: ``None``, or one ``ImageInputs`` or ``None`` per
    prompt; all ``None`` gives ``None``.

    Raises:
        ValueError: a length other than ``num_prompts``, or images for a text model (``token_id``
            ``None``; ``what`` names the model in the message).
    """
    if images is None:
        return None
    if len(images) != num_prompts:
        raise ValueError(f"generate: {len(images)} image entries for {num_prompts} prompts (one per prompt, or None)")
    if all(x is None for x in images):
        return None
    if token_id is None:
        raise ValueError(f"generate: prompts with images, but {what} is a text model (no vision tower)")
    return images


def stack_images(images: Sequence[Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """The patches and grids of several rows' ``ImageInputs`` (``None`` entries: rows without
    images) concatenated in row order: ``pixel_values`` ``[sum N, D]`` float32 and
    ``image_grid_thw`` ``[sum I, 3]`` int64; ``None`` when no row has an image."""
    present = [x for x in images if x is not None and len(x.image_grid_thw)]
    if not present:
        return None
    return (np.concatenate([x.pixel_values for x in present]).astype(np.float32, copy=False),
            np.concatenate([x.image_grid_thw for x in present]).astype(np.int64, copy=False))


def image_kwargs(input_ids: torch.Tensor, images: Sequence[Any], token_id: int | None,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """The image arguments of a vision-language forward or ``generate`` over ``input_ids``
    ``[B, L]`` (row b's images ``images[b]``, an ``ImageInputs`` or ``None``): ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` ``[B, L]`` int64; ``{}`` when no row has images.

    Raises:
        ValueError: the rows hold another number of image placeholder tokens than their
            images' merged patches (transformers would fail later with a shape error).
    """
    stacked = stack_images(images)
    if stacked is None or token_id is None:
        return {}
    pixel_values, grid = stacked
    placeholders = input_ids == token_id
    merge = next(x.merge_size for x in images if x is not None)
    expected = int(np.prod(grid, axis=1).sum()) // merge ** 2
    if int(placeholders.sum()) != expected:
        raise ValueError(f"the batch holds {int(placeholders.sum())} image placeholder tokens for images of "
                         f"{expected} merged patches (prompt ids must be expanded: data.images.expand_image_tokens)")
    return {"pixel_values": torch.from_numpy(pixel_values).to(device),
            "image_grid_thw": torch.from_numpy(grid).to(device),
            "mm_token_type_ids": placeholders.long().to(device)}


def input_only_token_ids(config: Any) -> list[int]:
    """The vision-language markup tokens a policy reads but never writes: the image and video
    placeholders and the vision start/end markers (``image_token_id``, ``video_token_id``,
    ``vision_start_token_id``, ``vision_end_token_id`` where the config has them); ``[]`` for a
    text model.

    Every engine gives them probability 0 when it samples and the learner does the same when it
    scores (``suppress_input_only``), so behaviour and learner log-probs are of one distribution.
    Why: transformers places image features wherever ``input_ids`` holds the placeholder, so a
    sampled placeholder would make the next forward of that sequence (the learner's, or the
    engine's on a resumed row) fail on a feature count, or read image features into a response.
    """
    if not is_vision_language(config):
        return []
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return sorted({int(v) for v in (getattr(config, n, None) for n in names) if v is not None})


def suppress_input_only(logits: torch.Tensor, token_ids: torch.Tensor | None, value: float | None = None) -> torch.Tensor:
    """``logits`` ``[..., V]`` with ``value`` at ``token_ids`` (``input_only_token_ids``, a 1-D int64
    tensor on ``logits``' device); by default the lowest finite value of their dtype: their
    softmax probability is exactly 0, and no ``0 * -inf`` can turn an entropy or a masked sum
    into NaN (a sampler that checks for ``-inf`` passes ``float("-inf")``). Out of place and
    differentiable elsewhere; ``logits`` itself when ``token_ids`` is ``None`` or empty."""
    if token_ids is None or not token_ids.numel():
        return logits
    return logits.index_fill(-1, token_ids, torch.finfo(logits.dtype).min if value is None else value)


def zero_input_only_labels(logprobs: torch.Tensor, labels: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """Label log-probs ``[..., T]`` (from ``suppress_input_only`` logits) with 0 where the label
    ``[..., T]`` is an input-only token: only image markup of a prompt or of an environment's
    observation is such a label, never a trained one (engines do not sample them, and the loss
    mask is 0 there), and its log-prob under the suppressed distribution
    is a huge finite negative that a difference or a square could overflow."""
    if token_ids is None or not token_ids.numel():
        return logprobs
    return torch.where(torch.isin(labels, token_ids), torch.zeros((), dtype=logprobs.dtype, device=logprobs.device),
                       logprobs)
