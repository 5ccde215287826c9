"""A tiny vision-language model built locally: ``builtin:tiny-qwen2-vl``.

A randomly initialised ``Qwen2VLForConditionalGeneration`` (transformers' Qwen2-VL: a ViT over
14x14 patches of 2 frames, a 2x2 patch merger into the language model's width, and a Qwen2
language model with multimodal rotary positions, M-RoPE: each position is a (time, height,
width) triple, text advancing all three), saved with its image processor and the project's
tokenizer (``builtin.build_tokenizer(vision=True)``: the byte-level vocabulary plus Qwen2-VL's
``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` markup, and a ChatML template whose
messages may hold image parts).

The image processor is transformers' ``Qwen2VLImageProcessorPil`` (Pillow and numpy only, no
torchvision): an image is resized to multiples of 28 pixels within ``min_pixels`` and
``max_pixels`` (``smart_resize``), cut into 14x14 patches, each patch repeated over the 2
frames, ``pixel_values`` ``[num_patches, 3 * 2 * 14 * 14]`` float32 and ``image_grid_thw``
``[num_images, 3]`` int64 (frames, rows, columns of patches); one ``<|image_pad|>`` per 2x2
merged patch reaches the language model.

Shape: language model as ``builtin:tiny-qwen2`` (hidden 128, 4 heads of 32, 2 key/value heads, 4
layers) with 512 positions; vision tower of 2 blocks, width 64, 2 heads of 32 (vLLM's CPU
attention serves head size 32). Images of 28x28 to 112x112 pixels: 1 to 16 image tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

PATCH = 14
"""Vision patch side, pixels."""
MERGE = 2
"""Patches merged per side into one language-model token (``spatial_merge_size``)."""

TINY_QWEN2_VL_SPEC: dict[str, Any] = {
    "text": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0,
             # M-RoPE: of the 16 rotary frequency pairs of a 32-wide head, 4 turn with time, 6 with
             # the row, 6 with the column (Qwen2-VL's 16/24/24 of 64, scaled to the head).
             "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
    "vision": {"depth": 2, "embed_dim": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": PATCH,
               "spatial_merge_size": MERGE, "temporal_patch_size": 2, "in_channels": 3},
    "min_pixels": (2 * PATCH) ** 2,
    "max_pixels": (8 * PATCH) ** 2,
    "seed": 0,
}
"""``builtin:tiny-qwen2-vl``: the language model's and the vision tower's Qwen2-VL config
fields, the image processor's pixel bounds (28x28 .. 112x112) and the initialisation seed.
Part of the artefact's cache key: a change rebuilds it."""


def build_tiny_qwen2_vl(out_dir: Path, build_tokenizer: Callable[..., Any],
                        spec: dict[str, Any] = TINY_QWEN2_VL_SPEC) -> None:
    """Write a randomly initialised ``Qwen2VLForConditionalGeneration`` of ``spec``, its image
    processor (``preprocessor_config.json``), generation config and the vision tokenizer
    (``build_tokenizer(out_dir, vision=True, model_max_length=...)``, passed in so this module
    imports nothing of ``builtin``, which registers it) to ``out_dir``; float32 safetensors,
    tied embeddings.
    """
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    text = dict(spec["text"])
    tokenizer = build_tokenizer(out_dir, vision=True, model_max_length=text["max_position_embeddings"])
    ids = {t: tokenizer.convert_tokens_to_ids(t)
           for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    config = Qwen2VLConfig(
        text_config={**text, "vocab_size": len(tokenizer), "bos_token_id": None,
                     "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
                     "tie_word_embeddings": True},
        vision_config={**spec["vision"], "hidden_size": text["hidden_size"]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, torch_dtype="float32")
    torch.manual_seed(spec["seed"])
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True,
                                               temperature=1.0, top_p=1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    Qwen2VLImageProcessorPil(min_pixels=spec["min_pixels"], max_pixels=spec["max_pixels"],
                             patch_size=PATCH, merge_size=MERGE,
                             temporal_patch_size=spec["vision"]["temporal_patch_size"]).save_pretrained(out_dir)
