"""Observation images in a ``Trajectory`` and on the trajectory wire (schema 8).

In a multi-turn vision-language episode an environment may answer with an image; the learner
needs its processed patches to recompute the sequence's log-probs, so a trajectory carries them
(``observation_pixel_values`` ``[N, D]`` float32, ``observation_image_grid_thw`` ``[I, 3]``
int64) and the codec sends them as checked raw arrays (``async_rl.buffers.codec``).

Run with ``python -m pytest -q tests/test_wire_images.py`` (about a second).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import msgpack
import numpy as np
import pytest

from test_transport import make_traj

from async_rl.buffers.trajectory import OBSERVATION_IMAGE_DTYPES, Trajectory, observation_image_array
from async_rl.buffers.transport import (
    SCHEMA_VERSION, GroupClosed, MalformedMessageError, TrajectoryGroup, decode_messages, decode_trajectory,
    encode_message, encode_trajectories, encode_trajectory, make_transport, pack_frame, split_frame,
)

QWEN2_VL_PATCH_DIM = 1176
"""Values a Qwen2-VL patch: 3 channels x 2 frames x 14 x 14 pixels."""

# Every awkward float32 a pixel may be: -0.0, 0.0, the smallest subnormal, float32's extremes.
_F32_EDGES = np.array([-0.0, 0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.0000001, -2.1179], np.float32)


def _pixels(num_patches: int, dim: int, seed: int = 0) -> np.ndarray:
    """``[num_patches, dim]`` float32 patches (normalised pixel values), the edges of float32 first."""
    pixels = np.random.default_rng(seed).normal(0.0, 1.0, (num_patches, dim)).astype(np.float32)
    edges = _F32_EDGES[: pixels.size]
    pixels.reshape(-1)[: len(edges)] = edges
    return pixels


def _traj(tid: str, group_id: int = 0, num_prompt: int = 5, num_response: int = 7, seed: int = 0,
          **kw) -> Trajectory:
    """A valid trajectory of group ``group_id`` (``test_transport.make_traj``, every token of
    policy version 3); ``kw`` sets or replaces fields."""
    return make_traj(tid, group_id, num_prompt, num_response, seed, **{"policy_version": [3] * num_response, **kw})


def _with_images(tid: str, grid: list[list[int]], dim: int, group_id: int = 0, seed: int = 0, **kw) -> Trajectory:
    """``_traj`` with observation images of ``grid`` (``[I, 3]``) and ``dim`` values a patch."""
    patches = sum(t * h * w for t, h, w in grid)
    return _traj(tid, group_id, seed=seed, observation_pixel_values=_pixels(patches, dim, seed),
                 observation_image_grid_thw=grid, **kw)


def _assert_images_equal(got: Trajectory, want: Trajectory) -> None:
    """``got``'s observation images are ``want``'s, bit for bit, as read-only arrays of the wire dtypes."""
    for name, dtype in OBSERVATION_IMAGE_DTYPES.items():
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (got.trajectory_id, name)
        assert not a.flags.writeable, (got.trajectory_id, name)


# -------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("as_group", [False, True])
def test_observation_images_round_trip_bit_exact_beside_trajectories_without(as_group):
    """Two images of different grids (N = 4 + 8 patches of Qwen2-VL's 1176 values), one image of
    another patch size beside a top-k, routing and teacher log-probs, and trajectories without
    images (one with an empty response), in one message: each gets its own [N_i, D_i] and
    [I_i, 3] back bit for bit (float32 -0.0, subnormals and extremes), as read-only views of the
    one frame; those without share read-only [0, 0] and [0, 3] arrays."""
    sent = [_with_images("4/0", [[1, 2, 2], [1, 4, 2]], QWEN2_VL_PATCH_DIM, 4, seed=0),
            _traj("4/1", 4, seed=1),
            _with_images("4/2", [[2, 2, 3]], 8, 4, seed=2, teacher_logprobs=[-1.0] * 7,
                         teacher_topk_ids=np.arange(14, dtype=np.int32).reshape(7, 2),
                         teacher_topk_logprobs=np.full((7, 2), -0.5, np.float32),
                         routed_experts=np.ones((11, 2, 2), np.int16)),
            _traj("4/3", 4, num_response=0, seed=3, response_text="")]
    frames = encode_message(TrajectoryGroup(4, sent)) if as_group else encode_trajectories(sent)
    header, body = split_frame(frames[0])
    assert header["schema"] == SCHEMA_VERSION == 8
    assert [e[14:] for e in header["trajectories"]] == [[12, 1176, 2], [0, 0, 0], [12, 8, 1], [0, 0, 0]]
    p, r, t, q, e, i, x = 20, 21, 7, 14, 44, 3, 12 * 1176 + 12 * 8
    assert len(body) == 21 * r + 8 * t + 24 * i + 4 * p + 8 * q + 4 * x + 2 * e == 57_681
    messages, rejected = decode_messages(frames)
    assert rejected == []
    assert messages == (sent + [GroupClosed(4, 4)] if as_group else sent)
    for got, want in zip(messages, sent):
        _assert_images_equal(got, want)
    first = messages[0]
    assert first.observation_pixel_values.shape == (12, 1176)
    assert first.observation_image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 2]]
    assert first.observation_pixel_values.view(np.uint32)[0, 0] == 0x80000000  # -0.0 kept
    assert first.observation_pixel_values[0, 4] == np.float32(3.4028235e38)
    assert np.shares_memory(first.observation_pixel_values, np.frombuffer(frames[0], np.uint8))
    assert np.shares_memory(messages[2].observation_image_grid_thw, np.frombuffer(frames[0], np.uint8))
    assert messages[2].observation_pixel_values.shape == (12, 8)
    assert messages[1].observation_pixel_values is messages[3].observation_pixel_values  # the one shared "none"
    assert messages[1].observation_pixel_values.shape == (0, 0)
    assert messages[1].observation_image_grid_thw.shape == (0, 3)
    # The neighbours of the image fields in the body are intact.
    assert messages[2].teacher_topk_logprobs.tobytes() == sent[2].teacher_topk_logprobs.tobytes()
    assert messages[2].routed_experts.tobytes() == sent[2].routed_experts.tobytes()
    assert [m.loss_mask.tolist() for m in messages[:4]] == [s.loss_mask.tolist() for s in sent]
    assert [m.policy_version.tolist() for m in messages[:4]] == [[3] * 7, [3] * 7, [3] * 7, []]


def test_the_grid_goes_before_the_versions_and_the_pixels_after_the_top_k_log_probs():
    """The documented offsets: P = 3, R = T = 4, K = 2, one routed layer of top-1, one image of
    [1, 2, 2] patches of 3 values: the grid at 8R + 8T (8-byte aligned), the versions 24I later,
    the pixels at 20R + 8T + 24I + 4P + 8Q (4-byte aligned), the routing 4X later; body
    21R + 8T + 24I + 4P + 8Q + 4X + 2E = 276 bytes."""
    pixels = np.arange(12, dtype=np.float32).reshape(4, 3) - 5.5
    traj = _traj("1/0", 1, num_prompt=3, num_response=4, teacher_logprobs=[-0.25] * 4,
                 teacher_topk_ids=[[1, 2]] * 4, teacher_topk_logprobs=[[-0.5, -1.5]] * 4,
                 routed_experts=np.arange(6, dtype=np.int16).reshape(6, 1, 1),
                 observation_pixel_values=pixels, observation_image_grid_thw=[[1, 2, 2]])
    header, body = split_frame(encode_trajectory(traj)[0])
    assert header["trajectories"][0][8:] == [3, 4, 4, 2, 1, 1, 4, 3, 1]
    assert len(body) == 21 * 4 + 8 * 4 + 24 * 1 + 4 * 3 + 8 * 8 + 4 * 12 + 2 * 6 == 276
    assert np.frombuffer(body, "<f8", 4, 32).tolist() == [-0.25] * 4
    assert np.frombuffer(body, "<i8", 3, 64).tolist() == [1, 2, 2]
    assert np.frombuffer(body, "<i8", 4, 88).tolist() == [3] * 4
    assert np.frombuffer(body, "<i4", 3, 120).tolist() == traj.prompt_ids.tolist()
    assert np.frombuffer(body, "<f4", 8, 180).tolist() == [-0.5, -1.5] * 4
    assert np.frombuffer(body, "<f4", 12, 212).tobytes() == pixels.tobytes()
    assert np.frombuffer(body, "<i2", 6, 260).tolist() == list(range(6))
    assert bytes(body[272:]) == bytes(traj.loss_mask.tolist())


def test_a_text_message_adds_three_zero_header_fields_and_no_body_byte():
    """Without images N = D = I = 0: the body is schema 7's, 21R + 8T + 4P + 8Q + 2E bytes."""
    header, body = split_frame(encode_trajectory(_traj("1/0", num_prompt=5, num_response=7))[0])
    assert len(header["trajectories"][0]) == 17 and header["trajectories"][0][14:] == [0, 0, 0]
    assert len(body) == 21 * 7 + 4 * 5 == 167


# -------------------------------------------------------------------- values: one trajectory refused
def _bad_group() -> tuple[list[Trajectory], list[bytes]]:
    """Group 6: 6/0 and 6/4 sound; 6/1 a NaN pixel, 6/2 a 0 in its grid, 6/3 N = 4 for a grid of
    6 patches, each set after construction (the encoder sends held values as they are)."""
    sent = [_with_images(f"6/{i}", [[1, 2, 2]], 3, 6, seed=i) for i in range(5)]
    sent[1].observation_pixel_values = sent[1].observation_pixel_values.copy()
    sent[1].observation_pixel_values[2, 1] = np.nan
    sent[2].observation_image_grid_thw = np.array([[1, 0, 4]], np.int64)  # an image of 0 rows
    sent[3].observation_image_grid_thw = np.array([[1, 2, 3]], np.int64)
    return sent, encode_message(TrajectoryGroup(6, sent))


def test_a_nan_pixel_a_zero_in_a_grid_and_a_patch_count_off_its_grid_each_reject_only_their_trajectory(caplog):
    sent, frames = _bad_group()
    messages, rejected = decode_messages(frames)
    assert messages == [sent[0], sent[4], GroupClosed(6, 5)]
    assert [str(e) for e in rejected] == [
        "trajectory '6/1': observation_pixel_values holds NaN or +-inf (1 values)",
        "trajectory '6/2': observation_image_grid_thw holds 0 (frames, rows and columns of patches are >= 1)",
        "trajectory '6/3': observation_pixel_values holds 4 patches for an observation_image_grid_thw of 6 "
        "(the sum of t*h*w)"]
    _assert_images_equal(messages[1], sent[4])
    receiver, _ = make_transport("inproc", hwm=8)
    receiver._channel.queue.put(frames)
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        assert receiver.recv_many(16, timeout_s=5.0) == messages
    assert (receiver.num_malformed, receiver.num_received) == (3, 3)
    assert caplog.text.count("rejected malformed message") == 3


def test_a_patch_count_off_its_grid_is_refused_when_every_reduction_passes():
    """Finite pixels and grid values >= 1 pass the message-wide reductions; each N_i is still held
    against its own grid rows: only that trajectory is refused."""
    good = _with_images("2/0", [[1, 2, 2]], 3, 2)
    bad = _with_images("2/1", [[1, 2, 2], [1, 1, 1]], 3, 2, seed=1)  # N = 5
    bad.observation_image_grid_thw = np.array([[1, 2, 2], [1, 1, 2]], np.int64)  # 6 patches
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(2, [good, bad])))
    assert messages == [good, GroupClosed(2, 2)]
    assert [str(e) for e in rejected] == ["trajectory '2/1': observation_pixel_values holds 5 patches for an "
                                          "observation_image_grid_thw of 6 (the sum of t*h*w)"]


def test_patch_counts_off_in_opposite_directions_are_each_refused():
    """One trajectory a patch short of its grid and the next a patch over: the message's totals
    agree (4 + 6 = 5 + 5), each trajectory's does not."""
    sent = [_with_images(f"2/{i}", [[1, 2, 2]], 3, 2, seed=i) for i in range(3)]
    sent[0].observation_image_grid_thw = np.array([[1, 1, 5]], np.int64)  # 5 patches for N = 4
    sent[1].observation_pixel_values = _pixels(6, 3, seed=1)
    sent[1].observation_image_grid_thw = np.array([[1, 5, 1]], np.int64)  # 5 patches for N = 6
    header, _ = split_frame(encode_message(TrajectoryGroup(2, sent))[0])
    assert [e[14] for e in header["trajectories"]] == [4, 6, 4]
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(2, sent)))
    assert messages == [sent[2], GroupClosed(2, 3)]
    assert [str(e) for e in rejected] == [
        "trajectory '2/0': observation_pixel_values holds 4 patches for an observation_image_grid_thw of 5 "
        "(the sum of t*h*w)",
        "trajectory '2/1': observation_pixel_values holds 6 patches for an observation_image_grid_thw of 5 "
        "(the sum of t*h*w)"]


def test_a_grid_whose_int64_products_wrap_onto_n_is_refused():
    """t*h*w summed exactly: 2^32 * 2^32 * 1 wraps to 0 in int64, so [[2^32, 2^32, 1], [1, 2, 2]]
    would sum to 4 = N; the exact sum is 2^64 + 4."""
    traj = _with_images("3/0", [[1, 2, 2]], 2)
    traj.observation_image_grid_thw = np.array([[2**32, 2**32, 1], [1, 2, 2]], np.int64)
    assert int(np.prod(traj.observation_image_grid_thw, axis=1).sum()) == 4  # what int64 would say
    messages, rejected = decode_messages(encode_trajectory(traj))
    assert messages == []
    assert [str(e) for e in rejected] == ["trajectory '3/0': observation_pixel_values holds 4 patches for an "
                                          "observation_image_grid_thw of 18446744073709551620 (the sum of t*h*w)"]


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_non_finite_pixel_anywhere_rejects_its_trajectory(value):
    sent = [_with_images(f"5/{i}", [[1, 1, 3]], 4, 5, seed=i) for i in range(3)]
    sent[2].observation_pixel_values = sent[2].observation_pixel_values.copy()
    sent[2].observation_pixel_values[-1, -1] = value  # the message's last pixel value
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(5, sent)))
    assert messages == [sent[0], sent[1], GroupClosed(5, 3)]
    assert [str(e) for e in rejected] == ["trajectory '5/2': observation_pixel_values holds NaN or +-inf (1 values)"]


def test_a_negative_grid_value_rejects_its_trajectory():
    sent = [_with_images("5/0", [[1, 1, 3]], 4, 5), _with_images("5/1", [[1, 1, 3]], 4, 5, seed=1)]
    sent[0].observation_image_grid_thw = np.array([[-1, -1, 3]], np.int64)  # t*h*w = 3 = N: only the sign is wrong
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(5, sent)))
    assert messages == [sent[1], GroupClosed(5, 2)]
    assert [str(e) for e in rejected] == ["trajectory '5/0': observation_image_grid_thw holds -1 (frames, rows and "
                                          "columns of patches are >= 1)"]


# --------------------------------------------------------------------- layout: the whole message void
def _one_image_frame() -> tuple[dict, memoryview]:
    """Header and body of one trajectory with one image of [1, 2, 2] patches of 3 values (N, D, I = 4, 3, 1)."""
    return split_frame(encode_trajectory(_with_images("1/0", [[1, 2, 2]], 3, 1))[0])


@pytest.mark.parametrize("counts", [[4, 0, 1], [4, 3, 0], [0, 3, 1], [0, 0, 1], [4, 0, 0], [-4, 3, 1], [4, -3, -1]])
def test_image_counts_not_all_zero_or_all_positive_void_the_whole_message(counts):
    header, body = _one_image_frame()
    header["trajectories"][0][14:17] = counts
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [body])])
    n, d, i = counts
    assert str(e.value) == (f"fields 'num_image_patches', 'patch_dim' and 'num_images' of trajectory header 0 are "
                            f"{n}, {d} and {i}, expected all 0 (no observation image) or all >= 1")


@pytest.mark.parametrize("change", [-1, 1])
def test_a_body_one_byte_off_the_image_counts_voids_the_whole_message(change):
    header, body = _one_image_frame()
    off = bytes(body[:-1]) if change < 0 else bytes(body) + b"\x00"
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [off])])
    assert str(e.value) == (f"message body is {len(body) + change} bytes, expected {len(body)} for 1 trajectories "
                            "(5 prompt, 7 response and 0 teacher tokens, 0 top-k and 0 routed-expert entries, "
                            "1 observation images and 12 pixel values)")
    assert len(body) == 21 * 7 + 4 * 5 + 24 + 4 * 12 == 239


def test_image_counts_that_disagree_with_the_body_void_the_whole_message(caplog):
    """A count off by one patch, value or image moves every later offset: one counted rejection,
    nothing of the group kept."""
    group = TrajectoryGroup(7, [_with_images(f"7/{i}", [[1, 2, 2]], 3, 7, seed=i) for i in range(3)])
    header, body = split_frame(encode_message(group)[0])
    for index, count, extra in ((14, 5, 4 * 3), (15, 4, 4 * 4), (16, 2, 24)):
        changed = [list(e) for e in header["trajectories"]]
        changed[1][index] = count
        with pytest.raises(MalformedMessageError, match=rf"^message body is {len(body)} bytes, expected "
                                                        rf"{len(body) + extra} for 3 trajectories "):
            decode_messages([pack_frame({**header, "trajectories": changed}, [body])])
    receiver, _ = make_transport("inproc", hwm=8)
    header["trajectories"][1][16] = 2
    receiver._channel.queue.put([pack_frame(header, [body])])
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        assert receiver.recv_many(8, timeout_s=0.5) == []
    assert (receiver.num_malformed, receiver.num_received) == (1, 0)


@pytest.mark.parametrize("index, value, kind", [(14, True, "bool"), (15, 3.0, "float"), (16, "1", "str")])
def test_an_image_count_of_another_type_voids_the_whole_message(index, value, kind):
    header, body = _one_image_frame()
    header["trajectories"][0][index] = value
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [body])])
    name = ["num_image_patches", "patch_dim", "num_images"][index - 14]
    assert str(e.value) == f"field '{name}' of trajectory header 0 is {kind}, expected int"


def test_a_schema_7_message_with_a_14_field_header_is_refused_naming_both_versions():
    header, body = split_frame(encode_trajectory(_traj("1/0"))[0])
    header["schema"] = 7
    header["trajectories"][0] = header["trajectories"][0][:14]
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [body])])
    assert str(e.value) == ("schema version 7, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")
    assert msgpack.unpackb(msgpack.packb(header))["schema"] == 7


# ------------------------------------------------------------------------------------ the encoder
def test_encode_converts_reassigned_observation_images_exactly_or_refuses_them():
    traj = _traj("8/0", 8)
    traj.observation_pixel_values = [[0.5, -1.25], [3.0, -0.0]]  # lists: converted
    traj.observation_image_grid_thw = [[1, 1, 2]]
    out = decode_trajectory(encode_trajectory(traj))
    assert out.observation_pixel_values.dtype == np.dtype("<f4")
    assert out.observation_pixel_values.tolist() == [[0.5, -1.25], [3.0, -0.0]]
    assert out.observation_image_grid_thw.tolist() == [[1, 1, 2]] and out.observation_image_grid_thw.dtype == "<i8"
    traj.observation_pixel_values = np.zeros((2, 3), np.float64)[:, ::-1]  # float64, not contiguous
    traj.observation_image_grid_thw = np.array([[1, 2, 1]], np.int32)
    assert decode_trajectory(encode_trajectory(traj)).observation_pixel_values.tolist() == [[0.0] * 3] * 2
    traj.observation_pixel_values, traj.observation_image_grid_thw = [], []  # "none": sent as N = D = I = 0
    assert encode_trajectory(traj) == encode_trajectory(_traj("8/0", 8))
    traj.observation_pixel_values = np.ones((2, 3), np.float32)
    traj.observation_image_grid_thw = np.zeros((0, 3), np.int64)
    with pytest.raises(ValueError) as e:
        encode_trajectory(traj)
    assert str(e.value) == ("trajectory 8/0: observation_pixel_values [2, 3] and observation_image_grid_thw [0, 3] "
                            "must be both present ([N, D] and [I, 3]) or both none")
    traj.observation_image_grid_thw = np.ones((1, 2), np.int64)
    with pytest.raises(ValueError, match=r"observation_image_grid_thw \[1, 2\] must be both present"):
        encode_trajectory(traj)
    traj.observation_image_grid_thw = [[1, 2.5, 1]]
    with pytest.raises(ValueError, match=r"^trajectory 8/0: observation_image_grid_thw cannot be held as int64 2-D: "
                                         r"dtype float64 is not an integer dtype$"):
        encode_trajectory(traj)
    traj.observation_image_grid_thw = [[1, 2, 1]]
    traj.observation_pixel_values = [[1e300, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match=r"observation_pixel_values cannot be held as float32 2-D: a finite value "
                                         r"beyond float32's range \(1e\+300\)"):
        encode_trajectory(traj)


# ---------------------------------------------------------------------------- the Trajectory itself
def test_a_trajectory_holds_observation_images_in_the_wire_dtypes_without_copying():
    pixels = _pixels(12, QWEN2_VL_PATCH_DIM)
    grid = np.array([[1, 2, 2], [1, 4, 2]], np.int64)
    traj = _traj("1/0", observation_pixel_values=pixels, observation_image_grid_thw=grid)
    assert traj.observation_pixel_values is pixels and traj.observation_image_grid_thw is grid  # right dtype: kept
    default = _traj("1/0")
    assert default.observation_pixel_values.shape == (0, 0) and default.observation_pixel_values.dtype == "<f4"
    assert default.observation_image_grid_thw.shape == (0, 3) and default.observation_image_grid_thw.dtype == "<i8"
    assert default != traj and traj == _traj("1/0", observation_pixel_values=pixels.copy(),
                                             observation_image_grid_thw=grid.tolist())
    other = pixels.copy()
    other[11, 1175] += np.float32(1.0)
    assert traj != _traj("1/0", observation_pixel_values=other, observation_image_grid_thw=grid)
    assert traj != _traj("1/0", observation_pixel_values=pixels, observation_image_grid_thw=[[1, 4, 2], [1, 2, 2]])
    # "None" in any spelling: [] (as_dict's), [0, D], [N, 0] with no grid.
    for none_pixels, none_grid in (([], []), (np.zeros((0, 1176), np.float32), np.zeros((0, 3), np.int64)),
                                   (np.zeros((5, 0)), [])):
        t = _traj("1/0", observation_pixel_values=none_pixels, observation_image_grid_thw=none_grid)
        assert t.observation_pixel_values.shape == (0, 0) and t.observation_image_grid_thw.shape == (0, 3)
        assert t == default


def test_every_none_is_one_shared_read_only_pair():
    """A text trajectory's [0, 0] pixels and [0, 3] grid are one shared read-only pair, whether
    built, rebuilt from ``as_dict`` or decoded: nothing allocated for them, nothing to write."""
    a, b = _traj("1/0"), _traj("1/1")
    pixels, grid = a.observation_pixel_values, a.observation_image_grid_thw
    assert b.observation_pixel_values is pixels and b.observation_image_grid_thw is grid
    assert not pixels.flags.writeable and not grid.flags.writeable
    assert Trajectory(**a.as_dict()).observation_pixel_values is pixels
    decoded = decode_trajectory(encode_trajectory(a))
    assert decoded.observation_pixel_values is pixels and decoded.observation_image_grid_thw is grid
    assert dataclasses.replace(decoded, reward=2.0).observation_image_grid_thw is grid
    spelled = _traj("1/2", observation_pixel_values=np.zeros((0, 7), np.float32), observation_image_grid_thw=[])
    assert spelled.observation_pixel_values is pixels and spelled.observation_image_grid_thw is grid


def test_as_dict_and_back_keeps_the_pixels_exactly_through_json():
    traj = _with_images("1/0", [[1, 2, 2], [1, 4, 2]], 16, seed=5)
    plain = traj.as_dict()
    assert plain["observation_image_grid_thw"] == [[1, 2, 2], [1, 4, 2]]
    assert len(plain["observation_pixel_values"]) == 12 and len(plain["observation_pixel_values"][0]) == 16
    back = Trajectory(**json.loads(json.dumps(plain)))
    assert back == traj
    assert back.observation_pixel_values.dtype == np.dtype("<f4")
    assert back.observation_pixel_values.tobytes() == traj.observation_pixel_values.tobytes()  # -0.0 included
    assert _traj("1/0").as_dict()["observation_pixel_values"] == []
    assert _traj("1/0").as_dict()["observation_image_grid_thw"] == []
    assert Trajectory(**_traj("1/0").as_dict()) == _traj("1/0")


def test_from_checked_defaults_to_no_observation_images():
    args = dict(trajectory_id="1/0", group_id=1, prompt_uid="u", prompt_ids=np.array([1], "<i4"),
                response_ids=np.array([2], "<i4"), behavior_logprobs=np.array([-1.0]), loss_mask=np.array([1], "u1"),
                finish_reason="stop", policy_version=np.array([0], "<i8"), reward=0.0, reward_extras={},
                response_text="", generator_id=-1, teacher_logprobs=np.zeros(0))
    traj = Trajectory.from_checked(**args)
    assert traj.observation_pixel_values.shape == (0, 0) and traj.observation_pixel_values.dtype == "<f4"
    assert traj.observation_image_grid_thw.shape == (0, 3) and traj.observation_image_grid_thw.dtype == "<i8"
    assert traj == Trajectory(**args)
    pixels, grid = np.ones((2, 5), np.float32), np.array([[1, 1, 2]], np.int64)
    given = Trajectory.from_checked(**args, observation_pixel_values=pixels, observation_image_grid_thw=grid)
    assert given.observation_pixel_values is pixels and given.observation_image_grid_thw is grid


@pytest.mark.parametrize("pixels, grid, message", [
    (np.ones((4, 3), np.float32), [[1, 2, 2, 1]],
     "trajectory t/0: observation_image_grid_thw is [1, 4], expected [I, 3] (frames, rows and columns of patches "
     "per image)"),
    (np.ones((4, 3), np.float32), [[1, 2], [2, 1]],
     "trajectory t/0: observation_image_grid_thw is [2, 2], expected [I, 3] (frames, rows and columns of patches "
     "per image)"),
    (np.ones((4, 3), np.float32), [[1, 0, 2], [1, 2, 2]],
     "trajectory t/0: observation_image_grid_thw holds 0 (frames, rows and columns of patches are >= 1)"),
    (np.ones((4, 3), np.float32), [[-1, -2, 2]],
     "trajectory t/0: observation_image_grid_thw holds -2 (frames, rows and columns of patches are >= 1)"),
    (np.array([[1, 2, np.nan]] * 4, np.float32), [[1, 2, 2]],
     "trajectory t/0: observation_pixel_values holds NaN or +-inf (4 values)"),
    (np.array([[np.inf, 2, -np.inf]] * 4, np.float32), [[1, 2, 2]],
     "trajectory t/0: observation_pixel_values holds NaN or +-inf (8 values)"),
    (np.ones((4, 3), np.float32), [],
     "trajectory t/0: observation_pixel_values [4, 3] and observation_image_grid_thw [0, 3] must be both present "
     "([N, D] and [I, 3]) or both none ([0, 0] and [0, 3])"),
    ([], [[1, 2, 2]],
     "trajectory t/0: observation_pixel_values [0, 0] and observation_image_grid_thw [1, 3] must be both present "
     "([N, D] and [I, 3]) or both none ([0, 0] and [0, 3])"),
    (np.ones((5, 3), np.float32), [[1, 2, 2]],
     "trajectory t/0: observation_pixel_values has 5 patches, observation_image_grid_thw's t*h*w sum to 4"),
    (np.ones((12, 3), np.float32), [[1, 2, 2], [1, 4, 1]],
     "trajectory t/0: observation_pixel_values has 12 patches, observation_image_grid_thw's t*h*w sum to 8"),
    (np.ones((4, 3), np.float32), [[2**32, 2**32, 1], [1, 2, 2]],
     "trajectory t/0: observation_pixel_values has 4 patches, observation_image_grid_thw's t*h*w sum to "
     "18446744073709551620"),
])
def test_a_trajectory_refuses_observation_images_the_learner_cannot_use(pixels, grid, message):
    with pytest.raises(ValueError) as e:
        _traj("t/0", observation_pixel_values=pixels, observation_image_grid_thw=grid)
    assert str(e.value) == message


@pytest.mark.parametrize("name, values, message", [
    ("observation_pixel_values", [[1.0, 2.0], [3.0]], "observation_pixel_values cannot be held as float32 2-D: "),
    ("observation_pixel_values", [1.0, 2.0], "observation_pixel_values cannot be held as float32 2-D: a 1-D array, "
                                             "expected 2-D"),
    ("observation_pixel_values", np.ones((1, 2, 3)), "a 3-D array, expected 2-D"),
    ("observation_pixel_values", [["a", "b"]], "observation_pixel_values cannot be held as float32 2-D: dtype <U1 "
                                               "is not numeric"),
    ("observation_pixel_values", [[-1e39, 0.0]], "a finite value beyond float32's range (-1e+39)"),
    ("observation_image_grid_thw", [[1, 2, 2.5]], "observation_image_grid_thw cannot be held as int64 2-D: dtype "
                                                  "float64 is not an integer dtype"),
    ("observation_image_grid_thw", np.array([[1, 2, 2**63]], np.uint64),
     "values must satisfy -9223372036854775808 <= number <= 9223372036854775807"),
])
def test_observation_image_array_converts_exactly_or_refuses(name, values, message):
    with pytest.raises(ValueError) as e:
        observation_image_array(values, name, "t/0")
    assert str(e.value).startswith(f"trajectory t/0: {name} cannot be held as ") and message in str(e.value)


def test_observation_image_array_keeps_the_right_array_and_converts_the_rest():
    pixels = np.ones((3, 4), np.float32)
    assert observation_image_array(pixels, "observation_pixel_values") is pixels
    strided = np.ones((3, 8), np.float32)[:, ::2]
    kept = observation_image_array(strided, "observation_pixel_values")
    assert kept.flags.c_contiguous and kept.shape == (3, 4) and kept.tolist() == strided.tolist()
    wide = observation_image_array(np.array([[0.1, -3.4028234e38]]), "observation_pixel_values")
    assert wide.dtype == np.dtype("<f4") and wide.tolist() == np.array([[0.1, -3.4028234e38]], np.float32).tolist()
    grid = observation_image_array([[1, 2, 2]], "observation_image_grid_thw")
    assert grid.dtype == np.dtype("<i8") and grid.tolist() == [[1, 2, 2]]
    assert observation_image_array(np.zeros((0, 3), np.int32), "observation_image_grid_thw").shape == (0, 3)
    assert observation_image_array([], "observation_pixel_values").shape == (0, 0)
    # Finiteness is the Trajectory's check: the converter refuses only what float32 cannot hold.
    assert observation_image_array(np.array([[1.0, np.nan]]), "observation_pixel_values").shape == (1, 2)
