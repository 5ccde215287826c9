"""Intake for the async loop: the receiver thread's work, routing each message to the replay buffer
or refusing it.

The transport's decoder has already refused what does not parse or cannot be trained on
(``pipeline/malformed_messages``); the ``Intake`` refuses well-formed messages that no generator
of this run sends (a group never dispatched, a sample index outside its group, ...), each counted
under its reason, since accepting one would stop the run (the buffer raises) or train on it.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable

from async_rl.buffers.transport import GroupClosed
from async_rl.runtime.cluster import is_loopback

logger = logging.getLogger(__name__)


def warn_if_exposed(zmq_address: str | None, address: str, bind_host: str) -> bool:
    """Warn (and return ``True``) when ``trainer.zmq_address`` made the trajectory receiver listen
    at ``address`` on a network other than the run's ``bind_host`` and not on loopback: reachable
    from that network, not only from this machine."""
    heard_on = address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if zmq_address and address.startswith("tcp://") and heard_on != bind_host and not is_loopback(heard_on):
        logger.warning("trainer.zmq_address=%s: the trajectory receiver listens on %s, reachable from that "
                       "network, not only from this machine", zmq_address, heard_on)
        return True
    return False


class Intake:
    """Routes decoded trajectory messages into the replay buffer, refusing foreign ones.

    Args:
        receiver: the trajectory transport's receiving end (``recv_many(max, timeout_s)`` returning
            decoded ``Trajectory`` / ``GroupClosed`` messages, ``num_malformed``).
        buffer: the replay buffer (``add``, ``close_group``).
        knows_group: whether a group id was dispatched in this run (``Dispatcher.knows``).
        group_size: samples per group; a sample index at or past it is foreign.
        learner_version: the learner's current policy version; tokens of a later one are foreign.
        on_messages: called after each non-empty batch is routed (a group rejected or evicted
            there frees an admission slot: ``Dispatcher.wake``).
        eval_sink: the pool's evaluations (``loops.evaluation.PoolEvaluation``: ``accepts(group_id)``,
            ``add(msg)``): messages of evaluation groups go there, never to the buffer; ``None``: none.
    """

    def __init__(self, receiver: Any, buffer: Any, knows_group: Callable[[int], bool], group_size: int,
                 learner_version: Callable[[], int], on_messages: Callable[[], None], eval_sink: Any = None) -> None:
        self.receiver, self.buffer = receiver, buffer
        self._eval_sink = eval_sink
        self._knows_group, self.n = knows_group, group_size
        self._learner_version, self._on_messages = learner_version, on_messages
        self.refused: dict[str, int] = {}
        """Well-formed messages refused by ``route``, by reason."""
        self._lock = threading.Lock()

    def refusal(self, msg) -> str | None:
        """Why ``msg`` cannot belong to this run (``unknown_group``, ``trajectory_id_of_another_group``,
        ``index_outside_group``, ``future_policy_version``), or ``None``."""
        gid = msg.group_id
        if not self._knows_group(gid):
            return "unknown_group"
        if isinstance(msg, GroupClosed):
            return None
        group, index = msg.trajectory_id.rsplit("/", 1)
        if int(group) != gid:
            return "trajectory_id_of_another_group"
        if int(index) >= self.n:
            return "index_outside_group"
        if len(msg.policy_version) and int(msg.policy_version.max()) > self._learner_version():
            return "future_policy_version"
        return None

    def route(self, msg) -> str | None:
        """Hand one decoded message to the buffer, or refuse it: counted in ``refused`` by reason
        (``refusal``, or ``contradicting_group_closed`` for a ``GroupClosed`` the buffer's
        contents contradict), logged for the first five and each power of ten. Returns the
        reason, or ``None`` when the buffer took it."""
        if self._eval_sink is not None and self._eval_sink.accepts(msg.group_id):
            self._eval_sink.add(msg)  # an evaluation group's: it checks and counts its own
            return None
        reason = self.refusal(msg)
        if reason is None and isinstance(msg, GroupClosed):
            try:
                self.buffer.close_group(msg.group_id, msg.num_kept)
                return None
            except ValueError as e:
                reason, detail = "contradicting_group_closed", str(e)
        elif reason is None:
            self.buffer.add(msg)
            return None
        else:
            detail = f"{msg!r:.200}"
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            count = sum(self.refused.values())
        if count <= 5 or math.log10(count).is_integer():
            logger.warning("async pipeline: refused message #%d (%s): %s", count, reason, detail)
        return reason

    def run(self, stop: threading.Event) -> None:
        """The receiver thread: route what arrives (up to 512 messages a call) until ``stop``."""
        while not stop.is_set():
            msgs = self.receiver.recv_many(512, timeout_s=0.05)
            for msg in msgs:
                self.route(msg)
            if msgs:
                self._on_messages()

    def drain(self) -> None:
        """Route what the generators sent before they stopped (until 0.2 s pass without a message),
        so the ledger counts it. Call once the receiver thread has ended."""
        while msgs := self.receiver.recv_many(4096, timeout_s=0.2):
            for msg in msgs:
                self.route(msg)

    def summary(self) -> dict[str, int]:
        """``pipeline/malformed_messages`` (the decoder's), ``pipeline/refused_messages`` and one
        ``pipeline/refused_messages_<reason>`` per reason seen, in name order."""
        out = {"pipeline/malformed_messages": self.receiver.num_malformed,
               "pipeline/refused_messages": sum(self.refused.values())}
        for reason, count in sorted(self.refused.items()):
            out[f"pipeline/refused_messages_{reason}"] = count
        return out
