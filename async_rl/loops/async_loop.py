"""Async mode: a generator pool streams trajectories while the learner trains.

::

    dispatcher thread ──GroupRequest (admission control)──> Ray queue ──> GeneratorWorker x N
                                                                          │ Trajectory / GroupClosed
    learner (this thread) <──get_groups(B, v)── ReplayBuffer <──add── receiver thread <──ZMQ PULL
           │
           └── new weights, version v+1 ──WeightPublisher (buckets: shm / broadcast)──> every worker

* **Admission** (``async_rl.buffers.replay.AdmissionController``): a group may start only while started
  groups (minus those that can never be trained: rejected, evicted, dropped by dynamic sampling)
  ≤ (max_staleness + v + 1) × B, with v the version every generator holds. With max_staleness 0
  the pool samples exactly the groups sync mode would, from the same weights and per-group seeds,
  so the two modes train on the same data. The replay buffer thus never holds more than
  (max_staleness + 1) × B groups (``buffer_bound``; its peak is logged as ``buffer/peak_*``).
* **Consumption**: the learner takes B complete groups (``ReplayBuffer.get_groups`` evicts any
  too stale and counts them), orders them by group id (so the batch does not depend on which
  worker finished first), and trains with proximal log-probs recomputed at its current version.
* **Publication**: after a training step the weights go to every worker through the weight sync
  layer (``async_rl.weight_sync``: shared-memory buckets on one host, or a gloo/NCCL broadcast
  group); each engine loads them between decoding steps (HF) or paused (vLLM), and the version
  counts as published, for admission, only once all workers hold it. With
  ``weight_sync.overlap_push`` (the default) the learner only copies its weights into a staging
  buffer and starts its next step while a background thread pushes that copy
  (``WeightPublisher.start_push``); one push at a time: the next push, a checkpoint, an
  evaluation's engine sync and ``close`` collect the pending one first, and its failure is
  raised on the learner's thread (at the latest at the next push) and handled as a blocking
  push's would be.
* **Exactly once**: every dispatched group ends trained, rejected (all samples rejected by the
  reward), dropped by dynamic sampling, evicted as stale or abandoned, each counted; whatever is
  still in flight at shutdown is counted too (``pipeline/*`` in the summary, checked to add up).
* **Supervision**: a generator actor that dies, or makes no progress and does not answer for
  ``generator.heartbeat_timeout_s``, is found while the learner waits for data or pushes weights.
  The groups it had claimed at the ``RequestBroker`` and that did not complete are abandoned
  (their samples counted) and their prompts dispatched again, once, under new group ids
  (``pipeline/reissued``); the actor is replaced in its placement bundle, up to
  ``generator.max_restarts`` times, and the current weights pushed to the pool again before the
  next step. With no actor left the run stops with an error naming each actor's end.

Thread budget: the learner process and each worker get a share of the cores
(``generator.threads_per_worker``), because oversubscribed torch processes slow each other down
many-fold on a small machine. ``generator.cpu_affinity`` / ``learner.cpu_affinity`` pin each role
to cores of its own (``cluster.pin_process``; a pinned role's threads default to its core count).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from async_rl.buffers.replay import AdmissionController, ReplayBuffer
from async_rl.buffers.transport import GroupClosed, make_transport
from async_rl.cluster import Cluster, PlacementConfig, is_loopback, started_on
from async_rl.cpu_threads import available_cores, user_num_threads
from async_rl.loops.base import RunContext
from async_rl.loops.common import dynamic_sampling, learn_on
from async_rl.loops.pool import GeneratorWorker, RequestBroker
from async_rl.rewards import check_rewards_work
from async_rl.rewards.model import RewardModel, model_kwargs
from async_rl.rollout import GroupRequest, RolloutResult, group_seed, longest_sequence, reward_model_path
from async_rl.weight_sync import RayTarget, WeightPublisher, engine_protocol, transports_for_targets

logger = logging.getLogger(__name__)


def probe_difference(reference: dict, probe: dict) -> dict[str, Any]:
    """How far an engine's greedy probe (``GeneratorWorker.probe``) is from ``reference``:
    ``tokens_equal`` (every row's ids), ``max_abs_logprob_diff`` over the common prefix of
    each row (nats), and whether the policy versions agree."""
    diff = 0.0
    for ids_a, lp_a, ids_b, lp_b in zip(reference["response_ids"], reference["logprobs"],
                                        probe["response_ids"], probe["logprobs"]):
        same = 0
        while same < min(len(ids_a), len(ids_b)) and ids_a[same] == ids_b[same]:
            same += 1
        diff = max([diff] + [abs(a - b) for a, b in zip(lp_a[:same], lp_b[:same])])
    return {"tokens_equal": reference["response_ids"] == probe["response_ids"], "max_abs_logprob_diff": diff,
            "same_version": reference["policy_version"] == probe["policy_version"]}


def engine_tokens_per_s(delta: dict[str, float], total: dict[str, float]) -> float | None:
    """The pool's engines' busy speed for one step's metrics, in tokens per busy second: the
    tokens of the batches that ended (``served_tokens``) over the seconds they took (``busy_s``),
    from this step's counters ``delta`` or, when no batch ended during the step (one long batch),
    from the run's so far ``total``; ``None`` before any batch ended. (A step's tokens over a busy
    time that does not hold them read as billions per second.)"""
    for counters in (delta, total):
        busy = counters.get("busy_s", 0.0)
        if busy > 0:
            return counters.get("served_tokens", 0.0) / busy
    return None


def buffer_bound(cfg) -> dict[str, int] | None:
    """Most the replay buffer can hold at once under admission control, from the run's config
    ``cfg`` (``async_rl.config.Config``):
    ``groups = (max_staleness + 1) · prompts_per_step`` (derived in
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
    groups = AdmissionController(t_cfg.prompts_per_step, t_cfg.max_staleness).max_resident_groups()
    samples = groups * t_cfg.samples_per_prompt
    return {"groups": groups, "samples": samples, "tokens": samples * longest_sequence(cfg)[0]}


def thread_budget(num_workers: int, threads_per_worker: int, cores: int | None = None,
                  user_threads: int = 0) -> tuple[int, int]:
    """``(threads per worker, learner threads)`` for ``num_workers`` generator processes.

    With ``threads_per_worker = 0`` the cores are split evenly between the workers and the
    learner (each at least 1); the learner gets what the workers leave. ``cores`` defaults to
    this process's CPU affinity (``available_cores``), not the machine's core count: a run
    pinned to 2 of 64 cores must not start 64 threads per process. ``user_threads`` (the user's
    ``OMP_NUM_THREADS``, 0 if unset) is every process's count where it has none of its own
    (``threads_per_worker``), as OpenMP would have it.

    Example: 2 workers on 16 cores -> ``(5, 6)``; on 2 cores -> ``(1, 1)`` (never 0 threads).
    """
    if user_threads:
        return threads_per_worker or user_threads, user_threads
    cores = cores or available_cores()
    per_worker = threads_per_worker or max(1, cores // (num_workers + 1))
    return per_worker, max(1, cores - num_workers * per_worker)


class AsyncLoop:
    """The async pipeline of one run; ``step`` is one learner step, ``close`` stops everything.

    Args:
        ctx: the run's shared parts (the learner is driven from the calling thread).
        resume_state: ``state_dict()`` of the loop a checkpoint saved, or ``None``. The replay
            buffer, counters and dataset position are restored; groups that were dispatched but
            not complete at the checkpoint (queued, in an engine, or partial in the buffer) are
            abandoned (counted) and their prompts dispatched again first, under new group ids.

    Raises:
        RuntimeError: (from ``step``) a generator actor died, or no data arrived for
            ``stall_timeout_s`` seconds.
    """

    stall_timeout_s = 600.0

    def __init__(self, ctx: RunContext, resume_state: dict[str, Any] | None = None) -> None:
        self.ctx = ctx
        self._closed = False
        cfg, t_cfg, g_cfg = ctx.cfg, ctx.cfg.trainer, ctx.cfg.generator
        self.n = t_cfg.samples_per_prompt
        self.groups_per_step = t_cfg.prompts_per_step
        # A reward model's actor takes one worker's share of the cores (or reward.model_num_threads).
        with_rm = cfg.reward.model is not None
        # Pinned roles (cpu_affinity) get as many threads as their cores, unless set explicitly.
        per_worker, learner_threads = thread_budget(g_cfg.num_workers + with_rm,
                                                    g_cfg.threads_per_worker or len(g_cfg.cpu_affinity),
                                                    user_threads=user_num_threads())
        learner_threads = cfg.learner.num_threads or len(cfg.learner.cpu_affinity) or learner_threads
        torch.set_num_threads(learner_threads)
        self._own_cluster = ctx.cluster is None
        self.cluster = Cluster.start(cfg) if self._own_cluster else ctx.cluster
        # Generator actors on other nodes dial this address: the driver node's, not loopback.
        self.receiver, sender_factory = make_transport(
            "zmq", t_cfg.zmq_address or f"tcp://{self.cluster.bind_host}:*", t_cfg.zmq_hwm)
        heard_on = self.receiver.address.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
        if t_cfg.zmq_address and self.receiver.address.startswith("tcp://") and heard_on != self.cluster.bind_host \
                and not is_loopback(heard_on):
            logger.warning("trainer.zmq_address=%s: the trajectory receiver listens on %s, reachable from that "
                           "network, not only from this machine", t_cfg.zmq_address, heard_on)
        self.buffer = ReplayBuffer(group_size=self.n, max_staleness=t_cfg.max_staleness, max_reuse=t_cfg.max_reuse)
        self.admission = AdmissionController(self.groups_per_step, t_cfg.max_staleness)
        self.bound = buffer_bound(cfg)
        # On the trainer's node: a generator node that goes down does not take the queue with it.
        self.broker = ray.remote(num_cpus=0, max_concurrency=2 * g_cfg.num_workers + 8)(RequestBroker).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        ).remote()
        tok_path = ctx.tokenizer.name_or_path
        reward_fn = cfg.reward.fn
        if reward_fn and ".py:" in reward_fn and not os.path.isabs(reward_fn):
            # Actors need not share the driver's working directory.
            reward_fn = os.path.abspath(reward_fn)
        self.reward_actor = None
        if with_rm:
            self.reward_actor = ray.remote(num_cpus=0)(RewardModel).remote(
                reward_model_path(cfg.reward), **model_kwargs(cfg.reward), num_threads=cfg.reward.model_num_threads or per_worker)
        self._worker_args = (tok_path, reward_fn, sender_factory, per_worker)
        self.workers: list[Any] = self._place_workers(ctx, *self._worker_args)  # None: retired
        spots = self.cluster.record("generators", self.workers)
        self.cluster.check_reachable("generator", spots)
        if self.reward_actor is not None:
            self.cluster.record("reward_model", [self.reward_actor])
        self.publisher = None
        self.published_version = -1
        self.overlap = cfg.weight_sync.overlap_push
        # Background pushes' metrics, collected on the learner's thread, reported with its next step.
        self._push_metrics: dict[str, float] = {}
        # The heartbeat probes (``_hung_workers``) run on the learner's thread and, through
        # ``_watch_pool``, on a background push's.
        self._supervision_lock = threading.RLock()
        self._connect_pool(supervised=False)  # supervision starts with the runs
        # The warm-started (or resumed) weights; not yet supervised (that starts with the runs).
        self.publisher.push(self.ctx.learner.version)
        self.published_version = self.ctx.learner.version
        self.run_refs = [w.run.remote(self.broker) for w in self.workers]
        # Supervision: replacements so far per actor index, each index's last counters and last
        # heartbeat probe (object ref, seconds sent), the counters of actors that died, and how
        # each retired index ended.
        self.restarts = [0] * len(self.workers)
        self._stats_by_worker: dict[int, dict[str, float]] = {}
        self._retired_stats: dict[str, float] = {}
        self._beats: dict[int, tuple[Any, float]] = {}
        self._ends: dict[int, str] = {}
        self._starting: set[int] = set()  # replaced, waiting for the weights before they sample
        self._killed: dict[int, str] = {}  # killed as hung, not yet replaced: why
        self.num_reissued = 0
        self.rejected_messages: dict[str, int] = {}
        """Well-formed messages refused by ``_route``, by reason."""
        self._refused_lock = threading.Lock()
        self.num_dispatched = 0
        self.num_dynamic_dropped = 0
        self.num_trained_groups = 0
        self.trained_by_generator: dict[int, int] = {}  # trained samples per actor index
        self._last_rejected_samples = 0
        self._rewards_checked = False
        # Dispatched groups not yet known complete, by id: what a checkpoint must re-issue.
        self._outstanding: dict[int, Any] = {}
        self._reissue: deque = deque()
        self._dispatch_lock = threading.Lock()
        if resume_state is not None:
            self._load_state_dict(resume_state)
        self._dispatched_tokens = 0
        self._stop = threading.Event()
        # Wakes the dispatcher when admission may let a group start (a version published, groups
        # ended untrained, the loop stopping) instead of a poll on the learner's core.
        self._admission_changed = threading.Condition()
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._guard(self._dispatch_loop), name="dispatcher", daemon=True),
                         threading.Thread(target=self._guard(self._receive_loop), name="receiver", daemon=True)]
        # The first window of the per-step worker counters opens before any request is
        # dispatched, so no generated token or tool call falls outside every step's window.
        self._last_stats = self._worker_stats()
        self._last_t = time.perf_counter()
        for th in self._threads:
            th.start()
        ctx.log.print(f"async mode: {g_cfg.num_workers} {g_cfg.backend} generator actors x {per_worker} threads, "
                      f"learner {learner_threads} threads, max_staleness {t_cfg.max_staleness}, weights over "
                      f"{self.transport}" + (f" (store {self.publisher.sender.host}:{self.publisher.sender.port})"
                                             if self.publisher.sender is not None else "") +
                      f", trajectories on {self.receiver.address}")

    def _place_workers(self, ctx: RunContext, tok_path: str, reward_fn, sender_factory, per_worker: int,
                       indices: list[int] | None = None, incarnation: int = 0) -> list:
        """Start generator actors (all, or those at ``indices``) in their bundles of the run's
        placement group (``generator.num_cpus_per_worker``, ``num_gpus_per_worker``,
        ``node_labels``, ``placement_strategy``)."""
        cfg, g_cfg = ctx.cfg, ctx.cfg.generator
        placement = PlacementConfig.of_generators(g_cfg)
        bundle = placement.bundle(cuda=False)
        strategies = self.cluster.place("generators", g_cfg.num_workers, placement)
        # max_concurrency: run() decodes on one thread while weights and stats arrive on others.
        worker_cls = ray.remote(max_concurrency=3)(GeneratorWorker)
        # A replacement loads the warm start's model; the pool then pushes it the current weights.
        return [worker_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                   scheduling_strategy=strategies[i]).remote(
                    i, ctx.model_path, tok_path, g_cfg, ctx.params, reward_fn, cfg.reward.on_error, sender_factory,
                    per_worker, cfg.learner.lora, cfg.agent, reward_cfg=cfg.reward, reward_model=self.reward_actor,
                    incarnation=incarnation, bind_host=self.cluster.bind_host)
                for i in (range(g_cfg.num_workers) if indices is None else indices)]

    def _active(self) -> list[int]:
        return [i for i, w in enumerate(self.workers) if w is not None]

    def _connect_pool(self, supervised: bool = True) -> None:
        """(Re)build the weight publisher over the live actors: per actor, shared memory on the
        trainer's node and a broadcast group to the others (``transports_for_targets``).
        ``supervised``: the pool is watched while the actors connect (``_watch_pool``), so one
        that hangs meanwhile fails the connection instead of holding it to the timeout."""
        cfg, g_cfg = self.ctx.cfg, self.ctx.cfg.generator
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        active = self._active()
        spots = [self.cluster.placed["generators"][i] for i in active]
        self.transports = transports_for_targets(cfg.weight_sync, g_cfg.backend, "async",
                                                 [self.cluster.on_driver_node(e) for e in spots])
        self.publisher = WeightPublisher(cfg.weight_sync, self.transports, self.ctx.learner,
                                         [RayTarget(self.workers[i]) for i in active],
                                         protocol=engine_protocol(g_cfg.backend), host=self.cluster.bind_host,
                                         watch=self._watch_pool if supervised else None)
        self.transport = self.publisher.transport_name
        for entry, transport in zip(spots, self.transports):
            entry["weight_transport"] = transport  # saved in placement.json

    # ------------------------------------------------------------------ background threads
    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced by step(); a dead thread must not hang the learner
                logger.exception("async pipeline thread %s failed", threading.current_thread().name)
                self._errors.append(e)
        return run

    def _num_discarded(self) -> int:
        return sum(self.buffer.dropped_groups.values()) + self.num_dynamic_dropped

    def _dispatch_loop(self) -> None:
        seed = self.ctx.cfg.trainer.seed

        def admitted(extra: int = 0) -> bool:
            return self.admission.can_start(self.num_dispatched + extra, max(self.published_version, 0),
                                            self._num_discarded())

        while not self._stop.is_set():
            with self._admission_changed:
                # Each change is announced (_wake_dispatcher); the timeout only bounds a missed one.
                if not self._admission_changed.wait_for(lambda: self._stop.is_set() or admitted(), timeout=0.05):
                    continue
            if self._stop.is_set():
                break
            with self._dispatch_lock:
                # Every group admission allows now, in one call: a worker waiting for requests
                # then takes them as one engine batch rather than waking with the first alone.
                batch: list[GroupRequest] = []
                while not batch or admitted(len(batch)):
                    gid = self.num_dispatched + len(batch)
                    if self._reissue:
                        request = dataclasses.replace(self._reissue.popleft(), group_id=gid, seed=group_seed(seed, gid))
                    else:
                        request = GroupRequest.of(self.ctx.train_ds.next_batch(1)[0], gid, self.n, group_seed(seed, gid))
                    self._outstanding[gid] = request
                    batch.append(request)
                # Blocking: the broker serves calls on several threads, so only waiting keeps
                # the queue in dispatch order.
                ray.get(self.broker.put_many.remote(batch))
                self.num_dispatched += len(batch)

    def _route(self, msg) -> None:
        """Hand one decoded message to the buffer, or refuse it (counted in
        ``rejected_messages`` by reason, logged) when it cannot belong to this run: a group never
        dispatched, a sample index outside the group, a trajectory id of another group, tokens of
        a policy version the learner has not reached, or a ``GroupClosed`` that contradicts what
        the buffer holds. The decoder already refused what does not parse or cannot be trained on
        (``pipeline/malformed_messages``); these are well-formed messages that no generator of
        this run sends, so accepting one would stop the run (the buffer raises) or train on it."""
        reason = self._refusal(msg)
        if reason is None and isinstance(msg, GroupClosed):
            try:
                self.buffer.close_group(msg.group_id, msg.num_kept)
                return
            except ValueError as e:
                reason, detail = "contradicting_group_closed", str(e)
        elif reason is None:
            self.buffer.add(msg)
            return
        else:
            detail = f"{msg!r:.200}"
        with self._refused_lock:
            self.rejected_messages[reason] = self.rejected_messages.get(reason, 0) + 1
            count = sum(self.rejected_messages.values())
        if count <= 5 or math.log10(count).is_integer():
            logger.warning("async pipeline: refused message #%d (%s): %s", count, reason, detail)

    def _refusal(self, msg) -> str | None:
        """Why ``msg`` cannot belong to this run, or ``None`` (see ``_route``)."""
        gid = msg.group_id
        # Requests enter _outstanding before the broker has them, so no worker can answer a group
        # that is neither there nor below num_dispatched.
        if not (0 <= gid < self.num_dispatched or gid in self._outstanding):
            return "unknown_group"
        if isinstance(msg, GroupClosed):
            return None
        group, index = msg.trajectory_id.rsplit("/", 1)
        if int(group) != gid:
            return "trajectory_id_of_another_group"
        if int(index) >= self.n:
            return "index_outside_group"
        if len(msg.policy_version) and int(msg.policy_version.max()) > self.ctx.learner.version:
            return "future_policy_version"
        return None

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            msgs = self.receiver.recv_many(512, timeout_s=0.05)
            for msg in msgs:
                self._route(msg)
            if msgs:  # a group rejected or evicted here frees its admission slot
                self._wake_dispatcher()

    def _wake_dispatcher(self) -> None:
        with self._admission_changed:
            self._admission_changed.notify_all()

    # ------------------------------------------------------------------ learner side
    def _check_health(self) -> None:
        if self._errors:
            raise RuntimeError(f"async pipeline thread failed: {self._errors[0]!r}") from self._errors[0]
        self._settle_push(block=False)
        self._supervise()

    # ------------------------------------------------------------------ supervision
    def _supervise(self, dead: list[tuple[int, str]] | None = None) -> None:
        """Replace dead and hung generator actors (``_replace_worker``), then push the learner's
        weights to the pool before the replacements start sampling; repeats while more die.

        Raises:
            RuntimeError: no generator actor is left, or a replacement failed to start.
        """
        if dead is None:
            self._hung_workers()
            dead = self._dead_workers()
        if dead:
            with started_on(self.ctx.service_cores):  # the new publisher's threads (TCPStore)
                self._replace_dead(dead)

    def _replace_dead(self, dead: list[tuple[int, str]]) -> None:
        """``_supervise``'s work once some actors are gone (see there)."""
        while dead:
            self._drop_pending_push()
            for i, reason in dead:
                self._replace_worker(i, reason)
            try:
                self._connect_pool()
                self._publish()
            except Exception:
                dead = self._dead_workers(timeout_s=5.0)  # another one died meanwhile?
                if not dead:
                    raise
                continue
            for i in sorted(self._starting):
                self.run_refs[i] = self.workers[i].run.remote(self.broker)
            self._starting.clear()
            self.cluster.save(self.ctx.run_dir)  # placement.json: the replacements' nodes and pids
            self._hung_workers()
            dead = self._dead_workers()

    def _dead_workers(self, timeout_s: float = 0.0) -> list[tuple[int, str]]:
        """Actors whose ``run`` ended (waiting up to ``timeout_s`` for a first one), with how."""
        active = [i for i in self._active() if i not in self._starting]
        refs = [self.run_refs[i] for i in active]
        if not refs:
            return []
        if timeout_s > 0:
            ray.wait(refs, num_returns=1, timeout=timeout_s)
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in done:
            i = active[refs.index(ref)]
            try:
                ray.get(ref)
                reason = "stopped unexpectedly"
            except Exception as e:  # the actor's end, as Ray reports it
                text = str(e).strip()
                reason = f"died ({type(e).__name__}: {text.splitlines()[0][:300] if text else ''})"
            with self._supervision_lock:
                out.append((i, self._killed.pop(i, reason)))
        return out

    def _hung_workers(self) -> list[tuple[int, str]]:
        """Probe each live actor's heartbeat (at most once a second); an actor that made no
        progress, or did not answer, for ``generator.heartbeat_timeout_s`` is killed (its run
        then ends; ``_dead_workers`` reports it with this reason) and returned. Replacements
        still loading are not probed: their calls queue behind the constructor."""
        with self._supervision_lock:
            return self._probe_heartbeats()

    def _probe_heartbeats(self) -> list[tuple[int, str]]:
        # ``_hung_workers``'s body, under its lock.
        timeout = self.ctx.cfg.generator.heartbeat_timeout_s
        now = time.monotonic()
        hung = []
        for i in self._active():
            if i in self._starting:
                continue
            probe = self._beats.get(i)
            if probe is None:
                self._beats[i] = (self.workers[i].heartbeat.remote(), now)
                continue
            ref, sent = probe
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    beat = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead actor: its run() reports it
                    beat = None
                if beat is not None and beat["since_progress_s"] > timeout:
                    hung.append((i, f"made no progress for {beat['since_progress_s']:.0f} s "
                                    f"(generator.heartbeat_timeout_s={timeout:g})"))
                elif now - sent >= 1.0:
                    self._beats[i] = (self.workers[i].heartbeat.remote(), now)
            elif now - sent > timeout:
                hung.append((i, f"did not answer for {now - sent:.0f} s (generator.heartbeat_timeout_s={timeout:g})"))
        for i, reason in hung:
            self._killed[i] = reason
            self._beats.pop(i, None)
            ray.kill(self.workers[i], no_restart=True)
            try:  # wait until it is gone, so that it cannot claim requests any more
                ray.wait([self.run_refs[i]], timeout=30)
            except Exception:  # noqa: BLE001
                pass
        return hung

    def _replace_worker(self, i: int, reason: str) -> None:
        """Actor ``i`` is gone: re-issue the groups it held, and start its replacement (it samples
        once ``_supervise`` has pushed it the weights), or retire the index past
        ``generator.max_restarts``.

        Raises:
            RuntimeError: no generator actor is left.
        """
        g_cfg = self.ctx.cfg.generator
        entry = self.cluster.placed["generators"][i]
        incarnation = self.restarts[i]  # the dead actor's: each restart makes the next one
        old = self.workers[i]
        # Give the receiver thread a moment to route what the actor streamed before it died, so
        # a group it finished completes rather than being abandoned (either way nothing is lost).
        time.sleep(0.2)
        held = ray.get(self.broker.reclaim.remote((i, incarnation)))
        reissued = 0
        with self._dispatch_lock:
            for request in sorted(held, key=lambda r: r.group_id):
                self._outstanding.pop(request.group_id, None)
                if self.buffer.abandon_group(request.group_id):
                    self._reissue.append(request)
                    reissued += 1
            self.num_reissued += reissued
        last = self._stats_by_worker.pop(i, {})
        for k, v in last.items():
            self._retired_stats[k] = self._retired_stats.get(k, 0.0) + v
        self._beats.pop(i, None)
        ray.kill(old, no_restart=True)
        where = f"on {entry.get('node_ip', '?')} (pid {entry.get('pid', '?')})"
        if self.restarts[i] >= g_cfg.max_restarts:
            self.workers[i] = None
            self._ends[i] = f"actor {i} {where} {reason}"
            self.ctx.log.print(f"generator actor {i} {where} {reason}; {reissued} groups re-issued; retired after "
                               f"{self.restarts[i]} restarts (generator.max_restarts={g_cfg.max_restarts})")
            if not self._active():
                raise RuntimeError("every generator actor is gone: " + "; ".join(self._ends[k] for k in sorted(self._ends)))
        else:
            self.restarts[i] += 1
            self.ctx.log.print(f"generator actor {i} {where} {reason}; {reissued} groups re-issued; restarting it "
                               f"({self.restarts[i]}/{g_cfg.max_restarts})")
            (self.workers[i],) = self._place_workers(self.ctx, *self._worker_args, indices=[i],
                                                     incarnation=incarnation + 1)
            self.cluster.check_reachable("generator", [self.cluster.record_replacement("generators", i, self.workers[i],
                                                                                       incarnation + 1)])
            self._starting.add(i)

    def _watch_pool(self) -> None:
        # Called while a push waits on the engines (on the learner's thread, or on a background
        # push's): a hung actor would hold it to the deadline.
        hung = self._hung_workers()
        if hung:
            raise RuntimeError(f"generator actor {hung[0][0]} {hung[0][1]}")

    def _on_published(self, version: int) -> None:
        # Every actor holds ``version`` (called from a background push's thread, or this one).
        self.published_version = version
        self._wake_dispatcher()

    def _publish(self, background: bool = False) -> dict[str, float]:
        """Push the learner's current weights to every actor. A pending push is collected first
        (its failure raises here). ``background``: return once the weights are staged
        (``WeightPublisher.start_push``), the version published later from the push's thread;
        else once every actor loaded them. ``timing/weight_sync_s``: seconds this thread was
        held, the wait for a pending push included."""
        t0 = time.perf_counter()
        self._push_metrics.update(self.publisher.wait())
        version = self.ctx.learner.version
        if background:
            # The push's thread copies into the slots and waits on the engines: off the learner's cores.
            metrics = self.publisher.start_push(version, watch=self._watch_pool, on_published=self._on_published,
                                                thread_cores=self.ctx.service_cores)
        else:
            metrics = self.publisher.push(version, watch=self._watch_pool)
            self._on_published(version)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t0
        return metrics

    def _supervised(self, push) -> dict[str, float]:
        """``push()``; when it fails because an actor died (found within a few seconds), the
        actor is replaced, which pushes the weights again (returns ``weight_sync/retried``).

        Raises:
            Exception: ``push``'s failure when no actor died (an engine's refusal, a timeout)."""
        try:
            return push()
        except Exception:
            dead = self._dead_workers(timeout_s=5.0)
            if not dead:
                raise
            self._supervise([(i, reason + " during a weight update") for i, reason in dead])
            return {"weight_sync/retried": 1.0}

    def _publish_supervised(self) -> dict[str, float]:
        """``_publish`` (in the background with ``weight_sync.overlap_push``), supervised: the
        previous background push's failure surfaces here too, handled alike."""
        return self._supervised(lambda: self._publish(background=self.overlap))

    def _settle_push(self, block: bool = True) -> None:
        """Collect a pending background push (only one that has ended, unless ``block``), its
        failure handled as ``_publish_supervised`` handles one (a dead actor is replaced and the
        weights pushed again; any other failure raises). Before what must see the pool's
        weights settled: a checkpoint, an evaluation, the exit probe, ``close``."""
        if self.publisher is None or self.publisher.pending_version is None:
            return
        if block or self.publisher.pending_done():
            self._push_metrics.update(self._supervised(self.publisher.wait))

    def _drop_pending_push(self) -> None:
        # Supervision rebuilds the publisher and pushes to every actor again: a pending push is
        # waited for first (it reads the publisher's transport), and its failure, most likely
        # the death being handled, is superseded by that push.
        if self.publisher is None:
            return
        version = self.publisher.pending_version
        try:
            self._push_metrics.update(self.publisher.wait())
        except Exception as e:  # noqa: BLE001 - superseded: supervision pushes the weights again
            logger.warning("weight push v%s failed (%s: %s); supervision pushes the weights again",
                           version, type(e).__name__, e)

    def _take_groups(self, step: int) -> tuple[list[list[Any]], dict[str, float]]:
        """B complete groups for this step; with dynamic sampling each round takes the missing
        number from the buffer and drops those without reward spread (``loops.common``)."""
        t0 = time.perf_counter()

        def take_round(missing: int) -> list[list[Any]]:
            while True:
                self._check_health()
                if not self._rewards_checked:
                    self._check_rewards(step)
                groups = self.buffer.get_groups(missing, self.ctx.learner.version, timeout_s=0.5)
                if groups is not None:
                    if not self._rewards_checked:
                        self._check_rewards(step)
                    return groups
                if time.perf_counter() - t0 > self.stall_timeout_s:
                    raise RuntimeError(f"step {step}: no complete group arrived for {self.stall_timeout_s:.0f} s")

        kept, metrics = dynamic_sampling(take_round, self.ctx.cfg.algorithm, self.groups_per_step, budget="groups")
        self.num_dynamic_dropped += int(metrics.get("rollout/dynamic_sampling_rejected_groups", 0))
        metrics["timing/wait_for_data_s"] = time.perf_counter() - t0
        return kept, metrics

    def _check_rewards(self, step: int) -> None:
        """The loop's first step: once the actors have scored a step's worth of samples, stop if
        the reward function failed on every call (``rewards.check_rewards_work``). Checked while
        waiting, since under ``reward.on_error=reject`` such a run never completes a group."""
        stats = self._worker_stats()
        window = {k: stats.get(k, 0.0) - self._last_stats.get(k, 0.0)
                  for k in ("reward/scored", "reward/errors", "reward/model_scored", "reward/model_errors")}
        if max(window["reward/scored"], window["reward/model_scored"]) < self.groups_per_step * self.n:
            return
        if (window["reward/errors"] >= window["reward/scored"]
                or window["reward/model_errors"] >= window["reward/model_scored"]):
            check_rewards_work(window, self._reward_first_error(), f"step {step}")
        self._rewards_checked = True

    def _reward_first_error(self) -> str | None:
        errors = [e for e in ray.get([self.workers[i].reward_first_error.remote() for i in self._active()])
                  if e is not None]
        return errors[0] if errors else None

    def _worker_stats(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The pool's counters summed: each live actor's (its last answer, if it does not answer
        within ``timeout_s``: supervision deals with it) plus those of the actors that died."""
        active = self._active()
        refs = [self.workers[i].get_stats.remote() for i in active]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for i, ref in zip(active, refs):
            try:
                self._stats_by_worker[i] = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - dead or slow: keep its last counters
                pass
        total = dict(self._retired_stats)
        for i in active:
            for k, v in self._stats_by_worker.get(i, {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def step(self, step: int) -> dict[str, float]:
        """Wait for B groups, train on them, publish the new weights (with
        ``weight_sync.overlap_push``: start publishing them); returns the step's metrics, with
        those of the background pushes collected during it (``weight_sync/publish_lag_s``, ...).

        Raises:
            ValueError: the reward function failed on every call of the loop's first step.
            RuntimeError: a generator actor died, or no data arrived for ``stall_timeout_s``.
            Exception: the previous step's background push failed in a way supervision does not
                repair (an engine's refusal, a timeout): its own error.
        """
        t0 = time.perf_counter()
        groups, metrics = self._take_groups(step)
        groups.sort(key=lambda g: g[0].group_id)
        trajs = [t for g in groups for t in sorted(g, key=lambda t: int(t.trajectory_id.rsplit("/", 1)[1]))]
        counters = self.buffer.counters
        ro = RolloutResult(trajs, counters["rejected_samples"] - self._last_rejected_samples, 0,
                           sum(len(t.response_ids) for t in trajs))
        self._last_rejected_samples = counters["rejected_samples"]
        metrics.update(learn_on(self.ctx, step, ro))
        self.num_trained_groups += len(groups)
        for t in trajs:
            self.trained_by_generator[t.generator_id] = self.trained_by_generator.get(t.generator_id, 0) + 1
        self._forget_finished()
        metrics.update(self._publish_supervised())
        metrics.update(self._push_metrics)  # background pushes collected since the last step
        self._push_metrics = {}
        self._wake_dispatcher()  # evictions and dynamic-sampling drops of this step
        now = time.perf_counter()
        stats = self._worker_stats()
        delta = {k: stats[k] - self._last_stats.get(k, 0.0) for k in stats}
        busy, idle = delta.get("busy_s", 0.0), delta.get("idle_s", 0.0)
        metrics.update({f"{k}": float(v) for k, v in self.buffer.metrics().items()})
        metrics.update(self._bound_metrics())
        metrics.update({
            # Pool-wide: per second of wall time since the previous step ended, and per second
            # the actors' engines spent sampling and scoring (summed over actors).
            "perf/gen_tokens_per_s": delta.get("generated_tokens", 0.0) / max(now - self._last_t, 1e-9),
            "perf/generator_busy_frac": busy / max(busy + idle, 1e-9),
            "rollout/rejected_samples": float(ro.num_rejected_samples),
            "pipeline/dispatched_groups": float(self.num_dispatched),
            "pipeline/reissued_groups": float(self.num_reissued),
            "pipeline/generator_restarts": float(sum(self.restarts)),
            "pipeline/in_flight_weight_updates": stats.get("in_flight_updates", 0.0),
            "timing/step_s": now - t0,
        })
        speed = engine_tokens_per_s(delta, stats)
        if speed is not None:
            metrics["perf/engine_tokens_per_s"] = speed
        # Training rollouts are scored in the actors: their counters, not the trainer's scorer.
        metrics.update({k: v for k, v in delta.items() if k.startswith(("tools/", "reward/"))})
        self._last_stats, self._last_t = stats, now
        return metrics

    def _bound_metrics(self) -> dict[str, float]:
        """``buffer/bound_{groups,samples,tokens}``: the most the buffer can hold (``buffer_bound``),
        beside its ``buffer/peak_*``; none with ``trainer.max_reuse > 1``."""
        return {f"buffer/bound_{k}": float(v) for k, v in (self.bound or {}).items()}

    def _forget_finished(self) -> None:
        # Groups that ended need no re-issue: drop them here and from the broker's claims.
        with self._dispatch_lock:
            ended = [g for g in self._outstanding if self.buffer.is_finished(g)]
            for g in ended:
                del self._outstanding[g]
        if ended:
            self.broker.forget.remote(ended)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the pipeline (taken between two learner steps):
        the replay buffer's contents and counters, the dispatch counters, the dataset position,
        and the requests of groups dispatched but not complete, all consistent with each other.
        A pending weight push is settled first (``_settle_push``; its failure raises)."""
        self._settle_push()
        with self._dispatch_lock:
            self._outstanding = {g: r for g, r in self._outstanding.items() if not self.buffer.is_finished(g)}
            return {
                "buffer": self.buffer.state_dict(),
                "dataset": self.ctx.train_ds.state_dict(),
                "num_dispatched": self.num_dispatched,
                "num_dynamic_dropped": self.num_dynamic_dropped,
                "num_trained_groups": self.num_trained_groups,
                "num_reissued": self.num_reissued,
                "trained_by_generator": dict(self.trained_by_generator),
                "last_rejected_samples": self._last_rejected_samples,
                # As plain dicts: a checkpoint stores data, never objects (async_rl.checkpoint_format).
                "outstanding": [dataclasses.asdict(r) for r in [*self._outstanding.values(), *self._reissue]],
            }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.ctx.train_ds.load_state_dict(state["dataset"])
        self.num_dispatched = int(state["num_dispatched"])
        self.num_dynamic_dropped = int(state["num_dynamic_dropped"])
        self.num_trained_groups = int(state["num_trained_groups"])
        self.num_reissued = int(state.get("num_reissued", 0))
        self.trained_by_generator = {int(k): int(v) for k, v in state.get("trained_by_generator", {}).items()}
        self._last_rejected_samples = int(state["last_rejected_samples"])
        for fields in state["outstanding"]:
            request = GroupRequest(**fields)
            # Its samples in this run's engines are gone; partial ones in the buffer are dropped
            # (counted as abandoned) and the prompt starts over as a new group.
            self.buffer.abandon_group(request.group_id)
            self._reissue.append(request)
            self.num_reissued += 1
        if self._reissue:
            logger.warning("resume: %d groups were in flight at the checkpoint; their prompts are dispatched again",
                           len(self._reissue))

    def sync_eval_engine(self) -> None:
        """Push the learner's weights into the colocated engine used for evaluation, once a
        pending push to the pool is settled (``_settle_push``; its failure raises)."""
        self._settle_push()
        self.ctx.publisher.push(self.ctx.learner.version)

    def _probe_engines(self, num_prompts: int = 4, max_tokens: int = 16) -> dict[str, float]:
        """``weight_sync.probe_at_exit``: every actor's engine and the trainer's own (holding the
        learner's weights) greedily decode the same prompts; the tokens and log-probs, with where
        each engine ran, go to ``engine_probe.json`` in the run directory. Returns the largest
        log-prob difference against the trainer's engine over the tokens both produced, and the
        number of actors whose tokens differ (``weight_sync/probe_*``)."""
        ds = self.ctx.val_ds if self.ctx.val_ds is not None and len(self.ctx.val_ds) else self.ctx.train_ds
        prompts = [list(p.prompt_ids) for p in ds.prompts[:num_prompts]]
        try:
            probes = ray.get([self.workers[i].probe.remote(prompts, max_tokens) for i in self._active()], timeout=300)
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("engine probe: %s", e)
            return {}
        self.sync_eval_engine()
        params = dataclasses.replace(self.ctx.eval_params, greedy=True, max_tokens=max_tokens)
        rows = self.ctx.generator.generate(prompts, 1, params, seeds=[0] * len(prompts))
        reference = {"policy_version": int(self.ctx.learner.version),
                     "response_ids": [r[0].response_ids for r in rows], "logprobs": [r[0].logprobs for r in rows]}
        diffs = [probe_difference(reference, p) for p in probes]
        (self.ctx.run_dir / "engine_probe.json").write_text(json.dumps(
            {"prompts": prompts, "max_tokens": max_tokens, "trainer_engine": reference, "actors": probes,
             "differences": diffs}, indent=1))
        return {"weight_sync/probe_max_abs_logprob_diff": max(d["max_abs_logprob_diff"] for d in diffs),
                "weight_sync/probe_token_mismatches": float(sum(not d["tokens_equal"] for d in diffs))}

    def ledger(self) -> dict[str, int]:
        """Where every dispatched group went; ``accounted == dispatched`` once the pool is stopped."""
        c = self.buffer.counters
        m = self.buffer.metrics()
        out = {
            "dispatched": self.num_dispatched,
            "trained": self.num_trained_groups,
            "rejected": c["rejected_groups"],
            "stale": c["stale_groups"],
            "abandoned": c["abandoned_groups"],
            "dynamic_sampling_dropped": self.num_dynamic_dropped,
            "ready_unused": int(m["buffer/num_groups_ready"]),
            "partial_at_exit": int(m["buffer/num_partial_groups"]),
            "queued_at_exit": int(ray.get(self.broker.qsize.remote())),
        }
        # Groups dispatched whose first sample never arrived are neither ready nor partial.
        seen = out["trained"] + out["rejected"] + out["stale"] + out["abandoned"] + out["dynamic_sampling_dropped"] \
            + out["ready_unused"] + out["partial_at_exit"] + out["queued_at_exit"]
        out["unstarted_or_in_engine_at_exit"] = out["dispatched"] - seen
        # Not part of the sum: each re-issue is a new dispatched group, its old one abandoned.
        out["reissued"] = self.num_reissued
        out["generator_restarts"] = sum(self.restarts)
        return out

    def close(self) -> dict[str, Any]:
        """Stop the dispatcher, the workers and the receiver; returns ``pipeline/*`` summary entries
        and the actors' reward call totals (``reward/*``, ``reward/first_error``).

        A pending weight push is settled first (``_settle_push``); if it failed beyond
        supervision's repair, everything is still stopped, then its failure raises."""
        if self._closed:
            return {}
        push_error = None
        try:
            self._settle_push()
        except Exception as e:  # noqa: BLE001 - raised once the pool is stopped
            push_error = e
        self._closed = True
        self._stop.set()
        self._wake_dispatcher()
        active = self._active()
        for i in active:
            self.workers[i].stop.remote()
        # Each one separately: one dead actor must not cut short the wait for the others.
        deadline = time.monotonic() + 60
        for i in active:
            try:
                ray.get(self.run_refs[i], timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # a dead worker was already reported by step()
                logger.warning("generator actor %d stop: %s", i, e)
        for th in self._threads:
            th.join(timeout=5)
        # Drain what the workers sent before stopping, so the ledger counts it.
        while msgs := self.receiver.recv_many(4096, timeout_s=0.2):
            for msg in msgs:
                self._route(msg)
        summary = {f"pipeline/{k}": v for k, v in self.ledger().items()}
        if self.ctx.cfg.weight_sync.probe_at_exit:
            summary.update(self._probe_engines())
        for i in range(len(self.workers)):
            summary[f"generator_{i}/trained_samples"] = self.trained_by_generator.get(i, 0)
            summary[f"generator_{i}/restarts"] = self.restarts[i]
        summary["pipeline/dropped_duplicate_samples"] = self.buffer.dropped["duplicate"]
        summary.update({k: v for k, v in self.buffer.metrics().items()
                        if k.startswith("buffer/peak_") or k == "buffer/dropped_late"})
        summary.update(self._bound_metrics())
        summary["pipeline/malformed_messages"] = self.receiver.num_malformed
        summary["pipeline/refused_messages"] = sum(self.rejected_messages.values())
        for reason, count in sorted(self.rejected_messages.items()):
            summary[f"pipeline/refused_messages_{reason}"] = count
        try:
            stats = self._worker_stats()
            summary.update({k: v for k, v in stats.items() if k.startswith("reward/")})
            # The pool's speed when it samples (not while admission holds it back): samples per
            # second of an actor's busy time is samples / (busy_s / actors).
            summary["perf/generated_samples"] = stats.get("samples", 0.0)
            summary["perf/generator_busy_s"] = stats.get("busy_s", 0.0)
            summary["reward/first_error"] = self._reward_first_error()
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("generator pool reward counts: %s", e)
        ray.get(self.broker.close.remote())
        self.receiver.close()
        try:
            ray.get([self.workers[i].close.remote() for i in active], timeout=60)
        except Exception as e:
            logger.warning("generator engine shutdown: %s", e)
        if self.publisher is not None:  # None: a supervised reconnection failed
            self.publisher.close()
        for i in active:
            ray.kill(self.workers[i])
        ray.kill(self.broker)
        if self.reward_actor is not None:
            ray.kill(self.reward_actor)
        if self._own_cluster:
            self.cluster.close()
        if push_error is not None:
            raise push_error
        return summary
