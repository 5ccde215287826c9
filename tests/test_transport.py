"""Tests for async_rl.buffers.transport: the msgpack codec, ZeroMQ PUSH/PULL and the in-process channel.

Run with ``python -m pytest -q tests/test_transport.py`` (a few seconds; one test spawns two
sender processes).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import multiprocessing as mp
import socket
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from async_rl.buffers.trajectory import PER_TOKEN_DTYPES, Trajectory, collate
from async_rl.buffers.transport import (
    SCHEMA_VERSION, GroupClosed, InProcTrajectoryReceiver, MalformedMessageError, SendTimeoutError, TrajectoryGroup,
    TrajectoryReceiver, TrajectorySender, ZmqSenderFactory, ZmqTrajectoryReceiver, decode_message, decode_messages,
    decode_trajectory, encode_message, encode_trajectories, encode_trajectory, make_transport, pack_frame, split_frame,
)


def make_traj(tid: str, group_id: int = 0, num_prompt: int = 5, num_response: int = 7, seed: int = 0,
              **kw) -> Trajectory:
    rng = np.random.default_rng(seed)
    fields = dict(
        trajectory_id=tid, group_id=group_id, prompt_uid=f"uid-{group_id}",
        prompt_ids=rng.integers(0, 150_000, num_prompt).tolist(),
        response_ids=rng.integers(0, 150_000, num_response).tolist(),
        # Full float64 precision, as an engine's log-probs arrive in Python.
        behavior_logprobs=(-rng.exponential(2.0, num_response)).tolist(),
        loss_mask=rng.integers(0, 2, num_response).tolist(), finish_reason="stop",
        policy_version=sorted(rng.integers(0, 5, num_response).tolist()),
        reward=float(rng.random()), reward_extras={"acc": 1.0, "format": 0.5}, response_text="x = 4",
    )
    fields.update(kw)
    return Trajectory(**fields)


def bits(xs: list[float]) -> list[int]:
    return np.asarray(xs, dtype=np.float64).view(np.int64).tolist()


def roundtrip(traj: Trajectory, as_memoryview: bool = False) -> Trajectory:
    frames = encode_trajectory(traj)
    return decode_trajectory([memoryview(f) for f in frames] if as_memoryview else frames)


# ------------------------------------------------------------------------------------------ codec
@pytest.mark.parametrize("traj", [
    make_traj("7/0", group_id=7, generator_id=3),
    make_traj("e/0", num_response=0, response_text=""),  # empty response
    make_traj("u/1", group_id=-(10**9), response_text="x² = 4 → x = ±2 ✓ 数学 🙂", prompt_uid="ünï"),
    make_traj("x/2", reward_extras={}, reward=-3.25),
    make_traj("s/3", behavior_logprobs=[-0.0, -1e-310, -math.inf, -1.0000000000000002, -7e-45, -123.456,
                                        -5e-324][:7], num_response=7),
    make_traj("big/0", num_prompt=100, num_response=1000, seed=3),
    make_traj("lim/0", prompt_ids=[0, 2**31 - 1, 0], loss_mask=[0, 1, 1, 1, 0, 1, 1], policy_version=[2**40] * 7),
    make_traj("t/0", teacher_logprobs=[-0.0, 0.0, -1e-310, -5e-324, -1.0000000000000002, -1e308, -123.456]),
    make_traj("t/1", num_prompt=100, num_response=1000, seed=4,
              teacher_logprobs=(-np.random.default_rng(4).exponential(1.0, 1000)).tolist()),
])
@pytest.mark.parametrize("as_memoryview", [False, True])
def test_codec_round_trip_is_exact(traj, as_memoryview):
    out = roundtrip(traj, as_memoryview)
    assert out == traj
    assert bits(out.behavior_logprobs) == bits(traj.behavior_logprobs)  # bit-exact, -0.0 and subnormals too
    assert bits(out.teacher_logprobs) == bits(traj.teacher_logprobs)
    for name, dtype in PER_TOKEN_DTYPES.items():
        got, sent = getattr(out, name), getattr(traj, name)
        assert got.dtype == dtype and got.ndim == 1 and got.tobytes() == sent.tobytes(), name
    assert (out.trajectory_id, out.group_id, out.prompt_uid, out.finish_reason, out.response_text, out.generator_id) == (
        traj.trajectory_id, traj.group_id, traj.prompt_uid, traj.finish_reason, traj.response_text, traj.generator_id)
    assert bits([out.reward]) == bits([traj.reward]) and out.reward_extras == traj.reward_extras


def test_codec_layout_is_the_documented_schema():
    traj = make_traj("a/0", num_prompt=3, num_response=4)
    assert traj.teacher_logprobs.tolist() == []  # a run without a teacher: T = 0, no teacher bytes
    frames = encode_trajectory(traj)
    assert len(frames) == 1
    frame = frames[0]
    head_len = int.from_bytes(frame[:4], "little")
    header = msgpack.unpackb(frame[4:4 + head_len])
    start = -(-(4 + head_len) // 8) * 8  # the body starts 8-byte aligned
    assert start % 8 == 0 and frame[4 + head_len:start] == bytes(start - 4 - head_len)
    assert header == {"schema": SCHEMA_VERSION, "kind": "trajectories", "group_id": None, "trajectories": [
        ["a/0", 0, "uid-0", -1, "stop", traj.reward, {"acc": 1.0, "format": 0.5}, "x = 4", 3, 4, 0, 0, 0, 0, 0, 0,
         0]]}
    assert SCHEMA_VERSION == 8
    body = frame[start:]
    assert len(body) == 4 * 8 + 4 * 8 + 3 * 4 + 4 * 4 + 4 * 1
    assert np.frombuffer(body, "<f8", 4, 0).tolist() == traj.behavior_logprobs.tolist()
    assert np.frombuffer(body, "<i8", 4, 32).tolist() == traj.policy_version.tolist()
    assert np.frombuffer(body, "<i4", 3, 64).tolist() == traj.prompt_ids.tolist()
    assert np.frombuffer(body, "<i4", 4, 76).tolist() == traj.response_ids.tolist()
    assert body[92:] == bytes(traj.loss_mask.tolist())
    assert b"\x80\x04" not in frame and b"\x80\x05" not in frame  # no pickle protocol 4/5 stream


def test_codec_layout_with_teacher_logprobs_puts_them_after_behavior_logprobs():
    """Schema 5: T_i = R_i in the header, the teacher's float64 log-probs at byte 8R (aligned),
    everything after them shifted by 8T; body 21R + 8T + 4P bytes."""
    teacher = [-0.5, -0.0, -1e-310, -7.25]
    traj = make_traj("a/0", num_prompt=3, num_response=4, teacher_logprobs=teacher)
    header, body = split_frame(encode_trajectory(traj)[0])
    assert header["schema"] == 8 and header["trajectories"][0][8:] == [3, 4, 4, 0, 0, 0, 0, 0, 0]
    assert len(header["trajectories"][0]) == 17
    assert len(body) == 21 * 4 + 8 * 4 + 4 * 3 == 128
    assert bits(np.frombuffer(body, "<f8", 4, 0)) == bits(traj.behavior_logprobs)
    assert bits(np.frombuffer(body, "<f8", 4, 32)) == bits(teacher)
    assert np.frombuffer(body, "<i8", 4, 64).tolist() == traj.policy_version.tolist()
    assert np.frombuffer(body, "<i4", 3, 96).tolist() == traj.prompt_ids.tolist()
    assert np.frombuffer(body, "<i4", 4, 108).tolist() == traj.response_ids.tolist()
    assert bytes(body[124:]) == bytes(traj.loss_mask.tolist())


def test_group_layout_puts_each_field_of_all_trajectories_together():
    """A group's body: every trajectory's log-probs, then versions, prompt ids, response ids, masks."""
    group = TrajectoryGroup(3, [make_traj("3/0", 3, num_prompt=2, num_response=3, seed=1),
                                make_traj("3/1", 3, num_prompt=1, num_response=2, seed=2,
                                          teacher_logprobs=[-0.75, -1.5])])
    header, body = split_frame(encode_message(group)[0])
    assert header["group_id"] == 3 and [e[0] for e in header["trajectories"]] == ["3/0", "3/1"]
    assert [e[8:] for e in header["trajectories"]] == [[2, 3, 0, 0, 0, 0, 0, 0, 0], [1, 2, 2, 0, 0, 0, 0, 0, 0]]
    a, b = group.trajectories
    expected = b"".join(np.concatenate([getattr(a, n), getattr(b, n)]).tobytes() for n in
                        ("behavior_logprobs", "teacher_logprobs", "policy_version", "prompt_ids", "response_ids",
                         "loss_mask"))
    assert bytes(body) == expected and len(body) == 21 * 5 + 8 * 2 + 4 * 3


def test_codec_int_reward_extras_become_float():
    out = roundtrip(make_traj("a/0", reward_extras={"acc": 1, "n": True}, reward=1))
    assert out.reward_extras == {"acc": 1.0, "n": 1.0} and type(out.reward_extras["acc"]) is float
    assert type(out.reward) is float


@pytest.mark.parametrize("kw, match", [
    (dict(prompt_ids=[2**31]), r"prompt_ids cannot be sent as int32: .*-2147483648 <= number <= 2147483647"),
    (dict(loss_mask=[0, 1, 2, 256, 1, 1, 1]), r"loss_mask cannot be sent as uint8: .*0 <= number <= 255"),
    (dict(response_ids=[1, 2, 3.5, 4, 5, 6, 7]), r"response_ids cannot be sent as int32: .*not an integer"),
    (dict(policy_version=[[1]] * 7), r"policy_version cannot be sent as int64"),
    (dict(reward_extras={"acc": "yes"}), "reward_extras must map str -> float"),
])
def test_encode_rejects_values_the_wire_cannot_carry(kw, match):
    with pytest.raises(ValueError, match=match):
        encode_trajectory(make_traj("a/0", **kw))


_ENTRY_FIELDS = ["trajectory_id", "group_id", "prompt_uid", "generator_id", "finish_reason", "reward",
                 "reward_extras", "response_text", "num_prompt_tokens", "num_response_tokens", "num_teacher_tokens",
                 "teacher_top_k", "routed_layers", "routed_top_k", "num_image_patches", "patch_dim", "num_images"]
_BODY = ["behavior_logprobs", "teacher_logprobs", "observation_image_grid_thw", "policy_version", "prompt_ids",
         "response_ids", "teacher_topk_ids", "teacher_topk_logprobs", "observation_pixel_values", "routed_experts",
         "loss_mask"]


def _parts(frame: bytes) -> tuple[dict, dict[str, bytes]]:
    """A one-trajectory frame as its header and its eleven arrays' bytes."""
    header, body = split_frame(frame)
    p, r, t, k, layers, top_k, n, d, i = header["trajectories"][0][8:17]
    e = (p + r - 1) * layers * top_k if layers else 0
    ends = np.cumsum([0, 8 * r, 8 * t, 24 * i, 8 * r, 4 * p, 4 * r, 4 * r * k, 4 * r * k, 4 * n * d, 2 * e,
                      r]).tolist()
    return header, {name: bytes(body[ends[i]:ends[i + 1]]) for i, name in enumerate(_BODY)}


def _message(**changes) -> bytes:
    """A valid encoded message with header, trajectory-header or array fields replaced (``...`` deletes one)."""
    header, arrays = _parts(encode_trajectory(make_traj("a/0"))[0])
    entry = header["trajectories"][0]
    for key, value in changes.items():
        if key in _ENTRY_FIELDS:
            entry[_ENTRY_FIELDS.index(key)] = value
        elif key in arrays:
            arrays[key] = value
        else:
            header[key] = value
    if "trajectories" not in changes:
        header["trajectories"][0] = [v for v in entry if v is not ...]
    return pack_frame({k: v for k, v in header.items() if v is not ...},
                      [arrays[n] for n in _BODY if arrays[n] is not ...])


def _encoded(**kw) -> bytes:
    """The one frame of ``make_traj("a/0", **kw)``: the encoder carries what the decoder refuses."""
    return encode_trajectory(make_traj(kw.pop("trajectory_id", "a/0"), **kw))[0]


_GOOD = encode_trajectory(make_traj("a/0"))[0]
_LOGPROBS = _parts(_GOOD)[1]["behavior_logprobs"]
_TEACHER = np.full(7, -0.5).tobytes()


@pytest.mark.parametrize("frames, match", [
    ([], "0 frames, schema 8 has 1"),
    ([_GOOD, b""], "2 frames"),
    ([_GOOD[:-3]], r"message body is 164 bytes, expected 167 for 1 trajectories "
                   r"\(5 prompt, 7 response and 0 teacher tokens, 0 top-k and 0 routed-expert entries, "
                   r"0 observation images and 0 pixel values\)"),
    ([b"\xc1\xc1garbage"], "too short for its header"),
    ([b"\x01\x00"], r"message is 2 bytes, too short for its header \(no length\)"),
    ([b"\x03\x00\x00\x00\xc1\xc1\xc1\x00"], "message header is not valid msgpack"),
    ([_GOOD + b"\x00"], "message body is 168 bytes, expected 167"),
    ([pack_frame([1, 2])], "message header is a msgpack list, expected a map"),
    ([_message(schema=2)], "schema version 2, this decoder reads version 8"),
    ([_message(schema=5)], "schema version 5, this decoder reads version 8"),
    ([_message(schema=6)], "schema version 6, this decoder reads version 8"),
    ([_message(schema=7)], "schema version 7, this decoder reads version 8"),
    ([_message(schema=...)], "schema version None"),
    ([_message(kind="trajectory")], "message kind 'trajectory'"),
    ([_message(extra_field=1)], r"message kind 'trajectories' with fields \['extra_field'"),
    ([_message(group_id="7")], "field 'group_id' of trajectory header 0 is str, expected int"),
    ([pack_frame({"schema": SCHEMA_VERSION, "kind": "trajectories", "group_id": "7", "trajectories": []})],
     "trajectories message has group_id '7'"),
    ([_message(trajectories=[])], "non-empty unless a group id closes it"),
    ([_message(trajectories={"a/0": 1})], "trajectories message has group_id None and trajectories dict"),
    ([_message(reward=...)], "trajectory header 0 is a msgpack list of 16 items, expected an array of 17"),
    ([_message(teacher_top_k=...)],
     r"list of 16 items, expected an array of 17 \(.*, num_teacher_tokens, teacher_top_k, routed_layers, routed_top_k, "
     r"num_image_patches, patch_dim, num_images\)"),
    ([_message(routed_top_k=...)], r"list of 16 items, expected an array of 17"),
    ([_message(num_images=...)], r"list of 16 items, expected an array of 17"),
    ([_message(teacher_top_k=-1)], r"'teacher_top_k' of trajectory header 0 is -1, expected >= 0"),
    ([_message(teacher_top_k=2)], r"message body is 167 bytes, expected 279 .*, 14 top-k and 0 routed-expert "
                                  r"entries, 0 observation images and 0 pixel values\)$"),
    ([_message(teacher_top_k=True)], "'teacher_top_k' of trajectory header 0 is bool"),
    # Routing replay's L_i and k_i: both 0 or both >= 1, and (P_i + R_i - 1) L_i k_i entries in the body.
    ([_message(routed_layers=2)], r"^fields 'routed_layers' and 'routed_top_k' of trajectory header 0 are 2 and 0, "
                                  r"expected both 0 \(no routing\) or both >= 1$"),
    ([_message(routed_top_k=8)], r"'routed_layers' and 'routed_top_k' of trajectory header 0 are 0 and 8, expected"),
    ([_message(routed_layers=-1, routed_top_k=-1)], r"header 0 are -1 and -1, expected both 0 \(no routing\)"),
    ([_message(routed_layers=3, routed_top_k=-2)], r"header 0 are 3 and -2, expected both 0"),
    ([_message(routed_layers=1, routed_top_k=1)],
     r"^message body is 167 bytes, expected 189 for 1 trajectories \(5 prompt, 7 response and 0 teacher tokens, "
     r"0 top-k and 11 routed-expert entries, 0 observation images and 0 pixel values\)$"),
    ([_message(routed_layers=2, routed_top_k=4, routed_experts=bytes(2 * 11 * 8 - 2))],
     r"message body is 341 bytes, expected 343 .* 88 routed-expert entries, 0 observation images and 0 pixel "
     r"values\)"),
    ([_message(routed_layers=True, routed_top_k=1)], "field 'routed_layers' of trajectory header 0 is bool, expected int"),
    ([_message(routed_top_k=1.0)], "field 'routed_top_k' of trajectory header 0 is float, expected int"),
    ([_message(trajectories=[{"trajectory_id": "a/0"}])], "trajectory header 0 is a msgpack dict"),
    ([pack_frame({"schema": SCHEMA_VERSION, "kind": "trajectories", "group_id": None, "trajectories": [1]})],
     "trajectory header 0 is a msgpack int of \\? items"),
    ([_message(prompt_uid=7)], "field 'prompt_uid' of trajectory header 0 is int, expected str"),
    ([_message(num_response_tokens=True)], "'num_response_tokens' of trajectory header 0 is bool"),
    ([_message(num_response_tokens=-1)], "negative"),
    ([_message(num_teacher_tokens=True)], "'num_teacher_tokens' of trajectory header 0 is bool"),
    # T_i neither 0 nor R_i: malformed even when the body holds T_i values (no offset is trusted).
    ([_message(num_teacher_tokens=3, teacher_logprobs=_TEACHER[:24])],
     r"^field 'num_teacher_tokens' of trajectory header 0 is 3, expected 0 or num_response_tokens \(7\)$"),
    ([_message(num_teacher_tokens=8, teacher_logprobs=_TEACHER + _TEACHER[:8])], "'num_teacher_tokens' .* is 8"),
    ([_message(num_teacher_tokens=-7)], r"'num_teacher_tokens' of trajectory header 0 is -7, expected 0 or"),
    ([_message(num_teacher_tokens=7)], r"message body is 167 bytes, expected 223 .*\(5 prompt, 7 response and 7 teacher"),
    ([_message(teacher_logprobs=_TEACHER)], r"message body is 223 bytes, expected 167"),
    ([_message(reward_extras={"acc": "1"})], "reward_extras must map"),
    ([_message(behavior_logprobs=_LOGPROBS[:-1])], r"message body is 166 bytes, expected 167"),
    ([_message(num_prompt_tokens=6)], r"message body is 167 bytes, expected 171 for 1 trajectories \(6 prompt"),
    ([pack_frame({"schema": SCHEMA_VERSION, "kind": "group_closed", "group_id": 1, "num_kept": 1}, [b"x"])],
     "group_closed message has fields .* and a 1-byte body"),
    # Well-formed layouts holding values the learner cannot train on (found by tests/test_fuzz.py).
    ([_encoded(trajectory_id="a")], "trajectory_id 'a' is not '<group>/<index in group>'"),
    ([_encoded(trajectory_id="a/x")], "is not '<group>/<index in group>'"),
    ([_encoded(prompt_ids=[])], "no prompt token"),
    ([_encoded(prompt_ids=[3, -1, 4])], r"prompt_ids holds a negative token id \(-1\)"),
    ([_encoded(response_ids=[-(2**31)] + [1] * 6)], "response_ids holds a negative token id"),
    ([_encoded(behavior_logprobs=[-1.0, math.nan] + [-1.0] * 5)], r"behavior_logprobs holds NaN or \+inf \(1 tokens\)"),
    ([_encoded(behavior_logprobs=[math.inf] * 7)], r"behavior_logprobs holds NaN or \+inf \(7 tokens\)"),
    ([_encoded(teacher_logprobs=[-1.0, math.nan] + [-1.0] * 5)], r"^trajectory 'a/0': teacher_logprobs holds NaN "
                                                                  r"or \+-inf \(1 tokens\)$"),
    ([_encoded(teacher_logprobs=[-math.inf] * 2 + [-1.0] * 5)], r"teacher_logprobs holds NaN or \+-inf \(2 tokens\)"),
    ([_encoded(teacher_logprobs=[math.inf] * 7)], r"teacher_logprobs holds NaN or \+-inf \(7 tokens\)"),
    ([_encoded(loss_mask=[0, 1, 2, 1, 1, 1, 1])], r"loss_mask holds 2 \(0 or 1 only\)"),
    ([_encoded(loss_mask=[255] * 7)], "loss_mask holds 255"),
    ([_encoded(policy_version=[-1] * 7)], r"policy_version holds -1 \(versions are >= 0\)"),
    ([_encoded(policy_version=[-(2**63)] * 7)], r"policy_version holds -9223372036854775808"),
    ([_encoded(reward=math.nan)], "reward is nan"),
    ([_encoded(reward=-math.inf)], "reward is -inf"),
    ([_encoded(reward_extras={"acc": 1.0, "x": math.inf})], r"reward_extras \['x'\] are not finite"),
])
def test_decode_rejects_malformed_messages_with_a_clear_error(frames, match):
    with pytest.raises(MalformedMessageError, match=match):
        decode_trajectory(frames)


def test_versions_past_int32_take_the_exact_check_and_pass():
    """The message-wide check reads versions as int32 words: one >= 2^31 must still be accepted."""
    for version in (2**31, 2**32 - 1, 2**40, 2**63 - 1):
        traj = make_traj("a/0", policy_version=[version] * 7)
        assert decode_trajectory(encode_trajectory(traj)) == traj


# ------------------------------------------------------------------------------ both transports
@pytest.mark.parametrize("kind", ["zmq", "inproc"])
def test_send_recv_and_recv_many(kind):
    receiver, make_sender = make_transport(kind, hwm=16)
    sender = make_sender()
    try:
        assert isinstance(receiver, TrajectoryReceiver) and isinstance(sender, TrajectorySender)
        sent = [make_traj(f"{i}/0", group_id=i, seed=i) for i in range(10)]
        for t in sent:
            sender.send(t)
        got = [receiver.recv(timeout_s=5.0)]
        while len(got) < len(sent):
            got += receiver.recv_many(max_items=4, timeout_s=5.0)
            assert len(got) <= len(sent)
        assert got == sent  # one sender: order is kept
        t0 = time.monotonic()
        assert receiver.recv(timeout_s=0.05) is None and receiver.recv_many(3, timeout_s=0.0) == []
        assert time.monotonic() - t0 < 1.0
        assert (receiver.num_received, receiver.num_malformed) == (10, 0)
    finally:
        sender.close()
        receiver.close()


def test_inproc_back_pressure_times_out_and_loses_nothing():
    receiver, make_sender = make_transport("inproc", hwm=2, send_timeout_s=0.1)
    sender = make_sender()
    sender.send(make_traj("0/0"))
    sender.send(make_traj("1/0"))
    with pytest.raises(SendTimeoutError, match=r"trajectory 2/0 .*timed out after 0.1 s.*not reading"):
        sender.send(make_traj("2/0"))
    assert [t.trajectory_id for t in receiver.recv_many(10, timeout_s=0)] == ["0/0", "1/0"]
    assert isinstance(receiver, InProcTrajectoryReceiver)


def test_make_transport_rejects_unknown_kind_and_bad_hwm():
    with pytest.raises(ValueError, match="unknown transport kind 'ray'"):
        make_transport("ray")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hwm must be >= 1"):
        make_transport("zmq", hwm=0)


# -------------------------------------------------------------------------------------------- zmq
def _send_many(factory: ZmqSenderFactory, rank: int, num: int) -> None:
    sender = factory()
    for i in range(num):
        sender.send(make_traj(f"{rank}/{i}", group_id=rank, seed=rank * 1000 + i))
    sender.close()  # lingers until everything is delivered


def _send_groups_and_exit(factory, num: int) -> None:
    """Send ``num`` groups of 8 trajectories (frames of ~200 KB, over pyzmq's 64 KiB zero-copy
    threshold), close the sender, and let the process end."""
    base = [make_traj(f"0/{i}", 0, num_prompt=100, num_response=1000, seed=i) for i in range(8)]
    groups = [TrajectoryGroup(g, [dataclasses.replace(t, trajectory_id=f"{g}/{i}", group_id=g)
                                  for i, t in enumerate(base)]) for g in range(num)]
    sender = factory()
    for group in groups:  # faster than the receiver decodes: messages are still queued at the end
        sender.send(group)
    sender.close()  # no Context.term(): a process that just ends, as an actor's may


def test_zmq_groups_sent_just_before_a_process_exits_all_arrive():
    """Frames over 64 KiB (a group) queued when the sending process exits are still delivered:
    the sender hands ZeroMQ a copy, flushed during its linger (a zero-copy frame was lost)."""
    num = 200
    receiver, factory = make_transport("zmq", hwm=64)
    proc = mp.get_context("spawn").Process(target=_send_groups_and_exit, args=(factory, num))
    proc.start()
    got = []
    try:
        while len(got) < num * 9:
            batch = receiver.recv_many(512, timeout_s=30.0)
            assert batch, f"receiver starved after {len(got)} messages"
            got += batch
    finally:
        proc.join(timeout=60)
        receiver.close()
    assert proc.exitcode == 0
    assert [m for m in got if isinstance(m, GroupClosed)] == [GroupClosed(g, 8) for g in range(num)]


def _send_to_unbound_address_and_exit(factory, num: int, queued) -> None:
    """Queue ``num`` groups for a receiver not bound yet, signal, close the sender, end the process."""
    sender = factory()
    for g in range(num):
        sender.send(TrajectoryGroup(g, [make_traj(f"{g}/{i}", g, num_prompt=100, num_response=1000, seed=i)
                                        for i in range(8)]))
    queued.set()
    sender.close()


def test_zmq_sender_close_delivers_the_queue_before_its_process_may_exit():
    """``close`` returns only once the queue is delivered (or the linger ends): queued for a
    receiver that binds 1 s later, every group arrives. With the sockets on pyzmq's shared
    context, ``close`` returned at once and the exiting interpreter killed ZeroMQ's I/O thread
    with the queue unsent (CI lost 18 of 200 groups that way under load)."""
    num = 16  # under the sender's hwm: all of them queue without a receiver
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queued = ctx.Event()
    proc = ctx.Process(target=_send_to_unbound_address_and_exit,
                       args=(ZmqSenderFactory(address, hwm=64), num, queued))
    proc.start()
    receiver = None
    try:
        assert queued.wait(60), "the sender process did not queue its groups"
        time.sleep(1.0)
        assert proc.is_alive(), "the sender's close returned with its queue undelivered"
        receiver = ZmqTrajectoryReceiver(address, hwm=64)
        got = []
        while len(got) < num * 9:
            batch = receiver.recv_many(512, timeout_s=20.0)
            assert batch, f"receiver starved after {len(got)} messages"
            got += batch
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        if receiver is not None:
            receiver.close()
    assert [m for m in got if isinstance(m, GroupClosed)] == [GroupClosed(g, 8) for g in range(num)]
    assert sorted(m.trajectory_id for m in got if isinstance(m, Trajectory)) == sorted(
        f"{g}/{i}" for g in range(num) for i in range(8))


def test_zmq_sender_close_is_idempotent_and_bounded_by_its_linger():
    sender = ZmqSenderFactory("tcp://127.0.0.1:1", hwm=4, linger_s=0.3)()
    sender.send(make_traj("never/0"))  # queued for a receiver that never binds
    t0 = time.monotonic()
    sender.close()
    assert 0.2 < time.monotonic() - t0 < 10.0  # waited out the linger, then gave the queue up
    sender.close()


def test_zmq_two_sender_processes_deliver_exactly_once():
    num = 200
    receiver, factory = make_transport("zmq", hwm=8)  # small hwm: senders block on the slow start
    assert receiver.address.startswith("tcp://127.0.0.1:")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_send_many, args=(factory, rank, num)) for rank in range(2)]
    for p in procs:
        p.start()
    got = []
    try:
        while len(got) < 2 * num:
            batch = receiver.recv_many(64, timeout_s=30.0)
            assert batch, f"receiver starved after {len(got)} trajectories"
            got += batch
        assert receiver.recv(timeout_s=0.2) is None  # and nothing more
    finally:
        for p in procs:
            p.join(timeout=30)
        receiver.close()
    assert [p.exitcode for p in procs] == [0, 0]
    ids = [t.trajectory_id for t in got]
    assert len(set(ids)) == len(ids) == 2 * num
    by_id = {t.trajectory_id: t for t in got}
    for rank in range(2):
        for i in (0, num // 2, num - 1):
            assert by_id[f"{rank}/{i}"] == make_traj(f"{rank}/{i}", group_id=rank, seed=rank * 1000 + i)
        # PUSH/PULL keeps each sender's order.
        assert [int(t.trajectory_id.split("/")[1]) for t in got if t.group_id == rank] == list(range(num))


def test_zmq_back_pressure_blocks_then_times_out_with_clear_error():
    receiver = ZmqTrajectoryReceiver(hwm=1)
    sender = ZmqSenderFactory(receiver.address, hwm=1, send_timeout_s=0.2)()
    traj = make_traj("bp/0", num_prompt=100, num_response=1000)  # ~21 KB on the wire
    t0 = time.monotonic()
    num_sent = 0
    try:
        with pytest.raises(SendTimeoutError, match=r"timed out after 0.2 s: the receiver is not reading"):
            for num_sent in range(100_000):  # the kernel socket buffers take a few hundred first
                sender.send(traj)
        elapsed = time.monotonic() - t0
        assert 0 < num_sent < 100_000 and elapsed < 3.0
        # The timed-out message was not queued; everything sent before it arrives.
        got = 0
        while receiver.recv(timeout_s=0.3) is not None:
            got += 1
        assert got == num_sent
        sender.send(traj)  # the pipe flows again once the receiver reads
        assert receiver.recv(timeout_s=2.0) == traj
    finally:
        sender.close()
        receiver.close()


def test_zmq_send_without_any_receiver_times_out():
    # Messages queue for a not-yet-bound receiver up to SNDHWM (delivered if it comes up), then block.
    sender = ZmqSenderFactory("tcp://127.0.0.1:1", hwm=2, send_timeout_s=0.1, linger_s=0)()
    sender.send(make_traj("a/0"))
    sender.send(make_traj("a/1"))
    with pytest.raises(SendTimeoutError, match="or was never bound"):
        sender.send(make_traj("a/2"))
    sender.close()


def test_zmq_receiver_counts_logs_and_skips_malformed_messages(caplog):
    receiver = ZmqTrajectoryReceiver()
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.connect(receiver.address)
    good = make_traj("ok/0")
    try:
        raw.send_multipart([b"not msgpack \xc1"])
        raw.send_multipart([_message(schema=99)])
        raw.send_multipart([_GOOD, _GOOD])
        raw.send_multipart(encode_trajectory(good))
        with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
            assert receiver.recv(timeout_s=5.0) == good
        assert (receiver.num_malformed, receiver.num_received) == (3, 1)
        assert "schema version 99" in caplog.text and "too short for its header" in caplog.text
        assert "message has 2 frames" in caplog.text
    finally:
        raw.close(linger=0)
        receiver.close()


def test_group_closed_travels_with_trajectories():
    from async_rl.buffers.transport import GroupClosed, decode_message, encode_message

    assert decode_message(encode_message(GroupClosed(7, 3))) == GroupClosed(7, 3)
    with pytest.raises(ValueError, match="num_kept"):
        encode_message(GroupClosed(7, -1))
    with pytest.raises(TypeError, match="only Trajectory, TrajectoryGroup and GroupClosed"):
        encode_message({"group_id": 7})
    receiver, make_sender = make_transport("inproc")
    sender = make_sender()
    sender.send(GroupClosed(1, 0))
    assert receiver.recv(1.0) == GroupClosed(1, 0)


# ------------------------------------------------------------------------------- arrays as arrays
@pytest.mark.parametrize("num_prompt, num_response", [(1, 0), (5, 7), (100, 1000), (3, 32_768)])
def test_every_field_round_trips_bit_for_bit_with_its_dtype(num_prompt, num_response):
    rng = np.random.default_rng(num_response)
    # Log-probs with every awkward float64: -0.0, subnormals, -inf, the next float after -1.
    special = [-0.0, -5e-324, -1e-310, -math.inf, -1.0000000000000002, -1e308]
    logprobs = (-rng.exponential(3.0, num_response)).tolist()
    logprobs[: len(special)] = special[:num_response]
    teacher = (-rng.exponential(1.0, num_response)).tolist()
    teacher[: len(special) - 1] = [x for x in special if x != -math.inf][:num_response]  # finite only
    traj = make_traj("9/3", group_id=9, num_prompt=num_prompt, num_response=num_response, seed=num_response,
                     behavior_logprobs=logprobs, teacher_logprobs=teacher,
                     prompt_ids=rng.integers(0, 2**31 - 1, num_prompt).tolist(),
                     policy_version=[2**62] * num_response, generator_id=5, reward=-0.0,
                     reward_extras={"acc": 5e-324, "len": -1.5}, response_text="é" * num_response)
    out = roundtrip(traj)
    for name, dtype in PER_TOKEN_DTYPES.items():
        sent, got = getattr(traj, name), getattr(out, name)
        assert got.dtype == dtype and got.shape == sent.shape == (len(sent),)
        assert got.tobytes() == sent.tobytes(), name  # bit for bit, incl. -0.0 and NaN-free subnormals
    assert bits(out.behavior_logprobs) == bits(logprobs) and bits(out.teacher_logprobs) == bits(teacher)
    assert out.as_dict() == traj.as_dict() and out == traj
    assert bits([out.reward, *out.reward_extras.values()]) == bits([-0.0, 5e-324, -1.5])
    assert (out.num_tokens, out.min_version) == (num_prompt + num_response, 2**62 if num_response else 0)
    # The decoded arrays are views of the received message: no per-token Python objects, read-only.
    assert not out.response_ids.flags.writeable and isinstance(out.response_ids, np.ndarray)
    assert not out.teacher_logprobs.flags.writeable


def test_a_message_mixing_trajectories_with_and_without_teacher_logprobs_round_trips_bit_exact():
    """T_i = R_i for some trajectories, 0 for others: each gets back exactly its own teacher
    log-probs (an empty array for none), read-only views of the one received frame."""
    sent = [make_traj("4/0", 4, num_response=3, seed=0, teacher_logprobs=[-0.0, -5e-324, -2.5]),
            make_traj("4/1", 4, num_response=5, seed=1),
            make_traj("4/2", 4, num_response=0, response_text=""),
            make_traj("4/3", 4, num_response=2, seed=3, teacher_logprobs=[-1.0000000000000002, -1e308])]
    frame = encode_message(TrajectoryGroup(4, sent))[0]
    header, body = split_frame(frame)
    assert [e[9:11] for e in header["trajectories"]] == [[3, 3], [5, 0], [0, 0], [2, 2]]
    assert len(body) == 21 * 10 + 8 * 5 + 4 * 20
    messages, rejected = decode_messages([frame])
    assert rejected == [] and messages == [*sent, GroupClosed(4, 4)]
    got = messages[:4]
    assert [bits(t.teacher_logprobs) for t in got] == [
        bits([-0.0, -5e-324, -2.5]), [], [], bits([-1.0000000000000002, -1e308])]
    for t in got:
        assert t.teacher_logprobs.dtype == np.float64 and t.teacher_logprobs.ndim == 1
        assert not t.teacher_logprobs.flags.writeable
    assert np.shares_memory(got[0].teacher_logprobs, np.frombuffer(frame, np.uint8))
    assert np.shares_memory(got[3].teacher_logprobs, np.frombuffer(frame, np.uint8))


def test_a_non_finite_teacher_logprob_rejects_only_its_trajectory():
    """NaN, +inf and -inf teacher log-probs (the message-wide sum is then not finite) send the
    message to the per-trajectory check: only those trajectories are refused."""
    good = [make_traj(f"5/{i}", 5, seed=i, teacher_logprobs=[-float(i + 1)] * 7) for i in range(4)]
    bad = {1: [-1.0, math.nan] + [-1.0] * 5, 2: [-math.inf] + [-0.5] * 6}
    sent = [make_traj(t.trajectory_id, 5, seed=i, teacher_logprobs=bad.get(i, t.teacher_logprobs.tolist()))
            for i, t in enumerate(good)]
    messages, rejected = decode_messages(encode_trajectories(sent))
    assert messages == [good[0], good[3]]
    assert [str(e) for e in rejected] == ["trajectory '5/1': teacher_logprobs holds NaN or +-inf (1 tokens)",
                                          "trajectory '5/2': teacher_logprobs holds NaN or +-inf (1 tokens)"]


def test_extreme_finite_teacher_logprobs_are_kept():
    """Only NaN and +-inf are refused: the largest finite magnitudes pass the message-wide check."""
    traj = make_traj("a/0", teacher_logprobs=[-1.7976931348623157e308] * 6 + [-5e-324])
    messages, rejected = decode_messages(encode_trajectory(traj))
    assert rejected == [] and messages == [traj]


def test_encode_refuses_teacher_logprobs_reassigned_to_another_length():
    traj = make_traj("a/0")
    traj.teacher_logprobs = np.full(3, -1.0)  # after construction: nothing checked it
    with pytest.raises(ValueError, match=r"^trajectory a/0: teacher_logprobs has 3 values for 7 response tokens"):
        encode_trajectory(traj)


def test_trajectory_holds_wire_dtypes_and_converts_exactly_or_refuses():
    traj = make_traj("a/0", prompt_ids=np.array([1, 2, 3], dtype=np.int64),
                     behavior_logprobs=np.full(7, -0.5, dtype=np.float32), loss_mask=np.ones(7, dtype=bool))
    assert {name: getattr(traj, name).dtype for name in PER_TOKEN_DTYPES} == PER_TOKEN_DTYPES
    assert traj.prompt_ids.tolist() == [1, 2, 3] and traj.loss_mask.tolist() == [1] * 7
    same = np.arange(7, dtype="<i4")
    assert make_traj("a/1", response_ids=same).response_ids is same  # right dtype: kept, not copied
    with pytest.raises(ValueError, match=r"trajectory a/2: prompt_ids cannot be sent as int32: .*<= 2147483647"):
        make_traj("a/2", prompt_ids=np.array([2**31], dtype=np.int64))
    with pytest.raises(ValueError, match="response_ids cannot be sent as int32: dtype float64 is not an integer"):
        make_traj("a/3", response_ids=np.zeros(7))
    with pytest.raises(ValueError, match="loss_mask cannot be sent as uint8: a 2-D array"):
        make_traj("a/4", loss_mask=np.ones((7, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"per-token fields disagree in length \(response_ids 7, behavior_logprobs 6"):
        make_traj("a/5", behavior_logprobs=[-1.0] * 6)
    assert traj.teacher_logprobs.dtype == np.float64 and traj.teacher_logprobs.shape == (0,)  # the default
    # A checkpointed buffer keeps plain lists; they rebuild an equal trajectory.
    plain = traj.as_dict()
    assert type(plain["response_ids"]) is list and Trajectory(**plain) == traj
    assert traj != make_traj("a/0", prompt_ids=[1, 2, 4])


@pytest.mark.parametrize("num_teacher", [1, 6, 8])
def test_teacher_logprobs_must_have_none_or_one_per_response_token(num_teacher):
    with pytest.raises(ValueError, match=rf"^trajectory t/0: per-token fields disagree in length \(response_ids 7, "
                                         rf".*teacher_logprobs {num_teacher}, which must be 0 or 7\)$"):
        make_traj("t/0", teacher_logprobs=[-1.0] * num_teacher)
    with pytest.raises(ValueError, match=r"teacher_logprobs 1, which must be 0 or 0"):
        make_traj("t/1", num_response=0, teacher_logprobs=[-1.0])
    assert make_traj("t/2", teacher_logprobs=[-1.0] * 7).teacher_logprobs.tolist() == [-1.0] * 7
    assert make_traj("t/3", teacher_logprobs=[]).teacher_logprobs.tolist() == []


def test_teacher_logprobs_survive_equality_and_as_dict():
    teacher = [-0.0, -5e-324, -0.25, -1.0000000000000002, -1e308, -3.0, -7.5]
    traj = make_traj("t/0", teacher_logprobs=np.full(7, -0.5, dtype=np.float32))  # converted like the others
    assert traj.teacher_logprobs.dtype == np.dtype("<f8") and traj.teacher_logprobs.tolist() == [-0.5] * 7
    exact = make_traj("t/0", teacher_logprobs=teacher)
    plain = exact.as_dict()
    assert type(plain["teacher_logprobs"]) is list and bits(plain["teacher_logprobs"]) == bits(teacher)
    back = Trajectory(**plain)
    assert back == exact and bits(back.teacher_logprobs) == bits(teacher)
    assert exact != make_traj("t/0") and exact != dataclasses.replace(exact, teacher_logprobs=[-0.0] + teacher[1:6] + [-7.0])
    assert make_traj("t/0").as_dict()["teacher_logprobs"] == []


def test_collate_from_arrays_matches_hand_layout():
    t = Trajectory("0/0", 0, "u", [7, 8, 9], [4, 5, 2], [-0.5, -0.25, -1.0], [1, 0, 1], "stop", [3, 3, 3])
    batch = collate([t, Trajectory("0/1", 0, "u", [7], [6], [-2.0], [1], "stop", [3])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 9, 4, 5, 2], [7, 6, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.behavior_logprobs.tolist() == [[0, 0, -0.5, -0.25, -1.0], [-2.0, 0, 0, 0, 0]]  # label-aligned
    assert batch.input_ids.dtype == torch.long and batch.behavior_logprobs.dtype == torch.float32
    assert batch.extras == {}  # no teacher: no extra


def test_collate_aligns_teacher_logprobs_like_behavior_logprobs():
    """Prompt [7, 8, 9], response [4, 5, 2]: label slot 2 predicts the first response token, so
    the teacher's log-probs sit in slots 2..4, zeros in the prompt slots and the padding."""
    a = Trajectory("0/0", 0, "u", [7, 8, 9], [4, 5, 2], [-0.5, -0.25, -1.0], [1, 0, 1], "stop", [3, 3, 3],
                   teacher_logprobs=[-0.125, -2.0, -0.75])
    b = Trajectory("0/1", 0, "u", [7], [6], [-2.0], [1], "stop", [3], teacher_logprobs=[-3.5])
    c = Trajectory("0/2", 0, "u", [7, 8], [], [], [], "abort", [])  # empty response: nothing to carry
    batch = collate([a, b, c], pad_token_id=0)
    assert set(batch.extras) == {"teacher_logprobs"}
    teacher = batch.extras["teacher_logprobs"]
    assert teacher.dtype == torch.float32 and teacher.shape == (3, 5)
    assert teacher.tolist() == [[0, 0, -0.125, -2.0, -0.75], [-3.5, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert batch.behavior_logprobs.tolist()[:2] == [[0, 0, -0.5, -0.25, -1.0], [-2.0, 0, 0, 0, 0]]  # same slots
    assert batch.trimmed().extras["teacher_logprobs"].tolist()[:2] == [[0, 0, -0.125, -2.0, -0.75], [-3.5, 0, 0, 0, 0]]
    assert batch.select([1]).extras["teacher_logprobs"].tolist() == [[-3.5, 0, 0, 0, 0]]


def test_collate_refuses_a_batch_mixing_trajectories_with_and_without_teacher_logprobs():
    with_t = Trajectory("0/0", 0, "u", [7], [4, 5], [-0.5, -0.25], [1, 1], "stop", [3, 3], teacher_logprobs=[-1.0, -2.0])
    without = [Trajectory(f"0/{i}", 0, "u", [7], [4], [-0.5], [1], "stop", [3]) for i in (1, 2)]
    with pytest.raises(ValueError) as e:
        collate([without[0], with_t, without[1]], pad_token_id=0)
    assert str(e.value) == "collate: trajectory 0/1 has no teacher_logprobs, but 1 of the batch's 3 trajectories have them"
    assert "teacher_logprobs" not in collate(without, pad_token_id=0).extras


def _garbled(rng: np.random.Generator) -> list[bytes]:
    """A message whose array bytes are truncated, padded or garbled, or whose trajectory
    header is schema 3's map; each is malformed."""
    header, arrays = _parts(encode_trajectory(make_traj("g/0", num_prompt=4, num_response=6,
                                                         teacher_logprobs=[-1.0] * 6,
                                                         teacher_topk_ids=np.ones((6, 2), np.int32),
                                                         teacher_topk_logprobs=np.full((6, 2), -1.0, np.float32),
                                                         routed_experts=np.ones((9, 2, 2), np.int16),
                                                         observation_pixel_values=np.ones((4, 3), np.float32),
                                                         observation_image_grid_thw=[[1, 2, 2]]))[0])
    name = _BODY[rng.integers(len(_BODY))]
    data = arrays[name]
    kind = rng.integers(4)
    if kind == 0:
        arrays[name] = data[: rng.integers(len(data))]  # truncated
    elif kind == 1:
        arrays[name] = data + bytes(int(rng.integers(1, 8)))  # trailing bytes
    elif kind == 2:  # garbled bytes of the right size, made invalid for the field
        arrays[name] = {"prompt_ids": b"\xff" * 16, "response_ids": b"\xff" * 24,
                        "behavior_logprobs": np.full(6, np.nan).tobytes(), "loss_mask": b"\x07" * 6,
                        "teacher_logprobs": np.full(6, -np.inf).tobytes(),
                        "teacher_topk_ids": b"\xff" * 48, "teacher_topk_logprobs": np.full(12, 0.5, np.float32).tobytes(),
                        "routed_experts": b"\xff" * 72,
                        "observation_image_grid_thw": bytes(24),
                        "observation_pixel_values": np.full(12, np.nan, np.float32).tobytes(),
                        "policy_version": b"\xff" * 48}[name]
    else:  # the trajectory's fields as a map, as schema 3 sent them
        header["trajectories"] = [dict(zip(_ENTRY_FIELDS, header["trajectories"][0]))]
    return [pack_frame(header, [arrays[n] for n in _BODY])]


def test_truncated_or_garbled_array_buffers_are_refused_and_counted_once_each(caplog):
    rng = np.random.default_rng(0)
    bad = [_garbled(rng) for _ in range(40)]
    for frames in bad:
        with pytest.raises(MalformedMessageError,
                           match=r"trajectory 'g/0'|message body is \d+ bytes|trajectory header 0 is a msgpack dict"):
            decode_trajectory(frames)
    receiver, make_sender = make_transport("inproc", hwm=64)
    good = make_traj("ok/0")
    for frames in bad:
        receiver._channel.queue.put(frames)
    make_sender().send(good)
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        assert receiver.recv(timeout_s=5.0) == good
    assert (receiver.num_malformed, receiver.num_received) == (len(bad), 1)
    assert caplog.text.count("rejected malformed message") == len(bad)


@pytest.mark.parametrize("kind", ["trajectory", "group_closed"])
def test_a_schema_3_message_is_refused_with_one_line_naming_both_versions(kind):
    """What a generator of the previous release sends: one msgpack map, arrays as bin fields."""
    traj = make_traj("a/0")
    old = ({"schema": 3, "kind": "group_closed", "group_id": 1, "num_kept": 2} if kind == "group_closed" else
           {"schema": 3, **dict(zip(_ENTRY_FIELDS, _parts(encode_trajectory(traj)[0])[0]["trajectories"][0])),
            **{name: getattr(traj, name).tobytes() for name in PER_TOKEN_DTYPES}})
    with pytest.raises(MalformedMessageError) as e:
        decode_message([msgpack.packb(old, use_bin_type=True)])
    assert str(e.value) == ("schema version 3, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")


@pytest.mark.parametrize("kind", ["trajectories", "group_closed"])
def test_a_schema_4_message_is_refused_with_one_line_naming_both_versions(kind):
    """What a generator of the previous release sends: the same framing, a 10-field trajectory
    header (no num_teacher_tokens) and a 21R + 4P body."""
    traj = make_traj("a/0")
    if kind == "group_closed":
        frame = pack_frame({"schema": 4, "kind": "group_closed", "group_id": 1, "num_kept": 2})
    else:
        entry = ["a/0", 0, "uid-0", -1, "stop", traj.reward, {"acc": 1.0}, "x = 4", 5, 7]
        frame = pack_frame({"schema": 4, "kind": "trajectories", "group_id": None, "trajectories": [entry]},
                           [getattr(traj, n) for n in ("behavior_logprobs", "policy_version", "prompt_ids",
                                                       "response_ids", "loss_mask")])
        assert len(split_frame(frame)[1]) == 21 * 7 + 4 * 5
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([frame])
    assert str(e.value) == ("schema version 4, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")


# --------------------------------------------------------------------------------- group messages
def _group(gid: int, k: int, **bad) -> TrajectoryGroup:
    """Group ``gid`` of ``k`` trajectories; ``bad`` replaces fields of its sample 1."""
    trajs = [make_traj(f"{gid}/{i}", gid, num_prompt=3 + i, num_response=5 + 2 * i, seed=i) for i in range(k)]
    if bad:
        trajs[1] = make_traj(f"{gid}/1", bad.pop("group_id", gid), num_prompt=4, num_response=7, seed=1, **bad)
    return TrajectoryGroup(gid, trajs)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_a_group_message_arrives_as_its_trajectories_then_its_closure(k):
    group = _group(9, k)
    messages, rejected = decode_messages(encode_message(group))
    assert rejected == [] and messages == [*group.trajectories, GroupClosed(9, k)]
    for got, sent in zip(messages, group.trajectories):
        for name, dtype in PER_TOKEN_DTYPES.items():
            assert getattr(got, name).dtype == dtype and getattr(got, name).tobytes() == getattr(sent, name).tobytes()
    if k:
        with pytest.raises(MalformedMessageError, match=f"message carries {k + 1} messages, expected one"):
            decode_message(encode_message(group))


@pytest.mark.parametrize("bad, match", [
    (dict(behavior_logprobs=[-1.0, math.nan] + [-1.0] * 5), r"trajectory '9/1': behavior_logprobs holds NaN"),
    (dict(teacher_logprobs=[-1.0] * 6 + [-math.inf]), r"trajectory '9/1': teacher_logprobs holds NaN or \+-inf \(1 "),
    (dict(loss_mask=[3] * 7), r"trajectory '9/1': loss_mask holds 3"),
    (dict(policy_version=[-1] * 7), r"trajectory '9/1': policy_version holds -1"),
    (dict(response_ids=[5, -2] + [1] * 5), r"trajectory '9/1': response_ids holds a negative token id \(-2\)"),
    (dict(prompt_ids=[]), r"trajectory '9/1': no prompt token"),
    (dict(reward=math.inf), r"trajectory '9/1': reward is inf"),
    (dict(group_id=8), r"trajectory '9/1': group_id 8 in a message of group 9"),
    # The teacher's top-k (the group's other samples carry none: K_i = 0 beside K_i = 2).
    (dict(teacher_topk_ids=[[4, 1]] * 6 + [[4, -3]], teacher_topk_logprobs=[[-0.5, -1.0]] * 7),
     r"^trajectory '9/1': teacher_topk_ids holds a negative token id \(-3\)$"),
    (dict(teacher_topk_ids=[[4, 1]] * 7, teacher_topk_logprobs=[[-0.5, math.nan]] + [[-0.5, -1.0]] * 6),
     r"^trajectory '9/1': teacher_topk_logprobs holds NaN, \+-inf or a positive log-prob \(> 1e-06; 1 values\)$"),
    (dict(teacher_topk_ids=[[4, 1]] * 7, teacher_topk_logprobs=[[2e-6, -1.0]] * 2 + [[-0.5, -1.0]] * 5),
     r"trajectory '9/1': teacher_topk_logprobs holds .* \(> 1e-06; 2 values\)$"),
])
def test_a_bad_trajectory_of_a_group_is_refused_alone_and_the_rest_kept(bad, match, caplog):
    """Values are per trajectory: the one that cannot be trained on is counted and logged, the
    others and the closure arrive (the buffer then waits for a sample that never comes, as when
    that trajectory travelled alone and was refused)."""
    group = _group(9, 4)
    frames = encode_trajectories([*group.trajectories[:1], _group(9, 4, **bad).trajectories[1],
                                  *group.trajectories[2:]])
    header, body = split_frame(frames[0])
    header["group_id"] = 9  # what a sender that does not check (another implementation) would send
    frames = [pack_frame(header, [body])]
    messages, rejected = decode_messages(frames)
    assert [str(e) for e in rejected] and re.match(match, str(rejected[0])) and len(rejected) == 1
    assert messages == [group.trajectories[0], *group.trajectories[2:], GroupClosed(9, 4)]
    receiver, make_sender = make_transport("inproc", hwm=8)
    receiver._channel.queue.put(frames)
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        got = receiver.recv_many(16, timeout_s=5.0)
    assert got == messages and (receiver.num_malformed, receiver.num_received) == (1, 4)
    assert caplog.text.count("rejected malformed message") == 1 and "9/1" in caplog.text


def _assert_refused_whole(header: dict, body, caplog) -> None:
    """The message of ``header`` and ``body`` is refused as a whole and counted once; a message
    after it still arrives."""
    receiver, make_sender = make_transport("inproc", hwm=8)
    receiver._channel.queue.put([pack_frame(header, [body])])
    make_sender().send(GroupClosed(5, 0))
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        assert receiver.recv_many(16, timeout_s=5.0) == [GroupClosed(5, 0)]
    assert (receiver.num_malformed, receiver.num_received) == (1, 1)


def test_a_group_with_a_broken_layout_is_refused_whole_and_counted_once(caplog):
    """A size that disagrees with the body voids every offset in it: nothing of it is trusted."""
    header, body = split_frame(encode_message(_group(9, 4))[0])
    header["trajectories"][2][9] += 1  # one response token more than the body holds
    _assert_refused_whole(header, body, caplog)
    assert "message body is" in caplog.text


def test_encode_refuses_a_group_holding_another_groups_trajectory_or_an_empty_batch():
    with pytest.raises(ValueError, match="trajectory 9/1 of group 8 sent in group 9"):
        encode_message(_group(9, 3, group_id=8))
    with pytest.raises(ValueError, match="no trajectory to send"):
        encode_trajectories([])


def test_zmq_groups_and_single_trajectories_interleave_in_order():
    receiver, make_sender = make_transport("zmq", hwm=4)
    sender = make_sender()
    try:
        sent = [_group(1, 3), make_traj("2/0", 2), _group(3, 0), _group(4, 8)]
        for msg in sent:
            sender.send(msg)
        expected = []
        for msg in sent:
            expected += [*msg.trajectories, GroupClosed(msg.group_id, len(msg.trajectories))] if isinstance(
                msg, TrajectoryGroup) else [msg]
        got = []
        deadline = time.monotonic() + 30  # only against a hang
        while len(got) < len(expected) and time.monotonic() < deadline:
            got += receiver.recv_many(5, timeout_s=1.0)
        assert got == expected and receiver.num_received == len(expected) and receiver.num_malformed == 0
    finally:
        sender.close()
        receiver.close()


def test_the_teacher_top_k_travels_flat_between_the_response_ids_and_the_loss_mask():
    """Schema 6: K_i in the header; the [R_i, K_i] int32 ids, then the float32 log-probs, after
    the response ids (4-byte aligned), read back as [R_i, K_i] read-only views; a trajectory
    without a top-k (K_i = 0) in the same group gets [0, 0]; body 21R + 8T + 4P + 8 sum(R_i K_i)."""
    ids = np.arange(12, dtype=np.int32).reshape(4, 3)
    lps = -np.linspace(0.1, 5.0, 12, dtype=np.float32).reshape(4, 3)
    with_topk = make_traj("5/0", 5, num_prompt=3, num_response=4, teacher_logprobs=[-0.5] * 4,
                          teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    without = make_traj("5/1", 5, num_prompt=2, num_response=2, teacher_logprobs=[-1.0, -2.0])
    frame = encode_message(TrajectoryGroup(5, [with_topk, without]))[0]
    header, body = split_frame(frame)
    assert [e[8:] for e in header["trajectories"]] == [[3, 4, 4, 3, 0, 0, 0, 0, 0], [2, 2, 2, 0, 0, 0, 0, 0, 0]]
    assert len(body) == 21 * 6 + 8 * 6 + 4 * 5 + 8 * 12
    at = 8 * 6 + 8 * 6 + 8 * 6 + 4 * 5 + 4 * 6
    assert np.frombuffer(body, "<i4", 12, at).tolist() == ids.reshape(-1).tolist()
    assert np.frombuffer(body, "<f4", 12, at + 48).tobytes() == lps.tobytes()
    messages, rejected = decode_messages([frame])
    assert rejected == [] and messages == [with_topk, without, GroupClosed(5, 2)]
    got = messages[0]
    assert got.teacher_topk_ids.shape == (4, 3) and got.teacher_topk_logprobs.dtype == np.float32
    assert not got.teacher_topk_ids.flags.writeable and messages[1].teacher_topk_ids.shape == (0, 0)


@pytest.mark.parametrize("ids, lps, match", [
    ([[1, -2]], [[-0.5, -1.0]], "teacher_topk_ids holds a negative token id"),
    ([[1, 2]], [[0.5, -1.0]], "teacher_topk_logprobs holds NaN, \\+-inf or a positive log-prob"),
    ([[1, 2]], [[float("nan"), -1.0]], "teacher_topk_logprobs holds NaN"),
    ([[1, 2]], [[-float("inf"), -1.0]], "teacher_topk_logprobs holds NaN"),
])
def test_a_bad_teacher_top_k_rejects_only_its_trajectory(ids, lps, match):
    good = make_traj("6/0", 6, num_response=1, teacher_logprobs=[-1.0], teacher_topk_ids=[[3, 4]],
                     teacher_topk_logprobs=[[-0.1, -2.0]])
    bad = make_traj("6/1", 6, num_response=1, teacher_logprobs=[-1.0], teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(6, [good, bad])))
    assert messages == [good, GroupClosed(6, 2)]
    assert len(rejected) == 1 and re.search(match, str(rejected[0])) and "'6/1'" in str(rejected[0])


def test_encode_refuses_a_top_k_reassigned_to_the_wrong_shape():
    traj = make_traj("7/0", 7, num_response=2, teacher_topk_ids=[[1], [2]], teacher_topk_logprobs=[[-1.0], [-1.0]])
    traj.teacher_topk_logprobs = np.zeros((3, 1), np.float32)
    with pytest.raises(ValueError, match=r"teacher_topk_ids \(2, 1\) and teacher_topk_logprobs \(3, 1\)"):
        encode_trajectory(traj)


def _topk(num_response: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A teacher top-k of ``[num_response, k]``: ids over int32, log-probs <= 0, for ``make_traj``."""
    rng = np.random.default_rng(seed)
    return {"teacher_topk_ids": rng.integers(0, 2**31 - 1, (num_response, k)).astype(np.int32),
            "teacher_topk_logprobs": (-rng.exponential(2.0, (num_response, k))).astype(np.float32)}


# Every awkward float32 a top-k log-prob may be: -0.0, 0.0, the smallest subnormal, the most
# negative finite value, the largest float32 <= 1e-6 and a tiny positive one (round-off).
_F32_EDGES = np.array([-0.0, 0.0, -1e-45, -3.4028235e38, 1e-6, 1e-30, -1.0000001, -7.25], dtype=np.float32)


@pytest.mark.parametrize("as_memoryview", [False, True])
def test_the_teacher_top_k_round_trips_bit_exact_in_a_mixed_group(as_memoryview):
    """K_i differs per trajectory on the wire (K = 1, K = 8, none, an empty response): each gets
    its own [R_i, K_i] back, bit for bit (float32 -0.0, subnormals, the <= 1e-6 round-off), as
    read-only views of the one frame; ids 0 and 2^31 - 1 included."""
    edges = _F32_EDGES.reshape(1, 8)
    sent = [make_traj("3/0", 3, num_response=4, seed=0, **_topk(4, 1, seed=1)),
            make_traj("3/1", 3, num_response=3, seed=1, teacher_logprobs=[-1.0] * 3,
                      teacher_topk_ids=np.array([[0, 2**31 - 1, 5, 6, 7, 8, 9, 10]] * 3, np.int32),
                      teacher_topk_logprobs=np.concatenate([edges, edges[:, ::-1], edges])),
            make_traj("3/2", 3, num_response=5, seed=2),
            make_traj("3/3", 3, num_response=0, response_text="")]
    frame = encode_message(TrajectoryGroup(3, sent))[0]
    header, body = split_frame(frame)
    assert [e[9:] for e in header["trajectories"]] == [[4, 0, 1, 0, 0, 0, 0, 0], [3, 3, 8, 0, 0, 0, 0, 0],
                                                        [5, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert len(body) == 21 * 12 + 8 * 3 + 4 * 20 + 8 * (4 * 1 + 3 * 8)
    messages, rejected = decode_messages([memoryview(frame)] if as_memoryview else [frame])
    assert rejected == [] and messages == [*sent, GroupClosed(3, 4)]
    for got, want in zip(messages, sent):
        for name, dtype in (("teacher_topk_ids", "<i4"), ("teacher_topk_logprobs", "<f4")):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == np.dtype(dtype) and a.shape == b.shape and a.tobytes() == b.tobytes(), name
            assert not a.flags.writeable
    assert [m.teacher_topk_ids.shape for m in messages[:4]] == [(4, 1), (3, 8), (0, 0), (0, 0)]
    assert np.shares_memory(messages[1].teacher_topk_logprobs, np.frombuffer(frame, np.uint8))
    assert messages[1].teacher_topk_logprobs.view(np.uint32)[0, 0] == 0x80000000  # -0.0 kept


def test_a_top_k_log_prob_of_exactly_the_tolerance_is_kept_and_one_above_is_refused():
    """The message-wide max and the per-trajectory check agree on the 1e-6 bound (float32)."""
    at = np.float32(1e-6)  # 9.9999997e-07 <= 1e-6
    above = np.nextafter(np.float32(1e-6), np.float32(1))  # the next float32: 1.0000001e-06 > 1e-6
    ok = make_traj("8/0", 8, num_response=2, teacher_topk_ids=[[1], [2]], teacher_topk_logprobs=[[at], [-1.0]])
    bad = make_traj("8/1", 8, num_response=2, teacher_topk_ids=[[1], [2]], teacher_topk_logprobs=[[-1.0], [above]])
    messages, rejected = decode_messages(encode_message(TrajectoryGroup(8, [ok, bad])))
    assert messages == [ok, GroupClosed(8, 2)]
    assert [str(e) for e in rejected] == ["trajectory '8/1': teacher_topk_logprobs holds NaN, +-inf or a positive "
                                          "log-prob (> 1e-06; 1 values)"]
    assert decode_messages(encode_trajectory(ok)) == ([ok], [])


def test_a_top_k_with_an_empty_response_or_a_count_off_by_one_voids_the_whole_message(caplog):
    """K_i != 0 with R_i = 0 is a layout error (R_i K_i = 0 entries would hide it from the body
    size), and a K_i that disagrees with the body voids every offset: nothing of the message is
    kept, one counted rejection."""
    header, body = split_frame(encode_trajectory(make_traj("e/0", num_response=0, response_text=""))[0])
    header["trajectories"][0][11] = 2
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [body])])
    assert str(e.value) == ("field 'teacher_top_k' of trajectory header 0 is 2, expected >= 0, and 0 when "
                            "num_response_tokens is 0 (it is 0)")
    group = TrajectoryGroup(9, [make_traj(f"9/{i}", 9, num_response=3, seed=i, **_topk(3, 2, seed=i))
                                for i in range(3)])
    header, body = split_frame(encode_message(group)[0])
    header["trajectories"][1][11] = 3  # the body holds K = 2 for it
    _assert_refused_whole(header, body, caplog)
    assert f"message body is {len(body)} bytes, expected {len(body) + 8 * 3} for 3 trajectories" in caplog.text


@pytest.mark.parametrize("kind", ["trajectories", "group_closed"])
def test_a_schema_5_message_is_refused_with_one_line_naming_both_versions(kind):
    """What a generator of the previous release sends: the same framing, an 11-field trajectory
    header (no teacher_top_k) and a 21R + 8T + 4P body."""
    traj = make_traj("a/0", teacher_logprobs=[-1.0] * 7)
    if kind == "group_closed":
        frame = pack_frame({"schema": 5, "kind": "group_closed", "group_id": 1, "num_kept": 2})
    else:
        entry = ["a/0", 0, "uid-0", -1, "stop", traj.reward, {"acc": 1.0}, "x = 4", 5, 7, 7]
        frame = pack_frame({"schema": 5, "kind": "trajectories", "group_id": None, "trajectories": [entry]},
                           [getattr(traj, n) for n in ("behavior_logprobs", "teacher_logprobs", "policy_version",
                                                       "prompt_ids", "response_ids", "loss_mask")])
        assert len(split_frame(frame)[1]) == 21 * 7 + 8 * 7 + 4 * 5
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([frame])
    assert str(e.value) == ("schema version 5, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")


def test_encode_converts_a_reassigned_top_k_exactly_or_refuses_it():
    """A top-k set after construction (as the teacher stage does) is sent in the wire dtypes when
    it converts exactly, else refused naming the trajectory and the field, never wrapped."""
    traj = make_traj("7/0", 7, num_response=2)
    traj.teacher_topk_ids = [[3, 4], [5, 6]]  # lists: converted
    traj.teacher_topk_logprobs = np.array([[-0.5, -1.5], [-0.25, -3.0]])  # float64: rounded to float32 exactly
    out = decode_trajectory(encode_trajectory(traj))
    assert out.teacher_topk_ids.tolist() == [[3, 4], [5, 6]] and out.teacher_topk_logprobs.dtype == np.float32
    assert out.teacher_topk_logprobs.tolist() == [[-0.5, -1.5], [-0.25, -3.0]]
    traj.teacher_topk_ids = np.array([[3, 2**31], [5, 6]], np.int64)
    with pytest.raises(ValueError, match=r"^trajectory 7/0: teacher_topk_ids cannot be held as int32 \[R, K\]: "
                                         r"values must satisfy -2147483648 <= number <= 2147483647"):
        encode_trajectory(traj)
    traj.teacher_topk_ids = [[3.5, 4], [5, 6]]
    with pytest.raises(ValueError, match=r"teacher_topk_ids cannot be held as int32 .*float64 is not an integer"):
        encode_trajectory(traj)


# --------------------------------------------------------------------------- top-k in a Trajectory
def test_a_trajectory_holds_its_top_k_in_the_wire_dtypes_and_converts_exactly_or_refuses():
    ids = np.array([[1, 2], [3, 4], [5, 6]], np.int32)
    lps = np.array([[-0.5, -1.0], [-2.0, -3.0], [-0.0, -9.0]], np.float32)
    kept = make_traj("k/0", num_response=3, teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    assert kept.teacher_topk_ids is ids and kept.teacher_topk_logprobs is lps  # right dtype: no copy
    plain = make_traj("k/0", num_response=3, teacher_topk_ids=ids.tolist(), teacher_topk_logprobs=lps.tolist())
    assert plain == kept and plain.teacher_topk_ids.dtype == np.dtype("<i4")
    assert plain.teacher_topk_logprobs.dtype == np.dtype("<f4")
    assert plain.teacher_topk_logprobs.tobytes() == lps.tobytes()
    wide = make_traj("k/0", num_response=3, teacher_topk_ids=ids.astype(np.int64), teacher_topk_logprobs=lps)
    assert wide.teacher_topk_ids.dtype == np.dtype("<i4") and wide == kept
    default = make_traj("k/1")
    assert default.teacher_topk_ids.shape == default.teacher_topk_logprobs.shape == (0, 0)
    assert (default.teacher_topk_ids.dtype, default.teacher_topk_logprobs.dtype) == (np.dtype("<i4"), np.dtype("<f4"))
    # "None" in any spelling is [0, 0]: as_dict's [], an empty response's [0, K], an [R, 0].
    for empty_ids, empty_lps in (([], []), (np.zeros((0, 4), np.int32), np.zeros((0, 4), np.float32)),
                                 (np.zeros((7, 0)), np.zeros((7, 0)))):
        t = make_traj("k/2", teacher_topk_ids=empty_ids, teacher_topk_logprobs=empty_lps)
        assert t.teacher_topk_ids.shape == t.teacher_topk_logprobs.shape == (0, 0) and t == make_traj("k/2")
    # as_dict / Trajectory(**d) keeps the float32 values exactly, through JSON too.
    back = Trajectory(**json.loads(json.dumps(kept.as_dict())))
    assert back == kept and back.teacher_topk_logprobs.tobytes() == lps.tobytes()
    assert kept.as_dict()["teacher_topk_ids"] == [[1, 2], [3, 4], [5, 6]]
    assert default.as_dict()["teacher_topk_ids"] == []
    assert kept != dataclasses.replace(kept, teacher_topk_logprobs=lps + np.float32(-1.0))
    assert kept != dataclasses.replace(kept, teacher_topk_ids=ids[:, ::-1])


@pytest.mark.parametrize("kw, match", [
    (dict(teacher_topk_ids=[[1, 2]] * 7), r"^trajectory t/0: teacher_topk_ids \(7, 2\) and teacher_topk_logprobs "
                                          r"\(0, 0\) must both be \[7, K\] \(K >= 1\) or both \[0, 0\]$"),
    (dict(teacher_topk_logprobs=[[-1.0]] * 7), r"teacher_topk_ids \(0, 0\) and teacher_topk_logprobs \(7, 1\)"),
    (dict(teacher_topk_ids=[[1, 2]] * 6, teacher_topk_logprobs=[[-1.0, -2.0]] * 6), r"\(6, 2\) .* \[7, K\]"),
    (dict(teacher_topk_ids=[[1, 2]] * 7, teacher_topk_logprobs=[[-1.0]] * 7), r"\(7, 2\) and .* \(7, 1\)"),
    (dict(teacher_topk_ids=[[1, 2]] * 6 + [[1]], teacher_topk_logprobs=[[-1.0, -2.0]] * 7),
     r"^trajectory t/0: teacher_topk_ids cannot be held as int32 \[R, K\]: .*inhomogeneous"),
    (dict(teacher_topk_ids=[1] * 7, teacher_topk_logprobs=[-1.0] * 7),
     r"teacher_topk_ids cannot be held .*a 1-D array"),
    (dict(teacher_topk_ids=np.ones((7, 1, 1), np.int32), teacher_topk_logprobs=np.ones((7, 1, 1), np.float32)),
     r"teacher_topk_ids cannot be held as int32 \[R, K\]: a 3-D array, expected 2-D"),
    (dict(teacher_topk_ids=[[1]] * 7, teacher_topk_logprobs=[[-1e300]] * 7),
     r"teacher_topk_logprobs cannot be held as float32 \[R, K\]: a finite value beyond float32's range \(-1e\+300\)"),
    (dict(teacher_topk_ids=[["a"]] * 7, teacher_topk_logprobs=[[-1.0]] * 7), r"teacher_topk_ids .*is not an integer"),
])
def test_a_trajectory_refuses_a_top_k_that_is_not_both_r_by_k(kw, match):
    with pytest.raises(ValueError, match=match):
        make_traj("t/0", **kw)


# ----------------------------------------------------------------------------- top-k in collate
def _topk_traj(tid: str, prompt: list[int], response: list[int], k: int, base: int) -> Trajectory:
    """Ids ``base + 10 t + j`` and log-probs ``-(base + 10 t + j) / 100`` at response position t, rank j."""
    r = len(response)
    grid = base + 10 * np.arange(r)[:, None] + np.arange(k)[None, :]
    return Trajectory(tid, 0, "u", prompt, response, [-0.5] * r, [1] * r, "stop", [3] * r,
                      teacher_logprobs=[-1.0] * r, teacher_topk_ids=grid.astype(np.int32),
                      teacher_topk_logprobs=(-grid / 100).astype(np.float32))


def test_collate_puts_the_top_k_rows_in_the_label_slots_of_the_teacher_logprobs():
    """Prompts of 3 and 1 tokens (the response starts at slot P - 1), L = 6: row t of trajectory
    i lands in slot P_i - 1 + t of [B, L-1, K], zeros (id 0, log-prob 0) everywhere else; an empty
    response fits with zeros."""
    a = _topk_traj("0/0", [7, 8, 9], [4, 5, 2], k=2, base=100)
    b = _topk_traj("0/1", [7], [6, 3], k=2, base=200)
    c = Trajectory("0/2", 0, "u", [7, 8], [], [], [], "abort", [])  # no response: nothing to carry
    batch = collate([a, b, c], pad_token_id=0)
    ids, lps = batch.extras["teacher_topk_ids"], batch.extras["teacher_topk_logprobs"]
    assert ids.dtype == torch.long and lps.dtype == torch.float32 and ids.shape == lps.shape == (3, 5, 2)
    z = [0, 0]
    assert ids.tolist() == [[z, z, [100, 101], [110, 111], [120, 121]],
                            [[200, 201], [210, 211], z, z, z],
                            [z, z, z, z, z]]
    assert lps.tolist() == (-ids.double() / 100).float().tolist()  # the same slots, the same rows
    # Exactly the slots where teacher_logprobs (and behavior_logprobs) go.
    assert ((ids != 0).any(-1) == (batch.extras["teacher_logprobs"] != 0)).all()
    assert ((ids != 0).any(-1) == (batch.loss_mask != 0)).all()
    # select, to and trimmed keep the [B, L-1, K] extras with their rows; trimmed cuts dim 1.
    one = batch.select([1])
    assert one.extras["teacher_topk_ids"].tolist() == [[[200, 201], [210, 211], z, z, z]]
    cut = one.trimmed()
    assert cut.input_ids.shape == (1, 3) and cut.extras["teacher_topk_ids"].shape == (1, 2, 2)
    assert cut.extras["teacher_topk_ids"].tolist() == [[[200, 201], [210, 211]]]
    assert torch.equal(cut.extras["teacher_topk_logprobs"], lps[1:2, :2])
    moved = batch.to("meta")
    assert moved.extras["teacher_topk_ids"].shape == (3, 5, 2)
    assert moved.extras["teacher_topk_ids"].device.type == "meta"


def test_collate_without_a_top_k_adds_none_and_a_batch_of_empty_responses_needs_none():
    plain = Trajectory("0/0", 0, "u", [7], [4], [-0.5], [1], "stop", [3], teacher_logprobs=[-1.0])
    empty = Trajectory("0/1", 0, "u", [7, 8], [], [], [], "abort", [])
    assert set(collate([plain, empty], pad_token_id=0).extras) == {"teacher_logprobs"}
    assert collate([empty], pad_token_id=0).extras == {}


def test_collate_refuses_a_batch_mixing_trajectories_with_and_without_a_top_k():
    with_k = [_topk_traj(f"0/{i}", [7], [4, 5], k=3, base=10 * i) for i in (0, 2)]
    without = Trajectory("0/1", 0, "u", [7], [4], [-0.5], [1], "stop", [3], teacher_logprobs=[-1.0])
    with pytest.raises(ValueError) as e:
        collate([with_k[0], without, with_k[1]], pad_token_id=0)
    assert str(e.value) == ("collate: trajectory 0/1 has no teacher_topk_ids, but 2 of the batch's 3 trajectories "
                            "have them")


def test_collate_refuses_top_k_trajectories_of_different_k():
    batch = [_topk_traj("0/0", [7], [4, 5], k=3, base=0), _topk_traj("0/1", [7], [4], k=3, base=50),
             _topk_traj("0/2", [7, 8], [4], k=2, base=90), _topk_traj("0/3", [7], [4], k=4, base=90)]
    with pytest.raises(ValueError) as e:
        collate(batch, pad_token_id=0)
    assert str(e.value) == ("collate: trajectory 0/2 has a teacher top-2, but the batch's first with a top-k (0/0) "
                            "has a top-3")


# ------------------------------------------------------------------- routed experts on the wire
def _routed(num_rows: int, layers: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Routing of ``[num_rows, layers, top_k]`` int16 expert indices over all of 0..32767, both
    ends included (for ``make_traj``'s ``routed_experts``)."""
    routed = np.random.default_rng(seed).integers(0, 2**15, (num_rows, layers, top_k)).astype(np.int16)
    if routed.size >= 2:
        routed.flat[0], routed.flat[-1] = 0, 2**15 - 1
    return routed


@pytest.mark.parametrize("as_memoryview", [False, True])
def test_routed_experts_of_different_shapes_round_trip_bit_exact_in_one_group_message(as_memoryview):
    """L_i and k_i differ per trajectory in one group message (2 x 3, none, 1 x 1, 4 x 8, an
    empty response, beside a top-k): each gets its own [P_i + R_i - 1, L_i, k_i] back bit for
    bit, as read-only int16 views of the one frame; those without share one read-only [0, 0, 0]."""
    sent = [make_traj("2/0", 2, num_prompt=3, num_response=4, seed=0, routed_experts=_routed(6, 2, 3, seed=0)),
            make_traj("2/1", 2, num_prompt=2, num_response=5, seed=1),
            make_traj("2/2", 2, num_prompt=1, num_response=1, seed=2, routed_experts=[[[7]]]),
            make_traj("2/3", 2, num_prompt=5, num_response=3, seed=3, teacher_logprobs=[-1.0] * 3,
                      **_topk(3, 2, seed=3), routed_experts=_routed(7, 4, 8, seed=3)),
            make_traj("2/4", 2, num_prompt=4, num_response=0, response_text="",
                      routed_experts=_routed(3, 2, 2, seed=4)),
            make_traj("2/5", 2, num_prompt=2, num_response=2, seed=5)]
    frame = encode_message(TrajectoryGroup(2, sent))[0]
    header, body = split_frame(frame)
    assert [e[12:] for e in header["trajectories"]] == [[2, 3, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                                                         [4, 8, 0, 0, 0], [2, 2, 0, 0, 0], [0, 0, 0, 0, 0]]
    p, r, t, q, e = 17, 15, 3, 6, 6 * 6 + 1 + 7 * 32 + 3 * 4
    assert len(body) == 21 * r + 8 * t + 4 * p + 8 * q + 2 * e
    messages, rejected = decode_messages([memoryview(frame)] if as_memoryview else [frame])
    assert rejected == [] and messages == [*sent, GroupClosed(2, 6)]
    for got, want in zip(messages, sent):
        a, b = got.routed_experts, want.routed_experts
        assert a.dtype == np.dtype("<i2") and a.shape == b.shape and a.tobytes() == b.tobytes(), got.trajectory_id
        assert not a.flags.writeable
    assert [m.routed_experts.shape for m in messages[:6]] == [(6, 2, 3), (0, 0, 0), (1, 1, 1), (7, 4, 8), (3, 2, 2),
                                                              (0, 0, 0)]
    assert messages[0].routed_experts.min() == 0 and messages[3].routed_experts.max() == 2**15 - 1
    assert np.shares_memory(messages[3].routed_experts, np.frombuffer(frame, np.uint8))
    assert messages[1].routed_experts is messages[5].routed_experts  # the one shared "none"
    assert messages[3].teacher_topk_ids.tobytes() == sent[3].teacher_topk_ids.tobytes()  # its neighbours intact
    assert messages[4].loss_mask.tolist() == [] and messages[5].loss_mask.tobytes() == sent[5].loss_mask.tobytes()


def test_routed_experts_travel_between_the_top_k_log_probs_and_the_loss_mask():
    """Schema 7: L_i, k_i after K_i in the trajectory header; the int16 routing of every trajectory
    at byte 20R + 8T + 4P + 8Q (4-byte aligned), the loss mask 2E bytes later; body
    21R + 8T + 4P + 8Q + 2E."""
    routed = _routed(6, 3, 2, seed=1)
    ids, lps = np.arange(8, dtype=np.int32).reshape(4, 2), np.full((4, 2), -0.5, np.float32)
    with_routing = make_traj("5/0", 5, num_prompt=3, num_response=4, teacher_logprobs=[-0.5] * 4,
                             teacher_topk_ids=ids, teacher_topk_logprobs=lps, routed_experts=routed)
    also = make_traj("5/1", 5, num_prompt=2, num_response=1, routed_experts=[[[1, 2]], [[3, 4]]])
    header, body = split_frame(encode_message(TrajectoryGroup(5, [with_routing, also]))[0])
    assert [e[8:] for e in header["trajectories"]] == [[3, 4, 4, 2, 3, 2, 0, 0, 0], [2, 1, 0, 0, 1, 2, 0, 0, 0]]
    assert len(header["trajectories"][0]) == 17
    p, r, t, q, e = 5, 5, 4, 8, 36 + 4
    assert len(body) == 21 * r + 8 * t + 4 * p + 8 * q + 2 * e == 301
    at = 20 * r + 8 * t + 4 * p + 8 * q
    assert at % 4 == 0 and np.frombuffer(body, "<f4", 8, at - 32).tobytes() == lps.tobytes()
    assert np.frombuffer(body, "<i2", e, at).tolist() == routed.reshape(-1).tolist() + [1, 2, 3, 4]
    assert bytes(body[at + 2 * e:]) == bytes(with_routing.loss_mask.tolist() + also.loss_mask.tolist())


def test_a_negative_routed_expert_rejects_only_its_trajectory(caplog):
    """A negative index (the message-wide min then fails) sends the message to the per-trajectory
    check: only that trajectory is refused, with one line; the rest of the group and its closure
    arrive. An encoder does not check a held int16 array, so a reassigned one carries it."""
    sent = [make_traj(f"6/{i}", 6, num_prompt=2 + i, num_response=3, seed=i,
                      routed_experts=_routed(4 + i, 1 + i, 2, seed=i)) for i in range(4)]
    sent[1].routed_experts = sent[1].routed_experts.copy()
    sent[1].routed_experts[2, 1, 0] = -1
    sent[3].routed_experts = np.full((7, 4, 2), -(2**15), np.int16)
    frames = encode_message(TrajectoryGroup(6, sent))
    messages, rejected = decode_messages(frames)
    assert messages == [sent[0], sent[2], GroupClosed(6, 4)]
    assert [str(e) for e in rejected] == ["trajectory '6/1': routed_experts holds a negative expert index (-1)",
                                          "trajectory '6/3': routed_experts holds a negative expert index (-32768)"]
    receiver, _ = make_transport("inproc", hwm=8)
    receiver._channel.queue.put(frames)
    with caplog.at_level(logging.WARNING, logger="async_rl.buffers.transport"):
        assert receiver.recv_many(16, timeout_s=5.0) == messages
    assert (receiver.num_malformed, receiver.num_received) == (2, 3)


def test_routed_experts_with_a_broken_layout_void_the_whole_message(caplog):
    """A routing of no token (P_i + R_i = 0) or a count that disagrees with the body by one entry
    (2 bytes) voids every offset: nothing of the message is kept, one counted rejection."""
    header, body = split_frame(encode_trajectory(make_traj("e/0", num_prompt=0, num_response=0, response_text=""))[0])
    header["trajectories"][0][12:14] = [2, 1]
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([pack_frame(header, [body])])
    assert str(e.value) == ("fields 'routed_layers' and 'routed_top_k' of trajectory header 0 are 2 and 1, expected 0 "
                            "for a trajectory without a token (num_prompt_tokens and num_response_tokens are 0)")
    group = TrajectoryGroup(9, [make_traj(f"9/{i}", 9, num_prompt=2, num_response=3, seed=i,
                                          routed_experts=_routed(4, 2, 2, seed=i)) for i in range(3)])
    header, body = split_frame(encode_message(group)[0])
    at_mask = len(body) - 9
    for short in (bytes(body[:at_mask - 2]) + bytes(body[at_mask:]),  # one entry short
                  bytes(body[:at_mask]) + b"\x00\x00" + bytes(body[at_mask:])):  # one entry too many
        with pytest.raises(MalformedMessageError, match=rf"^message body is {len(short)} bytes, expected {len(body)} "
                                                        r"for 3 trajectories .* 48 routed-expert entries, "
                                                        r"0 observation images and 0 pixel values\)$"):
            decode_messages([pack_frame(header, [short])])
    header["trajectories"][2][13] = 3  # the body holds k = 2 for it: 8 entries, 16 bytes short
    _assert_refused_whole(header, body, caplog)
    assert f"message body is {len(body)} bytes, expected {len(body) + 16} for 3 trajectories" in caplog.text


def test_routed_experts_of_a_single_token_are_none():
    """P_i + R_i = 1 forwards no token: L_i, k_i >= 1 then carry 0 entries (a layout the encoder
    never sends) and decode as the shared [0, 0, 0], as a ``Trajectory`` holds an empty routing."""
    traj = make_traj("1/0", num_prompt=1, num_response=0, response_text="",
                     routed_experts=np.zeros((0, 2, 2), np.int16))
    assert traj.routed_experts.shape == (0, 0, 0)
    header, body = split_frame(encode_trajectory(traj)[0])
    assert header["trajectories"][0][8:] == [1, 0, 0, 0, 0, 0, 0, 0, 0]
    header["trajectories"][0][12:14] = [2, 2]
    got = decode_trajectory([pack_frame(header, [body])])
    assert got == traj and got.routed_experts.shape == (0, 0, 0) and not got.routed_experts.flags.writeable


def test_encode_converts_reassigned_routed_experts_exactly_or_refuses_them():
    """Routing set after construction (as a generator may attach it) is sent as int16 when it
    converts exactly; a wrong row count, an index outside 0..32767 or a non-integer is refused
    at encode with one line naming the trajectory, never wrapped or sent to void a group."""
    traj = make_traj("7/0", 7, num_prompt=2, num_response=2)  # P + R - 1 = 3 forwarded tokens
    traj.routed_experts = [[[1, 2]], [[3, 4]], [[5, 32767]]]  # lists: converted
    out = decode_trajectory(encode_trajectory(traj))
    assert out.routed_experts.dtype == np.dtype("<i2")
    assert out.routed_experts.tolist() == [[[1, 2]], [[3, 4]], [[5, 32767]]]
    traj.routed_experts = np.arange(12, dtype=np.int64).reshape(3, 2, 2)[:, :, ::-1]  # int64, not contiguous
    assert decode_trajectory(encode_trajectory(traj)).routed_experts.tolist() == traj.routed_experts.tolist()
    traj.routed_experts = np.zeros((0, 4, 2), np.int16)  # empty: none
    assert encode_trajectory(traj) == encode_trajectory(make_traj("7/0", 7, num_prompt=2, num_response=2))
    for rows in (1, 2, 4):
        traj.routed_experts = np.ones((rows, 2, 2), np.int16)
        with pytest.raises(ValueError) as e:
            encode_trajectory(traj)
        assert str(e.value) == (f"trajectory 7/0: routed_experts has {rows} rows for 2 prompt and 2 response tokens "
                                "(P + R - 1 = 3 forwarded tokens)")
    traj.routed_experts = np.full((3, 1, 1), 2**15, np.int32)
    with pytest.raises(ValueError, match=r"^trajectory 7/0: routed_experts cannot be held as int16 \[tokens, layers, "
                                         r"k\]: values must satisfy -32768 <= number <= 32767"):
        encode_trajectory(traj)
    traj.routed_experts = [[[-1]], [[2]], [[3]]]  # converted, so checked as the constructor checks
    with pytest.raises(ValueError, match=r"^trajectory 7/0: routed_experts holds a negative expert index \(-1\)$"):
        encode_trajectory(traj)
    traj.routed_experts = np.ones((3, 2), np.int16)
    with pytest.raises(ValueError, match=r"routed_experts cannot be held as int16 .*a 2-D array, expected 3-D"):
        encode_trajectory(traj)
    # One trajectory's bad routing refuses the whole send: nothing half-encoded leaves.
    with pytest.raises(ValueError, match="trajectory 7/0: routed_experts"):
        encode_message(TrajectoryGroup(7, [make_traj("7/1", 7), traj]))


@pytest.mark.parametrize("kind", ["trajectories", "group_closed"])
def test_a_schema_6_message_is_refused_with_one_line_naming_both_versions(kind):
    """What a generator of the previous release sends: the same framing, a 12-field trajectory
    header (no routed_layers, routed_top_k) and a 21R + 8T + 4P + 8Q body."""
    traj = make_traj("a/0", teacher_logprobs=[-1.0] * 7, **_topk(7, 2))
    if kind == "group_closed":
        frame = pack_frame({"schema": 6, "kind": "group_closed", "group_id": 1, "num_kept": 2})
    else:
        entry = ["a/0", 0, "uid-0", -1, "stop", traj.reward, {"acc": 1.0}, "x = 4", 5, 7, 7, 2]
        frame = pack_frame({"schema": 6, "kind": "trajectories", "group_id": None, "trajectories": [entry]},
                           [getattr(traj, n) for n in ("behavior_logprobs", "teacher_logprobs", "policy_version",
                                                       "prompt_ids", "response_ids", "teacher_topk_ids",
                                                       "teacher_topk_logprobs", "loss_mask")])
        assert len(split_frame(frame)[1]) == 21 * 7 + 8 * 7 + 4 * 5 + 8 * 14
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([frame])
    assert str(e.value) == ("schema version 6, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")


@pytest.mark.parametrize("kind", ["trajectories", "group_closed"])
def test_a_schema_7_message_is_refused_with_one_line_naming_both_versions(kind):
    """What a generator of the previous release sends: the same framing, a 14-field trajectory
    header (no num_image_patches, patch_dim, num_images) and a 21R + 8T + 4P + 8Q + 2E body."""
    traj = make_traj("a/0", num_prompt=5, num_response=7, teacher_logprobs=[-1.0] * 7, **_topk(7, 2),
                     routed_experts=_routed(11, 2, 2))
    if kind == "group_closed":
        frame = pack_frame({"schema": 7, "kind": "group_closed", "group_id": 1, "num_kept": 2})
    else:
        entry = ["a/0", 0, "uid-0", -1, "stop", traj.reward, {"acc": 1.0}, "x = 4", 5, 7, 7, 2, 2, 2]
        frame = pack_frame({"schema": 7, "kind": "trajectories", "group_id": None, "trajectories": [entry]},
                           [getattr(traj, n) for n in ("behavior_logprobs", "teacher_logprobs", "policy_version",
                                                       "prompt_ids", "response_ids", "teacher_topk_ids",
                                                       "teacher_topk_logprobs", "routed_experts", "loss_mask")])
        assert len(split_frame(frame)[1]) == 21 * 7 + 8 * 7 + 4 * 5 + 8 * 14 + 2 * 44
    with pytest.raises(MalformedMessageError) as e:
        decode_messages([frame])
    assert str(e.value) == ("schema version 7, this decoder reads version 8 "
                            "(sender and receiver run different async-rl versions?)")
