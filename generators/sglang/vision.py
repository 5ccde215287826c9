"""Qwen2-VL image prompts on the SGLang engine, through SGLang's own multimodal path.

SGLang 0.5.23 serves Qwen2-VL (``sglang/srt/models/qwen2_vl.py``, image processor
``sglang/srt/multimodal/processors/qwen_vl.py``) on CPU in the repository's SGLang venv once two
things are fixed in the processes that start it:

* **Config name**: SGLang's vision tower reads ``vision_config.in_chans``, which transformers 5
  renamed ``in_channels``; the engine fails to build the model (``AttributeError``). The engine
  starts with ``json_model_override_args`` adding ``in_chans`` (``config_overrides``), which
  SGLang merges into the vision sub-config of the scheduler's config.
* **Kernel names**: the module of SGLang's Qwen-VL processor imports SGLang's Qwen3.5 model,
  which on CPU looks up four ``torch.ops.sgl_kernel`` ops at import time; without SGLang's CPU
  kernel build they do not exist, the import fails, SGLang skips the processor with a warning
  and the engine refuses the model ("No processor registered for architecture"). Where the
  venv's ``sgl_kernel`` is the repository's stand-in (``envs/sglang-cpu``), those ops are
  defined here (``register_kernel_stand_ins``), each raising ``NotImplementedError`` if called
  (the Qwen2-VL path calls none of them). The processor lives in the engine's owning process
  (SGLang's ``TokenizerManager``), so this runs there, before the engine starts.

Images reach SGLang as its ``processor_output`` input (``image_request``): the patches and grids
we computed (``ImageInputs.pixel_values``, ``image_grid_thw``), with the prompt ids already
expanded (one placeholder per merged patch), so SGLang re-processes nothing: it takes the ids
as they are and computes the multimodal rotary positions from them and the grids, as
transformers does. SGLang's image-processor path (PIL images) needs torchvision, which the
SGLang venv has (SGLang imports it at load), so no torchvision stand-in is needed here.

SGLang keeps vision-tower outputs across requests in its scheduler: an embedding cache keyed by
each image's content hash, which no weight update or ``flush_cache`` clears, so a request after
an update would read embeddings of the old vision tower. Salting the hash does not work in
SGLang 0.5.23: a request's ``mm_hashes`` are applied after its padded prompt ids were built from
the unsalted hashes, and the scheduler then finds no image tokens to fill (``IndexError`` in
``mm_utils._scatter_mm_embedding``, the scheduler dies); a ``hash`` in the ``processor_output``
item is dropped when SGLang splits a several-image item per image. So the engine of a
vision-language model starts with that cache off (``ENGINE_ENVIRONMENT``): each request encodes
its images itself. The prefix cache, whose keys of image tokens derive from the same hash, is
safe: every request also carries the weights' cache salt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

QWEN2_VL_ARCH = "Qwen2VLForConditionalGeneration"
KERNEL_STAND_INS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                    "fused_qkvzba_split_reshape_cat_contiguous_cpu")
"""The ``torch.ops.sgl_kernel`` ops SGLang's Qwen-VL processor module looks up at import on CPU."""

ENGINE_ENVIRONMENT = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}
"""Environment of a vision-language engine's processes: SGLang's vision-embedding cache off (a
capacity of 0 MB stores nothing; module docstring)."""

_library = None
"""The ``torch.library.Library`` holding the stand-in ops (kept alive: dropping it unregisters them)."""


def model_config(model_path: str) -> dict[str, Any]:
    """The model directory's ``config.json`` as a dict (``{}`` when there is none)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def is_qwen2_vl(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict names Qwen2-VL's architecture."""
    return QWEN2_VL_ARCH in (config.get("architectures") or [])


def config_overrides(model_path: str) -> dict[str, Any]:
    """SGLang's ``json_model_override_args`` (as a dict) a model needs: for a Qwen2-VL checkpoint
    whose vision config has ``in_channels`` but not ``in_chans`` (transformers 5), ``in_chans``;
    ``{}`` otherwise."""
    config = model_config(model_path)
    vision = config.get("vision_config") or {}
    if not is_qwen2_vl(config) or "in_chans" in vision:
        return {}
    return {"vision_config": {"in_chans": int(vision.get("in_channels", 3))}}


def register_kernel_stand_ins() -> list[str]:
    """Define, in this process, each op of ``KERNEL_STAND_INS`` that ``torch.ops.sgl_kernel``
    lacks, where the installed ``sgl_kernel`` is the repository's CPU stand-in; each raises
    ``NotImplementedError`` naming itself if called. Returns the ops defined now (``[]`` with a
    real ``sgl_kernel``, or when already defined). Idempotent."""
    global _library
    import sgl_kernel
    import torch

    if not getattr(sgl_kernel, "STAND_IN", False):
        return []
    missing = [name for name in KERNEL_STAND_INS if not hasattr(torch.ops.sgl_kernel, name)]
    if not missing:
        return []
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        _library.define(f"{name}(Tensor[] args) -> ()")
        _library.impl(name, _raiser(name), "CompositeExplicitAutograd")
    return missing


def _raiser(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel::{name} is a stand-in (async-rl's CPU SGLang venv): this SGLang "
                                  f"code path needs SGLang's CPU kernel build")

    return call


def image_offsets(ids: list[int], counts: list[int], token_id: int) -> list[tuple[int, int]]:
    """``[(first, last)]`` position of each image's run of placeholders in ``ids``, inclusive
    (what SGLang calls an item's offsets), with ``counts[k]`` placeholders for image k.

    Raises:
        ValueError: the ids hold other runs of placeholders than the images' merged patches
            (not expanded, or expanded for other images).
    """
    offsets: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] != token_id:
            i += 1
            continue
        k = len(offsets)
        run = counts[k] if k < len(counts) else 0
        if run == 0 or ids[i:i + run] != [token_id] * run:
            raise ValueError(f"generate: the prompt's image placeholders do not match its {len(counts)} image(s) of "
                             f"{counts} merged patches (expand them with data.images.expand_image_tokens)")
        offsets.append((i, i + run - 1))
        i += run
    if len(offsets) != len(counts):
        raise ValueError(f"generate: the prompt holds placeholders for {len(offsets)} of its {len(counts)} images")
    return offsets


def image_request(prompt: list[int], images, token_id: int) -> dict[str, Any]:
    """The multimodal fields of an SGLang ``GenerateReqInput`` for ``prompt`` (one placeholder
    ``token_id`` per merged patch) and its ``ImageInputs``.

    Returns:
        ``{"image_data": [item]}``: one ``processor_output`` item holding all the prompt's images
        (SGLang takes at most one such item per modality and splits it per image by its offsets
        and grids): ``pixel_values`` ``[N, D]`` float32, ``image_grid_thw`` ``[I, 3]`` int64,
        ``offsets`` (``image_offsets``: given, not searched, so adjacent images stay apart).

    Raises:
        ValueError: the prompt's placeholders do not match the images (``image_offsets``).
    """
    import torch

    offsets = image_offsets(prompt, images.tokens_per_image, token_id)
    pixels = np.ascontiguousarray(images.pixel_values, dtype=np.float32)
    grid = np.ascontiguousarray(images.image_grid_thw, dtype=np.int64)
    item = {"format": "processor_output", "pixel_values": torch.from_numpy(pixels),
            "image_grid_thw": torch.from_numpy(grid), "offsets": offsets}
    return {"image_data": [item]}
