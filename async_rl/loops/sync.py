"""Sync (colocated, "hybrid engine") mode: one process generates, trains and updates in turn.

One training step::

    dataset ──prompts──> generator (policy version v) ──samples──> reward scorer
                                                                       │ trajectories
    generator <──weights v+1── learner.train_step <──batch── advantages (per group)

1. take ``trainer.prompts_per_step`` prompts; sample ``trainer.samples_per_prompt`` responses
   each (one group per prompt) with the behavior log-probs of the sampled tokens
   (``async_rl.step.rollout``); with dynamic sampling, more rounds until enough groups have spread;
2. score each response; failures become reward 0 or a counted rejection (``reward.on_error``),
   and a reward function that failed on every call of the loop's first step stops the run;
3. compute advantages within each group; collate; the learner recomputes proximal log-probs and
   trains (``async_rl.loops.common.learn_on``): policy version v -> v + 1;
4. push the new weights into the generator in place through the weight publisher.

With ``generator.cpu_affinity`` the process moves onto the generator's cores for step 1 (and its
torch threads to their count) and back to the learner's for steps 3-4, so a sync run can give
each role the same cores as an async one and pay G + T where async pays max(G, T).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from async_rl.algorithms.dapo import rewards_have_spread
from async_rl.runtime.cluster import pin_process
from async_rl.utils.cpu_threads import SharedCoreGovernor, user_num_threads
from async_rl.generators.capabilities import engine_capabilities
from async_rl.loops.base import RunContext
from async_rl.loops.common import dynamic_sampling, learn_on
from async_rl.rewards import check_rewards_work
from async_rl.step.rollout import RolloutResult, rollout

MAX_OVERSAMPLING = 16
"""Dynamic sampling asks for at most this many times the missing groups in one round."""


def collect_step_rollouts(cfg, train_ds, generator, scorer, tokenizer, params, first_group: int, agent=None,
                          ) -> tuple[RolloutResult, dict[str, float], int]:
    """One step's trajectories: a single rollout round, or DAPO dynamic sampling.

    With ``algorithm.dynamic_sampling`` each round takes the missing number of groups divided by
    the acceptance rate so far (at most ``MAX_OVERSAMPLING`` times as many); see
    ``loops.common.dynamic_sampling`` for which groups are kept.

    Returns:
        ``(rollout, metrics, groups_used)``: the kept trajectories with rejection counts summed
        over rounds, ``rollout/dynamic_sampling_*`` metrics, and how many group ids were used.

    Raises:
        ValueError: fewer groups with spread than needed after the last round (counts in the message).
    """
    t_cfg, algo = cfg.trainer, cfg.algorithm
    totals = {"samples": 0, "groups": 0, "tokens": 0, "used": 0, "accepted": 0}

    def take_round(missing: int) -> list[list]:
        # Oversample by the acceptance rate seen so far in this step (at most 16x): asking for the
        # missing count, or a small multiple of it, converges geometrically slowly once most
        # prompts are solved (a run at 10% acceptance failed that way). Surplus groups are trained
        # on too, so no accepted sample is lost.
        count = missing
        if algo.dynamic_sampling:
            rate = totals["accepted"] / totals["used"] if totals["used"] else 1.0
            count = min(MAX_OVERSAMPLING * missing, math.ceil(missing / max(rate, 1 / MAX_OVERSAMPLING)))
        prompts = train_ds.next_batch(count)
        ro = rollout(generator, prompts, t_cfg.samples_per_prompt, params, scorer, tokenizer,
                     first_group + totals["used"], t_cfg.seed, agent)
        totals["used"] += len(prompts)
        totals["samples"] += ro.num_rejected_samples
        totals["groups"] += ro.num_rejected_groups
        totals["tokens"] += ro.num_generated_tokens
        by_group: dict[int, list] = {}
        for t in ro.trajectories:
            by_group.setdefault(t.group_id, []).append(t)
        totals["accepted"] += sum(rewards_have_spread([t.reward for t in g]) for g in by_group.values())
        return list(by_group.values())

    groups, metrics = dynamic_sampling(take_round, algo, t_cfg.prompts_per_step)
    trajectories = [t for group in groups for t in group]
    return RolloutResult(trajectories, totals["samples"], totals["groups"], totals["tokens"]), metrics, totals["used"]


def shared_core_governor(cfg) -> SharedCoreGovernor | None:
    """The ``SharedCoreGovernor`` of a sync run whose one process does all the work on all the
    cores it may use (HF engine, one learner rank) with torch's default thread count; ``None``
    where the user or the placement chose the threads (``learner.num_threads``,
    ``OMP_NUM_THREADS``, a ``cpu_affinity``) or other processes of the run share the cores (vLLM
    or SGLang engine processes, follower learner ranks), whose CPU time the governor would count
    as another job's."""
    chosen = cfg.learner.num_threads or user_num_threads() or cfg.learner.cpu_affinity or cfg.generator.cpu_affinity
    separate = engine_capabilities(cfg.generator.backend).separate_processes
    if chosen or separate or cfg.learner.world_size > 1 or torch.get_num_threads() < 2:
        return None
    return SharedCoreGovernor(torch.get_num_threads())


class SyncLoop:
    """Sync (hybrid engine) mode: each step generates with the colocated engine, trains, and
    copies the new weights into the engine in place (a ``Loop``).

    Args:
        ctx: the run's shared parts.
        resume_state: ``state_dict()`` of a checkpoint, or ``None``.
    """

    def __init__(self, ctx: RunContext, resume_state: dict[str, Any] | None = None) -> None:
        self.ctx = ctx
        # Where the process trains (learner.cpu_affinity, pinned by the trainer, or all it may
        # use) and with how many torch threads: it returns there after each generation phase.
        self._home = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
                      torch.get_num_threads())
        self.governor = shared_core_governor(ctx.cfg)
        self.next_group = 0
        self._rewards_checked = False
        self._last_t = time.perf_counter()
        if resume_state is not None:
            self.next_group = int(resume_state["next_group"])
            ctx.train_ds.load_state_dict(resume_state["dataset"])

    def step(self, step: int) -> dict[str, float]:
        """One training step; returns its metrics.

        Raises:
            ValueError: the reward function failed on every call of this loop's first step
                (``rewards.check_rewards_work``).
        """
        c = self.ctx
        gen_cores = c.cfg.generator.cpu_affinity
        t0 = time.perf_counter()
        threads = self.governor.update() if self.governor is not None else None
        try:
            if gen_cores:  # the generation phase on the generator's cores, as in async mode
                pin_process(gen_cores, "generator.cpu_affinity")
                torch.set_num_threads(len(gen_cores))
            ro, metrics, groups_used = collect_step_rollouts(c.cfg, c.train_ds, c.generator, c.scorer, c.tokenizer,
                                                             c.params, self.next_group, c.agent)
        except ValueError:
            # Dynamic sampling finds no reward spread when every reward failed: name the cause.
            if not self._rewards_checked:
                check_rewards_work(c.scorer.pop_metrics(), c.scorer.first_error, f"step {step}")
            raise
        finally:
            if gen_cores:
                pin_process(self._home[0], "learner.cpu_affinity")
                torch.set_num_threads(self._home[1])
        self.next_group += groups_used
        rewards = c.scorer.pop_metrics()
        if not self._rewards_checked:
            check_rewards_work(rewards, c.scorer.first_error, f"step {step}")
            self._rewards_checked = True
        metrics.update(rewards)
        if c.agent is not None:
            metrics.update(c.agent.pop_metrics())
        t_generate = time.perf_counter() - t0
        metrics.update({"perf/engine_tokens_per_s": ro.num_generated_tokens / max(t_generate, 1e-9),
                        "timing/generate_s": t_generate})
        metrics.update(learn_on(c, step, ro))
        metrics.update(c.publisher.push(c.learner.version))
        now = time.perf_counter()
        metrics["timing/step_s"] = now - t0
        if threads is not None:
            metrics["perf/torch_threads"] = float(threads)
            metrics["perf/others_busy_cores"] = self.governor.others_cores
        # Per second of wall time since the previous step ended (evaluation and checkpoints
        # included), as in async mode, so the two modes' figures compare.
        metrics["perf/gen_tokens_per_s"] = ro.num_generated_tokens / max(now - self._last_t, 1e-9)
        self._last_t = now
        return metrics

    def start_evaluation(self, step: int) -> bool:
        """Sync mode evaluates on its engine between steps (nothing trains meanwhile)."""
        return False

    def sync_eval_engine(self) -> None:
        """The colocated engine already holds the latest weights."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this loop: the next group id and the dataset position."""
        return {"next_group": self.next_group, "dataset": self.ctx.train_ds.state_dict()}

    def close(self) -> dict[str, Any]:
        """Nothing to stop (the engine belongs to the trainer); returns the training reward
        calls' totals (``reward/*``, ``reward/first_error``)."""
        return {**self.ctx.scorer.counts(), "reward/first_error": self.ctx.scorer.first_error}

    def evaluation_after_last_step(self) -> None:
        """Sync mode evaluates between steps on the colocated engine: nothing runs on."""
        return None
