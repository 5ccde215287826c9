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
message (or trajectory) the receiver cannot decode is counted (``num_malformed``) and logged,
never ignored silently. Closing loses what is still queued (a sender lingers ``linger_s`` to flush first).

The wire format (schema 8, msgpack headers and raw little-endian arrays in one frame) and its
codec live in ``async_rl.buffers.codec``; its names are re-exported here, the path senders,
receivers and tests import from.

Run the tests with ``python -m pytest -q tests/test_transport.py``; measure throughput with
``python bench/bench_transport.py``.
"""

from __future__ import annotations

import logging
import math
import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import zmq

from async_rl.buffers.codec import (  # noqa: F401  re-exported: the public import path
    SCHEMA_VERSION, GroupClosed, MalformedMessageError, Message, TrajectoryGroup, decode_message, decode_messages,
    decode_trajectory, encode_message, encode_trajectories, encode_trajectory, pack_frame, split_frame,
)
from async_rl.buffers.trajectory import Trajectory
from async_rl.runtime.cluster import LOOPBACK

log = logging.getLogger(__name__)


class SendTimeoutError(TimeoutError):
    """``send`` could not hand a trajectory over within ``send_timeout_s`` (receiver not reading)."""


# -------------------------------------------------------------------------------------- interface
@runtime_checkable
class TrajectorySender(Protocol):
    """Sending end, one per generator thread. Not thread-safe (a ZeroMQ socket is not)."""

    def send(self, traj: "Message") -> None:
        """Hand one message (a trajectory, a ``TrajectoryGroup`` or a ``GroupClosed``) to the
        transport; blocks while the receiver is behind.

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
        num_received: trajectories and ``GroupClosed`` decoded and returned so far.
        num_malformed: messages that failed to decode, and trajectories of a message refused
            for their values, each logged and skipped.
    """

    num_received: int
    num_malformed: int

    def recv(self, timeout_s: float | None = None) -> "Trajectory | GroupClosed | None":
        """Next trajectory (or ``GroupClosed``), or ``None`` after ``timeout_s`` seconds (``None``:
        wait forever, 0: poll)."""
        ...

    def recv_many(self, max_items: int, timeout_s: float | None = None) -> "list[Trajectory | GroupClosed]":
        """Wait up to ``timeout_s`` for one trajectory, then add those already waiting, up to ``max_items``."""
        ...

    def close(self) -> None:
        """Release the socket; undelivered messages are discarded."""
        ...


def _describe(msg: Message) -> str:
    if isinstance(msg, TrajectoryGroup):
        return f"group {msg.group_id} ({len(msg.trajectories)} trajectories)"
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
        self._pending: deque[Trajectory | GroupClosed] = deque()  # the rest of a decoded group message

    def _recv_frames(self, timeout_s: float | None) -> Sequence[Any] | None:
        raise NotImplementedError

    def _reject(self, error: MalformedMessageError) -> None:
        self.num_malformed += 1
        log.warning("transport: rejected malformed message #%d: %s", self.num_malformed, error)

    def recv(self, timeout_s: float | None = None) -> Trajectory | GroupClosed | None:
        """Next trajectory or ``GroupClosed``, or ``None`` after ``timeout_s`` s (``None``: wait
        forever; 0: poll). A ``TrajectoryGroup`` message is handed on as its trajectories, then its
        ``GroupClosed``, one per call.

        Malformed messages met on the way, and trajectories of a message refused for their values
        (``decode_messages``), are each counted in ``num_malformed``, logged at WARNING and
        skipped; the wait goes on until the deadline.

        Raises:
            ValueError: a negative or NaN ``timeout_s``.
        """
        if not self._pending:
            deadline = None if timeout_s == 0 else _deadline(timeout_s)  # a poll (recv_many) needs no clock
            while not self._pending:
                frames = self._recv_frames(0.0 if timeout_s == 0 else _remaining_s(deadline))
                if frames is None:
                    return None
                try:
                    messages, rejected = decode_messages(frames)
                except MalformedMessageError as e:
                    self._reject(e)
                    continue
                for e in rejected:
                    self._reject(e)
                self._pending.extend(messages)
        self.num_received += 1
        return self._pending.popleft()

    def recv_many(self, max_items: int, timeout_s: float | None = None) -> list[Trajectory | GroupClosed]:
        """Wait up to ``timeout_s`` for a first trajectory, then take those already waiting.

        Returns:
            0 (timed out) to ``max_items`` trajectories (and ``GroupClosed``), in arrival order.

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
        # copy=False: the decoder reads the frame's memory in place (a trajectory's arrays are
        # views of it), saving a copy of every message (receiving-thread CPU on loopback: 11 vs
        # 15 us for a 25 KB message, 20 vs 36 us for a 205 KB group).
        # A non-blocking read first: while messages are queued (the busy case) no poll is paid.
        try:
            frame = self._sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if timeout_s == 0 or not self._sock.poll(_timeout_ms(timeout_s), zmq.POLLIN):
                return None
            frame = self._sock.recv(copy=False)
        frames = [frame]
        while frame.more:  # only a malformed message has more frames; read them all, to refuse it whole
            frame = self._sock.recv(copy=False)
            frames.append(frame)
        return frames

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
        # A context of its own, terminated by ``close``: the linger only runs in the context's
        # I/O thread, and an interpreter that exits without ``Context.term()`` (pyzmq skips it
        # at exit) kills that thread with the queue unsent. A shared ``Context.instance()`` lost
        # the last 18 of 200 groups of a sender process that exited under load.
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, _timeout_ms(send_timeout_s))
        self._sock.setsockopt(zmq.LINGER, _timeout_ms(linger_s))
        self._sock.connect(address)

    def send(self, traj: Message) -> None:
        """Encode and push one message; see ``TrajectorySender.send``."""
        frames = encode_message(traj)
        try:
            # copy=True: ZeroMQ owns the bytes at once, so a process that exits right after
            # ``close`` still flushes them during its linger (a zero-copy frame over 64 KiB, a
            # group, is released by pyzmq's garbage-collector thread, and was lost at
            # interpreter exit when tried). One frame (always, today): ``send`` directly,
            # without ``send_multipart``'s Python loop.
            if len(frames) == 1:
                self._sock.send(frames[0], copy=True)
            else:
                self._sock.send_multipart(frames, copy=True)
        except zmq.Again:
            raise SendTimeoutError(
                f"sending {_describe(traj)} to {self.address} timed out after "
                f"{self.send_timeout_s} s: the receiver is not reading (high-water marks reached) "
                "or was never bound") from None

    def close(self) -> None:
        """Deliver what is queued, for up to ``linger_s`` seconds, then release the socket.

        Blocks until the queue is flushed or the linger ends, so a process may exit right after.
        Idempotent.
        """
        if not self._ctx.closed:
            self._sock.close()
            self._ctx.term()

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
        """Encode and enqueue one message; see ``TrajectorySender.send``."""
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
