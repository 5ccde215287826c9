"""Trajectories, groups, and their collation into padded learner batches.

Layout of a collated batch (worked example). Prompt ``[p0, p1, p2]``, response ``[r0, r1, eos]``,
batch padded to ``L = 8`` tokens with pad id ``_``::

    input_ids       p0 p1 p2 r0 r1 eos _  _        [B, L]
    attention_mask  1  1  1  1  1  1   0  0        [B, L]
    position_ids    0  1  2  3  4  5   5  5        [B, L]   (cumsum of the mask - 1, clamped)
    labels             p1 p2 r0 r1 eos _  _        [B, L-1] = input_ids[:, 1:]
    loss_mask          0  0  1  1  1   0  0        [B, L-1] (1 where the label is a response token)

Every per-token tensor of the learner (``behavior_logprobs``, ``advantages``, learner log-probs,
the teacher's log-probs of on-policy distillation) is aligned with ``labels``: slot ``t`` scores
token ``input_ids[:, t + 1]`` given the tokens up to ``t``. The teacher's top-k of top-k
distillation (``[B, L-1, K]``) is aligned the same way: row ``t`` holds the teacher's K most
likely tokens, and their log-probs, for slot ``t``, the position that predicts ``labels[:, t]``.
Position ids come from the attention mask, so the same sequence gets the same log-probs whether
it is left- or right-padded.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np
import torch

PER_TOKEN_DTYPES: dict[str, np.dtype] = {
    "prompt_ids": np.dtype("<i4"), "response_ids": np.dtype("<i4"), "behavior_logprobs": np.dtype("<f8"),
    "loss_mask": np.dtype("u1"), "policy_version": np.dtype("<i8"), "teacher_logprobs": np.dtype("<f8"),
}
"""The dtype of each per-token field of a ``Trajectory``; the wire (``async_rl.buffers.codec``)
carries these same bytes, so a received trajectory's arrays are views of the message. int32 ids
hold any vocabulary; float64 log-probs keep a Python float bit-exact; versions are int64. Every
field but ``teacher_logprobs`` has one value per response token (R), or per prompt token for
``prompt_ids``; ``teacher_logprobs`` has R or none (a run without a teacher). The teacher's
top-k, two 2-D fields, has a table of its own: ``TOPK_DTYPES``."""

TOPK_DTYPES: dict[str, np.dtype] = {"teacher_topk_ids": np.dtype("<i4"), "teacher_topk_logprobs": np.dtype("<f4")}
"""The dtype of each per-token top-k field of a ``Trajectory`` (the teacher's K most likely next
tokens at every response position, for top-k distillation): 2-D, ``[R, K]`` with ``K >= 1``, or
``[0, 0]`` without; the wire carries these same bytes, row-major. float32 log-probs: the teacher
computes them in float32 (or lower) and a top-k of 8 bytes an entry keeps a large K affordable.
Held apart from ``PER_TOKEN_DTYPES``, whose fields are 1-D (``per_token_array``); built by
``topk_array``."""

ROUTED_EXPERTS_DTYPE = np.dtype("<i2")
"""``Trajectory.routed_experts``: expert indices as int16 (models of up to 32,767 experts a layer)."""

OBSERVATION_IMAGE_DTYPES: dict[str, np.dtype] = {
    "observation_pixel_values": np.dtype("<f4"), "observation_image_grid_thw": np.dtype("<i8")}
"""The dtype of each observation-image field of a ``Trajectory`` (the images an episode's
environment answered with, in a multi-turn vision-language episode): ``observation_pixel_values``
``[N, D]`` float32 (the normalised patches, what the vision tower takes; ``[0, 0]`` without) and
``observation_image_grid_thw`` ``[I, 3]`` int64 (frames, rows and columns of patches per image;
``[0, 3]`` without), as the model's image processor makes them (``async_rl.data.images``). The
wire carries these same bytes, row-major. Built by ``observation_image_array``."""

_NO_IMAGES = {name: np.zeros(shape, dtype=OBSERVATION_IMAGE_DTYPES[name]) for name, shape in
              (("observation_pixel_values", (0, 0)), ("observation_image_grid_thw", (0, 3)))}
"""The "none" of each observation-image field, ``[0, 0]`` and ``[0, 3]``: one read-only array
each, shared by every trajectory without observation images (empty, so nothing in it to change;
a text run then allocates nothing for them, and ``Trajectory`` checks them by identity)."""
for _none in _NO_IMAGES.values():
    _none.flags.writeable = False
del _none

_ARRAY_FIELDS = (frozenset(PER_TOKEN_DTYPES) | frozenset(TOPK_DTYPES) | {"routed_experts"}
                 | frozenset(OBSERVATION_IMAGE_DTYPES))
"""Every ``Trajectory`` field held as a numpy array (the 1-D per-token ones, the [R, K] top-k,
the [P + R - 1, layers, k] routing and the [N, D] / [I, 3] observation images)."""

# Struct codes are spelled out: numpy's ``dtype.char`` for int64 is the platform's 'l'.
_STRUCT_CODES = {"<i4": "i", "<f8": "d", "|u1": "B", "<i8": "q"}


def per_token_array(values: Any, name: str, trajectory_id: str = "?") -> np.ndarray:
    """``values`` as the 1-D, C-contiguous array of ``PER_TOKEN_DTYPES[name]``, exactly or not at all.

    An ndarray already of that dtype is returned as is (no copy). A list (what engines give) goes
    through ``struct.pack``, 2-3x faster than ``np.asarray`` on Python ints and range-checked
    per value (numpy < 2 wraps silently; numpy truncates floats into ints).

    Raises:
        ValueError: a value outside the dtype's range (token id outside int32, ``loss_mask``
            outside 0..255, version outside int64), a non-integer in an integer field, or not a
            flat sequence of numbers. The text names the trajectory and the field.
    """
    dtype = PER_TOKEN_DTYPES[name]
    if isinstance(values, np.ndarray):
        if values.dtype == dtype and values.ndim == 1:
            return values if values.flags.c_contiguous else np.ascontiguousarray(values)
        problem = _array_problem(values, dtype)
        if problem:
            raise ValueError(f"trajectory {trajectory_id}: {name} cannot be sent as {dtype.name}: {problem}")
        return np.ascontiguousarray(values, dtype=dtype)
    try:
        return np.frombuffer(struct.pack(f"<{len(values)}{_STRUCT_CODES[dtype.str]}", *values), dtype=dtype)
    except (struct.error, TypeError) as e:
        raise ValueError(f"trajectory {trajectory_id}: {name} cannot be sent as {dtype.name}: {e}") from e


def topk_array(values: Any, name: str, trajectory_id: str = "?") -> np.ndarray:
    """``values`` as the 2-D, C-contiguous ``[R, K]`` array of ``TOPK_DTYPES[name]``, or ``[0, 0]``.

    An ndarray already of that dtype and 2-D is returned as is (no copy). Anything else (the
    nested lists of ``Trajectory.as_dict``, another dtype) is converted: integer values must fit
    int32 (never wrapped or truncated, as ``per_token_array``); float values are rounded to
    float32, but a finite one beyond float32's range is refused rather than made infinite. An
    empty input (``[]``, ``[0, K]`` or ``[R, 0]``) is ``[0, 0]``: nothing to carry (a response
    without a top-k, or an empty response), so every "none" compares equal and travels as K = 0.

    Raises:
        ValueError: not a rectangular 2-D array of numbers, a non-integer in
            ``teacher_topk_ids``, or a value the dtype cannot hold. The text names the
            trajectory and the field.
    """
    dtype = TOPK_DTYPES[name]
    return _held_2d(values, dtype, (trajectory_id, name, "[R, K]"), lambda: np.zeros((0, 0), dtype=dtype))


def _held_2d(values: Any, dtype: np.dtype, what: tuple[str, str, str], none: Any) -> np.ndarray:
    """``values`` as a 2-D, C-contiguous ``dtype`` array, exactly or not at all: an ndarray
    already so is returned as is; anything else is converted (integers must fit, floats are
    rounded to float32 but a finite one beyond its range is refused); an empty input is
    ``none()``. The conversion of ``topk_array`` and ``observation_image_array``; ``what`` is
    (trajectory id, field, shape) for the message, formatted only on a refusal.

    Raises:
        ValueError: not a rectangular 2-D array of numbers, or a value ``dtype`` cannot hold.
    """
    refusal = lambda: f"trajectory {what[0]}: {what[1]} cannot be held as {dtype.name} {what[2]}"  # noqa: E731
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 2 and values.size:
        return values if values.flags.c_contiguous else np.ascontiguousarray(values)
    try:
        array = np.asarray(values)  # nested lists: 2-D; ragged rows raise (numpy >= 1.24)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{refusal()}: {e}") from e
    if not array.size and array.ndim in (1, 2):
        return none()
    problem = _array_problem(array, dtype, ndim=2)
    if problem is None and dtype.kind == "f" and array.dtype.kind == "f" and array.dtype.itemsize > dtype.itemsize:
        with np.errstate(over="ignore"):
            narrowed = array.astype(dtype)
        overflowed = np.isinf(narrowed) & np.isfinite(array)
        if overflowed.any():
            problem = f"a finite value beyond float32's range ({array[overflowed][0]})"
        else:
            return np.ascontiguousarray(narrowed)
    if problem:
        raise ValueError(f"{refusal()}: {problem}")
    return np.ascontiguousarray(array, dtype=dtype)


def observation_image_array(values: Any, name: str, trajectory_id: str = "?") -> np.ndarray:
    """``values`` as the 2-D, C-contiguous array of ``OBSERVATION_IMAGE_DTYPES[name]``
    (``observation_pixel_values`` ``[N, D]`` float32, ``observation_image_grid_thw`` ``[I, 3]``
    int64), or its "none" shape (``[0, 0]``, ``[0, 3]``); exactly or not at all.

    An ndarray already of that dtype and 2-D is returned as is (no copy). Anything else (the
    nested lists of ``Trajectory.as_dict``, another dtype) is converted: grid values must be
    integers that fit int64 (never truncated); pixel values are rounded to float32, but a finite
    one beyond float32's range is refused rather than made infinite. An empty input (``[]``,
    ``[0, D]``, ``[N, 0]``) is the "none" shape (the one shared read-only array of it), so every
    "none" compares equal and travels as N = D = I = 0. The other rules (3 grid columns, finite
    pixels, grid values >= 1, N the grid's patches) are ``Trajectory``'s checks.

    Raises:
        ValueError: not a rectangular 2-D array of numbers, a non-integer in
            ``observation_image_grid_thw``, or a value the dtype cannot hold. The text names the
            trajectory and the field.
    """
    dtype = OBSERVATION_IMAGE_DTYPES[name]
    return _held_2d(values, dtype, (trajectory_id, name, "2-D"), lambda: _NO_IMAGES[name])


def _array_problem(values: np.ndarray, dtype: np.dtype, ndim: int = 1) -> str | None:
    """Why an ndarray of another dtype cannot be cast to an ``ndim``-D ``dtype`` array exactly, or ``None``."""
    if values.ndim != ndim:
        return f"a {values.ndim}-D array, expected {ndim}-D"
    if dtype.kind == "f":
        return None if values.dtype.kind in "biuf" else f"dtype {values.dtype} is not numeric"
    if values.dtype.kind not in "biu":
        return f"dtype {values.dtype} is not an integer dtype"
    info = np.iinfo(dtype)
    if values.size and (values.min() < info.min or values.max() > info.max):
        return f"values must satisfy {info.min} <= number <= {info.max}, got {values.min()}..{values.max()}"
    return None


def routed_experts_array(values: Any, trajectory_id: str = "?") -> np.ndarray:
    """``values`` as the 3-D, C-contiguous ``[tokens, num_moe_layers, top_k]`` int16 array of
    ``Trajectory.routed_experts``, or ``[0, 0, 0]`` when empty; exactly or not at all.

    Raises:
        ValueError: not a rectangular 3-D array of integers, or an index outside 0..32767. The
            text names the trajectory.
    """
    if type(values) is np.ndarray and values.dtype == ROUTED_EXPERTS_DTYPE and values.ndim == 3 and values.size:
        array = values if values.flags.c_contiguous else np.ascontiguousarray(values)
    else:
        try:
            array = np.asarray(values)
        except (ValueError, TypeError) as e:
            raise ValueError(f"trajectory {trajectory_id}: routed_experts cannot be held as int16 "
                             f"[tokens, layers, k]: {e}") from e
        if not array.size:
            return np.zeros((0, 0, 0), dtype=ROUTED_EXPERTS_DTYPE)
        problem = _array_problem(array, ROUTED_EXPERTS_DTYPE, ndim=3)
        if problem:
            raise ValueError(f"trajectory {trajectory_id}: routed_experts cannot be held as int16 "
                             f"[tokens, layers, k]: {problem}")
        array = np.ascontiguousarray(array, dtype=ROUTED_EXPERTS_DTYPE)
    if array.min() < 0:
        raise ValueError(f"trajectory {trajectory_id}: routed_experts holds a negative expert index ({array.min()})")
    return array


def _no_observation_pixels() -> np.ndarray:
    """The shared read-only ``[0, 0]`` float32 array: ``Trajectory.observation_pixel_values``
    without observation images."""
    return _NO_IMAGES["observation_pixel_values"]


def _no_observation_grid() -> np.ndarray:
    """The shared read-only ``[0, 3]`` int64 array: ``Trajectory.observation_image_grid_thw``
    without observation images."""
    return _NO_IMAGES["observation_image_grid_thw"]


def _no_routed_experts() -> np.ndarray:
    """An empty ``[0, 0, 0]`` int16 array: ``Trajectory.routed_experts`` without routing replay."""
    return np.zeros((0, 0, 0), dtype=ROUTED_EXPERTS_DTYPE)


def _no_topk_ids() -> np.ndarray:
    """An empty ``[0, 0]`` int32 array: ``Trajectory.teacher_topk_ids`` without a top-k signal."""
    return np.zeros((0, 0), dtype=TOPK_DTYPES["teacher_topk_ids"])


def _no_topk_logprobs() -> np.ndarray:
    """An empty ``[0, 0]`` float32 array: ``Trajectory.teacher_topk_logprobs`` without a top-k signal."""
    return np.zeros((0, 0), dtype=TOPK_DTYPES["teacher_topk_logprobs"])


def _no_teacher_logprobs() -> np.ndarray:
    """An empty ``[0]`` float64 array: ``Trajectory.teacher_logprobs`` of a run without a teacher."""
    return np.empty(0, dtype=PER_TOKEN_DTYPES["teacher_logprobs"])


@dataclass(eq=False)
class Trajectory:
    """One sampled response to one prompt, with everything the learner needs.

    Attributes:
        trajectory_id: unique id (``"<group_id>/<index in group>"``); the buffer drops duplicates.
        group_id: id of the group (the ``n`` samples of one prompt draw); advantages use it.
        prompt_uid: the dataset identity of the prompt (``Prompt.uid``).
        prompt_ids: prompt token ids, ``[P]`` int32.
        response_ids: sampled token ids, ``[R]`` int32 (EOS included when the response stopped).
        behavior_logprobs: log-probs of ``response_ids`` under the generator's sampling
            distribution (temperature-scaled), ``[R]`` float64.
        loss_mask: 1 for tokens the policy generated and is trained on, 0 for tool output or
            template glue, ``[R]`` uint8.
        finish_reason: ``"stop"`` (a stop token ended it), ``"length"`` (hit the token limit),
            ``"abort"`` or ``"tool_error"``.
        policy_version: the generator's policy version per response token, ``[R]`` int64 (all
            equal unless weights changed mid-generation).
        reward: scalar reward after shaping (set by the scorer).
        reward_extras: other numeric reward fields, for example ``{"acc": 1.0}``.
        response_text: decoded response (for reward and logs); for a multi-turn conversation its
            final answer (its turn and tool counts are in ``reward_extras`` under ``agent/``).
        generator_id: the generator actor that sampled it (its index in the async pool; which
            node that is: ``placement.json``), or -1 for the trainer's own engine (sync mode).
        teacher_logprobs: log-probs of ``response_ids`` under the teacher of on-policy
            distillation (``algorithm.distill``), ``[R]`` float64 (natural log, same temperature
            as ``behavior_logprobs``); an empty ``[0]`` array (the default) when the run has no
            teacher.
        teacher_topk_ids: the teacher's ``K`` most likely next tokens at the position predicting
            each response token (``algorithm.distill.signal=topk_*``), ``[R, K]`` int32; ``[0, 0]``
            (the default) without.
        teacher_topk_logprobs: their log-probs under the teacher (same temperature), ``[R, K]``
            float32; ``[0, 0]`` without.
        routed_experts: for routing replay (``algorithm.routing_replay``, a mixture-of-experts
            model), the experts the engine routed each forwarded token to,
            ``[P + R - 1, num_moe_layers, top_k]`` int16: the prompt's tokens, then the
            response's but the last (never forwarded), layers in model order
            (``async_rl.utils.moe``); ``[0, 0, 0]`` (the default) without.
        observation_pixel_values: in a multi-turn vision-language episode, the normalised
            patches of the images the environment answered with (its observations; the prompt's
            own images are the trainer's, found by ``prompt_uid``), in the order their
            placeholder tokens appear in ``response_ids``, ``[N, D]`` float32 (Qwen2-VL:
            D = 1176, N = sum over the images of t*h*w); ``[0, 0]`` (the default) without.
        observation_image_grid_thw: frames, rows and columns of patches of each of those
            images, ``[I, 3]`` int64; ``[0, 3]`` (the default) without.

    The six per-token fields are given as any sequence of numbers (engines give lists) and held
    as 1-D numpy arrays of ``PER_TOKEN_DTYPES`` (``per_token_array``); the two top-k fields as
    any ``[R, K]`` array or nested lists, held as 2-D arrays of ``TOPK_DTYPES``
    (``topk_array``); the routing as a 3-D int16 array (``routed_experts_array``); the
    observation images as 2-D arrays of ``OBSERVATION_IMAGE_DTYPES``
    (``observation_image_array``). The replay buffer and the batch builder then never touch one
    Python object per token, and the transport sends their bytes as they are. Treat them as read-only:
    a received trajectory's arrays are views of its message. Equality compares every field,
    arrays by value (and shape).

    Raises:
        ValueError: a per-token value its dtype cannot hold exactly (``per_token_array``,
            ``topk_array``), per-token fields of different lengths (``behavior_logprobs``,
            ``loss_mask`` and ``policy_version`` must have R values (``len(response_ids)``),
            ``teacher_logprobs`` 0 or R), top-k fields of different shapes (both
            ``[R, K]`` with K >= 1, or both ``[0, 0]``), routing of other than ``P + R - 1``
            rows or with a negative expert index, or observation images that
            ``observation_image_array`` refuses, pixels that are not finite (NaN or +-inf: one
            would poison the vision tower's step), a grid of other than 3 columns or with a
            value < 1, pixels without a grid or the reverse, or N other than the grid's
            sum of t*h*w. The text names the trajectory and the fields.
    """

    trajectory_id: str
    group_id: int
    prompt_uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behavior_logprobs: np.ndarray
    loss_mask: np.ndarray
    finish_reason: str
    policy_version: np.ndarray
    reward: float = 0.0
    reward_extras: dict[str, float] = field(default_factory=dict)
    response_text: str = ""
    generator_id: int = -1
    teacher_logprobs: np.ndarray = field(default_factory=_no_teacher_logprobs)
    teacher_topk_ids: np.ndarray = field(default_factory=_no_topk_ids)
    teacher_topk_logprobs: np.ndarray = field(default_factory=_no_topk_logprobs)
    routed_experts: np.ndarray = field(default_factory=_no_routed_experts)
    observation_pixel_values: np.ndarray = field(default_factory=_no_observation_pixels)
    observation_image_grid_thw: np.ndarray = field(default_factory=_no_observation_grid)

    def __post_init__(self) -> None:
        for name in PER_TOKEN_DTYPES:
            setattr(self, name, per_token_array(getattr(self, name), name, self.trajectory_id))
        n = len(self.response_ids)
        for name in TOPK_DTYPES:  # 2-D, [0, 0] when empty (as_dict's [] included)
            setattr(self, name, topk_array(getattr(self, name), name, self.trajectory_id))
        ids, lps = self.teacher_topk_ids, self.teacher_topk_logprobs
        # Both or neither, one row per response token: a top-k without its log-probs (or the
        # reverse) is a teacher stage's bug, and rows off by one would score the wrong tokens.
        if ids.shape != lps.shape or (ids.size and ids.shape[0] != n):
            raise ValueError(f"trajectory {self.trajectory_id}: teacher_topk_ids {ids.shape} and "
                             f"teacher_topk_logprobs {lps.shape} must both be [{n}, K] (K >= 1) or both [0, 0]")
        self.routed_experts = routed_experts_array(self.routed_experts, self.trajectory_id)
        forwarded = len(self.prompt_ids) + n - 1
        if self.routed_experts.size and self.routed_experts.shape[0] != forwarded:
            raise ValueError(f"trajectory {self.trajectory_id}: routed_experts has {self.routed_experts.shape[0]} "
                             f"rows; the engine forwards P + R - 1 = {forwarded} tokens")
        if not (self.observation_pixel_values is _NO_IMAGES["observation_pixel_values"]
                and self.observation_image_grid_thw is _NO_IMAGES["observation_image_grid_thw"]):
            self._check_observation_images()  # else the defaults: no observation image (a text episode)
        if not (len(self.behavior_logprobs) == len(self.loss_mask) == len(self.policy_version) == n
                and len(self.teacher_logprobs) in (0, n)):
            raise ValueError(
                f"trajectory {self.trajectory_id}: per-token fields disagree in length "
                f"(response_ids {n}, behavior_logprobs {len(self.behavior_logprobs)}, "
                f"loss_mask {len(self.loss_mask)}, policy_version {len(self.policy_version)}, "
                f"teacher_logprobs {len(self.teacher_logprobs)}, which must be 0 or {n})")

    def _check_observation_images(self) -> None:
        """Convert the observation-image fields (``observation_image_array``) and check them.

        Raises:
            ValueError: as the class docstring says; one line naming the trajectory and field.
        """
        tid = self.trajectory_id
        for name in OBSERVATION_IMAGE_DTYPES:
            setattr(self, name, observation_image_array(getattr(self, name), name, tid))
        pixels, grid = self.observation_pixel_values, self.observation_image_grid_thw
        if grid.shape[1] != 3:
            raise ValueError(f"trajectory {tid}: observation_image_grid_thw is {list(grid.shape)}, expected [I, 3] "
                             "(frames, rows and columns of patches per image)")
        if grid.size and grid.min() < 1:
            raise ValueError(f"trajectory {tid}: observation_image_grid_thw holds {grid.min()} (frames, rows and "
                             "columns of patches are >= 1)")
        if pixels.size and not (pixels.min() > -np.inf and pixels.max() < np.inf):  # NaN fails both
            raise ValueError(f"trajectory {tid}: observation_pixel_values holds NaN or +-inf "
                             f"({pixels.size - np.count_nonzero(np.isfinite(pixels))} values)")
        if bool(pixels.size) != bool(grid.size):  # patches without their images' shapes, or the reverse
            raise ValueError(f"trajectory {tid}: observation_pixel_values {list(pixels.shape)} and "
                             f"observation_image_grid_thw {list(grid.shape)} must be both present ([N, D] and "
                             "[I, 3]) or both none ([0, 0] and [0, 3])")
        patches = sum(t * h * w for t, h, w in grid.tolist())  # Python ints: no int64 overflow
        if pixels.shape[0] != patches:
            raise ValueError(f"trajectory {tid}: observation_pixel_values has {pixels.shape[0]} patches, "
                             f"observation_image_grid_thw's t*h*w sum to {patches}")

    @classmethod
    def from_checked(cls, trajectory_id: str, group_id: int, prompt_uid: str, prompt_ids: np.ndarray,
                     response_ids: np.ndarray, behavior_logprobs: np.ndarray, loss_mask: np.ndarray,
                     finish_reason: str, policy_version: np.ndarray, reward: float,
                     reward_extras: dict[str, float], response_text: str, generator_id: int,
                     teacher_logprobs: np.ndarray, teacher_topk_ids: np.ndarray | None = None,
                     teacher_topk_logprobs: np.ndarray | None = None,
                     routed_experts: np.ndarray | None = None,
                     observation_pixel_values: np.ndarray | None = None,
                     observation_image_grid_thw: np.ndarray | None = None) -> "Trajectory":
        """A trajectory from fields already in their held form, without ``__post_init__``'s checks.

        For the wire decoder (``async_rl.buffers.codec``), which has checked every field's
        type and the per-token lengths (``teacher_logprobs`` 0 or R, the top-k ``[R, K]`` or
        ``[0, 0]``, the routing ``[P + R - 1, L, k]`` with indices >= 0 or ``[0, 0, 0]``, the
        observation images ``[N, D]`` finite and ``[I, 3]`` >= 1 with N the grid's patches, or
        ``[0, 0]`` and ``[0, 3]``) and made each array itself (1-D of ``PER_TOKEN_DTYPES``, 2-D of
        ``TOPK_DTYPES``, 3-D of ``ROUTED_EXPERTS_DTYPE``, 2-D of ``OBSERVATION_IMAGE_DTYPES``);
        skipping the re-check saves a few microseconds per received trajectory. Anything else
        builds with ``Trajectory(...)``, which checks.
        Arguments: the attributes, in field order (the top-k pair ``None``: ``[0, 0]``;
        ``routed_experts`` ``None``: ``[0, 0, 0]``; ``observation_pixel_values`` ``None``:
        ``[0, 0]``; ``observation_image_grid_thw`` ``None``: ``[0, 3]``).
        """
        self = object.__new__(cls)
        self.__dict__.update(
            trajectory_id=trajectory_id, group_id=group_id, prompt_uid=prompt_uid, prompt_ids=prompt_ids,
            response_ids=response_ids, behavior_logprobs=behavior_logprobs, loss_mask=loss_mask,
            finish_reason=finish_reason, policy_version=policy_version, reward=reward,
            reward_extras=reward_extras, response_text=response_text, generator_id=generator_id,
            teacher_logprobs=teacher_logprobs,
            teacher_topk_ids=_no_topk_ids() if teacher_topk_ids is None else teacher_topk_ids,
            teacher_topk_logprobs=_no_topk_logprobs() if teacher_topk_logprobs is None else teacher_topk_logprobs,
            routed_experts=_no_routed_experts() if routed_experts is None else routed_experts,
            observation_pixel_values=(_no_observation_pixels() if observation_pixel_values is None
                                      else observation_pixel_values),
            observation_image_grid_thw=(_no_observation_grid() if observation_image_grid_thw is None
                                        else observation_image_grid_thw))
        return self

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any token (the staleness reference)."""
        return int(self.policy_version.min()) if len(self.policy_version) else 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length, in tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(np.array_equal(getattr(self, f.name), getattr(other, f.name)) if f.name in _ARRAY_FIELDS
                   else getattr(self, f.name) == getattr(other, f.name) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # mutable, so unhashable (as a dataclass with eq)

    def as_dict(self) -> dict[str, Any]:
        """Every field as plain Python (per-token arrays as lists of int / float, the ``[R, K]``
        top-k, the routing and the observation images as nested lists of rows, ``[]`` without),
        for JSON or a checkpoint; ``Trajectory(**d)`` rebuilds an equal trajectory (float32 top-k
        log-probs and pixels exactly: a float32 is a float64)."""
        return {f.name: getattr(self, f.name).tolist() if f.name in _ARRAY_FIELDS else getattr(self, f.name)
                for f in fields(self)} | {"reward_extras": dict(self.reward_extras)}


@dataclass
class TrainBatch:
    """A padded batch for the learner; see the module docstring for the alignment.

    Attributes:
        input_ids: ``[B, L]`` int64, right-padded.
        attention_mask: ``[B, L]`` int64.
        position_ids: ``[B, L]`` int64, from the attention mask.
        loss_mask: ``[B, L-1]`` float32, 1 on trainable response tokens.
        behavior_logprobs: ``[B, L-1]`` float32, 0 outside the response.
        advantages: ``[B, L-1]`` float32, 0 outside the loss mask.
        rewards: ``[B]`` float32 sequence rewards.
        group_ids: ``[B]`` int64.
        extras: other per-sample tensors keyed by name (for example ``ref_logprobs``;
            ``teacher_logprobs``, ``[B, L-1]`` float32, from ``collate`` in a distillation run;
            ``teacher_topk_ids`` int64 and ``teacher_topk_logprobs`` float32, ``[B, L-1, K]``,
            in a top-k distillation run).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn, per_sequence=None) -> "TrainBatch":
        """A batch with ``fn`` applied to every tensor (``per_sequence`` to the ``[B]`` ones if given)."""
        seq = per_sequence or fn
        return TrainBatch(
            input_ids=fn(self.input_ids), attention_mask=fn(self.attention_mask),
            position_ids=fn(self.position_ids), loss_mask=fn(self.loss_mask),
            behavior_logprobs=fn(self.behavior_logprobs), advantages=fn(self.advantages),
            rewards=seq(self.rewards), group_ids=seq(self.group_ids),
            extras={k: fn(v) for k, v in self.extras.items()},
        )

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> "TrainBatch":
        """Rows ``index`` of every tensor (a micro-batch or a rank's share)."""
        if not isinstance(index, (slice, torch.Tensor)):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device`` (itself when they already are there)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return self._map(lambda t: t.to(device, non_blocking=True))

    def trimmed(self) -> "TrainBatch":
        """The batch cut to its longest row (right padding beyond it removed): ``[B, L']`` and
        ``[B, L'-1]`` tensors with ``L' = max(attention_mask.sum(1))`` (at least 2 columns);
        ``[B, L-1, K]`` and ``[B, L, layers, k]`` extras are cut on dim 1 alike. Per-sequence
        ``[B]`` extras and the image extras (``IMAGE_EXTRAS``) are kept whole."""
        width = max(2, int(self.attention_mask.sum(1).max())) if len(self) else self.input_ids.shape[1]
        if width >= self.input_ids.shape[1]:
            return self
        full = self.input_ids.shape[1]
        cut = lambda t: t[:, :width] if t.dim() >= 2 and t.shape[1] == full else (  # noqa: E731
            t[:, : width - 1] if t.dim() >= 2 and t.shape[1] == full - 1 else t)
        trimmed = self._map(cut, per_sequence=lambda t: t)
        # A row's patches may number exactly L or L-1: the image extras are not token-aligned.
        trimmed.extras.update({k: v for k, v in self.extras.items() if k in IMAGE_EXTRAS})
        return trimmed


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, L]`` int64 that count only real tokens: ``cumsum(mask) - 1``, clamped at 0.

    Left pads get position 0 and right pads repeat the last position; neither is attended to, so
    a sequence's log-probs do not depend on where its padding sits.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def collate(trajectories: Sequence[Trajectory], pad_token_id: int,
            advantages: Sequence[Sequence[float]] | None = None, images: Sequence[Any] | None = None) -> TrainBatch:
    """Right-pad trajectories into a ``TrainBatch``.

    Args:
        trajectories: B trajectories.
        pad_token_id: id written into padded ``input_ids`` slots (never attended, never trained).
        advantages: optional per-response-token advantages, one sequence of length R_i per
            trajectory; zeros when ``None``.
        images: optional, one per trajectory: its prompt's ``ImageInputs``
            (``async_rl.data.images``; ``pixel_values`` ``[N_i, D]``, ``image_grid_thw``
            ``[I_i, 3]``) or ``None`` (a vision-language run: the trainer's dataset holds each
            prompt's images once and looks them up by ``prompt_uid``).

    Returns:
        The batch with L = max over trajectories of (P_i + R_i). When the trajectories carry the
        teacher's log-probs (on-policy distillation), ``extras["teacher_logprobs"]`` is a
        ``[B, L-1]`` float32 tensor aligned like ``behavior_logprobs`` (trajectory i's R_i values
        in slots ``P_i - 1 .. P_i + R_i - 2``), 0 elsewhere. It is there when at least one
        trajectory has a non-empty ``teacher_logprobs``; a trajectory with an empty response
        has nothing to carry and fits either way, so a batch of empty responses only has none.
        With routed experts (routing replay), ``extras["routed_experts"]`` ``[B, L, num_moe_layers,
        top_k]`` int64 in the input layout (slot t: the experts of input token t), ``-1`` where
        the engine recorded none (the last token, padding): the learner routes those itself.
        With the teacher's top-k (top-k distillation), ``extras["teacher_topk_ids"]`` (int64,
        what ``torch.gather`` takes) and ``extras["teacher_topk_logprobs"]`` (float32), both
        ``[B, L-1, K]``, hold trajectory i's R_i rows in the same slots, 0 elsewhere (id 0 in a
        slot outside the response: masked, never a signal). They are there when at least one
        trajectory has a top-k, by the same rule as ``teacher_logprobs``. With images,
        ``extras["pixel_values"]`` ``[B, max N_i, D]`` float32 (row i's patches, then zeros) and
        ``extras["image_grid_thw"]`` ``[B, max I_i, 3]`` int64 (row i's grids, then zero rows: no
        image), per row so that ``TrainBatch.select`` keeps a row's images with it
        (``IMAGE_EXTRAS``).

    Raises:
        ValueError: for an empty list, an advantage row whose length is not R_i, a batch that
            mixes trajectories with teacher log-probs and trajectories (R_i > 0) without (the
            message names the first without: a run either has a teacher or not, so the mix is a
            routing bug, and zeros in its place would train towards log-prob 0), the same mix
            for the top-k, or top-k trajectories of different K (the message names the first
            whose K differs from the batch's first: one run has one K); ``images`` of another
            length than ``trajectories``.
    """
    if not trajectories:
        raise ValueError("collate() needs at least one trajectory")
    B = len(trajectories)
    L = max(t.num_tokens for t in trajectories)
    # Filled in numpy from the trajectories' arrays (no per-token Python objects), then wrapped.
    input_ids = np.full((B, L), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, L), dtype=np.int64)
    loss_mask = np.zeros((B, L - 1), dtype=np.float32)
    behavior = np.zeros((B, L - 1), dtype=np.float32)
    adv = np.zeros((B, L - 1), dtype=np.float32)
    with_teacher = [len(t.teacher_logprobs) > 0 for t in trajectories]
    teacher = None
    if any(with_teacher):
        missing = next((t for t, has in zip(trajectories, with_teacher) if not has and len(t.response_ids)), None)
        if missing is not None:
            raise ValueError(f"collate: trajectory {missing.trajectory_id} has no teacher_logprobs, but "
                             f"{sum(with_teacher)} of the batch's {B} trajectories have them")
        teacher = np.zeros((B, L - 1), dtype=np.float32)
    topk_ids, topk_lps = _topk_buffers(trajectories, L)
    with_routing = [t.routed_experts.size > 0 for t in trajectories]
    routing = None
    if any(with_routing):
        first = trajectories[with_routing.index(True)]
        shape = first.routed_experts.shape[1:]
        other = next((t for t, has in zip(trajectories, with_routing) if not has or t.routed_experts.shape[1:] != shape),
                     None)
        if other is not None:  # a run records routing for every sample of one model, or for none
            raise ValueError(f"collate: trajectory {other.trajectory_id} has routed experts of shape "
                             f"{other.routed_experts.shape}, but the batch's first with them ({first.trajectory_id}) "
                             f"has [tokens, {shape[0]}, {shape[1]}]")
        routing = np.full((B, L, *shape), -1, dtype=np.int64)
    for i, t in enumerate(trajectories):
        P, R = len(t.prompt_ids), len(t.response_ids)
        if routing is not None:
            routing[i, : P + R - 1] = t.routed_experts
        input_ids[i, :P] = t.prompt_ids
        input_ids[i, P: P + R] = t.response_ids
        attention_mask[i, : P + R] = 1
        # Label slot P-1 predicts the first response token.
        sl = slice(P - 1, P - 1 + R)
        loss_mask[i, sl] = t.loss_mask
        behavior[i, sl] = t.behavior_logprobs
        if teacher is not None:
            teacher[i, sl] = t.teacher_logprobs
        if topk_ids is not None and R:
            topk_ids[i, sl] = t.teacher_topk_ids
            topk_lps[i, sl] = t.teacher_topk_logprobs
        if advantages is not None:
            if len(advantages[i]) != R:
                raise ValueError(f"advantages for {t.trajectory_id}: {len(advantages[i])} values for {R} tokens")
            adv[i, sl] = np.asarray(advantages[i], dtype=np.float32)
    attention = torch.from_numpy(attention_mask)
    mask = torch.from_numpy(loss_mask)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids), attention_mask=attention,
        position_ids=position_ids_from_mask(attention), loss_mask=mask,
        behavior_logprobs=torch.from_numpy(behavior), advantages=torch.from_numpy(adv) * mask,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        extras={**({} if teacher is None else {"teacher_logprobs": torch.from_numpy(teacher)}),
                **({} if topk_ids is None else {"teacher_topk_ids": torch.from_numpy(topk_ids),
                                                "teacher_topk_logprobs": torch.from_numpy(topk_lps)}),
                **({} if routing is None else {"routed_experts": torch.from_numpy(routing)}),
                **_image_extras(trajectories, images)},
    )


def _topk_buffers(trajectories: Sequence[Trajectory], L: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``collate``'s zeroed ``[B, L-1, K]`` int64 top-k ids and float32 log-probs, or
    ``(None, None)`` when no trajectory has a teacher top-k.

    Raises:
        ValueError: some trajectories (R_i > 0) with a top-k and some without, or two Ks.
    """
    B = len(trajectories)
    with_topk = [t.teacher_topk_ids.size > 0 for t in trajectories]
    if not any(with_topk):
        return None, None
    missing = next((t for t, has in zip(trajectories, with_topk) if not has and len(t.response_ids)), None)
    if missing is not None:
        raise ValueError(f"collate: trajectory {missing.trajectory_id} has no teacher_topk_ids, but "
                         f"{sum(with_topk)} of the batch's {B} trajectories have them")
    first = trajectories[with_topk.index(True)]
    k = first.teacher_topk_ids.shape[1]
    other = next((t for t, has in zip(trajectories, with_topk) if has and t.teacher_topk_ids.shape[1] != k), None)
    if other is not None:  # one [B, L-1, K] tensor cannot hold both; one run asks its teacher for one K
        raise ValueError(f"collate: trajectory {other.trajectory_id} has a teacher top-"
                         f"{other.teacher_topk_ids.shape[1]}, but the batch's first with a top-k "
                         f"({first.trajectory_id}) has a top-{k}")
    return np.zeros((B, L - 1, k), dtype=np.int64), np.zeros((B, L - 1, k), dtype=np.float32)


IMAGE_EXTRAS = ("pixel_values", "image_grid_thw")
"""``TrainBatch.extras`` of a vision-language batch (``collate``'s ``images``): per row, padded
on their own axis (patches, images), not on the token axis, so ``TrainBatch.trimmed`` keeps them."""


def _image_extras(trajectories: Sequence[Trajectory], images: Sequence[Any] | None) -> dict[str, torch.Tensor]:
    """``collate``'s ``pixel_values`` ``[B, max N_i, D]`` float32 and ``image_grid_thw``
    ``[B, max I_i, 3]`` int64 extras, or ``{}`` when no trajectory has images."""
    if images is None:
        return {}
    if len(images) != len(trajectories):
        raise ValueError(f"collate: {len(images)} image entries for {len(trajectories)} trajectories")
    present = [x for x in images if x is not None and len(x.image_grid_thw)]
    if not present:
        return {}
    dim = present[0].pixel_values.shape[1]
    pixels = np.zeros((len(images), max(len(x.pixel_values) for x in present), dim), dtype=np.float32)
    grids = np.zeros((len(images), max(len(x.image_grid_thw) for x in present), 3), dtype=np.int64)
    for i, x in enumerate(images):
        if x is not None and len(x.image_grid_thw):
            pixels[i, : len(x.pixel_values)] = x.pixel_values
            grids[i, : len(x.image_grid_thw)] = x.image_grid_thw
    return {"pixel_values": torch.from_numpy(pixels), "image_grid_thw": torch.from_numpy(grids)}

