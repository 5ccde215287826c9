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
  so the two modes train on the same data.
* **Consumption**: the learner takes B complete groups (``ReplayBuffer.get_groups`` evicts any
  too stale and counts them), orders them by group id (so the batch does not depend on which
  worker finished first), and trains with proximal log-probs recomputed at its current version.
* **Publication**: after a training step the weights go to every worker through the weight sync
  layer (``async_rl.weight_sync``: shared-memory buckets on one host, or a gloo/NCCL broadcast
  group); each engine loads them between decoding steps (HF) or paused (vLLM), and the version
  counts as published, for admission, only once all workers hold it.
* **Exactly once**: every dispatched group ends trained, rejected (all samples rejected by the
  reward), dropped by dynamic sampling or evicted as stale, each counted; whatever is still in
  flight at shutdown is counted too (``pipeline/*`` in the summary, checked to add up).

Thread budget: the learner process and each worker get a share of the cores
(``generator.threads_per_worker``), because oversubscribed torch processes slow each other down
many-fold on a small machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

import ray
import torch
from ray.util.queue import Queue

from async_rl.buffers.replay import AdmissionController, ReplayBuffer
from async_rl.buffers.transport import GroupClosed, make_transport
from async_rl.cluster import Cluster, PlacementConfig
from async_rl.loops.base import RunContext
from async_rl.loops.common import dynamic_sampling, learn_on
from async_rl.loops.pool import GeneratorWorker
from async_rl.rewards import check_rewards_work
from async_rl.rewards.model import RewardModel, model_kwargs
from async_rl.rollout import GroupRequest, RolloutResult, group_seed, reward_model_path
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


def thread_budget(num_workers: int, threads_per_worker: int, cores: int | None = None) -> tuple[int, int]:
    """``(threads per worker, learner threads)`` for ``num_workers`` generator processes.

    With ``threads_per_worker = 0`` the cores are split evenly between the workers and the
    learner (each at least 1); the learner gets what the workers leave.
    """
    cores = cores or os.cpu_count() or 1
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
        per_worker, learner_threads = thread_budget(g_cfg.num_workers + with_rm, g_cfg.threads_per_worker)
        learner_threads = cfg.learner.num_threads or learner_threads
        torch.set_num_threads(learner_threads)
        self._own_cluster = ctx.cluster is None
        self.cluster = Cluster.start(cfg) if self._own_cluster else ctx.cluster
        # Generator actors on other nodes dial this address: the driver node's, not loopback.
        self.receiver, sender_factory = make_transport(
            "zmq", t_cfg.zmq_address or f"tcp://{self.cluster.bind_host}:*", t_cfg.zmq_hwm)
        self.buffer = ReplayBuffer(group_size=self.n, max_staleness=t_cfg.max_staleness, max_reuse=t_cfg.max_reuse)
        self.admission = AdmissionController(self.groups_per_step, t_cfg.max_staleness)
        self.requests = Queue()
        tok_path = ctx.tokenizer.name_or_path
        reward_fn = cfg.reward.fn
        if reward_fn and ".py:" in reward_fn and not os.path.isabs(reward_fn):
            # Actors need not share the driver's working directory.
            reward_fn = os.path.abspath(reward_fn)
        self.reward_actor = None
        if with_rm:
            self.reward_actor = ray.remote(num_cpus=0)(RewardModel).remote(
                reward_model_path(cfg.reward), **model_kwargs(cfg.reward), num_threads=cfg.reward.model_num_threads or per_worker)
        self.workers = self._place_workers(ctx, tok_path, reward_fn, sender_factory, per_worker)
        spots = self.cluster.record("generators", self.workers)
        self.cluster.check_reachable("generator", spots)
        if self.reward_actor is not None:
            self.cluster.record("reward_model", [self.reward_actor])
        # Per actor: shared memory on the trainer's node, a broadcast group to the others.
        self.transports = transports_for_targets(cfg.weight_sync, g_cfg.backend, "async",
                                                 [self.cluster.on_driver_node(e) for e in spots])
        self.publisher = WeightPublisher(cfg.weight_sync, self.transports, ctx.learner,
                                         [RayTarget(w) for w in self.workers],
                                         protocol=engine_protocol(g_cfg.backend), host=self.cluster.bind_host)
        self.transport = self.publisher.transport_name
        for entry, transport in zip(spots, self.transports):
            entry["weight_transport"] = transport  # saved in placement.json
        self.published_version = -1
        self._publish()  # the warm-started (or resumed) weights
        self.run_refs = [w.run.remote(self.requests) for w in self.workers]
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

    def _place_workers(self, ctx: RunContext, tok_path: str, reward_fn, sender_factory, per_worker: int) -> list:
        """Start the generator actors in the run's placement group (``generator.num_cpus_per_worker``,
        ``num_gpus_per_worker``, ``node_labels``, ``placement_strategy``)."""
        cfg, g_cfg = ctx.cfg, ctx.cfg.generator
        placement = PlacementConfig.of_generators(g_cfg)
        bundle = placement.bundle(cuda=False)
        strategies = self.cluster.place("generators", g_cfg.num_workers, placement)
        # max_concurrency: run() decodes on one thread while weights and stats arrive on others.
        worker_cls = ray.remote(max_concurrency=3)(GeneratorWorker)
        return [worker_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                   scheduling_strategy=strategies[i]).remote(
                    i, ctx.model_path, tok_path, g_cfg, ctx.params, reward_fn, cfg.reward.on_error, sender_factory,
                    per_worker, cfg.learner.lora, cfg.agent, reward_cfg=cfg.reward, reward_model=self.reward_actor)
                for i in range(g_cfg.num_workers)]

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
        while not self._stop.is_set():
            if not self.admission.can_start(self.num_dispatched, max(self.published_version, 0), self._num_discarded()):
                time.sleep(0.002)
                continue
            with self._dispatch_lock:
                gid = self.num_dispatched
                if self._reissue:
                    request = dataclasses.replace(self._reissue.popleft(), group_id=gid, seed=group_seed(seed, gid))
                else:
                    request = GroupRequest.of(self.ctx.train_ds.next_batch(1)[0], gid, self.n, group_seed(seed, gid))
                self._outstanding[gid] = request
                self.requests.put(request)
                self.num_dispatched += 1

    def _route(self, msg) -> None:
        if isinstance(msg, GroupClosed):
            self.buffer.close_group(msg.group_id, msg.num_kept)
        else:
            self.buffer.add(msg)

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            for msg in self.receiver.recv_many(512, timeout_s=0.05):
                self._route(msg)

    # ------------------------------------------------------------------ learner side
    def _check_health(self) -> None:
        if self._errors:
            raise RuntimeError(f"async pipeline thread failed: {self._errors[0]!r}") from self._errors[0]
        done, _ = ray.wait(self.run_refs, timeout=0)
        if done:
            try:
                ray.get(done[0])
            except Exception as e:
                raise RuntimeError(f"a generator actor died: {e}") from e
            raise RuntimeError("a generator actor stopped unexpectedly")

    def _publish(self) -> dict[str, float]:
        metrics = self.publisher.push(self.ctx.learner.version)
        self.published_version = self.ctx.learner.version
        return metrics

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
        errors = [e for e in ray.get([w.reward_first_error.remote() for w in self.workers]) if e is not None]
        return errors[0] if errors else None

    def _worker_stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for stats in ray.get([w.get_stats.remote() for w in self.workers]):
            for k, v in stats.items():
                total[k] = total.get(k, 0.0) + v
        return total

    def step(self, step: int) -> dict[str, float]:
        """Wait for B groups, train on them, publish the new weights; returns the step's metrics.

        Raises:
            ValueError: the reward function failed on every call of the loop's first step.
            RuntimeError: a generator actor died, or no data arrived for ``stall_timeout_s``.
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
        metrics.update(self._publish())
        now = time.perf_counter()
        stats = self._worker_stats()
        delta = {k: stats[k] - self._last_stats.get(k, 0.0) for k in stats}
        busy, idle = delta.get("busy_s", 0.0), delta.get("idle_s", 0.0)
        metrics.update({f"{k}": float(v) for k, v in self.buffer.metrics().items()})
        metrics.update({
            # Pool-wide: per second of wall time since the previous step ended, and per second
            # the actors' engines spent sampling and scoring (summed over actors).
            "perf/gen_tokens_per_s": delta.get("generated_tokens", 0.0) / max(now - self._last_t, 1e-9),
            "perf/engine_tokens_per_s": delta.get("generated_tokens", 0.0) / max(busy, 1e-9),
            "perf/generator_busy_frac": busy / max(busy + idle, 1e-9),
            "rollout/rejected_samples": float(ro.num_rejected_samples),
            "pipeline/dispatched_groups": float(self.num_dispatched),
            "pipeline/in_flight_weight_updates": stats.get("in_flight_updates", 0.0),
            "timing/step_s": now - t0,
        })
        # Training rollouts are scored in the actors: their counters, not the trainer's scorer.
        metrics.update({k: v for k, v in delta.items() if k.startswith(("tools/", "reward/"))})
        self._last_stats, self._last_t = stats, now
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the pipeline (taken between two learner steps):
        the replay buffer's contents and counters, the dispatch counters, the dataset position,
        and the requests of groups dispatched but not complete, all consistent with each other."""
        with self._dispatch_lock:
            self._outstanding = {g: r for g, r in self._outstanding.items() if not self.buffer.is_finished(g)}
            return {
                "buffer": self.buffer.state_dict(),
                "dataset": self.ctx.train_ds.state_dict(),
                "num_dispatched": self.num_dispatched,
                "num_dynamic_dropped": self.num_dynamic_dropped,
                "num_trained_groups": self.num_trained_groups,
                "trained_by_generator": dict(self.trained_by_generator),
                "last_rejected_samples": self._last_rejected_samples,
                "outstanding": list(self._outstanding.values()) + list(self._reissue),
            }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.ctx.train_ds.load_state_dict(state["dataset"])
        self.num_dispatched = int(state["num_dispatched"])
        self.num_dynamic_dropped = int(state["num_dynamic_dropped"])
        self.num_trained_groups = int(state["num_trained_groups"])
        self.trained_by_generator = {int(k): int(v) for k, v in state.get("trained_by_generator", {}).items()}
        self._last_rejected_samples = int(state["last_rejected_samples"])
        for request in state["outstanding"]:
            # Its samples in this run's engines are gone; partial ones in the buffer are dropped
            # (counted as abandoned) and the prompt starts over as a new group.
            self.buffer.abandon_group(request.group_id)
            self._reissue.append(request)
        if self._reissue:
            logger.warning("resume: %d groups were in flight at the checkpoint; their prompts are dispatched again",
                           len(self._reissue))

    def sync_eval_engine(self) -> None:
        """Push the learner's weights into the colocated engine used for evaluation."""
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
            probes = ray.get([w.probe.remote(prompts, max_tokens) for w in self.workers], timeout=300)
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
            "queued_at_exit": int(self.requests.qsize()),
        }
        # Groups dispatched whose first sample never arrived are neither ready nor partial.
        seen = out["trained"] + out["rejected"] + out["stale"] + out["abandoned"] + out["dynamic_sampling_dropped"] \
            + out["ready_unused"] + out["partial_at_exit"] + out["queued_at_exit"]
        out["unstarted_or_in_engine_at_exit"] = out["dispatched"] - seen
        return out

    def close(self) -> dict[str, Any]:
        """Stop the dispatcher, the workers and the receiver; returns ``pipeline/*`` summary entries
        and the actors' reward call totals (``reward/*``, ``reward/first_error``)."""
        if self._closed:
            return {}
        self._closed = True
        self._stop.set()
        for w in self.workers:
            w.stop.remote()
        try:
            ray.get(self.run_refs, timeout=60)
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("generator pool stop: %s", e)
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
        summary["pipeline/dropped_duplicate_samples"] = self.buffer.dropped["duplicate"]
        summary["pipeline/malformed_messages"] = self.receiver.num_malformed
        try:
            stats = self._worker_stats()
            summary.update({k: v for k, v in stats.items() if k.startswith("reward/")})
            summary["reward/first_error"] = self._reward_first_error()
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("generator pool reward counts: %s", e)
        self.requests.shutdown()
        self.receiver.close()
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=60)
        except Exception as e:
            logger.warning("generator engine shutdown: %s", e)
        self.publisher.close()
        for w in self.workers:
            ray.kill(w)
        if self.reward_actor is not None:
            ray.kill(self.reward_actor)
        if self._own_cluster:
            self.cluster.close()
        return summary
