"""Async mode: a generator pool streams trajectories while the learner trains.

::

    Dispatcher thread ──GroupRequest (admission control)──> RequestBroker ──> GeneratorWorker x N
    (loops.dispatch)                                                          │ Trajectory / GroupClosed
    learner (this thread) <──get_groups(B, v)── ReplayBuffer <──add── Intake (receiver thread) <──ZMQ PULL
           │                                                          (loops.intake)
           └── new weights, version v+1 ──GeneratorPool.publish (loops.pool)──> every worker

``AsyncLoop`` is the wiring of three components that do not know it, and keeps the step, its
state and the exactly-once ledger:

* **Dispatch** (``loops.dispatch.Dispatcher``): a group may start only while started groups
  (minus those that can never be trained: rejected, evicted, dropped by dynamic sampling)
  ≤ (max_staleness + v + 1) × B, with v the version every generator holds
  (``buffers.replay.AdmissionController``). With max_staleness 0 the pool samples exactly the
  groups sync mode would, from the same weights and per-group seeds, so the two modes train on
  the same data. The replay buffer thus never holds more than (max_staleness + 1) × B groups
  (``buffer_bound``; its peak is logged as ``buffer/peak_*``).
* **Intake** (``loops.intake.Intake``): the receiver thread routes each message into the replay
  buffer, refusing (and counting) the well-formed ones no generator of this run sends.
* **The generator pool** (``loops.pool.GeneratorPool``): placement, supervision and restarts of
  the actors, and every push of weights into them (with ``weight_sync.overlap_push``, in the
  background while the learner starts its next step). A dead or hung actor's claimed groups are
  abandoned (counted) and their prompts dispatched again, once, under new group ids.
* **Consumption** (here): the learner takes B complete groups (``ReplayBuffer.get_groups`` evicts
  the stale), orders them by group id (so the batch does not depend on which worker finished
  first), and trains (``trainer.policy_version_per=mini_batch``: B above is one mini-batch's
  groups, and a step takes, trains on and publishes ``learner.num_mini_batches`` versions).
* **Exactly once** (here): every dispatched group ends trained, rejected (all samples rejected by
  the reward), dropped by dynamic sampling, evicted as stale or abandoned, each counted; whatever
  is still in flight at shutdown is counted too (``pipeline/*`` in the summary, checked to add up).

Thread budget: the learner process and each worker get a share of the cores
(``generator.threads_per_worker``, ``loops.pool.thread_budget``), because oversubscribed torch
processes slow each other down many-fold on a small machine. ``generator.cpu_affinity`` /
``learner.cpu_affinity`` pin each role to cores of its own (``cluster.pin_process``; a pinned
role's threads default to its core count).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from async_rl.buffers.replay import AdmissionController, ReplayBuffer
from async_rl.buffers.trajectory import Trajectory
from async_rl.buffers.transport import make_transport
from async_rl.runtime.cluster import Cluster
from async_rl.utils.cpu_threads import user_num_threads
from async_rl.loops.actors import RequestBroker
from async_rl.loops.base import RunContext, versions_per_step
from async_rl.loops.common import SpreadRows, dynamic_sampling, learn_on, merge_version_metrics, mixed_sources
from async_rl.loops.dispatch import Dispatcher, buffer_bound, exactly_once_ledger
from async_rl.loops.evaluation import PoolEvaluation
from async_rl.loops.intake import Intake, warn_if_exposed
# probe_difference: kept importable from here, where it was defined before the pool had a module.
from async_rl.loops.pool import GeneratorPool, engine_tokens_per_s, placer, probe_difference, thread_budget  # noqa: F401
from async_rl.rewards.model import RewardModel, model_kwargs
from async_rl.rewards.teacher import TeacherModel
from async_rl.step.rollout import GroupRequest, RolloutResult, reward_model_path, teacher_routes

logger = logging.getLogger(__name__)


def check_spread_state(state: dict[str, Any], spread: int) -> None:
    """Refuse to resume ``AsyncLoop.state_dict``'s ``state`` with another ``trainer.group_spread``
    while it holds groups whose shares are still pending: their shares were dealt for the saved
    spread, and another would train some twice or never.

    Raises:
        ValueError: pending shares and a different ``spread`` (one line, naming both values).
    """
    pending = state.get("spread_pending", [])
    saved = int(state.get("group_spread", 1))
    if pending and saved != spread:
        groups = sum(len({t["group_id"] for t in e["trajectories"]}) for e in pending)
        raise ValueError(f"resume: the checkpoint holds {groups} groups dealt over trainer.group_spread={saved} "
                         f"versions, some shares not yet trained; resume with trainer.group_spread={saved}, not {spread}")


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
        self._late_evaluation: dict[str, float] | None = None
        cfg, t_cfg, g_cfg = ctx.cfg, ctx.cfg.trainer, ctx.cfg.generator
        self.n = t_cfg.samples_per_prompt
        self.groups_per_step = t_cfg.prompts_per_step
        # trainer.policy_version_per=mini_batch: a step publishes one version per mini-batch.
        self.versions_per_step = versions_per_step(t_cfg, cfg.learner)
        self.groups_per_version = self.groups_per_step // self.versions_per_step
        # trainer.group_spread: groups taken but not yet wholly trained, each with its samples'
        # shares (0 .. spread-1) and the number of its versions trained so far.
        self.spread = t_cfg.group_spread or 1  # None only in a config that skipped load_config
        self._spread_pending: list[dict[str, Any]] = []
        # A reward model's actor takes one worker's share of the cores (or reward.model_num_threads),
        # as does a distillation teacher's (or algorithm.distill.num_threads).
        with_rm = cfg.reward.model is not None
        with_teacher = cfg.algorithm.needs_teacher
        # Pinned roles (cpu_affinity) get as many threads as their cores, unless set explicitly.
        per_worker, learner_threads = thread_budget(g_cfg.num_workers + with_rm + with_teacher,
                                                    g_cfg.threads_per_worker or len(g_cfg.cpu_affinity),
                                                    user_threads=user_num_threads())
        learner_threads = cfg.learner.num_threads or len(cfg.learner.cpu_affinity) or learner_threads
        torch.set_num_threads(learner_threads)
        self._own_cluster = ctx.cluster is None
        self.cluster = Cluster.start(cfg) if self._own_cluster else ctx.cluster
        # Generator actors on other nodes dial this address: the driver node's, not loopback.
        self.receiver, sender_factory = make_transport(
            "zmq", t_cfg.zmq_address or f"tcp://{self.cluster.bind_host}:*", t_cfg.zmq_hwm)
        warn_if_exposed(t_cfg.zmq_address, self.receiver.address, self.cluster.bind_host)
        self.buffer = ReplayBuffer(group_size=self.n, max_staleness=t_cfg.max_staleness, max_reuse=t_cfg.max_reuse,
                                   serve_order=t_cfg.serve_order)
        self.bound = buffer_bound(cfg)
        # On the trainer's node: a generator node that goes down does not take the queue with it.
        self.broker = ray.remote(num_cpus=0, max_concurrency=2 * g_cfg.num_workers + 8)(RequestBroker).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        ).remote(g_cfg.num_workers)
        self.num_dynamic_dropped = 0
        self.num_trained_groups = 0
        self.trained_by_generator: dict[int, int] = {}  # trained samples per actor index
        self._last_rejected_samples = 0
        self._rewards_checked = False
        self.dispatch = Dispatcher(
            AdmissionController(self.groups_per_version, t_cfg.max_staleness),
            feed=self._feed,
            forget=lambda ids: self.broker.forget.remote(ids),
            next_prompt=lambda: ctx.train_ds.next_batch(1)[0], group_size=self.n, seed=t_cfg.seed,
            published_version=lambda: self.pool.published_version,
            num_discarded=lambda: sum(self.buffer.dropped_groups.values()) + self.num_dynamic_dropped)
        # Mid-run evaluations sampled by the pool in its idle time (loops.evaluation).
        self.evaluation = (PoolEvaluation(ctx.val_ds, ctx.eval_params, ctx.eval_at_k)
                           if ctx.val_ds is not None and t_cfg.eval_on_pool else None)
        self.intake = Intake(self.receiver, self.buffer, self.dispatch.knows, self.n,
                             learner_version=lambda: ctx.learner.version, on_messages=self.dispatch.wake,
                             eval_sink=self.evaluation)
        self.reward_actor = None
        if with_rm:
            self.reward_actor = ray.remote(num_cpus=0)(RewardModel).remote(
                reward_model_path(cfg.reward), **model_kwargs(cfg.reward), num_threads=cfg.reward.model_num_threads or per_worker)
        self.teacher_actor = None
        if with_teacher:
            d = cfg.algorithm.distill
            self.teacher_actor = ray.remote(num_cpus=0, num_gpus=d.num_gpus)(TeacherModel).remote(
                teacher_routes(d), ctx.tokenizer.name_or_path, temperature=g_cfg.temperature,
                batch_size=d.batch_size, num_threads=d.num_threads or per_worker,
                top_k=d.top_k if d.uses_topk else 0)
        reward_fn = cfg.reward.fn
        if reward_fn and ".py:" in reward_fn and not os.path.isabs(reward_fn):
            reward_fn = os.path.abspath(reward_fn)  # actors need not share the driver's working directory
        self.pool = GeneratorPool(
            ctx, self.cluster, self.broker,
            placer(ctx, self.cluster, (ctx.tokenizer.name_or_path, reward_fn, sender_factory, per_worker),
                   self.reward_actor, self.teacher_actor),
            lost=self._lost, on_published=self.dispatch.wake)
        self.pool.place_all()
        if self.reward_actor is not None:
            self.cluster.record("reward_model", [self.reward_actor])
        if self.teacher_actor is not None:
            self.cluster.record("teacher", [self.teacher_actor])
        self.pool.start()
        if resume_state is not None:
            self._load_state_dict(resume_state)
        # The receiver stops after the workers: a worker's sender flushes its queue on close.
        self._stop, self._stop_intake = threading.Event(), threading.Event()
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._guard(lambda: self.dispatch.run(self._stop)), name="dispatcher", daemon=True),
            threading.Thread(target=self._guard(lambda: self.intake.run(self._stop_intake)), name="receiver", daemon=True)]
        # The first window of the per-step worker counters opens before any request is
        # dispatched, so no generated token or tool call falls outside every step's window.
        self._last_stats = self.pool.stats()
        self._last_t = time.perf_counter()
        for th in self._threads:
            th.start()
        sender = self.pool.publisher.sender
        actors = "actor" if g_cfg.num_workers == 1 else "actors"
        ctx.log.print(f"async mode: {g_cfg.num_workers} {g_cfg.backend} generator {actors} x {per_worker} threads, "
                      f"learner {learner_threads} threads, max_staleness {t_cfg.max_staleness}, weights over "
                      f"{self.pool.transport}" + (f" (store {sender.host}:{sender.port})" if sender is not None else "")
                      + f", trajectories on {self.receiver.address}")

    def _lost(self, held: list[GroupRequest]) -> int:
        """A dead actor's claimed requests: re-issued (``Dispatcher.requeue``); an evaluation
        running on the pool is abandoned, since the actor may have held some of its groups."""
        if self.evaluation is not None and self.evaluation.abandon("a generator actor was lost"):
            ray.get(self.broker.drop_eval.remote())
        return self.dispatch.requeue(held, self.buffer.abandon_group)

    @property
    def publisher(self):
        """The pool's current ``WeightPublisher`` (rebuilt when supervision replaces an actor)."""
        return self.pool.publisher

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced by step(); a dead thread must not hang the learner
                logger.exception("async pipeline thread %s failed", threading.current_thread().name)
                self._errors.append(e)
        return run

    def _feed(self, batch: list[GroupRequest]) -> None:
        """Hand dispatched requests to the broker, announced to the buffer first (its dispatch
        serve order waits for each of them: ``trainer.serve_order``)."""
        self.buffer.note_dispatched([r.group_id for r in batch])
        ray.get(self.broker.put_many.remote(batch))

    def _check_health(self) -> None:
        if self._errors:
            raise RuntimeError(f"async pipeline thread failed: {self._errors[0]!r}") from self._errors[0]
        self.pool.settle(block=False)
        self.pool.supervise()

    # ------------------------------------------------------------------ the step
    def _take_groups(self, step: int) -> tuple[list[list[Any]], dict[str, float]]:
        """The complete groups of one policy version (B, or B / ``num_mini_batches`` with
        ``trainer.policy_version_per=mini_batch``); with dynamic sampling each round takes the
        missing number from the buffer and drops those without reward spread (``loops.common``)."""
        t0 = time.perf_counter()

        def take_round(missing: int) -> list[list[Any]]:
            while True:
                self._check_health()
                self._check_rewards(step)
                groups = self.buffer.get_groups(missing, self.ctx.learner.version, timeout_s=0.5)
                if groups is not None:
                    self._check_rewards(step)
                    return groups
                if time.perf_counter() - t0 > self.stall_timeout_s:
                    raise RuntimeError(f"step {step}: no complete group arrived for {self.stall_timeout_s:.0f} s")

        kept, metrics = dynamic_sampling(take_round, self.ctx.cfg.algorithm, self.groups_per_version, budget="groups")
        self.num_dynamic_dropped += int(metrics.get("rollout/dynamic_sampling_rejected_groups", 0))
        metrics["timing/wait_for_data_s"] = time.perf_counter() - t0
        return kept, metrics

    def _check_rewards(self, step: int) -> None:
        # The loop's first step only (``GeneratorPool.check_rewards``: while waiting, since under
        # ``reward.on_error=reject`` a run whose reward always fails never completes a group).
        if not self._rewards_checked:
            self._rewards_checked = self.pool.check_rewards(self._last_stats, self.groups_per_version * self.n,
                                                            f"step {step}")

    def step(self, step: int) -> dict[str, float]:
        """Wait for B groups, train on them, publish the new weights (with
        ``weight_sync.overlap_push``: start publishing them); with
        ``trainer.policy_version_per=mini_batch`` the same for each of ``num_mini_batches`` shares
        of B groups, one optimizer step and one published version each. Returns the step's
        metrics (merged over its versions, ``loops.common.merge_version_metrics``), with those of
        the background pushes collected during it (``weight_sync/publish_lag_s``, ...).

        Raises:
            ValueError: the reward function failed on every call of the loop's first step.
            RuntimeError: a generator actor died, or no data arrived for ``stall_timeout_s``.
            Exception: the previous step's background push failed in a way supervision does not
                repair (an engine's refusal, a timeout): its own error.
        """
        t0 = time.perf_counter()
        last = step == self.ctx.cfg.trainer.total_steps
        results = [self._train_one_version(step, flush=last and k == self.versions_per_step - 1)
                   for k in range(self.versions_per_step)]
        metrics = merge_version_metrics([m for m, _ in results], [ro for _, ro in results], mixed_sources(self.ctx))
        metrics.update(self.pool.take_push_metrics())  # background pushes collected since the last step
        now = time.perf_counter()
        stats = self.pool.stats()
        delta = {k: stats[k] - self._last_stats.get(k, 0.0) for k in stats}
        busy, idle = delta.get("busy_s", 0.0), delta.get("idle_s", 0.0)
        metrics.update({f"{k}": float(v) for k, v in self.buffer.metrics().items()})
        metrics.update(self._bound_metrics())
        metrics.update({
            # Pool-wide: per second of wall time since the previous step ended, and per second
            # the actors' engines spent sampling and scoring (summed over actors).
            "perf/gen_tokens_per_s": delta.get("generated_tokens", 0.0) / max(now - self._last_t, 1e-9),
            "perf/generator_busy_frac": busy / max(busy + idle, 1e-9),
            "rollout/rejected_samples": float(sum(ro.num_rejected_samples for _, ro in results)),
            "pipeline/dispatched_groups": float(self.dispatch.num_dispatched),
            "pipeline/reissued_groups": float(self.dispatch.num_reissued),
            "pipeline/generator_restarts": float(sum(self.pool.restarts)),
            "pipeline/in_flight_weight_updates": stats.get("in_flight_updates", 0.0),
            "timing/step_s": now - t0,
        })
        speed = engine_tokens_per_s(delta, stats)
        if speed is not None:
            metrics["perf/engine_tokens_per_s"] = speed
        # Training rollouts are scored in the actors: their counters, not the trainer's scorer.
        metrics.update({k: v for k, v in delta.items() if k.startswith(("tools/", "reward/", "env/", "distill/"))})
        self._last_stats, self._last_t = stats, now
        if self.evaluation is not None and (done := self.evaluation.poll()) is not None:
            metrics.update(done)  # an evaluation started at an earlier step ended during this one
        return metrics

    def _train_one_version(self, step: int, flush: bool = False) -> tuple[dict[str, float], RolloutResult]:
        """Take one version's groups, train on them, publish the new weights; returns the
        version's metrics and what it trained on. ``flush`` (the run's last version): with
        ``trainer.group_spread`` > 1 it also trains every share still pending, so a run that
        ends normally leaves no group partly trained."""
        groups, metrics = self._take_groups(step)
        groups.sort(key=lambda g: g[0].group_id)
        trajs = [t for g in groups for t in sorted(g, key=lambda t: int(t.trajectory_id.rsplit("/", 1)[1]))]
        counters = self.buffer.counters
        ro = RolloutResult(trajs, counters["rejected_samples"] - self._last_rejected_samples, 0,
                           sum(len(t.response_ids) for t in trajs))
        self._last_rejected_samples = counters["rejected_samples"]
        trained, finished = trajs, len(groups)
        if self.spread > 1:
            spread = self._spread_rows(trajs, flush)
            metrics.update(learn_on(self.ctx, step, ro, num_mini_batches=1, spread=spread))
            trained = [spread.trajectories[i] for i in spread.rows]
            finished = self._advance_spread()
        # One version per mini-batch: the share of groups taken is the mini-batch (the argument
        # only then, so a wrapper of learn_on written for its three arguments keeps working).
        elif self.versions_per_step > 1:
            metrics.update(learn_on(self.ctx, step, ro, num_mini_batches=1))
        else:
            metrics.update(learn_on(self.ctx, step, ro))
        self.num_trained_groups += finished
        for t in trained:
            self.trained_by_generator[t.generator_id] = self.trained_by_generator.get(t.generator_id, 0) + 1
        self.dispatch.forget_finished(self.buffer.is_finished)
        metrics.update(self.pool.publish())
        self.dispatch.wake()  # evictions and dynamic-sampling drops of this version
        return metrics, ro

    def _spread_rows(self, trajs: list[Any], flush: bool = False) -> SpreadRows:
        """``trainer.group_spread``: deal the samples of the groups just taken (``trajs``, whole
        groups in batch order) into ``spread`` shares, and return this version's rows: share
        ``age`` of every pending entry (with ``flush``, every share from ``age`` on). Each group's samples go round-robin in a random order
        (seeded by the run's seed and the policy version, so a resumed run deals alike), the
        count carried on from group to group: every share holds ``n / spread`` samples of each
        group of ``n`` (within one), and the shares differ in size by one at most."""
        rng = torch.Generator().manual_seed(1_000_003 * self.ctx.cfg.trainer.seed + self.ctx.learner.version)
        rows_of: dict[int, list[int]] = {}
        for i, t in enumerate(trajs):
            rows_of.setdefault(t.group_id, []).append(i)
        parts, dealt = [0] * len(trajs), 0
        for rows in rows_of.values():
            for rank in torch.randperm(len(rows), generator=rng).tolist():
                parts[rows[rank]] = dealt % self.spread
                dealt += 1
        self._spread_pending.append({"trajectories": trajs, "parts": parts, "age": 0})
        everything: list[Any] = []
        rows: list[int] = []
        for entry in self._spread_pending:
            rows += [len(everything) + i for i, part in enumerate(entry["parts"])
                     if part == entry["age"] or (flush and part > entry["age"])]
            if flush:
                entry["age"] = self.spread - 1  # retired by _advance_spread below
            everything += entry["trajectories"]
        return SpreadRows(everything, rows, self.spread - 1)

    def _advance_spread(self) -> int:
        """After a version trained its shares: age every pending entry, retire those whose last
        share is trained; returns the number of groups retired (wholly trained now)."""
        for entry in self._spread_pending:
            entry["age"] += 1
        done = [e for e in self._spread_pending if e["age"] == self.spread]
        self._spread_pending = [e for e in self._spread_pending if e["age"] < self.spread]
        return sum(len({t.group_id for t in e["trajectories"]}) for e in done)

    def _spread_pending_groups(self) -> int:
        """Groups taken and partly trained, their other shares still pending (``group_spread``)."""
        return sum(len({t.group_id for t in e["trajectories"]}) for e in self._spread_pending)

    def _bound_metrics(self) -> dict[str, float]:
        """``buffer/bound_{groups,samples,tokens}``: the most the buffer can hold (``buffer_bound``),
        beside its ``buffer/peak_*``; none with ``trainer.max_reuse > 1``."""
        return {f"buffer/bound_{k}": float(v) for k, v in (self.bound or {}).items()}

    # ------------------------------------------------------------------ state and ledger
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the pipeline (taken between two learner steps):
        the replay buffer's contents and counters, the dispatch counters, the dataset position,
        and the requests of groups dispatched but not complete, all consistent with each other.
        A pending weight push is settled first (``GeneratorPool.settle``; its failure raises)."""
        self.pool.settle()
        with self.dispatch.lock:
            return {
                "buffer": self.buffer.state_dict(),
                "dataset": self.ctx.train_ds.state_dict(),
                "num_dispatched": self.dispatch.num_dispatched,
                "num_dynamic_dropped": self.num_dynamic_dropped,
                "num_trained_groups": self.num_trained_groups,
                "num_reissued": self.dispatch.num_reissued,
                "trained_by_generator": dict(self.trained_by_generator),
                "last_rejected_samples": self._last_rejected_samples,
                "group_spread": self.spread,
                "spread_pending": [{"trajectories": [t.as_dict() for t in e["trajectories"]], "parts": list(e["parts"]),
                                    "age": e["age"]} for e in self._spread_pending],
                # As plain dicts: a checkpoint stores data, never objects (async_rl.utils.checkpoint_format).
                # A request's images are its prompt's, found again by uid when it is restored.
                "outstanding": [dataclasses.asdict(dataclasses.replace(r, images=None))
                                for r in self.dispatch.pending(self.buffer.is_finished)],
            }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        check_spread_state(state, self.spread)
        self.buffer.load_state_dict(state["buffer"])
        self.ctx.train_ds.load_state_dict(state["dataset"])
        self.num_dynamic_dropped = int(state["num_dynamic_dropped"])
        self.num_trained_groups = int(state["num_trained_groups"])
        self.trained_by_generator = {int(k): int(v) for k, v in state.get("trained_by_generator", {}).items()}
        self._last_rejected_samples = int(state["last_rejected_samples"])
        self._spread_pending = [{"trajectories": [Trajectory(**d) for d in e["trajectories"]], "parts": list(e["parts"]),
                                 "age": int(e["age"])} for e in state.get("spread_pending", [])]
        # Their samples in this run's engines are gone; partial ones in the buffer are dropped
        # (counted as abandoned) and the prompts start over as new groups.
        count = self.dispatch.restore(int(state["num_dispatched"]), int(state.get("num_reissued", 0)),
                                      [GroupRequest(**{**fields, "images": self.ctx.prompt_images(fields["prompt_uid"])})
                                       for fields in state["outstanding"]],
                                      self.buffer.abandon_group)
        if count:
            logger.warning("resume: %d groups were in flight at the checkpoint; their prompts are dispatched again",
                           count)

    def ledger(self) -> dict[str, int]:
        """Where every dispatched group went (``loops.dispatch.exactly_once_ledger``);
        ``accounted == dispatched`` once the pool is stopped."""
        return exactly_once_ledger(self.dispatch, self.buffer, self.num_trained_groups, self.num_dynamic_dropped,
                                   int(ray.get(self.broker.qsize.remote())), sum(self.pool.restarts),
                                   spread_pending=self._spread_pending_groups())

    # ------------------------------------------------------------------ evaluation and exit
    def start_evaluation(self, step: int) -> bool:
        """Start an evaluation on the pool after ``step`` (``trainer.eval_on_pool``); its metrics
        come with the step during which its last group arrives. Returns ``False`` when evaluation
        is not on the pool (the caller evaluates on the colocated engine); ``True`` also when the
        previous one still runs (this one is skipped and counted)."""
        if self.evaluation is None:
            return False
        requests = self.evaluation.start(step)
        if requests:
            ray.get(self.broker.put_eval.remote(requests))
        return True

    def sync_eval_engine(self) -> None:
        """Push the learner's weights into the colocated engine used for evaluation, once a
        pending push to the pool is settled (``GeneratorPool.settle``; its failure raises)."""
        self.pool.settle()
        self.ctx.publisher.push(self.ctx.learner.version)

    def _summary(self) -> dict[str, Any]:
        """The ``pipeline/*``, ``generator_<i>/*``, ``buffer/peak_*`` and actors' ``reward/*``
        entries of the run's summary, once the pool has stopped and the receiver is drained."""
        summary = {f"pipeline/{k}": v for k, v in self.ledger().items()}
        if self.evaluation is not None:
            summary.update(self.evaluation.counts)
        if self.ctx.cfg.weight_sync.probe_at_exit:
            summary.update(self.pool.probe_engines(self.sync_eval_engine))
        for i in range(len(self.pool.workers)):
            summary[f"generator_{i}/trained_samples"] = self.trained_by_generator.get(i, 0)
            summary[f"generator_{i}/restarts"] = self.pool.restarts[i]
        summary["pipeline/dropped_duplicate_samples"] = self.buffer.dropped["duplicate"]
        summary.update({k: v for k, v in self.buffer.metrics().items()
                        if k.startswith("buffer/peak_") or k == "buffer/dropped_late"})
        summary.update(self._bound_metrics())
        summary.update(self.intake.summary())
        try:
            stats = self.pool.stats()
            summary.update({k: v for k, v in stats.items() if k.startswith(("reward/", "distill/"))})
            # The pool's speed when it samples (not while admission holds it back): samples per
            # second of an actor's busy time is samples / (busy_s / actors).
            summary["perf/generated_samples"] = stats.get("samples", 0.0)
            summary["perf/generator_busy_s"] = stats.get("busy_s", 0.0)
            summary["reward/first_error"] = self.pool.reward_first_error()
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("generator pool reward counts: %s", e)
        return summary

    def evaluation_after_last_step(self) -> dict[str, float] | None:
        """The evaluation on the pool whose last group arrived only as ``close`` drained the
        intake (its metrics, tagged ``eval/started_step``), or ``None``."""
        return self._late_evaluation

    def close(self) -> dict[str, Any]:
        """Stop the dispatcher, the workers and the receiver; returns ``pipeline/*`` summary entries
        and the actors' reward call totals (``reward/*``, ``reward/first_error``).

        A pending weight push is settled first (``GeneratorPool.settle``); if it failed beyond
        supervision's repair, everything is still stopped, then its failure raises."""
        if self._closed:
            return {}
        push_error = None
        try:
            self.pool.settle()
        except Exception as e:  # noqa: BLE001 - raised once the pool is stopped
            push_error = e
        self._closed = True
        self._stop.set()
        self.dispatch.wake()
        self.pool.stop()
        self._stop_intake.set()
        for th in self._threads:
            th.join(timeout=5)
        self.intake.drain()  # what the workers sent before stopping, so the ledger counts it
        if self.evaluation is not None:
            if (done := self.evaluation.poll()) is None:
                self.evaluation.abandon("the run ended before its last group arrived")
            else:  # its last group arrived after the last step: still a measurement, logged
                self._late_evaluation = done
        summary = self._summary()
        ray.get(self.broker.close.remote())
        self.receiver.close()
        self.pool.close()
        ray.kill(self.broker)
        for actor in (self.reward_actor, self.teacher_actor):
            if actor is not None:
                ray.kill(actor)
        if self._own_cluster:
            self.cluster.close()
        if push_error is not None:
            raise push_error
        return summary
