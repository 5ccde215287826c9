"""Trajectory wire format: the codec between a ``Trajectory`` (or a group of them) and one ZeroMQ frame.

Used by both ends of ``async_rl.buffers.transport``: a sender encodes, the receiver decodes and
checks. It knows no socket, so the in-process channel of the tests runs the same bytes.

Wire format (schema version 8; msgpack, never pickle). A message is one ZeroMQ frame::

    | header length H: uint32 LE | msgpack header (H bytes) | zero pad to a multiple of 8 | body |

The header is a msgpack map. A data message is ``{"schema": 8, "kind": "trajectories",
"group_id": None or g, "trajectories": [t_0, ..., t_{k-1}]}``: ``k >= 1`` trajectories, or, with
an integer ``group_id`` (a ``TrajectoryGroup``: every kept trajectory of group ``g``), ``k >= 0``
of them that also close group ``g`` with ``k`` kept. Each ``t_i`` is a msgpack array of the
trajectory's other fields, in this order: ``trajectory_id``, ``group_id``, ``prompt_uid``,
``generator_id``, ``finish_reason``, ``reward`` (float64), ``reward_extras`` (str -> float64),
``response_text``, ``num_prompt_tokens`` (P_i), ``num_response_tokens`` (R_i),
``num_teacher_tokens`` (T_i: R_i when the trajectory carries the teacher's log-probs of on-policy
distillation, else 0), ``teacher_top_k`` (K_i: the width of the teacher's top-k a position,
0 without), ``routed_layers`` (L_i: the mixture-of-experts layers whose routing routing replay
recorded), ``routed_top_k`` (k_i: the experts a token is routed to in each of them),
``num_image_patches`` (N_i: the patches of the images the episode's environment answered with,
in a multi-turn vision-language episode), ``patch_dim`` (D_i: the values a patch) and
``num_images`` (I_i: those images); L_i and k_i are both 0 (no routing) or both >= 1, and N_i,
D_i and I_i all 0 (no observation image) or all >= 1. With ``P = sum P_i``, ``R = sum R_i``,
``T = sum T_i``, ``Q = sum R_i K_i``, ``E = sum (P_i + R_i - 1) L_i k_i`` (the routed-expert
entries: one row a forwarded token, the last response token is never forwarded), ``I = sum I_i``
and ``X = sum N_i D_i`` (the pixel values) the body holds the array fields of all ``k``
trajectories, each field's arrays back to back in trajectory order, as raw little-endian arrays
in the dtypes the ``Trajectory`` holds (``PER_TOKEN_DTYPES``, ``TOPK_DTYPES`` for the
``[R_i, K_i]`` top-k pair, ``ROUTED_EXPERTS_DTYPE`` for the ``[P_i + R_i - 1, L_i, k_i]`` routing
and ``OBSERVATION_IMAGE_DTYPES`` for the ``[I_i, 3]`` image grid and the ``[N_i, D_i]`` pixels,
row-major), in falling dtype size (8-byte, then 4-byte, the 2-byte routing, the 1-byte mask
last) so every array is aligned with no padding. The top-k pair therefore goes after the
response ids, not after the mask: its ids then extend the run of int32 token ids that the
decoder checks with one reduction; the image grid goes before the versions, which stay
adjacent to that run.

==============================  =================  ======  ======================================
body field, in order            dtype              length  byte offset
==============================  =================  ======  ======================================
``behavior_logprobs``           float64 (``<f8``)  R       0
``teacher_logprobs``            float64 (``<f8``)  T       8R
``observation_image_grid_thw``  int64   (``<i8``)  3I      8R + 8T
``policy_version``              int64   (``<i8``)  R       8R + 8T + 24I
``prompt_ids``                  int32   (``<i4``)  P       16R + 8T + 24I
``response_ids``                int32   (``<i4``)  R       16R + 8T + 24I + 4P
``teacher_topk_ids``            int32   (``<i4``)  Q       20R + 8T + 24I + 4P
``teacher_topk_logprobs``       float32 (``<f4``)  Q       20R + 8T + 24I + 4P + 4Q
``observation_pixel_values``    float32 (``<f4``)  X       20R + 8T + 24I + 4P + 8Q
``routed_experts``              int16   (``<i2``)  E       20R + 8T + 24I + 4P + 8Q + 4X
``loss_mask``                   uint8   (``u1``)   R       20R + 8T + 24I + 4P + 8Q + 4X + 2E
==============================  =================  ======  ======================================

The body is 21R + 8T + 24I + 4P + 8Q + 4X + 2E bytes, exactly. A second message kind closes a
group whose samples were all rejected, or travels on its own:
``{"schema": 8, "kind": "group_closed", "group_id": g, "num_kept": k}`` with an empty body. The
buffer's ``close_group`` accepts a closure in any order relative to the group's trajectories.

The encoder joins each array's memory as it is (no per-token Python object, no conversion). The
receiver reads the frame without copying it (``recv(copy=False)``) and the decoder wraps the
body with ``np.frombuffer``: a received trajectory's arrays are read-only views of its message.
Layout checks void the whole message (one counted, logged rejection): the frame count, the header
length, msgpack, the schema version, the kind and fields, each trajectory header's length, field
types and non-negative counts, each ``num_teacher_tokens`` 0 or that trajectory's
``num_response_tokens``, each ``teacher_top_k`` >= 0 (0 when ``num_response_tokens`` is 0), each
``routed_layers`` and ``routed_top_k`` both 0 or both >= 1 (0 when the trajectory has no token,
P_i + R_i = 0), ``num_image_patches``, ``patch_dim`` and ``num_images`` all 0 or all >= 1, and the
body size against the counts; when any of these fails no offset in the message can be trusted.
Value checks are per trajectory, so a trajectory that would crash or poison a step is one counted,
logged rejection and the rest of its message is kept: ``trajectory_id`` ends in
``/<index in group>`` (the learner orders a group by it), at least one prompt token, token ids >= 0,
``behavior_logprobs`` neither NaN nor +inf (-inf is kept: the losses clamp log-ratios),
``teacher_logprobs`` finite (neither NaN nor +inf nor -inf: the distillation term is the teacher's
minus the student's log-prob, and an infinite teacher log-prob is a teacher's fault, not a signal:
the term would sit at its +-20-nat clamp), ``teacher_topk_ids`` >= 0, ``teacher_topk_logprobs``
finite and <= 1e-6 (a log-prob, 0 up to float32 round-off), ``routed_experts`` >= 0,
``observation_pixel_values`` finite (a NaN patch would poison the vision tower's step),
``observation_image_grid_thw`` values >= 1, N_i the sum of t*h*w over the trajectory's grid rows,
``loss_mask`` values 0 or 1, policy versions >= 0, a finite ``reward`` and finite
``reward_extras`` values, and in a group message the group's id. (Token ids past the vocabulary,
and expert indices past the model's experts a layer, cannot be checked here: the transport does
not know the model; the learner's routing replay checks the experts.) The array checks run once
per message, vectorised over all its trajectories (five reductions, two more with a top-k, one
more with routing, three more with observation images, and then each N_i against a sum over its
trajectory's I_i grid rows); only a message that fails one is checked trajectory by trajectory.
A refused trajectory of a group leaves the group one sample short, so the
buffer never completes it, exactly as when it travelled alone and was refused. A message of
another schema version (schema 4: the same framing, 10 fields per trajectory header; schema 3 and
older: one msgpack map, no length prefix; schema 5: 11 fields per trajectory header, no top-k;
schema 6: 12 fields per trajectory header, no routing; schema 7: 14 fields per trajectory header,
no observation images) is refused with one line naming both versions.

History: schema 2 carried the arrays as msgpack ext types and the receiver turned them back
into Python lists (0.15-0.19x raw ZeroMQ's messages/s in ``bench/bench_transport.py``); schema 3
carried them as msgpack ``bin`` fields of one map (~0.55x, copied out of the frame by msgpack,
with fixed per-message Python work in the decoder); schema 4 keeps them out of msgpack, reads the
frame in place, checks a message's arrays in three reductions and lets a generator send a whole
group as one message. Schema 5 adds the teacher's log-probs for on-policy distillation
(``num_teacher_tokens`` and the ``teacher_logprobs`` body field; a run without a teacher sends
every T_i = 0, one more header byte per trajectory than schema 4). Schema 6 adds the teacher's
top-k next-token distribution (``teacher_top_k`` and the two ``teacher_topk_*`` body fields, 8
bytes an entry; K_i = 0 otherwise, one more header byte per trajectory). Schema 7 adds routing
replay's routed experts (``routed_layers``, ``routed_top_k`` and the ``routed_experts`` body
field, 2 bytes an entry; L_i = k_i = 0 otherwise, two more header bytes per trajectory). Schema 8
adds the observation images of a multi-turn vision-language episode (``num_image_patches``,
``patch_dim``, ``num_images`` and the ``observation_image_grid_thw`` and
``observation_pixel_values`` body fields, 24 bytes an image and 4 bytes a pixel value; a
text run sends N_i = D_i = I_i = 0, three more header bytes per trajectory). Schema 2 added
``generator_id`` (the actor that sampled it).

Why this layout: raw arrays avoid encoding 1000s of numbers one msgpack item at a time, and one
frame beats one frame per array (``bench/bench_transport.py``: raw ZeroMQ moves ~1.6x more 25 KB
messages/s as 1 frame than as 6). Log-probs are float64, so a Python float round-trips bit-exactly
(the teacher's top-k log-probs and the observation images' pixels are float32, what the teacher
and the image processor compute, and travel bit-exactly as such); token ids must fit int32, expert
indices int16 and ``loss_mask`` values 0..255, else building the ``Trajectory`` raises
``ValueError`` rather than wrap around (the decoder then accepts only what the checks above
allow). Expert indices are int16 (0..32,767, more experts a layer than any model has) because
routing is the largest field a mixture-of-experts run sends: ``(P + R - 1) L k`` entries a
trajectory, 768 bytes a forwarded token at 48 layers x top-8, where a response token's other
fields take 21. An observation image is larger still (Qwen2-VL: 4,704 bytes a patch, four patches
a placeholder token), so its pixels travel as raw float32 too, never one msgpack item a value.

Run the tests with ``python -m pytest -q tests/test_transport.py``; measure throughput with
``python bench/bench_transport.py``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from async_rl.buffers.trajectory import (
    OBSERVATION_IMAGE_DTYPES, PER_TOKEN_DTYPES, ROUTED_EXPERTS_DTYPE, TOPK_DTYPES, Trajectory, observation_image_array,
    per_token_array, routed_experts_array, topk_array,
)

SCHEMA_VERSION = 8
"""Version of the wire format above; bump it on any change to the fields, their encoding or the framing."""

_NUM_FRAMES = 1
_LENGTH = 4
"""Bytes of the little-endian header length that opens a frame."""
# One trajectory's header: a msgpack array of these fields, in this order, of these exact types
# (msgpack makes no subclasses, and a bool, an int subclass, in a count or id field is a sender bug).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "trajectory_id": (str,), "group_id": (int,), "prompt_uid": (str,), "generator_id": (int,),
    "finish_reason": (str,), "reward": (float, int), "reward_extras": (dict,), "response_text": (str,),
    "num_prompt_tokens": (int,), "num_response_tokens": (int,), "num_teacher_tokens": (int,),
    "teacher_top_k": (int,), "routed_layers": (int,), "routed_top_k": (int,),
    "num_image_patches": (int,), "patch_dim": (int,), "num_images": (int,),
}
_FIELD_NAMES = tuple(_FIELD_TYPES)
# The common case in one comparison (a float reward); anything else takes the per-field loop.
_USUAL_TYPES = tuple(kinds[0] for kinds in _FIELD_TYPES.values())
(_TID, _GID, _UID, _GEN, _FINISH, _REWARD, _EXTRAS, _TEXT, _P, _R, _T, _K, _L, _KR, _NX, _DX,
 _IX) = range(len(_FIELD_TYPES))
_HEADER_FIELDS = frozenset({"schema", "kind", "group_id", "trajectories"})
# Body order: falling dtype size, so every array starts aligned when the body does.
_F8, _I8, _I4, _U1 = (PER_TOKEN_DTYPES[n] for n in ("behavior_logprobs", "policy_version", "prompt_ids", "loss_mask"))
_BYTES_PER_RESPONSE_TOKEN = _F8.itemsize + _I8.itemsize + _I4.itemsize + _U1.itemsize  # 21
_BYTES_PER_TEACHER_TOKEN = _F8.itemsize  # 8
_BYTES_PER_PROMPT_TOKEN = _I4.itemsize  # 4
_F4 = TOPK_DTYPES["teacher_topk_logprobs"]
assert TOPK_DTYPES["teacher_topk_ids"] == _I4  # the top-k ids extend the int32 run of token ids
_BYTES_PER_TOPK_ENTRY = _I4.itemsize + _F4.itemsize  # 8: an id and its log-prob
_I2 = ROUTED_EXPERTS_DTYPE
_BYTES_PER_ROUTED_ENTRY = _I2.itemsize  # 2: one expert index
assert OBSERVATION_IMAGE_DTYPES == {"observation_pixel_values": _F4, "observation_image_grid_thw": _I8}
_BYTES_PER_IMAGE = 3 * _I8.itemsize  # 24: one grid row (t, h, w)
_BYTES_PER_PIXEL_VALUE = _F4.itemsize  # 4
_PAD = bytes(7)
_BODY_ORDER = ("behavior_logprobs", "teacher_logprobs", "observation_image_grid_thw", "policy_version", "prompt_ids",
               "response_ids", "teacher_topk_ids", "teacher_topk_logprobs", "observation_pixel_values",
               "routed_experts", "loss_mask")
"""Body fields in order; each is the concatenation over the message's trajectories."""
_PER_TOKEN_ORDER = tuple(name for name in _BODY_ORDER if name in PER_TOKEN_DTYPES)
"""The 1-D per-token fields among them (the top-k pair is ``[R, K]``, the routing
``[P + R - 1, L, k]`` and the observation images ``[I, 3]`` and ``[N, D]``, all sent flat)."""
_PER_TOKEN_BODY_DTYPES = tuple(PER_TOKEN_DTYPES[name] for name in _PER_TOKEN_ORDER)
# The encoder's per-trajectory list in _BODY_ORDER: the per-token fields with the grid after the
# teacher's log-probs (8-byte, before the versions, which stay adjacent to the int32 run of ids)
# and the top-k pair, the pixels and the routing before the loss mask, the one 1-byte field.
assert _PER_TOKEN_ORDER == ("behavior_logprobs", "teacher_logprobs", "policy_version", "prompt_ids", "response_ids",
                            "loss_mask")
assert _BODY_ORDER == (*_PER_TOKEN_ORDER[:2], "observation_image_grid_thw", *_PER_TOKEN_ORDER[2:5], *TOPK_DTYPES,
                       "observation_pixel_values", "routed_experts", "loss_mask")
_OPTIONAL_FIELDS = (frozenset(TOPK_DTYPES), frozenset({"routed_experts"}), frozenset(OBSERVATION_IMAGE_DTYPES))
_SENT_FIELDS = {flags: tuple(i for i, name in enumerate(_BODY_ORDER)
                             if all(flag or name not in group for group, flag in zip(_OPTIONAL_FIELDS, flags)))
                for flags in itertools.product((False, True), repeat=len(_OPTIONAL_FIELDS))}
"""The indices into ``_BODY_ORDER`` of the fields an encoder joins, by whether any trajectory of
the message has a top-k, a routing, observation images: a field none has is empty."""
_ndarray = np.ndarray
_STR, _FLOAT = frozenset({str}), frozenset({float})
# Reductions called directly: ``ndarray.min()`` adds a Python-level wrapper per call.
_min, _max = np.minimum.reduce, np.maximum.reduce
_frombuffer, _isfinite, _from_checked = np.frombuffer, math.isfinite, Trajectory.from_checked
_NO_I4, _NO_F4, _NO_I2 = np.zeros(0, dtype=_I4), np.zeros(0, dtype=_F4), np.zeros(0, dtype=_I2)
_NO_I8 = np.zeros(0, dtype=_I8)
_NO_IMAGES = (0, 0, 0)  # N, D, I of a trajectory without observation images
# Shared by every decoded trajectory without a top-k (without routing, without observation
# images): read-only like the views of a message.
_NO_TOPK_IDS, _NO_TOPK_LPS = np.zeros((0, 0), dtype=_I4), np.zeros((0, 0), dtype=_F4)
_NO_ROUTED = np.zeros((0, 0, 0), dtype=_I2)
# The observation images' "none" is the Trajectory's own shared pair, so a decoded text trajectory
# rebuilt by ``Trajectory(...)`` (``dataclasses.replace``) takes its fast path.
_NO_PIXELS = observation_image_array([], "observation_pixel_values")
_NO_GRID = observation_image_array([], "observation_image_grid_thw")
for _none in (_NO_TOPK_IDS, _NO_TOPK_LPS, _NO_ROUTED, _NO_PIXELS, _NO_GRID):
    _none.flags.writeable = False
del _none


_MAX_LOGPROB = 1e-6
"""Largest teacher top-k log-prob accepted: 0 up to float32 round-off (a float32 log-softmax of a
near-certain token can come out a few 1e-8 above 0; a larger one is not a log-prob)."""

_TRAJECTORY_ID = re.compile(r".*/[0-9]+", re.DOTALL)
"""``"<group>/<index in group>"``: the learner sorts a group's samples by the index."""


class MalformedMessageError(ValueError):
    """A received message (or one trajectory of it) is not valid schema ``SCHEMA_VERSION``; the text says why."""


# ------------------------------------------------------------------------------------------ codec
@dataclass(frozen=True)
class GroupClosed:
    """Control message: group ``group_id`` is finished with ``num_kept`` trajectories sent.

    Attributes:
        group_id: the group's id.
        num_kept: trajectories of the group that were sent (>= 0); the rest were rejected.
    """

    group_id: int
    num_kept: int


@dataclass(frozen=True)
class TrajectoryGroup:
    """Every kept trajectory of one finished group, sent as one message that also closes it.

    The receiver hands on ``trajectories`` one by one, then ``GroupClosed(group_id,
    len(trajectories))``: the same messages as sending each trajectory and the closure alone, for
    one message's fixed cost instead of ``len(trajectories) + 1``.

    Attributes:
        group_id: the group's id; every trajectory's ``group_id`` must equal it.
        trajectories: the group's kept trajectories (any number, 0 for a group the reward
            rejected whole).
    """

    group_id: int
    trajectories: Sequence[Trajectory]


Message = Trajectory | GroupClosed | TrajectoryGroup
"""What travels from async_rl.generators to the buffer (a receiver hands on ``Trajectory`` and
``GroupClosed`` only: a ``TrajectoryGroup`` arrives as its parts)."""


def pack_frame(header: Any, body: Sequence[Any] = ()) -> bytes:
    """One frame: the 4-byte header length, the msgpack ``header``, zero padding to a
    multiple of 8 bytes, then the ``body`` buffers back to back (module docstring).

    Args:
        header: any msgpack-able value (the codec passes the header map; tests pass anything).
        body: buffer-protocol objects (C-contiguous arrays, bytes), concatenated as they are.

    Returns:
        The frame (one copy of every body buffer).
    """
    head = msgpack.packb(header, use_bin_type=True)
    pad = -(_LENGTH + len(head)) % 8
    return b"".join([len(head).to_bytes(_LENGTH, "little"), head, _PAD[:pad], *body])


def split_frame(frame: Any) -> tuple[Any, memoryview]:
    """The header (unpacked) and the body (a view, padding removed) of one frame: ``pack_frame``'s inverse.

    Raises:
        MalformedMessageError: a frame shorter than its header length says, or a header that is
            not msgpack. A frame of schema 3 or older (one msgpack map, no length prefix) is
            refused with its version named.
    """
    view = memoryview(frame)
    size = len(view)
    head_len = int.from_bytes(view[:_LENGTH], "little") if size >= _LENGTH else -1
    start = -(-(_LENGTH + head_len) // 8) * 8
    if head_len < 0 or start > size:
        _refuse_old_schema(view)
        raise MalformedMessageError(f"message is {size} bytes, too short for its header "
                                    f"({'no length' if head_len < 0 else f'{head_len} bytes'})")
    try:
        header = msgpack.unpackb(view[_LENGTH:_LENGTH + head_len], raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        _refuse_old_schema(view)
        raise MalformedMessageError(f"message header is not valid msgpack: {type(e).__name__}: {e}") from e
    return header, view[start:]


def _refuse_old_schema(view: memoryview) -> None:
    """Name the version of a schema <= 3 message (one msgpack map, no framing); else return."""
    try:
        old = msgpack.unpackb(view, raw=False, strict_map_key=False)
    except Exception:  # not an old message either: the caller's error stands
        return
    if isinstance(old, dict) and "schema" in old:
        raise MalformedMessageError(
            f"schema version {old['schema']!r:.40}, this decoder reads version {SCHEMA_VERSION} "
            "(sender and receiver run different async-rl versions?)")


def _topk_arrays(traj: Trajectory) -> tuple[np.ndarray, np.ndarray, int]:
    """The trajectory's teacher top-k as flat ``<i4`` ids and ``<f4`` log-probs (views of the
    held ``[R, K]`` arrays, row-major), and K (0: none, two empty arrays).

    Raises:
        ValueError: a field reassigned after construction that ``topk_array`` refuses, or shapes
            other than ``[R, K]`` for both.
    """
    ids, lps = traj.teacher_topk_ids, traj.teacher_topk_logprobs
    if type(ids) is _ndarray and type(lps) is _ndarray and not ids.size and not lps.size:
        return _NO_I4, _NO_F4, 0  # the usual case first: no top-k
    if not (type(ids) is _ndarray and ids.dtype == _I4 and ids.ndim == 2 and ids.flags.c_contiguous
            and type(lps) is _ndarray and lps.dtype == _F4 and lps.ndim == 2 and lps.flags.c_contiguous):
        # Reassigned after construction: converted exactly (or refused) as the constructor would.
        ids = topk_array(ids, "teacher_topk_ids", traj.trajectory_id)
        lps = topk_array(lps, "teacher_topk_logprobs", traj.trajectory_id)
    if not ids.size and not lps.size:
        return _NO_I4, _NO_F4, 0
    if ids.shape != lps.shape or ids.shape[0] != len(traj.response_ids):  # would void a whole group
        raise ValueError(f"trajectory {traj.trajectory_id}: teacher_topk_ids {ids.shape} and teacher_topk_logprobs "
                         f"{lps.shape} must both be [{len(traj.response_ids)}, K]")
    return ids.reshape(-1), lps.reshape(-1), ids.shape[1]


def _routed_array(traj: Trajectory) -> tuple[np.ndarray, int, int]:
    """The trajectory's routed experts as flat ``<i2`` indices (a view of the held
    ``[P + R - 1, L, k]`` array, row-major), L and k (0, 0: none, an empty array).

    Raises:
        ValueError: a field reassigned after construction that ``routed_experts_array`` refuses
            (not a 3-D array of integers, an index outside 0..32767), or a row count other than
            P + R - 1.
    """
    routed = traj.routed_experts
    if type(routed) is _ndarray and not routed.size:
        return _NO_I2, 0, 0  # the usual case first: no routing
    if not (type(routed) is _ndarray and routed.dtype == _I2 and routed.ndim == 3 and routed.flags.c_contiguous):
        # Reassigned after construction: converted exactly (or refused) as the constructor would.
        routed = routed_experts_array(routed, traj.trajectory_id)
        if not routed.size:
            return _NO_I2, 0, 0
    num_prompt, num_response = len(traj.prompt_ids), len(traj.response_ids)
    if routed.shape[0] != num_prompt + num_response - 1:  # would void a whole group
        raise ValueError(f"trajectory {traj.trajectory_id}: routed_experts has {routed.shape[0]} rows for "
                         f"{num_prompt} prompt and {num_response} response tokens (P + R - 1 = "
                         f"{num_prompt + num_response - 1} forwarded tokens)")
    return routed.reshape(-1), routed.shape[1], routed.shape[2]


def _observation_image_arrays(traj: Trajectory) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """The trajectory's observation images as a flat ``<i8`` grid (a view of the held ``[I, 3]``
    array) and flat ``<f4`` pixels (of the held ``[N, D]``), row-major, and ``(N, D, I)``
    (``(0, 0, 0)``: none, two empty arrays).

    Raises:
        ValueError: a field reassigned after construction that ``observation_image_array``
            refuses, or shapes the wire cannot carry: a grid of other than 3 columns, pixels
            without a grid or the reverse. (Values are the receiver's to check: it rejects that
            one trajectory, as it does a NaN log-prob.)
    """
    pixels, grid = traj.observation_pixel_values, traj.observation_image_grid_thw
    if type(pixels) is _ndarray and type(grid) is _ndarray and not pixels.size and not grid.size:
        return _NO_I8, _NO_F4, _NO_IMAGES  # the usual case first: no observation image
    if not (type(pixels) is _ndarray and pixels.dtype == _F4 and pixels.ndim == 2 and pixels.flags.c_contiguous
            and type(grid) is _ndarray and grid.dtype == _I8 and grid.ndim == 2 and grid.flags.c_contiguous):
        # Reassigned after construction: converted exactly (or refused) as the constructor would.
        pixels = observation_image_array(pixels, "observation_pixel_values", traj.trajectory_id)
        grid = observation_image_array(grid, "observation_image_grid_thw", traj.trajectory_id)
    if not pixels.size and not grid.size:
        return _NO_I8, _NO_F4, _NO_IMAGES
    if grid.shape[1] != 3 or not pixels.size or not grid.size:  # no [N, D] / [I, 3] the header can state
        raise ValueError(f"trajectory {traj.trajectory_id}: observation_pixel_values {list(pixels.shape)} and "
                         f"observation_image_grid_thw {list(grid.shape)} must be both present ([N, D] and [I, 3]) "
                         "or both none")
    return grid.reshape(-1), pixels.reshape(-1), (pixels.shape[0], pixels.shape[1], grid.shape[0])


def _trajectory_header(traj: Trajectory, top_k: int, routed_layers: int, routed_top_k: int,
                       images: tuple[int, int, int]) -> list[Any]:
    """Trajectory ``traj``'s header: its fields in ``_FIELD_TYPES`` order (``images``: N, D, I).

    Raises:
        ValueError: a ``teacher_logprobs`` of neither 0 nor R values, or a non-numeric
            ``reward_extras`` value.
    """
    num_response, num_teacher = len(traj.response_ids), len(traj.teacher_logprobs)
    if num_teacher and num_teacher != num_response:  # reassigned after construction: would void a whole group
        raise ValueError(f"trajectory {traj.trajectory_id}: teacher_logprobs has {num_teacher} values for "
                         f"{num_response} response tokens (0 or {num_response})")
    try:
        extras = {str(k): float(v) for k, v in traj.reward_extras.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"trajectory {traj.trajectory_id}: reward_extras must map str -> float ({e})") from e
    return [traj.trajectory_id, int(traj.group_id), traj.prompt_uid, int(traj.generator_id), traj.finish_reason,
            float(traj.reward), extras, traj.response_text, len(traj.prompt_ids), num_response, num_teacher, top_k,
            routed_layers, routed_top_k, *images]


def encode_trajectories(trajectories: Sequence[Trajectory], group_id: int | None = None) -> list[bytes]:
    """Encode trajectories as one schema-8 message (module docstring).

    Args:
        trajectories: the trajectories; at least one unless ``group_id`` is given. Their
            per-token arrays are packed as they are (a field reassigned after construction is
            converted first); ``reward`` and ``reward_extras`` values are sent as float.
        group_id: ``None``: a plain batch of trajectories. An id: the message also closes that
            group with ``len(trajectories)`` kept (``TrajectoryGroup``).

    Returns:
        The message's frames: one ``bytes`` frame.

    Raises:
        ValueError: a per-token field its wire dtype cannot hold (``per_token_array``: a token
            id outside int32, a ``loss_mask`` value outside 0..255, a non-integer in an integer
            field, not a flat sequence of numbers), a non-numeric ``reward_extras`` value, a
            ``teacher_logprobs`` of neither 0 nor R values, a teacher top-k not ``[R, K]``, or
            routed experts that ``routed_experts_array`` refuses or of a row count other than
            P + R - 1, observation images that ``observation_image_array`` refuses or of shapes
            other than ``[N, D]`` and ``[I, 3]`` (each reassigned after construction), no
            trajectory without a ``group_id``, or a trajectory of another group than ``group_id``.
    """
    if group_id is None and not trajectories:
        raise ValueError("encode_trajectories: no trajectory to send (and no group to close)")
    headers, arrays = [], []
    with_topk = with_routing = with_images = False
    for traj in trajectories:
        if group_id is not None and traj.group_id != group_id:
            raise ValueError(f"trajectory {traj.trajectory_id} of group {traj.group_id} sent in group {group_id}")
        topk_ids, topk_lps, top_k = _topk_arrays(traj)
        routed, routed_layers, routed_top_k = _routed_array(traj)
        grid, pixels, images = _observation_image_arrays(traj)
        if top_k:
            with_topk = True
        if routed_layers:
            with_routing = True
        if images[2]:
            with_images = True
        headers.append(_trajectory_header(traj, top_k, routed_layers, routed_top_k, images))
        held = [getattr(traj, name) for name in _PER_TOKEN_ORDER]
        if not all(type(a) is _ndarray and a.dtype == dt and a.ndim == 1 and a.flags.c_contiguous
                   for a, dt in zip(held, _PER_TOKEN_BODY_DTYPES)):  # a field reassigned after construction
            held = [per_token_array(a, name, traj.trajectory_id) for a, name in zip(held, _PER_TOKEN_ORDER)]
        behavior, teacher, versions, prompt, response, mask = held
        arrays.append((behavior, teacher, grid, versions, prompt, response, topk_ids, topk_lps, pixels, routed,
                       mask))  # _BODY_ORDER
    # All trajectories' arrays of one field back to back, fields in _BODY_ORDER: the decoder
    # checks each field of the whole message with one reduction (the versions, the prompt and
    # response ids and the top-k ids, adjacent runs of int32 words, with one together). A field
    # that no trajectory has adds no byte: leaving its empty arrays out saves joining them.
    body = [a[i] for i in _SENT_FIELDS[with_topk, with_routing, with_images] for a in arrays]
    return [pack_frame({"schema": SCHEMA_VERSION, "kind": "trajectories",
                        "group_id": None if group_id is None else int(group_id), "trajectories": headers}, body)]



def encode_trajectory(traj: Trajectory) -> list[bytes]:
    """``encode_trajectories([traj])``: one trajectory as one message (same errors)."""
    return encode_trajectories([traj])


def encode_message(msg: Message) -> list[bytes]:
    """Frames of a ``Trajectory``, a ``TrajectoryGroup`` (``encode_trajectories``) or a ``GroupClosed``.

    Raises:
        ValueError: as ``encode_trajectories``, or a negative ``num_kept``.
        TypeError: any other object.
    """
    if isinstance(msg, Trajectory):
        return encode_trajectories([msg])
    if isinstance(msg, TrajectoryGroup):
        return encode_trajectories(msg.trajectories, msg.group_id)
    if isinstance(msg, GroupClosed):
        if msg.num_kept < 0:
            raise ValueError(f"GroupClosed({msg.group_id}): num_kept must be >= 0, got {msg.num_kept}")
        return [pack_frame({"schema": SCHEMA_VERSION, "kind": "group_closed", "group_id": int(msg.group_id),
                            "num_kept": int(msg.num_kept)})]
    raise TypeError(f"cannot send a {type(msg).__name__}: only Trajectory, TrajectoryGroup and GroupClosed travel")


def _decode_group_closed(header: dict, body: memoryview) -> GroupClosed:
    if set(header) != {"schema", "kind", "group_id", "num_kept"} or len(body):
        raise MalformedMessageError(f"group_closed message has fields {sorted(header, key=str)} "
                                    f"and a {len(body)}-byte body")
    gid, kept = header["group_id"], header["num_kept"]
    if type(gid) is not int or type(kept) is not int or kept < 0:
        raise MalformedMessageError(f"group_closed message has group_id {gid!r:.40} and num_kept {kept!r:.40}")
    return GroupClosed(gid, kept)


def _check_fields(entry: Any, index: int) -> None:
    """Types and counts of trajectory ``index``'s header (a failure voids the whole message's layout);
    the image counts are ``_check_image_counts``'s, called where they are summed."""
    if type(entry) is not list or len(entry) != len(_FIELD_TYPES):
        raise MalformedMessageError(f"trajectory header {index} is a msgpack {type(entry).__name__} of "
                                    f"{len(entry) if hasattr(entry, '__len__') else '?'} items, expected an array "
                                    f"of {len(_FIELD_TYPES)} ({', '.join(_FIELD_NAMES)})")
    if tuple(map(type, entry)) != _USUAL_TYPES:
        for key, kinds, value in zip(_FIELD_NAMES, _FIELD_TYPES.values(), entry):
            if type(value) not in kinds:
                raise MalformedMessageError(f"field {key!r} of trajectory header {index} is {type(value).__name__}, "
                                            f"expected {' or '.join(k.__name__ for k in kinds)}")
    if entry[_P] < 0 or entry[_R] < 0:
        raise MalformedMessageError(f"field 'num_prompt_tokens' or 'num_response_tokens' of trajectory header "
                                    f"{index} is negative ({entry[_P]}, {entry[_R]})")
    if entry[_T] != 0 and entry[_T] != entry[_R]:  # a negative count included
        raise MalformedMessageError(f"field 'num_teacher_tokens' of trajectory header {index} is {entry[_T]}, "
                                    f"expected 0 or num_response_tokens ({entry[_R]})")
    if entry[_K] < 0 or (entry[_K] and not entry[_R]):
        raise MalformedMessageError(f"field 'teacher_top_k' of trajectory header {index} is {entry[_K]}, "
                                    f"expected >= 0, and 0 when num_response_tokens is 0 (it is {entry[_R]})")
    layers, top_k = entry[_L], entry[_KR]
    if layers or top_k:
        if layers < 1 or top_k < 1:  # one without the other: no [P + R - 1, L, k] shape to read
            raise MalformedMessageError(f"fields 'routed_layers' and 'routed_top_k' of trajectory header {index} are "
                                        f"{layers} and {top_k}, expected both 0 (no routing) or both >= 1")
        if not entry[_P] + entry[_R]:  # P + R - 1 = -1 rows: a negative entry count
            raise MalformedMessageError(f"fields 'routed_layers' and 'routed_top_k' of trajectory header {index} are "
                                        f"{layers} and {top_k}, expected 0 for a trajectory without a token "
                                        "(num_prompt_tokens and num_response_tokens are 0)")
    extras = entry[_EXTRAS]
    if not (_STR.issuperset(map(type, extras)) and _FLOAT.issuperset(map(type, extras.values()))):
        raise MalformedMessageError(f"reward_extras must map str -> float, got {extras!r:.200}")


def _check_image_counts(entry: list, index: int) -> None:
    """N_i, D_i and I_i of trajectory ``index``'s header (``_check_fields`` passed), one of them
    non-zero: all must be >= 1 (a failure voids the whole message's layout)."""
    if entry[_NX] < 1 or entry[_DX] < 1 or entry[_IX] < 1:  # no [N, D] / [I, 3] shape to read
        raise MalformedMessageError(
            f"fields 'num_image_patches', 'patch_dim' and 'num_images' of trajectory header {index} are "
            f"{entry[_NX]}, {entry[_DX]} and {entry[_IX]}, expected all 0 (no observation image) or all >= 1")


def _value_problems(entry: list, arrays: dict[str, np.ndarray], group_id: int | None) -> str | None:
    """What one trajectory holds that the learner cannot train on (module docstring), or ``None``."""
    tid = entry[_TID]
    if not _TRAJECTORY_ID.fullmatch(tid):
        return f"trajectory_id {tid!r:.100} is not '<group>/<index in group>'"
    problems = []
    if group_id is not None and entry[_GID] != group_id:
        problems.append(f"group_id {entry[_GID]} in a message of group {group_id}")
    if entry[_P] == 0:
        problems.append("no prompt token")
    for name in ("prompt_ids", "response_ids"):
        if arrays[name].size and _min(arrays[name]) < 0:
            problems.append(f"{name} holds a negative token id ({_min(arrays[name])})")
    logprobs = arrays["behavior_logprobs"]
    if logprobs.size and not _max(logprobs) < math.inf:  # max is NaN when any is; NaN < inf is False
        problems.append(f"behavior_logprobs holds NaN or +inf ({int((np.isnan(logprobs) | np.isposinf(logprobs)).sum())} "
                        "tokens)")
    teacher = arrays["teacher_logprobs"]
    num_bad = int(teacher.size - np.count_nonzero(np.isfinite(teacher))) if teacher.size else 0
    if num_bad:
        problems.append(f"teacher_logprobs holds NaN or +-inf ({num_bad} tokens)")
    topk_ids, topk_lps = arrays["teacher_topk_ids"].reshape(-1), arrays["teacher_topk_logprobs"].reshape(-1)
    if topk_ids.size and _min(topk_ids) < 0:
        problems.append(f"teacher_topk_ids holds a negative token id ({_min(topk_ids)})")
    num_bad = int(topk_lps.size - np.count_nonzero(np.isfinite(topk_lps) & (topk_lps <= _MAX_LOGPROB)))
    if num_bad:
        problems.append(f"teacher_topk_logprobs holds NaN, +-inf or a positive log-prob (> {_MAX_LOGPROB}; "
                        f"{num_bad} values)")
    routed = arrays["routed_experts"].reshape(-1)  # reduce over every axis, not the first only
    if routed.size and _min(routed) < 0:
        problems.append(f"routed_experts holds a negative expert index ({_min(routed)})")
    problems += _image_problems(arrays["observation_pixel_values"], arrays["observation_image_grid_thw"])
    if arrays["loss_mask"].size and _max(arrays["loss_mask"]) > 1:
        problems.append(f"loss_mask holds {_max(arrays['loss_mask'])} (0 or 1 only)")
    if arrays["policy_version"].size and _min(arrays["policy_version"]) < 0:
        problems.append(f"policy_version holds {_min(arrays['policy_version'])} (versions are >= 0)")
    if not math.isfinite(entry[_REWARD]):
        problems.append(f"reward is {entry[_REWARD]!r}")
    bad_extras = sorted(k for k, v in entry[_EXTRAS].items() if not math.isfinite(v))
    if bad_extras:
        problems.append(f"reward_extras {bad_extras!r:.100} are not finite")
    return f"trajectory {tid!r:.100}: " + "; ".join(problems) if problems else None


def _image_problems(pixels: np.ndarray, grid: np.ndarray) -> list[str]:
    """What one trajectory's ``[N, D]`` pixels and ``[I, 3]`` grid hold that the learner cannot
    train on (module docstring): each problem one phrase naming its field, ``[]`` when none."""
    problems = []
    flat = pixels.reshape(-1)
    num_bad = int(flat.size - np.count_nonzero(np.isfinite(flat))) if flat.size else 0
    if num_bad:
        problems.append(f"observation_pixel_values holds NaN or +-inf ({num_bad} values)")
    if grid.size and _min(grid.reshape(-1)) < 1:
        problems.append(f"observation_image_grid_thw holds {_min(grid.reshape(-1))} (frames, rows and columns of "
                        "patches are >= 1)")
    elif grid.size and _num_patches(grid) != len(pixels):
        problems.append(f"observation_pixel_values holds {len(pixels)} patches for an observation_image_grid_thw "
                        f"of {_num_patches(grid)} (the sum of t*h*w)")
    return problems


def _patch_counts_agree(entries: list, grids: np.ndarray) -> bool:
    """Whether each trajectory header of ``entries`` with images has N_i patches: the sum of t*h*w
    over its I_i rows of ``grids`` (the message's flat ``[3 I]`` int64 grids, in trajectory order),
    in Python ints (exact: int64 products of a hostile message's values could wrap onto N_i)."""
    rows = iter(grids.reshape(-1, 3).tolist())
    return all(sum(t * h * w for t, h, w in itertools.islice(rows, entry[_IX])) == entry[_NX]
               for entry in entries if entry[_IX])


def _num_patches(grid: np.ndarray) -> int:
    """The patches of an ``[I, 3]`` grid, sum of t*h*w over its rows, in Python ints (exact:
    int64 products of a hostile message's values could wrap onto N)."""
    return sum(t * h * w for t, h, w in grid.tolist())


def _message_arrays(entries: list, body: memoryview) -> tuple[int, tuple[np.ndarray, ...], bool]:
    """Check each trajectory header of ``entries`` (``_check_fields``) and return the message's
    body arrays: ``(P, (behavior log-probs, teacher log-probs, image grids, versions, token ids
    (all prompts, then all responses), top-k ids, top-k log-probs, pixels, routed experts, loss
    mask), ok)``, each a read-only view of ``body`` (flat, all trajectories back to back), with
    ``ok`` false when a message-wide value check failed (then each trajectory is checked on its own).

    Raises:
        MalformedMessageError: a malformed trajectory header, or a body whose size does not match
            the headers' counts.
    """
    num_prompt = num_response = num_teacher = num_topk = num_routed = num_images = num_pixels = 0
    for index, entry in enumerate(entries):
        _check_fields(entry, index)
        num_prompt += entry[_P]
        num_response += entry[_R]
        num_teacher += entry[_T]
        num_topk += entry[_R] * entry[_K]
        if entry[_L]:  # then P + R >= 1 (checked): a count >= 0
            num_routed += (entry[_P] + entry[_R] - 1) * entry[_L] * entry[_KR]
        if entry[_IX] or entry[_NX] or entry[_DX]:  # read once here, where they are summed
            _check_image_counts(entry, index)
            num_images += entry[_IX]
            num_pixels += entry[_NX] * entry[_DX]
    p, r, t, q, e, i, x = num_prompt, num_response, num_teacher, num_topk, num_routed, num_images, num_pixels
    expected = (r * _BYTES_PER_RESPONSE_TOKEN + t * _BYTES_PER_TEACHER_TOKEN + p * _BYTES_PER_PROMPT_TOKEN
                + q * _BYTES_PER_TOPK_ENTRY + e * _BYTES_PER_ROUTED_ENTRY + i * _BYTES_PER_IMAGE
                + x * _BYTES_PER_PIXEL_VALUE)
    if len(body) != expected:
        raise MalformedMessageError(
            f"message body is {len(body)} bytes, expected {expected} for {len(entries)} trajectories "
            f"({p} prompt, {r} response and {t} teacher tokens, {q} top-k and {e} routed-expert entries, "
            f"{i} observation images and {x} pixel values)")
    logprobs = _frombuffer(body, _F8, r, 0)
    teacher = _frombuffer(body, _F8, t, 8 * r)
    grids = _frombuffer(body, _I8, 3 * i, 8 * (r + t)) if i else _NO_I8  # a text run: no view to make
    at_versions = 8 * (r + t) + 24 * i
    versions = _frombuffer(body, _I8, r, at_versions)
    token_ids = _frombuffer(body, _I4, p + r, at_versions + 8 * r)  # all prompts, then all responses
    at_topk = at_versions + 12 * r + 4 * p
    topk_ids = _frombuffer(body, _I4, q, at_topk)
    topk_lps = _frombuffer(body, _F4, q, at_topk + 4 * q)
    pixels = _frombuffer(body, _F4, x, at_topk + 8 * q) if x else _NO_F4
    routed = _frombuffer(body, _I2, e, at_topk + 8 * q + 4 * x)
    mask = _frombuffer(body, _U1, r, at_topk + 8 * q + 4 * x + 2 * e)
    # The whole message's arrays in a few reductions, conservatively: versions, token ids and
    # top-k ids together as int32 words (adjacent in the body), >= 0 when every id and every
    # version's high word is (a version >= 2^31 has a "negative" low word too, and takes the
    # exact per-trajectory check); the teacher's log-probs, its top-k log-probs and the pixels by
    # their min and max (both NaN when any is; a sum could overflow; the top-k's max also bounds
    # them by _MAX_LOGPROB); the routed experts, int16 and not adjacent to the int32 run, and the
    # image grids (>= 1, not >= 0) by their own min, then each N_i against its grid rows (a loop
    # over the trajectories with images only: a text message pays nothing for it). Only a message
    # that fails one is checked trajectory by trajectory.
    arrays_ok = ((not r or (_max(logprobs) < math.inf and _max(mask) <= 1))
                 and (not t or (_min(teacher) > -math.inf and _max(teacher) < math.inf))
                 and (not q or (_min(topk_lps) > -math.inf and _max(topk_lps) <= _MAX_LOGPROB))
                 and (not e or _min(routed) >= 0)
                 and (not i or (_min(grids) >= 1 and _min(pixels) > -math.inf and _max(pixels) < math.inf
                                and _patch_counts_agree(entries, grids)))
                 and (not p + r or _min(_frombuffer(body, _I4, 2 * r + p + r + q, at_versions)) >= 0))
    return p, (logprobs, teacher, grids, versions, token_ids, topk_ids, topk_lps, pixels, routed, mask), arrays_ok


def _data_header(frames: Sequence[Any]) -> tuple[dict, memoryview]:
    """The header map and the body of a one-frame message of schema ``SCHEMA_VERSION``.

    Raises:
        MalformedMessageError: a wrong frame count, a frame that is not a length-prefixed msgpack
            map, or another schema version (a schema <= 3 message names its version).
    """
    if len(frames) != _NUM_FRAMES:
        raise MalformedMessageError(f"message has {len(frames)} frames, schema {SCHEMA_VERSION} has {_NUM_FRAMES}")
    header, body = split_frame(frames[0])
    if type(header) is not dict:
        _refuse_old_schema(memoryview(frames[0]))
        raise MalformedMessageError(f"message header is a msgpack {type(header).__name__}, expected a map")
    if header.get("schema") != SCHEMA_VERSION:
        raise MalformedMessageError(
            f"schema version {header.get('schema')!r:.40}, this decoder reads version {SCHEMA_VERSION} "
            "(sender and receiver run different async-rl versions?)")
    return header, body


def decode_messages(frames: Sequence[Any]) -> tuple[list[GroupClosed | Trajectory], list[MalformedMessageError]]:
    """Decode one schema-8 message into what it carries, refusing bad trajectories one by one.

    Args:
        frames: the message's frames (one), each a buffer-protocol object (``bytes``,
            ``memoryview``, ``zmq.Frame``), as made by ``encode_message`` or received with
            ``recv_multipart``. The trajectories' arrays are read-only views of it (no copy).

    Returns:
        ``(messages, rejected)``. ``messages``: a ``GroupClosed``; or the message's trajectories
        in order, equal to the encoded ones (float64 log-probs bit-exact, ``reward`` and
        ``reward_extras`` values as float), followed by ``GroupClosed(group_id, k)`` for a
        ``TrajectoryGroup`` of ``k``. ``rejected``: one error per trajectory refused for its
        values (the trajectory id, an empty prompt, a negative token id or version, a NaN or
        +inf behavior log-prob, a non-finite teacher log-prob, a loss mask other than 0/1, a
        non-finite reward, another group's id in a group message, a negative top-k id, a
        non-finite or positive top-k log-prob, a negative routed expert index, a non-finite
        pixel value, an image grid value < 1, N_i other than the grid's sum of t*h*w): the
        message's layout is sound, so the other trajectories are kept. A trajectory sent without
        teacher log-probs (T_i = 0) has an empty ``teacher_logprobs``, one without a top-k
        (K_i = 0) ``[0, 0]`` ``teacher_topk_ids`` and ``teacher_topk_logprobs``.
        ``routed_experts`` is a read-only ``[P_i + R_i - 1, L_i, k_i]`` int16 view of the
        message, or, without routing (L_i = k_i = 0, or no forwarded token: P_i + R_i = 1), one
        shared read-only ``[0, 0, 0]`` array, as a ``Trajectory`` holds "none".
        ``observation_pixel_values`` is a read-only ``[N_i, D_i]`` float32 view and
        ``observation_image_grid_thw`` an ``[I_i, 3]`` int64 one, or, without observation images
        (N_i = D_i = I_i = 0), shared read-only ``[0, 0]`` and ``[0, 3]`` arrays.

    Raises:
        MalformedMessageError (a ``ValueError``), for the whole message: a wrong frame count, a
            frame that is not a length-prefixed msgpack header (a schema <= 3 message names its
            version), a schema version other than ``SCHEMA_VERSION`` (schemas 4 to 7 included),
            missing, unexpected or mistyped fields in the header or any trajectory's header, a
            negative token count, a ``num_teacher_tokens`` other than 0 or
            ``num_response_tokens``, a negative ``teacher_top_k`` or one without a response token,
            ``routed_layers`` and ``routed_top_k`` not both 0 or both >= 1, or >= 1 for a
            trajectory without a token, ``num_image_patches``, ``patch_dim`` and ``num_images``
            not all 0 or all >= 1, or a body whose size does not match the counts: none of the
            message's offsets can then be trusted.
    """
    header, body = _data_header(frames)
    kind = header.get("kind")
    if kind == "group_closed":
        return [_decode_group_closed(header, body)], []
    if kind != "trajectories" or header.keys() != _HEADER_FIELDS:
        raise MalformedMessageError(f"message kind {kind!r:.40} with fields {sorted(header, key=str)!r:.200}: "
                                    f"expected 'trajectories' with {sorted(_HEADER_FIELDS)} or 'group_closed'")
    group_id, entries = header["group_id"], header["trajectories"]
    if type(entries) is not list or not (type(group_id) is int or (group_id is None and entries)):
        raise MalformedMessageError(f"trajectories message has group_id {group_id!r:.40} and trajectories "
                                    f"{type(entries).__name__} (a list, non-empty unless a group id closes it)")
    p, (logprobs, teacher, grids, versions, token_ids, topk_ids, topk_lps, pixels, routed, mask), arrays_ok = \
        _message_arrays(entries, body)
    out: list[GroupClosed | Trajectory] = []
    rejected: list[MalformedMessageError] = []
    at_p, at_r, at_t, at_q, at_e, at_g, at_x = 0, 0, 0, 0, 0, 0, 0
    for tid, gid, uid, gen, finish, reward, extras, text, np_, nr, nt, nk, nl, nkr, nx, nd, ni in entries:
        prompt, response = token_ids[at_p:at_p + np_], token_ids[p + at_r:p + at_r + nr]
        rs = slice(at_r, at_r + nr)
        teacher_i = teacher[at_t:at_t + nt]  # an empty view for nt == 0, read-only like the others
        if nk:
            end_q = at_q + nr * nk
            topk_ids_i, topk_lps_i = topk_ids[at_q:end_q].reshape(nr, nk), topk_lps[at_q:end_q].reshape(nr, nk)
            at_q = end_q
        else:
            topk_ids_i, topk_lps_i = _NO_TOPK_IDS, _NO_TOPK_LPS
        # L_i, k_i >= 1 with P_i + R_i = 1 is 0 entries: "none", [0, 0, 0] as a Trajectory holds it.
        if nl and np_ + nr > 1:
            end_e = at_e + (np_ + nr - 1) * nl * nkr
            routed_i = routed[at_e:end_e].reshape(np_ + nr - 1, nl, nkr)
            at_e = end_e
        else:
            routed_i = _NO_ROUTED
        if ni:  # then nx, nd >= 1 too (checked)
            end_g, end_x = at_g + 3 * ni, at_x + nx * nd
            grid_i, pixels_i = grids[at_g:end_g].reshape(ni, 3), pixels[at_x:end_x].reshape(nx, nd)
            at_g, at_x = end_g, end_x
        else:
            grid_i, pixels_i = _NO_GRID, _NO_PIXELS
        at_p += np_
        at_r += nr
        at_t += nt
        if not (arrays_ok and np_ and _TRAJECTORY_ID.fullmatch(tid) and _isfinite(reward)
                and (group_id is None or gid == group_id) and all(map(_isfinite, extras.values()))):
            problem = _value_problems(
                [tid, gid, uid, gen, finish, reward, extras, text, np_, nr, nt, nk, nl, nkr, nx, nd, ni],
                {"prompt_ids": prompt, "response_ids": response, "behavior_logprobs": logprobs[rs],
                 "teacher_logprobs": teacher_i, "loss_mask": mask[rs], "policy_version": versions[rs],
                 "teacher_topk_ids": topk_ids_i, "teacher_topk_logprobs": topk_lps_i,
                 "routed_experts": routed_i, "observation_pixel_values": pixels_i,
                 "observation_image_grid_thw": grid_i}, group_id)
            if problem is not None:
                rejected.append(MalformedMessageError(problem))
                continue
            # Else this one is fine: another trajectory failed a message-wide reduction.
        out.append(_from_checked(tid, gid, uid, prompt, response, logprobs[rs], mask[rs], finish, versions[rs],
                                 float(reward), extras, text, gen, teacher_i, topk_ids_i, topk_lps_i, routed_i,
                                 pixels_i, grid_i))
    if group_id is not None:
        out.append(GroupClosed(group_id, len(entries)))
    return out, rejected


def decode_message(frames: Sequence[Any]) -> Trajectory | GroupClosed:
    """Decode a message that carries exactly one ``Trajectory`` or ``GroupClosed``.

    Raises:
        MalformedMessageError (a ``ValueError``): as ``decode_messages``, the one trajectory's
            rejection, or a message that carries more than one (``decode_messages`` reads those).
    """
    messages, rejected = decode_messages(frames)
    if rejected:
        raise rejected[0]
    if len(messages) != 1:
        raise MalformedMessageError(f"message carries {len(messages)} messages, expected one "
                                    "(decode_messages reads a group)")
    return messages[0]


def decode_trajectory(frames: Sequence[Any]) -> Trajectory:
    """Decode a message of one trajectory (``decode_message``; a ``GroupClosed`` is malformed here).

    Raises:
        MalformedMessageError: as ``decode_message``, or a ``GroupClosed`` message.
    """
    msg = decode_message(frames)
    if not isinstance(msg, Trajectory):
        raise MalformedMessageError(f"expected a trajectory, got {msg}")
    return msg
