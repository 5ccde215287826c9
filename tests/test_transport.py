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
