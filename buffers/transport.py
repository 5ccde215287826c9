"""Trajectory transport: generators push finished trajectories to the learner's replay buffer.

Many generator processes (Ray actors) each own a ``TrajectorySender``; one process owns the
``TrajectoryReceiver`` and a thread that moves what it receives into the ``ReplayBuffer``::

    generator 0 ──send──> PUSH ─┐
    generator 1 ──send──> PUSH ─┼──tcp/ipc──> PULL ──recv──> receiver thread ──add──> ReplayBuffer
    generator k ──send──> PUSH ─┘   (bind on the receiver side; senders connect)

Who waits on whom: a sender's ``send`` blocks when its own queue (SNDHWM), the receiver's queue
(RCVHWM) and the kernel socket buffers between them are full, i.e. when the receiver thread stops
reading. With ``send_timeout_s`` set it raises ``SendTimeoutError`` instead of blocking forever.
While both ends are open nothing is dropped: ZeroMQ PUSH/PULL blocks rather than discards, and a
message the receiver cannot decode is counted (``num_malformed``) and logged, never ignored
silently. Closing loses what is still queued (a sender lingers ``linger_s`` to flush first).

Wire format (schema version 3; msgpack, never pickle). One trajectory is one ZeroMQ message of
one frame holding a msgpack map of the ``Trajectory`` fields plus ``schema`` (=3),
``num_prompt_tokens`` (P) and ``num_response_tokens`` (R). Scalars and strings are msgpack
values (``reward`` and ``reward_extras`` values as float64); each per-token field is a msgpack
``bin`` whose payload is the raw little-endian array, in the dtype the ``Trajectory`` holds it
(``PER_TOKEN_DTYPES``):

=======================  =======================  ======
field                    payload dtype            length
=======================  =======================  ======
``prompt_ids``           int32   (``<i4``)        P
``response_ids``         int32   (``<i4``)        R
``behavior_logprobs``    float64 (``<f8``)        R
``loss_mask``            uint8   (``u1``)         R
``policy_version``       int64   (``<i8``)        R
=======================  =======================  ======

The encoder packs each array's memory as it is (no per-token Python object, no conversion);
the decoder checks each payload's byte size against its count and dtype and wraps it with
``np.frombuffer`` (a read-only view, no copy beyond msgpack's one of the frame). Beyond the
layout the decoder checks what the learner relies on, vectorised, so a message that would
crash or poison a step is a counted malformed message instead: ``trajectory_id`` ends in
``/<index in group>`` (the learner orders a group by it), at least one prompt token, token ids
>= 0, ``behavior_logprobs`` neither NaN nor +inf (-inf is kept: the losses clamp log-ratios),
``loss_mask`` values 0 or 1, policy versions >= 0, a finite ``reward`` and finite
``reward_extras`` values. (Token ids past the vocabulary cannot be checked here: the transport
does not know the model.) A message of another schema version is refused with one line naming
both versions.

History: schema 2 carried the same arrays as msgpack ext types and the receiver turned them
back into Python lists (0.15-0.19x raw ZeroMQ's messages/s in ``bench/bench_transport.py``);
schema 3 (bin payloads, arrays kept as arrays) runs at ~0.55x on the same shared 2-core machine,
the rest being fixed per-message Python work in the decoder. Schema 2 added ``generator_id`` (the
actor that sampled it). A second message kind closes a group: ``{"schema": 3, "kind":
"group_closed", "group_id": g, "num_kept": k}``, sent by a generator once all samples of group
``g`` are scored, ``k`` of them kept (the others were rejected by the reward). It travels on the
same socket as the group's trajectories; the buffer's ``close_group`` accepts it in any order
relative to them.

Why this layout: raw arrays avoid encoding 1000s of numbers one msgpack item at a time, and one
frame beats one frame per array (``bench/bench_transport.py``: raw ZeroMQ moves ~1.6x more
25 KB messages/s as 1 frame than as 6; pyzmq copies frames under 64 KiB even with
``copy=False``, so separate zero-copy frames buy nothing at these sizes). Log-probs are
float64, so a Python float round-trips bit-exactly; token ids must fit int32 and ``loss_mask``
values 0..255, else building the ``Trajectory`` raises ``ValueError`` rather than wrap around
(the decoder then accepts only what the checks above allow).

Run the tests with ``python -m pytest -q tests/test_transport.py``; measure throughput with
``python bench/bench_transport.py``.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import msgpack
import numpy as np
import zmq

from async_rl.buffers.trajectory import PER_TOKEN_DTYPES, Trajectory, per_token_array
from async_rl.cluster import LOOPBACK

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
"""Version of the wire format above; bump it on any change to the fields, their encoding or the framing."""

# (field, payload dtype, the header count that gives its length).
_ARRAY_FIELDS: tuple[tuple[str, np.dtype, str], ...] = tuple(
    (name, dtype, "num_prompt_tokens" if name == "prompt_ids" else "num_response_tokens")
    for name, dtype in PER_TOKEN_DTYPES.items())
_NUM_FRAMES = 1
# Exact types: msgpack makes no subclasses, and a bool (an int subclass) in a count or id field is
# a sender bug.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "schema": (int,), "trajectory_id": (str,), "group_id": (int,), "prompt_uid": (str,), "generator_id": (int,),
    "finish_reason": (str,), "reward": (float, int), "reward_extras": (dict,), "response_text": (str,),
    "num_prompt_tokens": (int,), "num_response_tokens": (int,),
    **{name: (bytes,) for name, *_ in _ARRAY_FIELDS},
}
_FIELD_NAMES = frozenset(_FIELD_TYPES)
# The common case in one comparison (a float reward); anything else takes the per-field loop.
_USUAL_TYPES = tuple(kinds[0] for kinds in _FIELD_TYPES.values())
# Reductions called directly: ``ndarray.min()`` adds a Python-level wrapper per call.
_min, _max = np.minimum.reduce, np.maximum.reduce


_TRAJECTORY_ID = re.compile(r".*/[0-9]+", re.DOTALL)
"""``"<group>/<index in group>"``: the learner sorts a group's samples by the index."""


class MalformedMessageError(ValueError):
    """A received message is not a schema-``SCHEMA_VERSION`` trajectory; the text says why."""


class SendTimeoutError(TimeoutError):
    """``send`` could not hand a trajectory over within ``send_timeout_s`` (receiver not reading)."""


# ------------------------------------------------------------------------------------------ codec
def encode_trajectory(traj: Trajectory) -> list[bytes]:
    """Encode one trajectory in the schema-3 wire format (module docstring).

    Args:
        traj: the trajectory. ``reward`` and ``reward_extras`` values are sent as float (their
            declared type); everything else is sent exactly. Its per-token arrays are packed as
            they are (a field reassigned after construction is converted first).

    Returns:
        The message's frames: one ``bytes`` frame, the msgpack map (a list so that a later
        schema can add frames without changing the API).

    Raises:
        ValueError: a per-token field its wire dtype cannot hold (``per_token_array``: a token
            id outside int32, a ``loss_mask`` value outside 0..255, a non-integer in an integer
            field, not a flat sequence of numbers), or a non-numeric ``reward_extras`` value.
    """
    try:
        extras = {str(k): float(v) for k, v in traj.reward_extras.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"trajectory {traj.trajectory_id}: reward_extras must map str -> float ({e})") from e
    message = {
        "schema": SCHEMA_VERSION, "trajectory_id": traj.trajectory_id, "group_id": int(traj.group_id),
        "generator_id": int(traj.generator_id),
        "prompt_uid": traj.prompt_uid, "finish_reason": traj.finish_reason, "reward": float(traj.reward),
        "reward_extras": extras, "response_text": traj.response_text,
        "num_prompt_tokens": len(traj.prompt_ids), "num_response_tokens": len(traj.response_ids),
    }
    for name, *_ in _ARRAY_FIELDS:
        # A byte view of the array's own memory: msgpack copies it once, into the frame.
        message[name] = memoryview(per_token_array(getattr(traj, name), name, traj.trajectory_id)).cast("B")
    return [msgpack.packb(message, use_bin_type=True)]


@dataclass(frozen=True)
class GroupClosed:
    """Control message: group ``group_id`` is finished with ``num_kept`` trajectories sent.

    Attributes:
        group_id: the group's id.
        num_kept: trajectories of the group that were sent (>= 0); the rest were rejected.
    """

    group_id: int
    num_kept: int


Message = Trajectory | GroupClosed
"""What travels from async_rl.generators to the buffer."""


def encode_message(msg: Message) -> list[bytes]:
    """Frames of a ``Trajectory`` (``encode_trajectory``) or a ``GroupClosed`` message.

    Raises:
        ValueError: as ``encode_trajectory``, or a negative ``num_kept``.
        TypeError: any other object.
    """
    if isinstance(msg, Trajectory):
        return encode_trajectory(msg)
    if isinstance(msg, GroupClosed):
        if msg.num_kept < 0:
            raise ValueError(f"GroupClosed({msg.group_id}): num_kept must be >= 0, got {msg.num_kept}")
        return [msgpack.packb({"schema": SCHEMA_VERSION, "kind": "group_closed", "group_id": int(msg.group_id),
                               "num_kept": int(msg.num_kept)}, use_bin_type=True)]
    raise TypeError(f"cannot send a {type(msg).__name__}: only Trajectory and GroupClosed travel")


def _decode_group_closed(message: dict) -> GroupClosed:
    if set(message) != {"schema", "kind", "group_id", "num_kept"}:
        raise MalformedMessageError(f"group_closed message has fields {sorted(message)}")
    gid, kept = message["group_id"], message["num_kept"]
    if not (isinstance(gid, int) and isinstance(kept, int)) or isinstance(gid, bool) or isinstance(kept, bool) or kept < 0:
        raise MalformedMessageError(f"group_closed message has group_id {gid!r} and num_kept {kept!r}")
    return GroupClosed(gid, kept)


def _check_fields(message: Any) -> None:
    if type(message) is not dict:
        raise MalformedMessageError(f"message is a msgpack {type(message).__name__}, expected a map")
    if message.get("schema") != SCHEMA_VERSION:
        raise MalformedMessageError(
            f"schema version {message.get('schema')!r}, this decoder reads version {SCHEMA_VERSION} "
            "(sender and receiver run different async-rl versions?)")
    if message.keys() != _FIELD_NAMES:
        missing = sorted(_FIELD_NAMES - set(message))
        unexpected = sorted(set(message) - _FIELD_NAMES, key=str)
        raise MalformedMessageError(f"fields missing {missing}, unexpected {unexpected}")
    if tuple(map(type, map(message.__getitem__, _FIELD_TYPES))) != _USUAL_TYPES:
        for key, kinds in _FIELD_TYPES.items():
            if type(message[key]) not in kinds:
                raise MalformedMessageError(f"field {key!r} is {type(message[key]).__name__}, expected "
                                            f"{' or '.join(k.__name__ for k in kinds)}")
    for key in ("num_prompt_tokens", "num_response_tokens"):
        if message[key] < 0:
            raise MalformedMessageError(f"field {key!r} is negative ({message[key]})")
    extras = message["reward_extras"]
    if not all(type(k) is str and type(v) is float for k, v in extras.items()):
        raise MalformedMessageError(f"reward_extras must map str -> float, got {extras!r:.200}")


def _check_values(message: dict, arrays: dict[str, np.ndarray]) -> None:
    """The value checks of the module docstring, on a message whose layout is already valid."""
    tid = message["trajectory_id"]
    if not _TRAJECTORY_ID.fullmatch(tid):
        raise MalformedMessageError(f"trajectory_id {tid!r:.100} is not '<group>/<index in group>'")
    problems = []
    if message["num_prompt_tokens"] == 0:
        problems.append("no prompt token")
    # One reduction per array on the accepted path; the counts for the message only on rejection.
    for name in ("prompt_ids", "response_ids"):
        if arrays[name].size and _min(arrays[name]) < 0:
            problems.append(f"{name} holds a negative token id ({_min(arrays[name])})")
    logprobs = arrays["behavior_logprobs"]
    if logprobs.size and not _max(logprobs) < math.inf:  # max is NaN when any is; NaN < inf is False
        problems.append(f"behavior_logprobs holds NaN or +inf ({int((np.isnan(logprobs) | np.isposinf(logprobs)).sum())} "
                        "tokens)")
    if arrays["loss_mask"].size and _max(arrays["loss_mask"]) > 1:
        problems.append(f"loss_mask holds {_max(arrays['loss_mask'])} (0 or 1 only)")
    if arrays["policy_version"].size and _min(arrays["policy_version"]) < 0:
        problems.append(f"policy_version holds {_min(arrays['policy_version'])} (versions are >= 0)")
    if not math.isfinite(message["reward"]):
        problems.append(f"reward is {message['reward']!r}")
    bad_extras = sorted(k for k, v in message["reward_extras"].items() if not math.isfinite(v))
    if bad_extras:
        problems.append(f"reward_extras {bad_extras!r:.100} are not finite")
    if problems:
        raise MalformedMessageError(f"trajectory {tid!r:.100}: " + "; ".join(problems))


def decode_trajectory(frames: Sequence[Any]) -> Trajectory:
    """Decode the frames of one schema-3 message back into a ``Trajectory``.

    Args:
        frames: the message's frames (one), each a buffer-protocol object (``bytes``,
            ``memoryview``, ``zmq.Frame``), as made by ``encode_trajectory`` or received with
            ``recv_multipart``.

    Returns:
        A trajectory equal to the encoded one (float64 log-probs are bit-exact; ``reward`` and
        ``reward_extras`` values come back as float).

    Raises:
        MalformedMessageError (a ``ValueError``): a wrong frame count, bytes that are not one
            msgpack map, a schema version other than ``SCHEMA_VERSION``, missing, unexpected or
            mistyped fields, an array payload whose byte size does not match its field's
            dtype and token count, or a value the learner cannot train on (module docstring:
            the trajectory id, an empty prompt, a negative token id or version, a NaN or +inf
            log-prob, a loss mask other than 0/1, a non-finite reward). The message names the
            field at fault.
    """
    msg = decode_message(frames)
    if not isinstance(msg, Trajectory):
        raise MalformedMessageError(f"expected a trajectory, got {msg}")
    return msg


def decode_message(frames: Sequence[Any]) -> Message:
    """Decode one message: a ``Trajectory`` or a ``GroupClosed``.

    Raises:
        MalformedMessageError: as ``decode_trajectory``, or a malformed ``group_closed`` message.
    """
    if len(frames) != _NUM_FRAMES:
        raise MalformedMessageError(f"message has {len(frames)} frames, schema {SCHEMA_VERSION} has {_NUM_FRAMES}")
    try:
        message = msgpack.unpackb(memoryview(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for corrupt input
        raise MalformedMessageError(f"message is not valid msgpack: {type(e).__name__}: {e}") from e
    if isinstance(message, dict) and message.get("schema") == SCHEMA_VERSION and message.get("kind") == "group_closed":
        return _decode_group_closed(message)
    _check_fields(message)
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, length_key in _ARRAY_FIELDS:
        data, count = message.pop(name), message[length_key]
        if len(data) != count * dtype.itemsize:
            raise MalformedMessageError(
                f"trajectory {message['trajectory_id']}: {name} is {len(data)} bytes, "
                f"expected {count * dtype.itemsize} bytes ({count} x {dtype.name})")
        arrays[name] = np.frombuffer(data, dtype=dtype)
    _check_values(message, arrays)
    return Trajectory(
        trajectory_id=message["trajectory_id"], group_id=message["group_id"], prompt_uid=message["prompt_uid"],
        finish_reason=message["finish_reason"], reward=float(message["reward"]),
        reward_extras=message["reward_extras"], response_text=message["response_text"],
        generator_id=message["generator_id"], **arrays)


# -------------------------------------------------------------------------------------- interface
@runtime_checkable
class TrajectorySender(Protocol):
    """Sending end, one per generator thread. Not thread-safe (a ZeroMQ socket is not)."""

    def send(self, traj: "Message") -> None:
        """Hand one trajectory to the transport; blocks while the receiver is behind.

        Raises:
            SendTimeoutError: the send could not complete within the sender's ``send_timeout_s``.
        """
        ...

    def close(self) -> None:
        """Flush what is queued (bounded by the sender's linger) and release the socket."""
        ...


@runtime_checkable
class TrajectoryReceiver(Protocol):
    """Receiving end, one per learner process, read by one thread.

    Attributes:
        num_received: trajectories decoded and returned so far.
        num_malformed: messages that failed to decode, logged and skipped.
    """

    num_received: int
    num_malformed: int

    def recv(self, timeout_s: float | None = None) -> "Message | None":
        """Next trajectory, or ``None`` after ``timeout_s`` seconds (``None``: wait forever, 0: poll)."""
        ...

    def recv_many(self, max_items: int, timeout_s: float | None = None) -> "list[Message]":
        """Wait up to ``timeout_s`` for one trajectory, then add those already waiting, up to ``max_items``."""
        ...

    def close(self) -> None:
        """Release the socket; undelivered messages are discarded."""
        ...


def _describe(msg: Message) -> str:
    return f"trajectory {msg.trajectory_id}" if isinstance(msg, Trajectory) else f"{msg}"


def _deadline(timeout_s: float | None) -> float | None:
    if timeout_s is not None and (timeout_s < 0 or math.isnan(timeout_s)):
        raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
    return None if timeout_s is None else time.monotonic() + timeout_s


def _remaining_s(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _ReceiverBase:
    """Decode loop shared by both receivers: skips (counts, logs) malformed messages until the deadline."""

    def __init__(self) -> None:
        self.num_received = 0
        self.num_malformed = 0

    def _recv_frames(self, timeout_s: float | None) -> Sequence[Any] | None:
        raise NotImplementedError

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """Next trajectory, or ``None`` after ``timeout_s`` s (``None``: wait forever; 0: poll).

        Malformed messages met on the way are counted in ``num_malformed``, logged at WARNING
        and skipped; the wait goes on until the deadline.

        Raises:
            ValueError: a negative or NaN ``timeout_s``.
        """
        deadline = _deadline(timeout_s)
        while True:
            frames = self._recv_frames(_remaining_s(deadline))
            if frames is None:
                return None
            try:
                traj = decode_message(frames)
            except MalformedMessageError as e:
                self.num_malformed += 1
                log.warning("transport: rejected malformed message #%d: %s", self.num_malformed, e)
                continue
            self.num_received += 1
            return traj

    def recv_many(self, max_items: int, timeout_s: float | None = None) -> list[Message]:
        """Wait up to ``timeout_s`` for a first trajectory, then take those already waiting.

        Returns:
            0 (timed out) to ``max_items`` trajectories, in arrival order.

        Raises:
            ValueError: ``max_items`` < 1 or an invalid ``timeout_s``.
        """
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        first = self.recv(timeout_s)
        if first is None:
            return []
        out = [first]
        while len(out) < max_items and (traj := self.recv(0.0)) is not None:
            out.append(traj)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------------------- zmq
def _timeout_ms(timeout_s: float | None) -> int:
    return -1 if timeout_s is None else int(math.ceil(timeout_s * 1000))


class ZmqTrajectoryReceiver(_ReceiverBase):
    """PULL socket that binds; senders connect to ``.address``.

    Args:
        address: ZeroMQ endpoint to bind, e.g. ``"tcp://127.0.0.1:5555"`` or ``"ipc:///tmp/x"``.
            ``None`` binds loopback TCP on a free port (``bind_to_random_port``). For senders
            on other hosts bind a routable interface (``"tcp://10.0.0.5:*"``); a wildcard
            ``"tcp://*:5555"`` reports ``0.0.0.0`` in ``.address``, which they cannot dial.
        hwm: receive high-water mark (RCVHWM) in messages (trajectories); > 0. Together with
            the senders' SNDHWM and kernel buffers it bounds how far generators run ahead.

    Attributes:
        address: the bound endpoint, with the real port (pass it to ``ZmqSenderFactory``).

    Raises:
        ValueError: ``hwm`` < 1. ``zmq.ZMQError``: the address cannot be bound.
    """

    def __init__(self, address: str | None = None, hwm: int = 64) -> None:
        super().__init__()
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1 message, got {hwm} (0 would mean unbounded in ZeroMQ)")
        self._sock = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if address is None:
            port = self._sock.bind_to_random_port(f"tcp://{LOOPBACK}")
            self.address = f"tcp://{LOOPBACK}:{port}"
        else:
            self._sock.bind(address)
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _recv_frames(self, timeout_s: float | None) -> Sequence[Any] | None:
        # copy=True: typical messages are < 64 KiB, where copying beats zmq.Frame tracking.
        # A non-blocking read first: while messages are queued (the busy case) no poll is paid.
        try:
            return self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
        except zmq.Again:
            pass
        if timeout_s == 0 or not self._sock.poll(_timeout_ms(timeout_s), zmq.POLLIN):
            return None
        return self._sock.recv_multipart(copy=True)

    def close(self) -> None:
        """Close the socket at once; messages not yet received are discarded."""
        self._sock.close(linger=0)


class ZmqTrajectorySender:
    """PUSH socket that connects to a ``ZmqTrajectoryReceiver``'s address.

    Create it in the process and thread that sends (sockets cannot be pickled or shared between
    threads); ``ZmqSenderFactory`` is the picklable recipe to ship to Ray actors. Until the
    receiver is reachable, up to ``hwm`` messages queue locally (delivered once it binds), then
    ``send`` blocks / times out like for a slow receiver.

    Args:
        address: the receiver's ``.address``.
        hwm: send high-water mark (SNDHWM) in messages; > 0.
        send_timeout_s: seconds one ``send`` may block before ``SendTimeoutError``; ``None``
            blocks until the receiver catches up.
        linger_s: seconds ``close`` keeps trying to deliver queued messages; what is still
            queued afterwards is lost (a sender closes only when its actor stops: at the end of a run,
            whose ledger counts such groups, or with a dead actor, which stops the run).

    Raises:
        ValueError: ``hwm`` < 1 or a negative timeout.
    """

    def __init__(self, address: str, hwm: int = 64, send_timeout_s: float | None = None,
                 linger_s: float = 30.0) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1 message, got {hwm} (0 would mean unbounded in ZeroMQ)")
        if (send_timeout_s is not None and send_timeout_s < 0) or linger_s < 0:
            raise ValueError(f"send_timeout_s ({send_timeout_s}) and linger_s ({linger_s}) must be >= 0")
        self.address, self.send_timeout_s = address, send_timeout_s
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, _timeout_ms(send_timeout_s))
        self._sock.setsockopt(zmq.LINGER, _timeout_ms(linger_s))
        self._sock.connect(address)

    def send(self, traj: Message) -> None:
        """Encode and push one trajectory (or ``GroupClosed``); see ``TrajectorySender.send``."""
        frames = encode_message(traj)
        try:
            self._sock.send_multipart(frames)
        except zmq.Again:
            raise SendTimeoutError(
                f"sending {_describe(traj)} to {self.address} timed out after "
                f"{self.send_timeout_s} s: the receiver is not reading (high-water marks reached) "
                "or was never bound") from None

    def close(self) -> None:
        """Close the socket after up to ``linger_s`` seconds of delivering what is queued."""
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class ZmqSenderFactory:
    """Picklable recipe for ``ZmqTrajectorySender``s; call it where the sender will live.

    Attributes: as the ``ZmqTrajectorySender`` arguments of the same names.
    """

    address: str
    hwm: int = 64
    send_timeout_s: float | None = None
    linger_s: float = 30.0

    def __call__(self) -> ZmqTrajectorySender:
        return ZmqTrajectorySender(self.address, self.hwm, self.send_timeout_s, self.linger_s)


# ----------------------------------------------------------------------------------------- inproc
class InProcChannel:
    """In-process transport for tests: a ``queue.Queue`` of encoded frames, bounded by ``hwm``.

    Messages go through the same codec as over ZeroMQ, so the tests of everything built on the
    transport also exercise the wire format. Senders and the receiver must share the process.

    Args:
        hwm: queue capacity in messages; > 0. A full queue blocks ``send`` (back-pressure).
    """

    def __init__(self, hwm: int = 64) -> None:
        if hwm < 1:
            raise ValueError(f"hwm must be >= 1 message, got {hwm}")
        self.queue: queue.Queue[Sequence[Any]] = queue.Queue(maxsize=hwm)


class InProcTrajectorySender:
    """Sender half of an ``InProcChannel``. Args as ``ZmqTrajectorySender`` (no address, no linger)."""

    def __init__(self, channel: InProcChannel, send_timeout_s: float | None = None) -> None:
        self._channel, self.send_timeout_s = channel, send_timeout_s

    def send(self, traj: Message) -> None:
        """Encode and enqueue one trajectory (or ``GroupClosed``); see ``TrajectorySender.send``."""
        frames = encode_message(traj)
        try:
            self._channel.queue.put(frames, timeout=self.send_timeout_s)
        except queue.Full:
            raise SendTimeoutError(
                f"sending {_describe(traj)} in-process timed out after {self.send_timeout_s} s: "
                f"the receiver is not reading (queue of {self._channel.queue.maxsize} full)") from None

    def close(self) -> None:
        """Nothing to release; queued messages stay readable."""


class InProcTrajectoryReceiver(_ReceiverBase):
    """Receiver half of an ``InProcChannel``; same contract as ``ZmqTrajectoryReceiver``."""

    def __init__(self, channel: InProcChannel) -> None:
        super().__init__()
        self._channel = channel

    def _recv_frames(self, timeout_s: float | None) -> Sequence[Any] | None:
        try:
            if timeout_s == 0:
                return self._channel.queue.get_nowait()
            return self._channel.queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Nothing to release."""


# ---------------------------------------------------------------------------------------- factory
def make_transport(kind: Literal["zmq", "inproc"], address: str | None = None, hwm: int = 64,
                   send_timeout_s: float | None = None,
                   ) -> tuple[TrajectoryReceiver, Callable[[], TrajectorySender]]:
    """Create a receiver and a factory for its senders.

    Args:
        kind: ``"zmq"`` (PUSH/PULL, across processes and hosts) or ``"inproc"`` (tests).
        address: ZeroMQ bind address; ``None`` picks a free loopback TCP port. Ignored by inproc.
        hwm: high-water mark in messages, used for SNDHWM and RCVHWM (zmq) or the queue size.
        send_timeout_s: see ``ZmqTrajectorySender``.

    Returns:
        ``(receiver, make_sender)``: call ``make_sender()`` once per sending thread. For zmq it
        is a picklable ``ZmqSenderFactory``; for inproc a closure over the shared queue.

    Raises:
        ValueError: an unknown ``kind`` or an invalid ``hwm``.
    """
    if kind == "zmq":
        receiver = ZmqTrajectoryReceiver(address, hwm)
        return receiver, ZmqSenderFactory(receiver.address, hwm, send_timeout_s)
    if kind == "inproc":
        channel = InProcChannel(hwm)
        return InProcTrajectoryReceiver(channel), lambda: InProcTrajectorySender(channel, send_timeout_s)
    raise ValueError(f"unknown transport kind {kind!r}; valid: 'zmq', 'inproc'")
