"""Evaluation on the async pool: held-out groups sampled by the generator actors in their idle
time, while the learner keeps training.

An evaluation in async mode on the trainer's colocated engine stops the learner for as long as
it samples. ``PoolEvaluation`` instead hands the held-out prompts to the pool as evaluation groups
(``RequestBroker.put_eval``: each group with its own sampling settings, handed out only while no
training request waits and every live generator actor is idle), routes their trajectories away from the replay buffer as they arrive
(``Intake``'s ``eval_sink``), and once every group is closed computes the same metrics as the
colocated evaluation (``async_rl.step.evaluation.eval_metrics``). They are logged with the step at
which they complete, tagged with what they measured: ``eval/policy_version`` (the oldest version
any of their tokens was sampled with; ``eval/policy_version_max`` the newest: an update may land
between two groups) and ``eval/started_step``; ``eval/wall_s`` is the time from start to the last
group. One evaluation runs at a time; one due while another runs is skipped and counted
(``eval/skipped_busy``). A generator lost while an evaluation runs abandons it
(``eval/abandoned``): its groups are not re-issued, the next evaluation is sampled afresh. At
the end of a run, one whose last group arrives as the loop closes is logged at the last step
(``AsyncLoop.evaluation_after_last_step``); one still unfinished then is abandoned, counted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from async_rl.buffers.transport import GroupClosed
from async_rl.step.evaluation import EVAL_FIRST_GROUP_ID, EvalAtK, eval_metrics
from async_rl.step.rollout import GroupRequest

logger = logging.getLogger(__name__)

__all__ = ["PoolEvaluation"]


class PoolEvaluation:
    """The async loop's evaluations on the generator pool (see the module docstring).

    Args:
        dataset: the held-out ``PromptDataset`` (its ``prompts``).
        params: ``SamplingParams`` of the single pass (``trainer.eval_greedy``).
        at_k: evaluation at k, or ``None``.

    Thread safety: ``accepts`` and ``add`` run on the receiver thread, the rest on the trainer's;
    one lock guards the state they share.
    """

    def __init__(self, dataset, params, at_k: EvalAtK | None = None) -> None:
        self.dataset, self.params, self.at_k = dataset, params, at_k
        self._lock = threading.Lock()
        self._next_id = EVAL_FIRST_GROUP_ID
        self._groups: dict[int, GroupRequest] = {}  # the running evaluation's groups, by id
        self._trajectories: dict[int, dict[str, Any]] = {}  # group id -> trajectory id -> trajectory
        self._closed: set[int] = set()
        self._single: set[int] = set()  # the running evaluation's single-pass groups
        self._started: tuple[int, float] | None = None  # (step, perf_counter) of the running one
        self.counts = {"eval/skipped_busy": 0, "eval/abandoned": 0, "eval/refused_messages": 0}

    @property
    def running(self) -> bool:
        """Whether an evaluation is in flight."""
        with self._lock:
            return self._started is not None

    def start(self, step: int) -> list[GroupRequest] | None:
        """The groups of a new evaluation after ``step`` (to ``RequestBroker.put_eval``), or
        ``None`` when one is still running (counted in ``eval/skipped_busy``). Ids count up from
        ``EVAL_FIRST_GROUP_ID`` (negative, apart from training groups), never reused, so a
        message of an abandoned evaluation cannot be taken for one of a later evaluation."""
        with self._lock:
            if self._started is not None:
                self.counts["eval/skipped_busy"] += 1
                return None
            requests, self._single = [], set()
            passes = [(1, self.params)] + ([(self.at_k.samples, self.at_k.params)] if self.at_k else [])
            for k, (n, params) in enumerate(passes):
                for prompt in self.dataset.prompts:
                    requests.append(dataclasses.replace(GroupRequest.of(prompt, self._next_id, n, None), params=params))
                    if k == 0:
                        self._single.add(self._next_id)
                    self._next_id += 1
            self._groups = {r.group_id: r for r in requests}
            self._trajectories = {r.group_id: {} for r in requests}
            self._closed = set()
            self._started = (step, time.perf_counter())
            return requests

    def accepts(self, group_id: int) -> bool:
        """Whether a message of ``group_id`` belongs to evaluation (any evaluation's id range,
        the running one's or an abandoned one's): it must not reach the replay buffer."""
        return EVAL_FIRST_GROUP_ID <= group_id < self._next_id

    def add(self, msg) -> None:
        """Take one decoded message of an evaluation group (``Trajectory`` or ``GroupClosed``);
        one of no running evaluation's group, or a sample index outside its group, is counted in
        ``eval/refused_messages`` and dropped."""
        with self._lock:
            request = self._groups.get(msg.group_id)
            if request is None:
                self.counts["eval/refused_messages"] += 1
                return
            if isinstance(msg, GroupClosed):
                self._closed.add(msg.group_id)
                return
            if int(msg.trajectory_id.rsplit("/", 1)[1]) >= request.n:
                self.counts["eval/refused_messages"] += 1
                return
            self._trajectories[msg.group_id][msg.trajectory_id] = msg

    def poll(self) -> dict[str, float] | None:
        """The running evaluation's metrics once every group is closed (it then ends), else ``None``."""
        with self._lock:
            if self._started is None or len(self._closed) < len(self._groups):
                return None
            step, t0 = self._started
            single, sampled, n = [], [], self.at_k.samples if self.at_k else 0
            for gid in self._groups:
                (single if gid in self._single else sampled).extend(self._trajectories[gid].values())
            self._groups, self._trajectories, self._closed, self._started = {}, {}, set(), None
        versions = [int(v) for t in single + sampled for v in t.policy_version]
        out = eval_metrics(single, self.dataset, min(versions, default=-1), (sampled, n) if self.at_k else None)
        out["eval/policy_version_max"] = float(max(versions, default=-1))
        out["eval/started_step"] = float(step)
        out["eval/wall_s"] = time.perf_counter() - t0
        return out

    def abandon(self, reason: str) -> bool:
        """End the running evaluation without metrics (a generator was lost: its groups are not
        re-issued); counted in ``eval/abandoned``. Returns whether one was running."""
        with self._lock:
            if self._started is None:
                return False
            step = self._started[0]
            self._groups, self._trajectories, self._closed, self._started = {}, {}, set(), None
            self.counts["eval/abandoned"] += 1
        logger.warning("the evaluation started after step %d is abandoned: %s", step, reason)
        return True
