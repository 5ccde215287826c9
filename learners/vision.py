"""Vision-language policies in the FSDP2 learner: which models are ones, what a micro-batch's
images become in the model's forward call, and multimodal rotary positions under packing.

A vision-language model (Qwen2-VL: a ViT over 14x14 patches, a 2x2 patch merger, and a Qwen2
language model with multimodal rotary positions, M-RoPE) is recognised by its config's
``vision_config``. A batch carries its rows' images in two padded extras (``buffers.trajectory``'s
collate): ``pixel_values`` ``[B, P_max, D]`` float32 (row ``b``'s patches in order, then zeros) and
``image_grid_thw`` ``[B, I_max, 3]`` int64 (row ``b``'s images' frames, rows and columns of
patches, then zero rows). The model takes them flat, rows in order (``flat_image_inputs``).

**Positions.** M-RoPE gives each token a (time, height, width) triple: text tokens advance all
three, an image's placeholder tokens lie on its merged-patch grid. ``forward_kwargs`` asks the
model's own ``get_rope_index`` (transformers' Qwen2-VL code) with the attention mask, so a
padded row's real tokens get the positions of the row alone. A packed row (several
sequences in one, ``learner.packing``) keeps each sequence's own ``[3, n_i]`` positions, and
transformers' Qwen2-VL text model reads a ``[4, 1, N]`` position tensor as (text positions,
M-RoPE positions): the first row, restarting at 0 for each sequence, is what its mask builder
(``masking_utils.find_packed_sequence_indices``) cuts the row into sequences by, so no token
attends across a boundary. A ``[3, 1, N]`` tensor would not be cut (measured: the second
sequence's log-probs move by ~0.1-0.3 nats), nor would any when a KV cache is passed
(``use_cache=False`` is required).
"""

from __future__ import annotations

import torch

from async_rl.utils.vision import is_vision_language  # noqa: F401 (one definition, used as vision.is_vision_language)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision encoder of a (possibly peft-wrapped) transformers vision-language model:
    Qwen2-VL's ``model.visual`` (its ViT blocks and the patch merger).

    Raises:
        ValueError: no submodule named ``visual``, ``vision_tower`` or ``vision_model``.
    """
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ("visual", "vision_tower", "vision_model"):
            return module
    raise ValueError(f"{type(model).__name__} has no vision tower (a submodule named visual, vision_tower or "
                     "vision_model)")


def rope_index_fn(model: torch.nn.Module):
    """The model's own M-RoPE position function, ``get_rope_index(input_ids, mm_token_type_ids=,
    image_grid_thw=, attention_mask=) -> (positions [3, B, L] int64, deltas [B, 1])``, bound to
    the (possibly peft-wrapped or FSDP2-sharded) model's inner module; it reads only the config.

    Raises:
        ValueError: the model has no ``get_rope_index``.
    """
    for module in model.modules():
        fn = getattr(type(module), "get_rope_index", None)
        if fn is not None:
            return fn.__get__(module)
    raise ValueError(f"{type(model).__name__} has no get_rope_index: cannot compute its multimodal positions")


def flat_image_inputs(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows' images as the model takes them: ``(pixel_values [sum P_b, D], image_grid_thw
    [sum I_b, 3] int64)``, rows in order and each row's images in order, padding dropped; ``None``
    when no row has an image.

    Args:
        pixel_values: ``[B, P_max, D]`` float, row ``b``'s ``P_b`` patches first.
        image_grid_thw: ``[B, I_max, 3]`` int64, row ``b``'s images' ``(t, h, w)`` then zero rows
            (a zero row is no image); ``P_b = sum(t * h * w)`` over its images.

    Raises:
        ValueError: a row's grid counts more patches than ``P_max``.
    """
    real = (image_grid_thw != 0).any(-1)  # [B, I_max]
    if not bool(real.any()):
        return None
    patches = (image_grid_thw.prod(-1) * real).sum(-1)  # [B]
    if int(patches.max()) > pixel_values.shape[1]:
        raise ValueError(f"image_grid_thw counts {int(patches.max())} patches in a row but pixel_values holds "
                         f"{pixel_values.shape[1]} per row")
    keep = torch.arange(pixel_values.shape[1], device=patches.device) < patches.unsqueeze(1)  # [B, P_max]
    return pixel_values[keep], image_grid_thw[real].long()


def forward_kwargs(rope_index, image_token_id: int, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor, position_ids: torch.Tensor, extras: dict,
                   packed: bool) -> dict:
    """Keyword arguments of a vision-language model's forward call for right-padded rows: with
    ``packed``, one row of their real tokens (as ``batching.pack_rows``) with ``[4, 1, N]``
    positions (text positions restarting per sequence, then each sequence's own M-RoPE
    positions; see the module docstring); else the ``[B, L]`` rows with ``[3, B, L]`` positions
    and the attention mask. Images, when the rows have any, as ``pixel_values``,
    ``image_grid_thw`` and ``mm_token_type_ids`` (1 at image placeholders).

    Args:
        rope_index: ``rope_index_fn(policy)``.
        image_token_id: the placeholder token id (``config.image_token_id``).
        input_ids, attention_mask, position_ids: ``[B, L]`` int64 (right-padded as collated;
            left padding works too, positions follow the mask); ``position_ids`` 0 at each row's
            first real token.
        extras: the micro-batch's extras (``pixel_values`` and ``image_grid_thw`` read when present).
        packed: one packed row instead of the padded rows.

    Returns:
        ``{"input_ids", "position_ids", ...}`` (``attention_mask`` only when not packed), plus the
        image arguments when there are images.
    """
    images = None
    if "pixel_values" in extras and "image_grid_thw" in extras:
        images = flat_image_inputs(extras["pixel_values"], extras["image_grid_thw"])
    types = (input_ids == image_token_id).long()
    if images is not None:
        positions, _ = rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=images[1],
                                  attention_mask=attention_mask)
    else:
        positions = position_ids.unsqueeze(0).expand(3, -1, -1)  # text advances all three axes alike
    keep = attention_mask.bool()
    if packed:
        out = {"input_ids": input_ids[keep].unsqueeze(0), "mm_token_type_ids": types[keep].unsqueeze(0),
               "position_ids": torch.cat([position_ids[keep].view(1, 1, -1),
                                          positions[:, keep].unsqueeze(1)], 0)}
    else:
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions,
               "mm_token_type_ids": types}
    if images is not None:
        out["pixel_values"], out["image_grid_thw"] = images
    else:
        out.pop("mm_token_type_ids")
    return out


def check_lora_targets(model: torch.nn.Module, target_modules: list[str]) -> None:
    """Refuse LoRA target modules that match the vision tower: adapters go on the language model
    only (the engines serve adapters on it alone).

    Raises:
        ValueError: a vision-tower module matches a target (one line, naming it).
    """
    from async_rl.utils.lora import targets

    inside = {id(m) for m in vision_tower(model).modules()}
    for name, module in model.named_modules():
        if id(module) in inside and isinstance(module, torch.nn.Linear) and targets(name, target_modules):
            raise ValueError(f"learner.lora.target_modules={list(target_modules)} matches the vision tower's "
                             f"{name!r}: LoRA adapts the language model only; name its modules")
