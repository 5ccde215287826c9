"""Images in prompts: decoding, resizing once, processing into what a vision-language model takes.

A row of a vision-language dataset (the verl layout) holds an ``images`` column next to
``prompt``: a list of images, each raw encoded bytes (PNG, JPEG, ...), a ``{"bytes": ..., "path":
...}`` mapping (how Hugging Face ``datasets`` stores an ``Image`` feature in parquet) or a file
path (absolute, or relative to the data file's directory). ``decode_image`` turns one into an
RGB ``PIL.Image`` or raises ``BadImageError`` with one of ``BAD_IMAGE_REASONS``, so a dataset can
count the row's rejection by reason.

``ImageProcessing`` wraps the model's own image processor (``preprocessor_config.json``, loaded
with transformers' ``AutoImageProcessor``; for Qwen2-VL the Pillow implementation, which needs no
torchvision) with the run's pixel bounds, and turns a prompt's images into ``ImageInputs``:
the resized images (kept for engines that take images, as vLLM does), ``pixel_values`` and
``image_grid_thw`` (what transformers' model takes), computed once per prompt. The prompt's
token ids carry one image placeholder token per merged patch (``expand_image_tokens``), so
``data.max_prompt_tokens`` and every token budget count image tokens as the model sees them.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

BAD_IMAGE_REASONS = ("image_not_decodable", "image_missing_path", "image_bad_type", "image_bad_mode",
                     "image_too_small", "image_count_mismatch")
"""Why a row's image was refused (``BadImageError.reason``): bytes that no image decoder reads
(corrupt, truncated, not an image); a path that names no file; a value that is neither bytes,
a ``{"bytes", "path"}`` mapping nor a path string; a pixel mode that has no RGB conversion (for
example 16-bit or floating-point single-channel); fewer than one pixel on a side; a row whose
number of images differs from its number of image placeholders."""

_IN_MEMORY_FILE = re.compile(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>")

IMAGE_MODES_CONVERTIBLE = ("RGB", "RGBA", "L", "LA", "P", "PA", "CMYK", "YCbCr", "1", "LAB", "HSV", "I;16")
"""Pillow modes that convert to RGB without losing what the picture shows (palette, grey,
alpha over black, CMYK, ...); any other mode (``I``, ``F``: 32-bit integer or float channels,
whose range Pillow's conversion clips) is refused as ``image_bad_mode``."""


class BadImageError(ValueError):
    """An image of a dataset row that cannot be used; ``reason`` is one of ``BAD_IMAGE_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in BAD_IMAGE_REASONS:
            raise ValueError(f"unknown bad-image reason {reason!r}")
        super().__init__(message)
        self.reason = reason


def decode_image(value: Any, base_dir: Path | None = None):
    """One image of a row's ``images`` as an RGB ``PIL.Image`` (fully loaded).

    Args:
        value: encoded bytes, a ``{"bytes": bytes | None, "path": str | None}`` mapping (bytes win
            when both are set), a path (relative to ``base_dir`` when not absolute), or a
            ``PIL.Image`` (an environment's observation).
        base_dir: where relative paths start (the data file's directory).

    Raises:
        BadImageError: ``image_bad_type``, ``image_missing_path``, ``image_not_decodable``,
            ``image_bad_mode`` or ``image_too_small`` (see ``BAD_IMAGE_REASONS``).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):  # an environment's observation may hand over a picture it drew
        return _as_rgb(value, f"a {value.width}x{value.height} picture")
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        source, where = io.BytesIO(bytes(value)), f"{len(value)} bytes"
    elif isinstance(value, (str, Path)) and str(value):
        path = Path(value)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise BadImageError("image_missing_path", f"image file {str(path)!r} does not exist")
        source, where = path, repr(str(path))
    else:
        raise BadImageError("image_bad_type", f"an image must be bytes, a {{'bytes', 'path'}} mapping or a "
                                              f"path, got {type(value).__name__}")
    try:
        with Image.open(source) as img:
            img.load()
            return _as_rgb(img, where)
    except BadImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:  # Pillow's decoders raise these
        # Pillow names an in-memory file by its repr (a memory address): the message says which bytes.
        reason = _IN_MEMORY_FILE.sub("", str(e)).strip()
        raise BadImageError("image_not_decodable", f"image ({where}) cannot be decoded: {reason}") from e
    except Exception as e:  # noqa: BLE001
        # Not only the above: a header claiming a huge size raises DecompressionBombError (an
        # Exception), and a plugin may raise EOFError, struct.error or zlib.error on crafted bytes.
        # Any of them is a row's bad image, never a stopped run.
        raise BadImageError("image_not_decodable", f"image ({where}) cannot be decoded: "
                                                   f"{type(e).__name__}: {str(e)[:200]}") from e


def _as_rgb(img: Any, where: str) -> Any:
    """A loaded ``PIL.Image`` as RGB (transparent pixels over black, as the processors' own
    ``convert_rgb`` does).

    Raises:
        BadImageError: ``image_bad_mode`` or ``image_too_small``.
    """
    from PIL import Image

    mode, size = img.mode, img.size
    if mode not in IMAGE_MODES_CONVERTIBLE:
        raise BadImageError("image_bad_mode", f"image ({where}) has pixel mode {mode!r}, which has no "
                                              f"RGB conversion; use one of {', '.join(IMAGE_MODES_CONVERTIBLE)}")
    if min(size) < 1:
        raise BadImageError("image_too_small", f"image ({where}) is {size[0]}x{size[1]} pixels")
    if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in img.info):
        img = img.convert("RGBA")
        rgb = Image.new("RGB", img.size)
        rgb.paste(img, mask=img.getchannel("A"))
        return rgb
    return img.convert("RGB")


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """A prompt's images as the model takes them, computed once (``ImageProcessing.process``).

    Attributes:
        images: the RGB images, resized to the processor's grid (sides multiples of
            ``patch_size * merge_size`` pixels, area within the pixel bounds).
        pixel_values: ``[num_patches, channels * temporal_patch_size * patch_size**2]`` float32,
            the images' normalised patches in order (Qwen2-VL: ``[sum(t*h*w), 1176]``).
        image_grid_thw: ``[num_images, 3]`` int64: frames, rows and columns of patches per image.
        merge_size: patches merged per side into one language-model token.
    """

    images: tuple[Any, ...]
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    merge_size: int

    @property
    def tokens_per_image(self) -> list[int]:
        """Placeholder tokens each image takes in the prompt: ``t * h * w // merge_size**2``."""
        return [int(t * h * w) // self.merge_size ** 2 for t, h, w in self.image_grid_thw.tolist()]


class ImageProcessing:
    """The model's image processor with the run's pixel bounds (see the module docstring).

    Args:
        model_path: a model directory with ``preprocessor_config.json``.
        image_token_id: the placeholder token id (``config.image_token_id``).
        min_pixels, max_pixels: bounds on an image's area after resizing (pixels); ``None`` keeps
            the processor's own.

    Raises:
        ValueError: the directory has no image processor, or ``min_pixels > max_pixels``.
    """

    def __init__(self, model_path: str, image_token_id: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        from transformers import AutoImageProcessor

        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            raise ValueError(f"image min_pixels ({min_pixels}) exceeds max_pixels ({max_pixels})")
        overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_path, **overrides)
        except (OSError, ValueError) as e:
            raise ValueError(f"{model_path}: no image processor (preprocessor_config.json) for a "
                             f"vision-language model: {e}") from e
        if overrides:  # Qwen2-VL's processor reads its bounds from `size`, kept in step with these
            self.processor.size = {"shortest_edge": overrides.get("min_pixels", self.processor.size["shortest_edge"]),
                                   "longest_edge": overrides.get("max_pixels", self.processor.size["longest_edge"])}
        self.image_token_id = int(image_token_id)
        self.merge_size = int(getattr(self.processor, "merge_size", 1))
        self.patch_size = int(getattr(self.processor, "patch_size", 14))

    def process(self, images: Sequence[Any]) -> ImageInputs:
        """Resize ``images`` (RGB ``PIL.Image``) once and compute their patches.

        Raises:
            BadImageError: ``image_too_small`` for an image the processor cannot resize to one
                merged patch (its error, one line).
        """
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        size = self.processor.size
        resized = []
        for img in images:
            try:
                h, w = smart_resize(img.height, img.width, factor=factor, min_pixels=size["shortest_edge"],
                                    max_pixels=size["longest_edge"])
            except ValueError as e:
                raise BadImageError("image_too_small", f"image of {img.width}x{img.height} pixels: {e}") from e
            resized.append(img if (img.width, img.height) == (w, h) else img.resize((w, h), resample=3))
        out = self.processor(images=resized, return_tensors="np")
        return ImageInputs(tuple(resized), np.ascontiguousarray(out["pixel_values"], dtype=np.float32),
                           np.asarray(out["image_grid_thw"], dtype=np.int64), self.merge_size)


def concat_images(parts: Sequence[ImageInputs | None]) -> ImageInputs | None:
    """Several ``ImageInputs`` as one, in order (``None`` entries skipped): a prompt's images then
    the images its episode's observations added, as one sequence's forward takes them
    (``pixel_values`` ``[sum N, D]`` float32, ``image_grid_thw`` ``[sum I, 3]`` int64); the one
    part itself when only one has images; ``None`` when none has.

    Raises:
        ValueError: parts of different ``merge_size`` or patch width (two image processors).
    """
    present = [x for x in parts if x is not None and len(x.image_grid_thw)]
    if len(present) <= 1:
        return present[0] if present else None
    if len({(x.merge_size, x.pixel_values.shape[1]) for x in present}) > 1:
        raise ValueError("concat_images: images of different processors (merge size, patch width): "
                         f"{sorted({(x.merge_size, x.pixel_values.shape[1]) for x in present})}")
    return ImageInputs(tuple(img for x in present for img in x.images),
                       np.ascontiguousarray(np.concatenate([x.pixel_values for x in present]), dtype=np.float32),
                       np.concatenate([x.image_grid_thw for x in present]).astype(np.int64, copy=False),
                       present[0].merge_size)


def expand_image_tokens(prompt_ids: Sequence[int], inputs: ImageInputs, image_token_id: int) -> list[int]:
    """``prompt_ids`` with its k-th image placeholder repeated ``inputs.tokens_per_image[k]`` times.

    Raises:
        BadImageError: ``image_count_mismatch``: the number of placeholders differs from the
            number of images.
    """
    counts = inputs.tokens_per_image
    positions = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(positions) != len(counts):
        raise BadImageError("image_count_mismatch", f"the prompt has {len(positions)} image placeholder(s) for "
                                                    f"{len(counts)} image(s)")
    out: list[int] = []
    k = 0
    for t in prompt_ids:
        if t == image_token_id:
            out.extend([t] * counts[k])
            k += 1
        else:
            out.append(t)
    return out


class PromptImages:
    """The images of a run's prompts by ``Prompt.uid``, and the batch builder's lookup of a
    trajectory's images: its prompt's (they travel to the engine with the request, never back:
    the trainer, which holds its datasets, finds them here) followed by those its episode's
    observations added (``Trajectory.observation_pixel_values`` / ``observation_image_grid_thw``,
    which travel with the trajectory).

    Args:
        datasets: ``PromptDataset``s (their ``prompts``; ``None`` entries are skipped).
        merge_size: the policy's patch merge size (``ImageProcessing.merge_size``), for a
            trajectory whose observations hold images but whose prompt holds none; ``None``: a
            text policy (such a trajectory is then refused).
    """

    def __init__(self, *datasets: Any, merge_size: int | None = None) -> None:
        self._by_uid = {p.uid: p.images for ds in datasets if ds is not None for p in ds.prompts
                        if getattr(p, "images", None) is not None}
        self.merge_size = merge_size

    def __bool__(self) -> bool:
        return bool(self._by_uid) or self.merge_size is not None

    def __call__(self, uid: str) -> ImageInputs | None:
        """The ``ImageInputs`` of prompt ``uid``, or ``None`` (a prompt without images)."""
        return self._by_uid.get(uid)

    def of(self, trajectories: Sequence[Any]) -> list[ImageInputs | None] | None:
        """One ``ImageInputs`` or ``None`` per trajectory (``collate``'s ``images``): the prompt's
        images, then the observations'; ``None`` when no trajectory has an image and the run
        has no image prompt.

        Raises:
            ValueError: a trajectory with observation images in a run of a text policy (no merge
                size known, none of its prompt's either).
        """
        out, seen = [], False
        for t in trajectories:
            images = self._by_uid.get(t.prompt_uid)
            grid = getattr(t, "observation_image_grid_thw", None)
            if grid is not None and len(grid):
                merge = images.merge_size if images is not None else self.merge_size
                if merge is None:
                    raise ValueError(f"trajectory {t.trajectory_id} carries observation images, but the run's "
                                     "policy is a text model")
                images = concat_images([images, ImageInputs((), t.observation_pixel_values, grid, merge)])
                seen = True
            out.append(images)
        return out if self._by_uid or seen else None
