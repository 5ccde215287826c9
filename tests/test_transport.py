"""Tests for async_rl.buffers.transport: the msgpack codec, ZeroMQ PUSH/PULL and the in-process channel.

Run with ``python -m pytest -q tests/test_transport.py`` (a few seconds; one test spawns two
sender processes).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from async_rl.buffers.trajectory import PER_TOKEN_DTYPES, Trajectory, collate
from async_rl.buffers.transport import (
    SCHEMA_VERSION, InProcTrajectoryReceiver, MalformedMessageError, SendTimeoutError, TrajectoryReceiver,
    TrajectorySender, ZmqSenderFactory, ZmqTrajectoryReceiver, decode_message, decode_trajectory, encode_trajectory,
    make_transport,
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
])
@pytest.mark.parametrize("as_memoryview", [False, True])
def test_codec_round_trip_is_exact(traj, as_memoryview):
    out = roundtrip(traj, as_memoryview)
    assert out == traj
    assert bits(out.behavior_logprobs) == bits(traj.behavior_logprobs)  # bit-exact, -0.0 and subnormals too
    for name, dtype in PER_TOKEN_DTYPES.items():
        got, sent = getattr(out, name), getattr(traj, name)
        assert got.dtype == dtype and got.ndim == 1 and got.tobytes() == sent.tobytes(), name
    assert (out.trajectory_id, out.group_id, out.prompt_uid, out.finish_reason, out.response_text, out.generator_id) == (
        traj.trajectory_id, traj.group_id, traj.prompt_uid, traj.finish_reason, traj.response_text, traj.generator_id)
    assert bits([out.reward]) == bits([traj.reward]) and out.reward_extras == traj.reward_extras


def test_codec_layout_is_the_documented_schema():
    traj = make_traj("a/0", num_prompt=3, num_response=4)
    frames = encode_trajectory(traj)
    assert len(frames) == 1
    message = msgpack.unpackb(frames[0])
    assert message["schema"] == SCHEMA_VERSION == 3
    assert message["generator_id"] == traj.generator_id
    assert (message["num_prompt_tokens"], message["num_response_tokens"]) == (3, 4)
    arrays = {k: v for k, v in message.items() if isinstance(v, bytes)}
    assert {k: len(v) for k, v in arrays.items()} == {
        "prompt_ids": 3 * 4, "response_ids": 4 * 4, "behavior_logprobs": 4 * 8, "loss_mask": 4 * 1,
        "policy_version": 4 * 8}
    assert np.frombuffer(arrays["behavior_logprobs"], "<f8").tolist() == traj.behavior_logprobs.tolist()
    assert np.frombuffer(arrays["prompt_ids"], "<i4").tolist() == traj.prompt_ids.tolist()
    assert arrays["loss_mask"] == bytes(traj.loss_mask.tolist())
    assert b"\x80\x04" not in frames[0] and b"\x80\x05" not in frames[0]  # no pickle protocol 4/5 stream


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


def _message(**changes) -> bytes:
    """A valid encoded message with fields replaced (``...`` deletes one)."""
    message = msgpack.unpackb(encode_trajectory(make_traj("a/0"))[0])
    message.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del message[k]
    return msgpack.packb(message)


def _encoded(**kw) -> bytes:
    """The one frame of ``make_traj("a/0", **kw)``: the encoder carries what the decoder refuses."""
    return encode_trajectory(make_traj(kw.pop("trajectory_id", "a/0"), **kw))[0]


_GOOD = encode_trajectory(make_traj("a/0"))[0]
_LOGPROBS = msgpack.unpackb(_GOOD)["behavior_logprobs"]


@pytest.mark.parametrize("frames, match", [
    ([], "0 frames, schema 3 has 1"),
    ([_GOOD, b""], "2 frames"),
    ([_GOOD[:-3]], "not valid msgpack"),
    ([b"\xc1\xc1garbage"], "not valid msgpack"),
    ([_GOOD + b"\x00"], "not valid msgpack: ExtraData"),
    ([msgpack.packb([1, 2])], "msgpack list, expected a map"),
    ([_message(schema=2)], "schema version 2, this decoder reads version 3"),
    ([_message(schema=...)], "schema version None"),
    ([_message(reward=...)], r"missing \['reward'\]"),
    ([_message(behavior_logprobs=...)], r"missing \['behavior_logprobs'\]"),
    ([_message(extra_field=1)], r"unexpected \['extra_field'\]"),
    ([_message(group_id="7")], "'group_id' is str"),
    ([_message(num_response_tokens=True)], "'num_response_tokens' is bool"),
    ([_message(loss_mask=[1, 0, 1, 1, 0, 1, 1])], "'loss_mask' is list"),
    ([_message(num_response_tokens=-1)], "negative"),
    ([_message(reward_extras={"acc": "1"})], "reward_extras must map"),
    ([_message(behavior_logprobs=_LOGPROBS[:-1])],
     r"trajectory a/0: behavior_logprobs is 55 bytes, expected 56 bytes \(7 x float64\)"),
    ([_message(behavior_logprobs=msgpack.ExtType(2, _LOGPROBS))], "'behavior_logprobs' is ExtType, expected bytes"),
    ([_message(num_prompt_tokens=6)], r"prompt_ids is 20 bytes, expected 24 bytes \(6 x int32\)"),
    # Well-formed layouts holding values the learner cannot train on (found by tests/test_fuzz.py).
    ([_encoded(trajectory_id="a")], "trajectory_id 'a' is not '<group>/<index in group>'"),
    ([_encoded(trajectory_id="a/x")], "is not '<group>/<index in group>'"),
    ([_encoded(prompt_ids=[])], "no prompt token"),
    ([_encoded(prompt_ids=[3, -1, 4])], r"prompt_ids holds a negative token id \(-1\)"),
    ([_encoded(response_ids=[-(2**31)] + [1] * 6)], "response_ids holds a negative token id"),
    ([_encoded(behavior_logprobs=[-1.0, math.nan] + [-1.0] * 5)], r"behavior_logprobs holds NaN or \+inf \(1 tokens\)"),
    ([_encoded(behavior_logprobs=[math.inf] * 7)], r"behavior_logprobs holds NaN or \+inf \(7 tokens\)"),
    ([_encoded(loss_mask=[0, 1, 2, 1, 1, 1, 1])], r"loss_mask holds 2 \(0 or 1 only\)"),
    ([_encoded(loss_mask=[255] * 7)], "loss_mask holds 255"),
    ([_encoded(policy_version=[-1] * 7)], r"policy_version holds -1 \(versions are >= 0\)"),
    ([_encoded(reward=math.nan)], "reward is nan"),
    ([_encoded(reward=-math.inf)], "reward is -inf"),
    ([_encoded(reward_extras={"acc": 1.0, "x": math.inf})], r"reward_extras \['x'\] are not finite"),
])
def test_decode_rejects_malformed_messages_with_a_clear_error(frames, match):
    with pytest.raises(MalformedMessageError, match=match):
        decode_trajectory(frames)


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
        assert "schema version 99" in caplog.text and "not valid msgpack" in caplog.text
        assert "message has 2 frames" in caplog.text
    finally:
        raw.close(linger=0)
        receiver.close()


def test_group_closed_travels_with_trajectories():
    from async_rl.buffers.transport import GroupClosed, decode_message, encode_message

    assert decode_message(encode_message(GroupClosed(7, 3))) == GroupClosed(7, 3)
    with pytest.raises(ValueError, match="num_kept"):
        encode_message(GroupClosed(7, -1))
    with pytest.raises(TypeError, match="only Trajectory and GroupClosed"):
        encode_message({"group_id": 7})
    receiver, make_sender = make_transport("inproc")
    sender = make_sender()
    sender.send(GroupClosed(1, 0))
    assert receiver.recv(1.0) == GroupClosed(1, 0)


# ------------------------------------------------------------------ schema 3: arrays as arrays
@pytest.mark.parametrize("num_prompt, num_response", [(1, 0), (5, 7), (100, 1000), (3, 32_768)])
def test_every_field_round_trips_bit_for_bit_with_its_dtype(num_prompt, num_response):
    rng = np.random.default_rng(num_response)
    # Log-probs with every awkward float64: -0.0, subnormals, -inf, the next float after -1.
    special = [-0.0, -5e-324, -1e-310, -math.inf, -1.0000000000000002, -1e308]
    logprobs = (-rng.exponential(3.0, num_response)).tolist()
    logprobs[: len(special)] = special[:num_response]
    traj = make_traj("9/3", group_id=9, num_prompt=num_prompt, num_response=num_response, seed=num_response,
                     behavior_logprobs=logprobs, prompt_ids=rng.integers(0, 2**31 - 1, num_prompt).tolist(),
                     policy_version=[2**62] * num_response, generator_id=5, reward=-0.0,
                     reward_extras={"acc": 5e-324, "len": -1.5}, response_text="é" * num_response)
    out = roundtrip(traj)
    for name, dtype in PER_TOKEN_DTYPES.items():
        sent, got = getattr(traj, name), getattr(out, name)
        assert got.dtype == dtype and got.shape == sent.shape == (len(sent),)
        assert got.tobytes() == sent.tobytes(), name  # bit for bit, incl. -0.0 and NaN-free subnormals
    assert bits(out.behavior_logprobs) == bits(logprobs)
    assert out.as_dict() == traj.as_dict() and out == traj
    assert bits([out.reward, *out.reward_extras.values()]) == bits([-0.0, 5e-324, -1.5])
    assert (out.num_tokens, out.min_version) == (num_prompt + num_response, 2**62 if num_response else 0)
    # The decoded arrays are views of the received message: no per-token Python objects, read-only.
    assert not out.response_ids.flags.writeable and isinstance(out.response_ids, np.ndarray)


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
    # A checkpointed buffer keeps plain lists; they rebuild an equal trajectory.
    plain = traj.as_dict()
    assert type(plain["response_ids"]) is list and Trajectory(**plain) == traj
    assert traj != make_traj("a/0", prompt_ids=[1, 2, 4])


def test_collate_from_arrays_matches_hand_layout():
    t = Trajectory("0/0", 0, "u", [7, 8, 9], [4, 5, 2], [-0.5, -0.25, -1.0], [1, 0, 1], "stop", [3, 3, 3])
    batch = collate([t, Trajectory("0/1", 0, "u", [7], [6], [-2.0], [1], "stop", [3])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[7, 8, 9, 4, 5, 2], [7, 6, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0, 1], [1, 0, 0, 0, 0]]
    assert batch.behavior_logprobs.tolist() == [[0, 0, -0.5, -0.25, -1.0], [-2.0, 0, 0, 0, 0]]  # label-aligned
    assert batch.input_ids.dtype == torch.long and batch.behavior_logprobs.dtype == torch.float32


def _garbled(rng: np.random.Generator) -> list[bytes]:
    """A schema-3 message whose array buffers are truncated, padded or garbled; each is malformed."""
    message = msgpack.unpackb(encode_trajectory(make_traj("g/0", num_prompt=4, num_response=6))[0])
    name = ["prompt_ids", "response_ids", "behavior_logprobs", "loss_mask", "policy_version"][rng.integers(5)]
    data = message[name]
    kind = rng.integers(4)
    if kind == 0:
        message[name] = data[: rng.integers(len(data))]  # truncated
    elif kind == 1:
        message[name] = data + bytes(int(rng.integers(1, 8)))  # trailing bytes
    elif kind == 2:  # garbled bytes of the right size, made invalid for the field
        message[name] = {"prompt_ids": b"\xff" * 16, "response_ids": b"\xff" * 24,
                         "behavior_logprobs": np.full(6, np.nan).tobytes(), "loss_mask": b"\x07" * 6,
                         "policy_version": b"\xff" * 48}[name]
    else:
        message[name] = msgpack.ExtType(1, data)  # schema 2's encoding of an array
    return [msgpack.packb(message, use_bin_type=True)]


def test_truncated_or_garbled_array_buffers_are_refused_and_counted_once_each(caplog):
    rng = np.random.default_rng(0)
    bad = [_garbled(rng) for _ in range(40)]
    for frames in bad:
        with pytest.raises(MalformedMessageError, match=r"trajectory 'g/0'|trajectory g/0: \w+ is \d+ bytes|is ExtType"):
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


def test_a_schema_2_message_is_refused_with_one_line_naming_both_versions():
    """What a generator of the previous release sends (per-token fields as msgpack ext types)."""
    traj = make_traj("a/0")
    old = {"schema": 2, **{k: v for k, v in msgpack.unpackb(encode_trajectory(traj)[0]).items() if k != "schema"}}
    for code, name in enumerate(PER_TOKEN_DTYPES, start=1):
        old[name] = msgpack.ExtType(min(code, 4), old[name])
    with pytest.raises(MalformedMessageError) as e:
        decode_trajectory([msgpack.packb(old, use_bin_type=True)])
    assert str(e.value) == ("schema version 2, this decoder reads version 3 "
                            "(sender and receiver run different async-rl versions?)")
