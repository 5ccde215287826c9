"""Dispatch for the async loop: admission, the feed into the request broker, the re-issue queue.

The ``Dispatcher`` decides which groups start (``AdmissionController``), numbers them, gives each
its per-group seed, and hands every group admission allows at once to the broker. It keeps the
requests of the groups dispatched but not known complete (``outstanding``: what a checkpoint or
a dead actor's claims must re-issue) and the queue of prompts to dispatch again first, under new
group ids (``reissue``). It knows neither Ray nor the loop: the broker is reached through the
``feed`` and ``forget`` callables, the policy version through ``published_version``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any, Callable, Iterable

from async_rl.buffers.replay import AdmissionController
from async_rl.loops.base import versions_per_step
from async_rl.step.rollout import GroupRequest, group_seed, longest_sequence


def buffer_bound(cfg) -> dict[str, int] | None:
    """Most the replay buffer can hold at once under admission control, from the run's config
    ``cfg`` (``async_rl.config.Config``):
    ``groups = (max_staleness + 1) · B`` with ``B`` the groups of one policy version
    (``prompts_per_step``, divided by ``learner.num_mini_batches`` with
    ``trainer.policy_version_per=mini_batch``; derived in
    ``AdmissionController.max_resident_groups``), ``samples = groups · samples_per_prompt``,
    ``tokens = samples ·`` the longest rollout sequence (``data.max_prompt_tokens`` plus
    ``generator.max_response_tokens``, or ``agent.max_response_tokens`` with tools;
    ``rollout.longest_sequence``).

    Returns:
        ``{"groups", "samples", "tokens"}``, or ``None`` with ``trainer.max_reuse > 1``: a group
        kept for reuse is no longer counted by admission, so no such bound holds.
    """
    t_cfg = cfg.trainer
    if t_cfg.max_reuse > 1:
        return None
    per_version = t_cfg.prompts_per_step // versions_per_step(t_cfg, cfg.learner)
    groups = AdmissionController(per_version, t_cfg.max_staleness).max_resident_groups()
    samples = groups * t_cfg.samples_per_prompt
    return {"groups": groups, "samples": samples, "tokens": samples * longest_sequence(cfg)[0]}


class Dispatcher:
    """Admission control and the request feed of the async pool (the dispatcher thread's work).

    A group may start only while ``admission.can_start(dispatched, v, discarded)`` holds, with
    ``v`` the version every generator holds (``published_version()``, ``-1`` read as 0) and
    ``discarded`` the groups that can never be trained (``num_discarded()``); see
    ``buffers.replay.AdmissionController`` for the bound.

    Args:
        admission: the run's admission controller.
        feed: hands a batch of requests to the broker, in order; blocks until it holds them
            (``RequestBroker.put_many``).
        forget: tells the broker that groups ended, so their claims are dropped (``RequestBroker.forget``).
        next_prompt: the next prompt of the training set (``data.Prompt``).
        group_size: samples per group (``trainer.samples_per_prompt``).
        seed: the run's seed; group ``g`` samples with ``rollout.group_seed(seed, g)``.
        published_version: the policy version every generator holds (``-1`` before the first push).
        num_discarded: groups dispatched that can never be trained (rejected, evicted, dropped).

    ``lock`` guards ``num_dispatched``, ``outstanding`` and ``reissue``; take it to read them
    consistently with the training set's position (a checkpoint).
    """

    def __init__(self, admission: AdmissionController, feed: Callable[[list[GroupRequest]], Any],
                 forget: Callable[[list[int]], Any], next_prompt: Callable[[], Any], group_size: int, seed: int,
                 published_version: Callable[[], int], num_discarded: Callable[[], int]) -> None:
        self.admission = admission
        self._feed, self._forget, self._next_prompt = feed, forget, next_prompt
        self.n, self.seed = group_size, seed
        self._published_version, self._num_discarded = published_version, num_discarded
        self.num_dispatched = 0
        self.num_reissued = 0
        self.outstanding: dict[int, GroupRequest] = {}
        """Dispatched groups not yet known complete, by id."""
        self.reissue: deque[GroupRequest] = deque()
        """Requests whose prompts are dispatched again before any new prompt, oldest first."""
        self.lock = threading.Lock()
        # Wakes the dispatcher when admission may let a group start (a version published, groups
        # ended untrained, the loop stopping) instead of a poll on the learner's core.
        self._changed = threading.Condition()

    def admitted(self, extra: int = 0) -> bool:
        """Whether ``extra + 1`` more groups may start now."""
        return self.admission.can_start(self.num_dispatched + extra, max(self._published_version(), 0),
                                        self._num_discarded())

    def knows(self, group_id: int) -> bool:
        """Whether ``group_id`` was dispatched in this run (a message of any other group is foreign).
        Requests enter ``outstanding`` before the broker has them, so no worker can answer a group
        that is neither there nor below ``num_dispatched``."""
        return 0 <= group_id < self.num_dispatched or group_id in self.outstanding

    def wake(self) -> None:
        """Announce that admission may have changed (a version published, groups ended untrained)."""
        with self._changed:
            self._changed.notify_all()

    def run(self, stop: threading.Event) -> None:
        """The dispatcher thread: dispatch what admission allows, each time it may change, until ``stop``."""
        while not stop.is_set():
            with self._changed:
                # Each change is announced (wake); the timeout only bounds a missed one.
                if not self._changed.wait_for(lambda: stop.is_set() or self.admitted(), timeout=0.05):
                    continue
            if stop.is_set():
                break
            self.dispatch_admitted()

    def dispatch_admitted(self) -> list[GroupRequest]:
        """Dispatch every group admission allows now (at least one), re-issued prompts first, in
        one ``feed`` call: a worker waiting for requests then takes them as one engine batch
        rather than waking with the first alone. Returns the requests dispatched."""
        with self.lock:
            batch: list[GroupRequest] = []
            while not batch or self.admitted(len(batch)):
                gid = self.num_dispatched + len(batch)
                if self.reissue:
                    request = dataclasses.replace(self.reissue.popleft(), group_id=gid, seed=group_seed(self.seed, gid))
                else:
                    request = GroupRequest.of(self._next_prompt(), gid, self.n, group_seed(self.seed, gid))
                self.outstanding[gid] = request
                batch.append(request)
            # Blocking: the broker serves calls on several threads, so only waiting keeps the
            # queue in dispatch order.
            self._feed(batch)
            self.num_dispatched += len(batch)
        return batch

    def forget_finished(self, is_finished: Callable[[int], bool]) -> list[int]:
        """Drop the groups that ended (``is_finished(group_id)``) from ``outstanding`` and from
        the broker's claims: they need no re-issue. Returns their ids."""
        with self.lock:
            ended = [g for g in self.outstanding if is_finished(g)]
            for g in ended:
                del self.outstanding[g]
        if ended:
            self._forget(ended)
        return ended

    def requeue(self, held: Iterable[GroupRequest], abandon: Callable[[int], bool]) -> int:
        """A dead actor's claimed requests: each whose group ``abandon(group_id)`` drops (it did
        not complete) is queued for re-issue, in group order, and counted in ``num_reissued``.
        Returns how many were queued."""
        reissued = 0
        with self.lock:
            for request in sorted(held, key=lambda r: r.group_id):
                self.outstanding.pop(request.group_id, None)
                if abandon(request.group_id):
                    self.reissue.append(request)
                    reissued += 1
            self.num_reissued += reissued
        return reissued

    def pending(self, is_finished: Callable[[int], bool]) -> list[GroupRequest]:
        """The requests a checkpoint must re-issue on resume: those dispatched and not finished,
        then those queued for re-issue. Call with ``lock`` held."""
        self.outstanding = {g: r for g, r in self.outstanding.items() if not is_finished(g)}
        return list(self.outstanding.values()) + list(self.reissue)

    def restore(self, num_dispatched: int, num_reissued: int, pending: Iterable[GroupRequest],
                abandon: Callable[[int], Any]) -> int:
        """Resume from a checkpoint's counters and ``pending`` requests (``pending``'s result):
        each group is abandoned (``abandon(group_id)``; its samples in the old run's engines are
        gone) and its prompt re-issued first, under a new id. Returns how many."""
        self.num_dispatched, self.num_reissued = num_dispatched, num_reissued
        count = 0
        for request in pending:
            abandon(request.group_id)
            self.reissue.append(request)
            count += 1
        self.num_reissued += count
        return count


def exactly_once_ledger(dispatch: Dispatcher, buffer: Any, trained: int, dynamic_dropped: int,
                        queued: int, restarts: int, spread_pending: int = 0) -> dict[str, int]:
    """Where every group ``dispatch`` started went, in groups: trained, rejected (every sample
    rejected by the reward), stale (evicted), abandoned, dropped by dynamic sampling, complete
    but unused, partial, still queued in the broker, taken and partly trained
    (``spread_partly_trained_at_exit``: ``trainer.group_spread`` > 1, shares still pending), and
    the rest (``unstarted_or_in_engine_at_exit``: started, no sample arrived), which add up to
    ``dispatched``. ``reissued`` and ``generator_restarts`` are not part of the sum: each
    re-issue is a new dispatched group, its old one abandoned.

    Args:
        dispatch: the run's ``Dispatcher``. buffer: its ``ReplayBuffer`` (``counters`` and
            ``metrics()``). trained, dynamic_dropped: the loop's counts of groups. queued:
            requests still in the broker. restarts: actor restarts, summed over the pool.
            spread_pending: groups of which some shares are trained and some pending.
    """
    c, m = buffer.counters, buffer.metrics()
    out = {"dispatched": dispatch.num_dispatched, "trained": trained, "rejected": c["rejected_groups"],
           "stale": c["stale_groups"], "abandoned": c["abandoned_groups"], "dynamic_sampling_dropped": dynamic_dropped,
           "ready_unused": int(m["buffer/num_groups_ready"]), "partial_at_exit": int(m["buffer/num_partial_groups"]),
           "queued_at_exit": queued, "spread_partly_trained_at_exit": spread_pending}
    out["unstarted_or_in_engine_at_exit"] = out["dispatched"] - sum(v for k, v in out.items() if k != "dispatched")
    out["reissued"] = dispatch.num_reissued
    out["generator_restarts"] = restarts
    return out
