"""What both loops share: DAPO dynamic sampling over complete groups, the learner step with
the step's rollout, staleness and loss metrics, and the merge of a step's metrics over the
policy versions it published."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from async_rl.algorithms.dapo import fill_groups_with_spread
from async_rl.algorithms.distill import reverse_kl_metrics
from async_rl.step.batch import make_batch
from async_rl.buffers.replay import staleness as staleness_of
from async_rl.buffers.trajectory import Trajectory
from async_rl.utils.cpu_threads import thread_times
from async_rl.step.evaluation import accuracy_of
from async_rl.loops.base import RunContext
from async_rl.runtime.metrics import metric_reduction
from async_rl.step.rollout import RolloutResult


def dynamic_sampling(take_round: Callable[[int], Sequence[list[Trajectory]]], algo, target_groups: int,
                     budget: str = "rounds") -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Complete groups for one step, with DAPO dynamic sampling when ``algo.dynamic_sampling``.

    Each round asks ``take_round`` for the number of groups still missing (sync mode generates
    them, oversampling by the acceptance rate; async mode takes them from the replay buffer); a
    group whose rewards are all equal is dropped and counted (it carries no group-relative
    signal). The budget (DAPO, arXiv 2503.14476, Sec. 3.2, bounds it by generation rounds) is
    ``budget="rounds"``: at most ``algo.max_generation_rounds`` rounds (sync mode, whose rounds
    oversample); ``"groups"``: at most ``algo.max_generation_rounds * target_groups`` groups
    examined (async mode, whose rounds take exactly the missing groups as they complete).
    Accepted groups beyond the target are returned too (trained on, never dropped). Without
    dynamic sampling one round is taken and every group kept.

    Returns:
        ``(groups, metrics)``: accepted groups (target first, then surplus) and
        ``rollout/dynamic_sampling_{rounds,surplus_groups,rejected_groups}`` (dynamic sampling only).

    Raises:
        ValueError: fewer groups with spread than ``target_groups`` after the last round.
    """
    if not algo.dynamic_sampling:
        return list(take_round(target_groups)), {}
    try:
        limit = {"max_rounds": algo.max_generation_rounds} if budget == "rounds" else \
            {"max_groups": algo.max_generation_rounds * target_groups}
        result = fill_groups_with_spread(take_round, target_groups=target_groups, **limit,
                                         rewards_of=lambda group: [t.reward for t in group])
    except ValueError as e:
        raise ValueError(f"{e} (algorithm.max_generation_rounds={algo.max_generation_rounds}, "
                         f"trainer.prompts_per_step={target_groups})") from None
    metrics = {"rollout/dynamic_sampling_rounds": float(result.num_rounds),
               "rollout/dynamic_sampling_surplus_groups": float(len(result.surplus)),
               "rollout/dynamic_sampling_rejected_groups": float(result.num_rejected)}
    return result.groups + result.surplus, metrics


@dataclass
class SpreadRows:
    """The rows one policy version trains on under ``trainer.group_spread`` > 1: each group's
    samples are dealt over that many consecutive versions, so a version's mini-batch holds a
    share of the groups of several versions (``loops.async_loop``).

    Attributes:
        trajectories: every sample of the groups that have a share in this version, whole groups
            (advantages compare a sample with its whole group, trained or not).
        rows: indices into ``trajectories`` of the samples trained now.
        extra_staleness: versions a share may wait after its group was taken (``group_spread - 1``);
            the staleness check allows ``trainer.max_staleness`` plus this.
    """

    trajectories: list[Trajectory]
    rows: list[int]
    extra_staleness: int


def learn_on(ctx: RunContext, step: int, ro: RolloutResult, num_mini_batches: int | None = None,
             spread: SpreadRows | None = None) -> dict[str, float]:
    """Train on one step's trajectories (both modes): check staleness, build the batch with
    advantages, take the learner's step (``num_mini_batches`` optimizer steps; ``None``: the
    learner's own number); returns rollout, loss and staleness metrics (and, with a teacher,
    ``distill/reverse_kl`` and per source ``distill/<source>/reverse_kl``).

    With ``spread`` (``trainer.group_spread`` > 1) the batch is ``spread.rows`` of
    ``spread.trajectories``: advantages are computed over the whole groups, then the rows are
    selected and the learner's ``prepare`` runs on them alone (proximal log-probs of the current
    version); ``ro`` is the version's newly taken groups, which the rollout metrics describe, and
    the staleness metrics describe the trained rows.

    Raises:
        RuntimeError: no trajectory to train on, or a sample older than ``trainer.max_staleness``
            (plus ``spread.extra_staleness``; the buffer and admission control should make that
            impossible).
    """
    cfg, learner = ctx.cfg, ctx.learner
    trajs = ro.trajectories
    if not trajs:
        raise RuntimeError(f"step {step}: every sample was rejected by the reward function (see the warnings above)")
    trained = trajs if spread is None else [spread.trajectories[i] for i in spread.rows]
    bound = cfg.trainer.max_staleness + (0 if spread is None else spread.extra_staleness)
    staleness = [staleness_of(t, learner.version) for t in trained]
    if max(staleness) > bound:
        raise RuntimeError(f"step {step}: a sample is {max(staleness)} policy versions old, more than "
                           f"trainer.max_staleness={cfg.trainer.max_staleness}"
                           + ("" if spread is None else f" + trainer.group_spread - 1 = {bound}"))
    t1, (cpu1, queued1) = time.perf_counter(), thread_times()
    if spread is None:
        batch, metrics = make_batch(trajs, cfg.algorithm, ctx.tokenizer.pad_token_id,
                                    cfg.generator.max_response_tokens, learner, images=ctx.prompt_images.of(trajs))
    else:
        # group_spread is refused with a critic, a KL term or a teacher (async_rl.config): the
        # advantages need nothing of the learner, whose passes then run on the rows trained now.
        whole, metrics = make_batch(spread.trajectories, cfg.algorithm, ctx.tokenizer.pad_token_id,
                                    cfg.generator.max_response_tokens, None,
                                    images=ctx.prompt_images.of(spread.trajectories))
        batch = whole.select(torch.tensor(spread.rows, dtype=torch.long)).trimmed()
        metrics.update(learner.prepare(batch))
        new_groups = {t.group_id for t in trajs}
        metrics["spread/trained_samples"] = float(len(trained))
        metrics["spread/carried_samples"] = float(sum(t.group_id not in new_groups for t in trained))
    train_metrics = learner.train_step(batch) if num_mini_batches is None else \
        learner.train_step(batch, num_mini_batches=num_mini_batches)
    t_train = time.perf_counter() - t1
    cpu2, queued2 = thread_times()
    for k, v in train_metrics.items():
        # The loss returns its mismatch metrics under loss/; they belong to their own namespace.
        metrics[k.replace("loss/mismatch_", "mismatch/")] = v
    metrics.update(rollout_metrics(trajs, ro, mixed_sources(ctx)))
    if cfg.algorithm.needs_teacher:  # the per-token reverse KL to the teacher, per source when mixed
        metrics.update(reverse_kl_metrics(trajs, mixed_sources(ctx)))
    metrics.update({
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": float(max(staleness)),
        "data/epoch": float(ctx.train_ds.epoch),
        "policy/version": float(learner.version),
        "perf/train_tokens_per_s": float(batch.attention_mask.sum()) / max(t_train, 1e-9),
        "timing/train_s": t_train,
        # Where train_s went on the training thread: its CPU time, its wait for a core (other
        # threads or processes on the learner's cores), and the rest blocked (GIL, locks, I/O).
        "timing/train_cpu_s": cpu2 - cpu1,
        "timing/train_runqueue_s": queued2 - queued1,
    })
    return metrics


def per_source_metrics(trajs: list[Trajectory], source_of: Callable[[str], str], prefix: str) -> dict[str, float]:
    """Reward, accuracy, response length (tokens), truncated fraction and count of the
    trajectories of each data source (task or environment), as ``<prefix><source>/<metric>``;
    ``source_of`` maps a trajectory's ``prompt_uid`` to its source (``PromptDataset.source_of``)."""
    by_source: dict[str, list[Trajectory]] = {}
    for t in trajs:
        by_source.setdefault(source_of(t.prompt_uid), []).append(t)
    out: dict[str, float] = {}
    for source, group in sorted(by_source.items()):
        n = len(group)
        out.update({f"{prefix}{source}/reward_mean": sum(t.reward for t in group) / n,
                    f"{prefix}{source}/accuracy": accuracy_of(group),
                    f"{prefix}{source}/response_length_mean": sum(len(t.response_ids) for t in group) / n,
                    f"{prefix}{source}/truncated_frac": sum(t.finish_reason == "length" for t in group) / n,
                    f"{prefix}{source}/num_trajectories": float(n)})
    return out


def rollout_metrics(trajs: list[Trajectory], ro: RolloutResult,
                    source_of: Callable[[str], str] | None = None) -> dict[str, float]:
    """``rollout/*`` of the trajectories a step trains on: reward mean/std, accuracy, response
    length (tokens), truncated fraction, counts, per-conversation tool use (agent runs) and
    per-episode environment infos (``rollout/env_info_<key>_mean``); with ``source_of`` (a run
    whose data mixes sources) the same per data source, ``env/<source>/*`` (``per_source_metrics``)."""
    rewards = torch.tensor([t.reward for t in trajs])
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    metrics: dict[str, Any] = {}
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/max_turns"):
        if key in trajs[0].reward_extras:
            metrics[f"rollout/{key.split('/')[1]}_mean"] = sum(t.reward_extras.get(key, 0.0) for t in trajs) / len(trajs)
    # An environment's step infos (env/info/<key>), summed per episode, averaged over episodes.
    for key in sorted({k for t in trajs for k in t.reward_extras if k.startswith("env/info/")}):
        metrics[f"rollout/env_info_{key[len('env/info/'):]}_mean"] = sum(
            t.reward_extras.get(key, 0.0) for t in trajs) / len(trajs)
    if "model_score" in trajs[0].reward_extras:  # reward.model: its raw score, before reward.model_weight
        metrics["rollout/model_score_mean"] = sum(t.reward_extras.get("model_score", 0.0) for t in trajs) / len(trajs)
    metrics.update({
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "rollout/accuracy": accuracy_of(trajs),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/rejected_samples": float(ro.num_rejected_samples),
        "rollout/rejected_groups": float(ro.num_rejected_groups),
    })
    if source_of is not None:
        metrics.update(per_source_metrics(trajs, source_of, "env/"))
    return metrics


def mixed_sources(ctx: RunContext) -> Callable[[str], str] | None:
    """``ctx.train_ds.source_of`` when the training data holds more than one ``data_source``
    (tasks or environments mixed in one run: their metrics are also reported apart), else ``None``."""
    ds = ctx.train_ds
    return ds.source_of if ds is not None and len(ds.sources) > 1 else None


SUMMED_METRICS = frozenset({
    "actor/optimizer_steps", "actor/skipped_mini_batches", "rollout/num_trajectories", "rollout/rejected_samples",
    "rollout/rejected_groups", "rollout/dynamic_sampling_rounds", "rollout/dynamic_sampling_surplus_groups",
    "rollout/dynamic_sampling_rejected_groups", "spread/trained_samples", "spread/carried_samples"})
"""Counts: a step's value is the sum over its policy versions (with ``timing/*``, in seconds)."""

LAST_METRICS = frozenset({"policy/version", "data/epoch"})
"""Positions: a step's value is that of its last policy version."""


def merge_version_metrics(parts: Sequence[dict[str, float]], rollouts: Sequence[RolloutResult] = (),
                          source_of: Callable[[str], str] | None = None) -> dict[str, float]:
    """One step's metrics from those of its policy versions (``trainer.policy_version_per=mini_batch``
    publishes several a step), in order: counts (``SUMMED_METRICS``) and ``timing/*`` seconds
    summed, positions (``LAST_METRICS``) from the last, extremes by ``metric_reduction`` (max /
    min), ``perf/train_tokens_per_s`` as tokens over the summed ``timing/train_s``, and every
    other metric the mean over the versions that report it (each trains on equally many groups).
    With the versions' ``rollouts`` given, ``rollout/*`` is recomputed over every trajectory of
    the step (``rollout_metrics``, per data source with ``source_of``), not averaged. One
    version's metrics come back as they are.

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("merge_version_metrics needs the metrics of at least one policy version")
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [float(p[key]) for p in parts if key in p]
        how = metric_reduction(key)
        if key in SUMMED_METRICS or key.startswith("timing/"):
            out[key] = sum(values)
        elif key in LAST_METRICS:
            out[key] = values[-1]
        elif how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    if all("perf/train_tokens_per_s" in p and "timing/train_s" in p for p in parts):
        tokens = sum(p["perf/train_tokens_per_s"] * p["timing/train_s"] for p in parts)
        out["perf/train_tokens_per_s"] = tokens / max(out["timing/train_s"], 1e-9)
    if rollouts:
        trajs = [t for ro in rollouts for t in ro.trajectories]
        out.update(rollout_metrics(trajs, RolloutResult(trajs, sum(ro.num_rejected_samples for ro in rollouts),
                                                        sum(ro.num_rejected_groups for ro in rollouts),
                                                        sum(ro.num_generated_tokens for ro in rollouts)), source_of))
    return out
