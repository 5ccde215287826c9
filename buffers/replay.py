"""Staleness-aware replay buffer and the admission rule that paces generation.

Where it sits in the async pipeline (who waits on whom)::

    generators ──(AdmissionController.can_start)──> start a group ──> ... ──> transport
                                                                                │
    receiver thread ──add(traj) / close_group(gid, n)──> ReplayBuffer ──get_groups(k, v)──> learner
                                                        (lock + condition)   waits up to timeout_s

Staleness is bounded twice: ``AdmissionController`` stops generators from *starting*
groups that would be too old by the time the learner reaches them (pace, don't discard), and
``ReplayBuffer.get_groups`` evicts, with a counted reason, any group that still came out too old.
Staleness itself is defined once, in ``staleness``.

Lifecycle of a group ``g`` in the buffer::

    partial ──(group_size trajectories arrive, or close_group(g, n) and n have arrived)──> ready
    ready   ──get_groups: in dispatch order (the oldest group first, none skipped while an older
              one is in flight), or oldest completion first──> served (returned to the back of
              the ready queue until served max_reuse times)
    ready   ──any sample staleness > max_staleness──> evicted (dropped["stale"])
    close_group(g, 0) ──> rejected group (dropped_groups["rejected"])
    partial ──abandon_group(g) (its generator died; re-issue the prompt as a new group)──> abandoned

A trajectory id is accepted once: a re-sent trajectory is dropped as a duplicate even after its
group was served, and a trajectory for a group that already completed is dropped as ``late``.

Run the tests with ``python -m pytest -q tests/test_replay_buffer.py``.
"""

from __future__ import annotations

import copy
import heapq
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from async_rl.buffers.trajectory import Trajectory

STATE_FORMAT = 4
"""Version of the ``ReplayBuffer.state_dict`` layout. 2: each trajectory dict also holds
``teacher_topk_ids`` and ``teacher_topk_logprobs`` (``[R, K]`` nested lists, ``[]`` without); 3:
and ``routed_experts`` (``[P + R - 1, layers, k]`` nested lists, ``[]`` without); 4: and
``observation_pixel_values`` / ``observation_image_grid_thw`` (an episode's observation images,
``[N, D]`` and ``[I, 3]`` nested lists, ``[]`` without). Code that reads only an older format
would fail on those keys mid-load, so it refuses the whole state in one line instead. This code
reads formats 1 to 3 too (``READABLE_STATE_FORMATS``): their trajectories have no top-k, no
routing and no observation images, which is what the missing keys default to, so a run
checkpointed before a bump resumes."""

READABLE_STATE_FORMATS = (1, 2, 3, STATE_FORMAT)
"""State formats ``load_state_dict`` accepts."""


def staleness(traj: Trajectory, current_version: int) -> int:
    """Policy versions between a sample's oldest token and the learner: ``current_version - traj.min_version``.

    This is the one definition used by admission control, the buffer and the metrics.
    Note: ``Trajectory.min_version`` is 0 for an empty response, so such a sample looks as old as
    the run.
    """
    return current_version - traj.min_version


@dataclass(frozen=True)
class AdmissionController:
    """Staleness-bounded admission: may a generator start one more group now?

    Rule (AReaL, Fu et al. 2025, arXiv 2505.24298, Sec. 4 "staleness-aware training"; the same
    pacing as PipelineRL's bounded lag): with learner version ``v``, ``B = groups_per_step`` and
    ``η = max_staleness``, a new group may start iff the groups started so far, including the new
    one, number at most ``(η + v + 1) · B``. The learner consumes ``B`` groups per version, so a
    group started under this bound is consumed at most ``η`` versions after it began (up to
    reordering by completion time, which the buffer's eviction catches).

    Example: ``B = 4, η = 1``: at ``v = 0`` groups 1..8 may start and the 9th waits; at ``v = 1``
    up to 12. ``η = 0`` reduces to synchronous on-policy generation (``B`` groups per version).

    Attributes:
        groups_per_step: groups the learner consumes per optimizer step (per version); >= 1.
        max_staleness: η, in policy versions; >= 0.

    Raises:
        ValueError: from the constructor for out-of-range attributes.
    """

    groups_per_step: int
    max_staleness: int

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 0:
            raise ValueError(f"AdmissionController needs groups_per_step >= 1 and max_staleness >= 0, got "
                             f"{self.groups_per_step} and {self.max_staleness}")

    def max_resident_groups(self) -> int:
        """Most groups the replay buffer can hold at once (partial and ready) when each group is
        trained once (``max_reuse = 1``): ``(η + 1) · B``.

        Derivation. Let ``D`` be the groups dispatched, ``X`` those discarded (rejected, evicted,
        abandoned, dropped by dynamic sampling), ``S`` those the learner took from the buffer
        (dynamic sampling's drops included) and ``F`` those not yet back from an engine. With
        ``v_p`` the version every generator holds and ``v >= v_p`` the learner's:

        * admission (``can_start``): ``D - X <= (η + v_p + 1) · B``;
        * the learner took ``B`` groups to train (or more: dynamic sampling's surplus) for each
          of its ``v`` versions, plus those dynamic sampling dropped: ``S >= v · B + X_ds``;
        * resident groups ``= D - (X - X_ds) - S - F <= (η + v_p + 1) · B - v · B <= (η + 1) · B``.

        (``X_ds`` is in ``X`` and in ``S``: admission frees its slot, the buffer let it go once.)
        A stale group not yet evicted still counts towards ``D - X``, so the bound holds between
        two ``get_groups`` calls too. With ``max_reuse > 1`` a served group stays for reuse
        while admission counts it consumed: no such bound follows.

        Example: ``B = 4, η = 1``: at most 8 groups, of ``n`` samples each, at any time.
        """
        return (self.max_staleness + 1) * self.groups_per_step

    def capacity(self, current_version: int) -> int:
        """Most groups that may have started by version ``current_version``: ``(η + v + 1) · B``."""
        return (self.max_staleness + current_version + 1) * self.groups_per_step

    def can_start(self, num_started_groups: int, current_version: int, num_discarded_groups: int = 0) -> bool:
        """True iff ``num_started_groups - num_discarded_groups + 1 <= capacity(current_version)``.

        Args:
            num_started_groups: groups started since the run began (a monotonic counter).
            current_version: the learner's current policy version ``v``.
            num_discarded_groups: started groups that will never reach the learner: rejected
                whole, evicted as stale or abandoned (``sum(ReplayBuffer.dropped_groups.values())``).
                Subtract them, or a run that loses groups waits forever: the learner needs ``B``
                groups per step while admission counts the lost ones as consumed.
        """
        return num_started_groups - num_discarded_groups + 1 <= self.capacity(current_version)


@dataclass
class _Group:
    group_id: int
    trajectories: list[Trajectory]
    times_served: int = 0


SERVE_ORDERS = ("dispatch", "completion")
"""``ReplayBuffer`` serve orders (``trainer.serve_order``)."""

_COUNTERS = ("added", "duplicate", "late", "stale", "stale_groups", "reuse_expired_groups",
             "rejected_groups", "rejected_samples", "abandoned", "abandoned_groups", "completed_groups",
             "served_groups", "served_samples")


class ReplayBuffer:
    """Assembles complete groups from trajectories arriving in any order and serves them in order.

    Args:
        group_size: trajectories per group when none is rejected (``n`` samples per prompt); >= 1.
        max_staleness: η; a group with any sample of staleness > η is never served; >= 0.
        max_reuse: times a group is served before it leaves the buffer; 1 = no reuse; >= 1.
        serve_order: which ready groups ``get_groups`` serves first. ``dispatch``: by group id
            (ids are given in dispatch order), and none above the oldest group announced by
            ``note_dispatched`` that has not finished (completed, rejected, evicted or
            abandoned), so a group still being sampled is never overtaken by those dispatched
            after it. ``completion``: the oldest completion first, whatever the ids. On a
            long-tailed task the groups that finish last are those with long answers: served by
            completion, they are the ones the learner reaches last, past ``max_staleness``, and
            evicted, which biases training towards short answers (measured with two generator
            actors: 12% of groups evicted, trained responses 7 tokens long against 11). In
            dispatch order a step trains on the groups admitted for it, as sync mode would, and
            admission (``AdmissionController``) bounds their staleness; groups kept for reuse
            (``max_reuse > 1``) come after the never-served ones.

    Thread safety: every method takes one lock, so a receiver thread may ``add`` while the
    learner thread waits in ``get_groups``.

    Memory: seen trajectory ids and finished group ids are kept for the whole run (and in the
    checkpoint) so that duplicates and stragglers are recognised at any time; about 100 bytes
    per trajectory.

    Raises:
        ValueError: from the constructor for out-of-range arguments.
    """

    def __init__(self, group_size: int, max_staleness: int, max_reuse: int = 1, serve_order: str = "completion") -> None:
        if group_size < 1 or max_staleness < 0 or max_reuse < 1:
            raise ValueError(f"ReplayBuffer needs group_size >= 1, max_staleness >= 0, max_reuse >= 1; got "
                             f"{group_size}, {max_staleness}, {max_reuse}")
        if serve_order not in SERVE_ORDERS:
            raise ValueError(f"ReplayBuffer serve_order must be one of {SERVE_ORDERS}, got {serve_order!r}")
        self.group_size, self.max_staleness, self.max_reuse = group_size, max_staleness, max_reuse
        self.serve_order = serve_order
        self._cond = threading.Condition(threading.Lock())
        self._reset()

    def _reset(self) -> None:
        self._partial: dict[int, list[Trajectory]] = {}
        self._expected: dict[int, int] = {}        # close_group declared counts still waiting for samples
        self._ready: deque[_Group] = deque()
        self._finished: dict[int, int] = {}        # group id -> final size (0: rejected, -1: abandoned)
        self._announced: list[int] = []            # heap of note_dispatched ids, those finished popped lazily
        self._seen: set[str] = set()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._last_version: int | None = None
        self._last_hist = [0] * (self.max_staleness + 1)
        # Resident size (partial + ready), kept up to date on every change, and its peak.
        self._resident = {"groups": 0, "samples": 0, "tokens": 0}
        self._peak = dict(self._resident)

    def _resize(self, groups: int, trajs: list[Trajectory], sign: int) -> None:
        """Add (``sign=1``) or remove (``-1``) ``groups`` groups holding ``trajs`` from the resident
        size; a new peak is recorded as it happens."""
        r = self._resident
        r["groups"] += sign * groups
        r["samples"] += sign * len(trajs)
        r["tokens"] += sign * sum(t.num_tokens for t in trajs)
        if sign > 0:
            for k, n in r.items():
                self._peak[k] = max(self._peak[k], n)

    # ------------------------------------------------------------------------------ producers
    def add(self, traj: Trajectory) -> bool:
        """Store one trajectory; completes its group when the group's count is reached.

        Returns:
            True if stored; False if dropped and counted: ``dropped["duplicate"]`` for a
            trajectory id seen before (also after its group was served or evicted),
            ``dropped["late"]`` for a new id whose group already completed.
        """
        with self._cond:
            if traj.trajectory_id in self._seen:
                self._counters["duplicate"] += 1
                return False
            self._seen.add(traj.trajectory_id)
            if traj.group_id in self._finished:
                self._counters["late"] += 1
                return False
            self._counters["added"] += 1
            new_group = traj.group_id not in self._partial
            members = self._partial.setdefault(traj.group_id, [])
            members.append(traj)
            self._resize(int(new_group), [traj], 1)
            if len(members) == self._expected.get(traj.group_id, self.group_size):
                self._complete(traj.group_id)
            return True

    def close_group(self, group_id: int, expected: int) -> None:
        """Declare that group ``group_id`` will hold exactly ``expected`` trajectories.

        Order-independent: it may arrive before, between or after the group's trajectories (so it
        can travel on a different channel than they do). The group completes as soon as
        ``expected`` of them are in; ``expected = 0`` completes it at once as a rejected group
        (``dropped_groups["rejected"]``). ``group_size - expected`` is added to
        ``rejected_samples``. Repeating a call with the same value, or closing an abandoned group,
        is a no-op.

        Raises:
            ValueError: ``expected`` outside ``[0, group_size]``, a different count than an earlier
                call or than the group already completed with, or more trajectories already stored
                than ``expected``.
        """
        if not 0 <= expected <= self.group_size:
            raise ValueError(f"close_group({group_id}): expected must be in [0, {self.group_size}], got {expected}")
        with self._cond:
            if self._finished.get(group_id) == -1:
                return  # abandoned: its samples, if any still come, count as late
            if group_id in self._finished or group_id in self._expected:
                declared = self._finished.get(group_id, self._expected.get(group_id))
                if declared != expected:
                    raise ValueError(f"close_group({group_id}, {expected}): the group was already closed or "
                                     f"completed with {declared} trajectories")
                return
            have = len(self._partial.get(group_id, ()))
            if have > expected:
                raise ValueError(f"close_group({group_id}, {expected}): {have} trajectories of it are already stored")
            self._expected[group_id] = expected
            self._counters["rejected_samples"] += self.group_size - expected
            if have == expected:
                self._complete(group_id)

    def abandon_group(self, group_id: int) -> bool:
        """Give up on a group that will not complete (its generator died); for re-issuing its prompt.

        The group's stored samples are dropped (``dropped["abandoned"]``,
        ``dropped_groups["abandoned"]``) and later arrivals for it count as ``late``. Re-issue the
        prompt under a new group id: reusing the id would mix two attempts whose rejected
        samples differ, so ``close_group`` counts could not match.

        Returns:
            True if the group was abandoned (it was partial or never seen): re-issue its prompt.
            False if it had already completed (ready, served, evicted or rejected): nothing to do.
        """
        with self._cond:
            if group_id in self._finished:
                return False
            samples = self._partial.pop(group_id, [])
            self._resize(int(bool(samples)), samples, -1)
            self._expected.pop(group_id, None)
            self._finished[group_id] = -1
            self._counters["abandoned"] += len(samples)
            self._counters["abandoned_groups"] += 1
            self._cond.notify_all()  # the dispatch-order frontier may move
            return True

    def _complete(self, group_id: int) -> None:
        trajs = self._partial.pop(group_id, [])
        self._expected.pop(group_id, None)
        self._finished[group_id] = len(trajs)
        if trajs:
            self._counters["completed_groups"] += 1
            self._ready.append(_Group(group_id, trajs))
        else:
            self._counters["rejected_groups"] += 1
        self._cond.notify_all()  # a rejected group moves the dispatch-order frontier too

    def note_dispatched(self, group_ids: list[int]) -> None:
        """Announce groups as dispatched (``serve_order: dispatch``): none of a higher id is
        served while one of them has not finished. Call before their requests reach a generator."""
        with self._cond:
            for gid in group_ids:
                heapq.heappush(self._announced, gid)

    # ------------------------------------------------------------------------------- consumer
    def _servable(self) -> list[_Group]:
        """Ready groups in the order ``get_groups`` serves them (``serve_order``): in dispatch
        order, the never-served groups below the oldest announced group still in flight, by id,
        then groups kept for reuse in queue order; by completion, the queue as it stands."""
        if self.serve_order == "completion":
            return list(self._ready)
        heap = self._announced
        while heap and heap[0] in self._finished:
            heapq.heappop(heap)
        frontier = heap[0] if heap else None
        fresh = sorted((g for g in self._ready if g.times_served == 0 and (frontier is None or g.group_id < frontier)),
                       key=lambda g: g.group_id)
        return fresh + [g for g in self._ready if g.times_served > 0]

    def _evict_stale(self, current_version: int) -> None:
        ages = [[staleness(t, current_version) for t in g.trajectories] for g in self._ready]
        for g, a in zip(self._ready, ages):
            if min(a) < 0:
                raise ValueError(f"group {g.group_id} holds tokens of policy version {current_version - min(a)}, "
                                 f"newer than current_version {current_version}")
        kept: deque[_Group] = deque()
        for g, a in zip(self._ready, ages):
            if max(a) <= self.max_staleness:
                kept.append(g)
                continue
            self._resize(1, g.trajectories, -1)
            if g.times_served:
                self._counters["reuse_expired_groups"] += 1  # already trained on: not lost data
            else:
                self._counters["stale_groups"] += 1
                self._counters["stale"] += len(g.trajectories)
        self._ready = kept

    def get_groups(self, num_groups: int, current_version: int,
                   timeout_s: float | None = 0.0) -> list[list[Trajectory]] | None:
        """Serve ``num_groups`` complete groups in ``serve_order``, none of them too stale.

        Stale groups (any sample with ``staleness > max_staleness`` at ``current_version``) are
        evicted first and counted. All or nothing: a step needs a fixed number of groups, so
        this never returns fewer than ``num_groups``.

        Args:
            num_groups: groups wanted (``groups_per_step`` or a mini-batch's share); >= 1.
            current_version: the learner's policy version; must not decrease between calls
                (eviction cannot be undone).
            timeout_s: seconds to wait for enough groups (0: poll; ``None``: wait forever).

        Returns:
            ``num_groups`` lists of trajectories (a group's samples in arrival order), or ``None``
            if fewer complete groups are ready by the deadline (nothing is taken then).

        Raises:
            ValueError: ``num_groups`` < 1, a negative timeout, a decreasing ``current_version``, or
                a ready sample with a policy version newer than ``current_version``.
        """
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if self._last_version is not None and current_version < self._last_version:
                raise ValueError(f"get_groups: current_version {current_version} < previous {self._last_version}")
            self._last_version = current_version
            while True:
                self._evict_stale(current_version)
                servable = self._servable()
                if len(servable) >= num_groups:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            taken = servable[:num_groups]
            chosen = {id(g) for g in taken}
            self._ready = deque(g for g in self._ready if id(g) not in chosen)
            hist = [0] * (self.max_staleness + 1)
            for g in taken:
                g.times_served += 1
                for t in g.trajectories:
                    hist[staleness(t, current_version)] += 1
                self._counters["served_samples"] += len(g.trajectories)
                if g.times_served < self.max_reuse:
                    self._ready.append(g)  # back of the queue: fresher groups go first
                else:
                    self._resize(1, g.trajectories, -1)
            self._counters["served_groups"] += num_groups
            self._last_hist = hist
            return [list(g.trajectories) for g in taken]

    # ------------------------------------------------------------------------- introspection
    def is_finished(self, group_id: int) -> bool:
        """Whether group ``group_id`` completed (ready, served, evicted or rejected) or was abandoned."""
        with self._cond:
            return group_id in self._finished

    @property
    def dropped(self) -> dict[str, int]:
        """Samples dropped, by reason: ``duplicate``, ``late``, ``stale`` (never-served groups), ``abandoned``."""
        with self._cond:
            return {k: self._counters[k] for k in ("duplicate", "late", "stale", "abandoned")}

    @property
    def dropped_groups(self) -> dict[str, int]:
        """Groups that ended unserved: ``stale`` (evicted), ``rejected`` (closed with 0), ``abandoned``.

        Their sum is what ``AdmissionController.can_start`` takes as ``num_discarded_groups``.
        """
        with self._cond:
            return {"stale": self._counters["stale_groups"], "rejected": self._counters["rejected_groups"],
                    "abandoned": self._counters["abandoned_groups"]}

    @property
    def counters(self) -> dict[str, int]:
        """All monotonic counters (a copy); see ``metrics`` for their meaning."""
        with self._cond:
            return dict(self._counters)

    def metrics(self) -> dict[str, float]:
        """Gauges and counters under stable keys (no side effects).

        Gauges: ``buffer/num_groups_ready``, ``buffer/num_partial_groups``, ``buffer/num_samples``
        and ``buffer/num_tokens`` (ready + partial; tokens = prompt + response). Peaks since the
        start of the run (a resumed run's included): ``buffer/peak_groups``,
        ``buffer/peak_samples``, ``buffer/peak_tokens`` of the resident (ready + partial) size,
        taken after every stored sample. Counters since the start of the run: ``buffer/added_samples``,
        ``buffer/dropped_duplicate``, ``buffer/dropped_late``, ``buffer/dropped_stale`` (samples),
        ``buffer/dropped_stale_groups``, ``buffer/reuse_expired_groups`` (served, then too old to
        reuse), ``buffer/rejected_groups``, ``buffer/rejected_samples``, ``buffer/abandoned`` and
        ``buffer/abandoned_groups``, ``buffer/completed_groups``, ``buffer/served_groups`` (every
        serve, reuse included), ``buffer/served_samples``. ``staleness/hist_{k}`` for
        ``k = 0..max_staleness``: samples of the last ``get_groups`` result with staleness ``k``
        (a per-step histogram when the learner takes one batch per step).
        """
        with self._cond:
            out = {
                "buffer/num_groups_ready": float(len(self._ready)),
                "buffer/num_partial_groups": float(len(self._partial)),
                "buffer/num_samples": float(self._resident["samples"]),
                "buffer/num_tokens": float(self._resident["tokens"]),
            }
            out.update({f"buffer/peak_{k}": float(n) for k, n in self._peak.items()})
            names = {"added": "added_samples", "duplicate": "dropped_duplicate", "late": "dropped_late",
                     "stale": "dropped_stale", "stale_groups": "dropped_stale_groups"}
            for k in _COUNTERS:
                out[f"buffer/{names.get(k, k)}"] = float(self._counters[k])
            out.update({f"staleness/hist_{k}": float(n) for k, n in enumerate(self._last_hist)})
            return out

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, as plain Python (lists, dicts, str, int, float).

        Trajectories are ``Trajectory.as_dict`` dicts (per-token arrays as lists, the teacher's
        top-k as lists of rows; float32 top-k log-probs come back bit-exact); group ids sit
        in lists of pairs so the state also survives JSON. Includes partial groups, declared counts, the ready queue in
        order with reuse counts, seen ids, finished groups, counters, the last histogram and the
        peak resident size.
        """
        with self._cond:
            as_dicts = lambda trajs: [t.as_dict() for t in trajs]  # noqa: E731
            return {
                "format": STATE_FORMAT,
                "config": {"group_size": self.group_size, "max_staleness": self.max_staleness,
                           "max_reuse": self.max_reuse},
                "partial": [[gid, as_dicts(m)] for gid, m in self._partial.items()],
                "expected": [[gid, n] for gid, n in self._expected.items()],
                "ready": [{"group_id": g.group_id, "times_served": g.times_served,
                           "trajectories": as_dicts(g.trajectories)} for g in self._ready],
                "finished": [[gid, n] for gid, n in self._finished.items()],
                "seen_ids": sorted(self._seen),
                "counters": dict(self._counters),
                "last_version": self._last_version,
                "last_hist": list(self._last_hist),
                "peak": dict(self._peak),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this buffer's contents with ``state`` (from ``state_dict``); the state is copied.

        ``max_staleness`` and ``max_reuse`` stay as constructed (a resumed run may change them);
        ``group_size`` must match because it decides when groups are complete.

        Raises:
            ValueError: an unknown state format or a different ``group_size``.
        """
        if state.get("format") not in READABLE_STATE_FORMATS:
            raise ValueError(f"replay buffer state format {state.get('format')!r}, this code reads "
                             f"{', '.join(map(str, READABLE_STATE_FORMATS))}")
        if state["config"]["group_size"] != self.group_size:
            raise ValueError(f"replay buffer state has group_size {state['config']['group_size']}, "
                             f"this buffer {self.group_size}")
        state = copy.deepcopy(state)
        to_trajs = lambda ds: [Trajectory(**d) for d in ds]  # noqa: E731
        with self._cond:
            self._reset()
            self._partial = {gid: to_trajs(m) for gid, m in state["partial"]}
            self._expected = {gid: n for gid, n in state["expected"]}
            self._ready = deque(_Group(g["group_id"], to_trajs(g["trajectories"]), g["times_served"])
                                for g in state["ready"])
            self._finished = {gid: n for gid, n in state["finished"]}
            self._seen = set(state["seen_ids"])
            self._counters.update(state["counters"])
            self._last_version = state["last_version"]
            if len(state["last_hist"]) == len(self._last_hist):
                self._last_hist = state["last_hist"]
            for members in self._partial.values():
                self._resize(1, members, 1)
            for g in self._ready:
                self._resize(1, g.trajectories, 1)
            for k, n in state.get("peak", {}).items():  # absent in states saved before peaks were kept
                self._peak[k] = max(self._peak[k], int(n))
            self._cond.notify_all()
