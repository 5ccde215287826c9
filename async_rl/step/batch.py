"""Batch building: trajectories -> a collated ``TrainBatch`` with advantages (both modes).

The order of the shaping steps is part of the algorithm (DAPO shaping, the learner's extra
passes, a KL penalty in the reward, the estimator over every scored sample, and only then the
overlong filter on the loss mask, then the teacher's per-token term of on-policy distillation);
``make_batch`` is the one place that fixes it.
"""

from __future__ import annotations

from typing import Any

import torch

from async_rl.algorithms.advantages import AdvantageInputs, has_spread
from async_rl.algorithms.dapo import overlong_filter_mask, overlong_reward_shaping
from async_rl.algorithms.distill import distill_advantages
from async_rl.algorithms.kl import apply_kl_reward_penalty, kl_penalty
from async_rl.algorithms.logprobs import masked_mean
from async_rl.buffers.trajectory import collate


def _last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` float32: each sequence reward ``[B]`` on its last valid token, 0 elsewhere."""
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    valid = mask.bool()
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    return torch.where(valid & (positions == last), rewards.float().unsqueeze(-1), torch.zeros(()))


def make_batch(trajectories, algo, pad_token_id: int, max_response_tokens: int, learner=None,
               images=None) -> tuple[Any, dict[str, float]]:
    """Collate trajectories and fill in advantages (and critic returns) with the configured algorithm.

    In order: DAPO soft overlong punishment shapes the rewards; ``learner.prepare`` adds
    proximal/reference log-probs and critic values; a KL-in-reward penalty ``kl_coef * KL_t``
    (InstructGPT eq. 2) is taken from the per-token rewards (estimators that declare
    ``token_rewards``) or from the
    sequence reward as its sum over valid tokens (sequence estimators, as verl does); the estimator
    runs on the explicit group ids over every trajectory's generated tokens; only then does DAPO
    overlong filtering zero the loss mask (and advantages) of truncated samples; last, with a
    teacher (``algorithm.distill``), ``distill_advantages`` adds ``-coef * (log mu - log q)`` per
    trained token (or replaces the task advantage with it: ``task_reward=false``); with a top-k
    signal the teacher's term is the learner's loss term instead (``topk_kl``), and the advantage
    is the task's or, with ``task_reward=false``, zero. Leaving the loss
    is not leaving the baseline: a truncated sample's reward still counts in its group's mean and
    std (and in whitening statistics), so filtering never changes another sample's advantage.
    Every trajectory here has a reward (samples without one were rejected and counted upstream).

    Args:
        trajectories: the step's trajectories.
        algo: ``AlgorithmConfig`` (preset applied).
        pad_token_id: padding id of the collated batch.
        max_response_tokens: the generator's response limit L, in tokens (overlong shaping).
        learner: the learner whose ``prepare`` fills the extras; ``None`` skips it (then neither
            a KL penalty nor a critic estimator can be used).
        images: one prompt ``ImageInputs`` or ``None`` per trajectory (``collate``), or ``None``.

    Returns:
        ``(batch, metrics)``: the ``TrainBatch`` with ``advantages`` (and ``returns`` in
        ``extras`` when there is a critic) and metrics of the shaping steps.

    Raises:
        ValueError: a KL penalty or a critic estimator without a learner; a teacher configured
            but trajectories without teacher log-probs (``collate``: some with, some without);
            or the estimator's errors.
    """
    batch = collate(trajectories, pad_token_id, images=images)
    # Only the advantage needs the teacher: its log-probs do not travel on to the learner.
    teacher = batch.extras.pop("teacher_logprobs", None)
    metrics: dict[str, float] = {}
    rewards = batch.rewards
    if algo.overlong_buffer_frac > 0:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories])
        shaped = overlong_reward_shaping(
            rewards, lengths, max_response_tokens=max_response_tokens,
            buffer_tokens=max(1, round(algo.overlong_buffer_frac * max_response_tokens)),
            penalty_factor=algo.overlong_penalty_factor)
        metrics["reward/overlong_penalty_mean"] = float((shaped - rewards).mean())
        rewards = shaped
    if learner is not None:
        metrics.update(learner.prepare(batch))
    elif algo.needs_critic or algo.needs_reference:
        raise ValueError("make_batch: a critic estimator or a KL term needs the learner's prepare() pass")
    estimator = algo.estimator
    token_rewards = None
    if algo.needs_reference and algo.use_kl_in_reward:
        policy_lp = batch.extras.get("proximal_logprobs", batch.behavior_logprobs)
        kl = kl_penalty(policy_lp, batch.extras["ref_logprobs"], algo.kl_estimator, mask=batch.loss_mask,
                        k3_clamp=algo.kl_k3_clamp)
        metrics["actor/kl_reward_penalty"] = float(algo.kl_coef * masked_mean(kl, batch.loss_mask))
        if estimator.token_rewards:
            token_rewards = apply_kl_reward_penalty(_last_token_rewards(rewards, batch.loss_mask), kl,
                                                    algo.kl_coef, mask=batch.loss_mask)
        else:
            rewards = rewards - algo.kl_coef * (kl * batch.loss_mask).sum(-1)
    advantages, returns = estimator(
        AdvantageInputs(rewards=rewards, response_mask=batch.loss_mask, group_ids=batch.group_ids,
                        values=batch.extras.get("values"), token_rewards=token_rewards),
        **estimator.params(algo))
    if algo.overlong_filter:
        keep = overlong_filter_mask([t.finish_reason for t in trajectories])
        batch.loss_mask = batch.loss_mask * keep.unsqueeze(-1).float()
        metrics["rollout/overlong_filtered"] = float((~keep).sum())
    batch.advantages = advantages * batch.loss_mask
    if algo.needs_teacher and algo.distill.uses_topk:
        has_response = any(len(t.response_ids) for t in trajectories)
        if has_response and "teacher_topk_logprobs" not in batch.extras:
            raise ValueError(f"make_batch: algorithm.distill.signal={algo.distill.signal} needs the teacher's top-k "
                             "log-probs, but the trajectories carry none (the rollout did not go through the "
                             "teacher stage, or its teacher sent no top-k)")
        if not algo.distill.task_reward:
            batch.advantages = torch.zeros_like(batch.advantages)
    elif algo.needs_teacher:
        if teacher is None and not any(len(t.response_ids) for t in trajectories):
            teacher = torch.zeros_like(batch.behavior_logprobs)  # no response token: nothing to score
        if teacher is None:
            raise ValueError("make_batch: algorithm.distill names a teacher, but the trajectories carry no "
                             "teacher log-probs (the rollout did not go through the teacher stage)")
        batch.advantages = distill_advantages(batch.advantages, batch.behavior_logprobs, teacher, batch.loss_mask,
                                              algo.distill.coef, algo.distill.task_reward)
        metrics["distill/advantage_mean"] = float(masked_mean(batch.advantages, batch.loss_mask))
    if "values" in batch.extras:
        batch.extras["returns"] = returns
        mask = batch.loss_mask.bool()
        err, ret = (returns - batch.extras["values"])[mask], returns[mask]
        metrics["critic/values_mean"] = float(batch.extras["values"][mask].mean()) if mask.any() else 0.0
        metrics["critic/returns_mean"] = float(ret.mean()) if mask.any() else 0.0
        if ret.numel() > 1 and bool(has_spread(ret.min(), ret.max())):
            # Explained variance 1 - Var[R - V] / Var[R]: 1 is a perfect critic, <= 0 no better than a
            # constant. Undefined for constant returns (a rounding residue of Var[R] would make it huge).
            metrics["critic/explained_variance"] = float(1.0 - err.double().var() / ret.double().var())
    return batch, metrics
