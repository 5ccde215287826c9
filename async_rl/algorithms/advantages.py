"""Advantage estimators, chosen by name from `ADVANTAGE_ESTIMATORS`.

Every estimator has the same call: `estimator(inputs: AdvantageInputs, **params) ->
(advantages [B, T] float32, returns [B, T] float32)`. Built-in names:

    grpo                   (r - group mean) / (group std + eps)              DeepSeekMath
    dr_grpo                r - group mean (no std division)                  Dr. GRPO
    rloo                   r - mean of the *other* samples of the group      RLOO
    reinforce_pp           return-to-go whitened over the batch's tokens     REINFORCE++
    reinforce_pp_baseline  (r - group mean), then whitened over the batch    REINFORCE++ w/ baseline
    gae                    generalised advantage estimation with a critic    GAE / PPO

Rules shared by the group-based estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline):
  * groups come only from `inputs.group_ids` (never from batch order or a group size);
  * a sequence with no trainable token (all-zero `response_mask` row) is *invalid*: it is left out
    of its group's statistics and gets advantage 0;
  * a group with fewer than two valid sequences has no baseline to compare against: its
    sequences get advantage 0 (never NaN);
  * groups of different sizes use their real number of valid sequences.
All estimators return 0 wherever `response_mask` is 0 and never read masked slots, so NaN there
cannot leak.

Worked example (grpo): rewards `[1, 0, 5]`, group_ids `[7, 7, 9]`, masks all ones ->
group 7: mean 0.5, std 0.7071 -> advantages `+0.7071, -0.7071`; group 9 has one sample -> 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from async_rl.algorithms.logprobs import masked_count, masked_mean
from async_rl.algorithms.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "compute_advantages"]

ADVANTAGE_ESTIMATORS = Registry("advantage estimator")


@dataclass
class AdvantageInputs:
    """Per-batch inputs of an advantage estimator (B sequences, T padded response positions).

    Attributes:
        rewards: `[B]` float, one scalar reward per sequence.
        response_mask: `[B, T]` bool or 0/1, 1 on trainable response tokens (0 on padding and on
            tool/environment output in multi-turn rollouts).
        group_ids: `[B]` int64, the group (prompt) of each sequence; required by the
            group-based estimators.
        values: `[B, T]` float32 critic values V(s_t); required by "gae".
        token_rewards: `[B, T]` float per-token rewards (e.g. a KL penalty plus the outcome
            reward); if None the sequence reward sits on the last valid token ("gae",
            "reinforce_pp").

    Raises:
        ValueError: (at construction) a tensor has the wrong rank or its size disagrees with B/T.
    """

    rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor | None = None
    values: Tensor | None = None
    token_rewards: Tensor | None = None

    def __post_init__(self) -> None:
        if self.response_mask.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(self.response_mask.shape)}")
        batch = self.response_mask.shape[0]
        if self.rewards.shape != (batch,):
            raise ValueError(f"rewards must be [B]=[{batch}], got shape {tuple(self.rewards.shape)}")
        if self.group_ids is not None and self.group_ids.shape != (batch,):
            raise ValueError(f"group_ids must be [B]=[{batch}], got shape {tuple(self.group_ids.shape)}")
        for name in ("values", "token_rewards"):
            t = getattr(self, name)
            if t is not None and t.shape != self.response_mask.shape:
                raise ValueError(f"{name} must be [B, T]={tuple(self.response_mask.shape)}, "
                                 f"got shape {tuple(t.shape)}")

    @property
    def mask(self) -> Tensor:
        """`[B, T]` bool response mask."""
        return self.response_mask.bool()

    @property
    def valid(self) -> Tensor:
        """`[B]` bool, True for sequences with at least one trainable token."""
        return self.mask.any(dim=-1)


def compute_advantages(name: str, inputs: AdvantageInputs, **params) -> tuple[Tensor, Tensor]:
    """Look up estimator `name` in `ADVANTAGE_ESTIMATORS` (or by import path) and call it.

    Returns:
        `(advantages [B, T] float32, returns [B, T] float32)`.

    Raises:
        ValueError: unknown name, or the estimator's own errors.
    """
    return ADVANTAGE_ESTIMATORS.get(name)(inputs, **params)


# ----------------------------------------------------------------------------------------------
# helpers


def _require_groups(inputs: AdvantageInputs, estimator: str) -> Tensor:
    if inputs.group_ids is None:
        raise ValueError(f"advantage estimator {estimator!r} needs inputs.group_ids ([B] int64)")
    return inputs.group_ids


@dataclass
class _GroupStats:
    """Per-sequence view of its group's statistics over *valid* sequences, all `[B]` float32."""

    count: Tensor  # valid sequences in the group
    total: Tensor  # sum of their rewards
    mean: Tensor
    std: Tensor  # Bessel-corrected (n - 1); 0 for groups of < 2 valid sequences


def _group_stats(rewards: Tensor, valid: Tensor, group_ids: Tensor) -> _GroupStats:
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    # Invalid sequences may carry garbage rewards; select them out before any arithmetic.
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    zeros = torch.zeros(num_groups, dtype=torch.float32, device=rewards.device)
    count = zeros.index_add(0, inverse, valid.float())
    total = zeros.index_add(0, inverse, r)
    mean = total / count.clamp_min(1.0)
    dev = torch.where(valid, r - mean[inverse], torch.zeros_like(r))
    # Unbiased variance like torch.std (what GRPO implementations use); n - 1 clamped so singleton
    # groups give 0 instead of 0 / 0.
    var = zeros.index_add(0, inverse, dev * dev) / (count - 1.0).clamp_min(1.0)
    return _GroupStats(count=count[inverse], total=total[inverse], mean=mean[inverse],
                       std=var.sqrt()[inverse])


def _broadcast(seq_values: Tensor, mask: Tensor) -> Tensor:
    """`[B]` -> `[B, T]`, 0 outside `mask`."""
    return torch.where(mask, seq_values.unsqueeze(-1), torch.zeros((), dtype=seq_values.dtype,
                                                                    device=seq_values.device))


def _masked_whiten(x: Tensor, mask: Tensor, epsilon: float) -> Tensor:
    """`(x - mean) / (std + eps)` with mean/std over the selected entries; 0 outside `mask`."""
    mean = masked_mean(x, mask)
    dev = torch.where(mask, x - mean, torch.zeros_like(x))
    var = (dev * dev).sum() / (masked_count(x, mask) - 1.0).clamp_min(1.0)
    return dev / (var.sqrt() + epsilon)


def _token_rewards(inputs: AdvantageInputs, rewards: Tensor) -> Tensor:
    """Per-token rewards `[B, T]` float32, 0 outside the mask; the sequence reward sits on the last
    valid token when `inputs.token_rewards` is None."""
    mask = inputs.mask
    if inputs.token_rewards is not None:
        return torch.where(mask, inputs.token_rewards.float(), torch.zeros((), device=mask.device))
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    return torch.where(mask & (positions == last), rewards.unsqueeze(-1), torch.zeros((), device=mask.device))


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go `G_t = r_t + gamma * G_next` over valid tokens only (masked positions, e.g.
    tool output, are skipped and carry `G` through); 0 outside the mask."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return returns


# ----------------------------------------------------------------------------------------------
# estimators


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True,
                    epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Group-relative advantage `A_i = (r_i - mean_g) / (std_g + eps)`, broadcast over tokens.

    Source: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300), Sec. 4.1.2 "outcome supervision",
    `A_i,t = (r_i - mean(r)) / std(r)`. `std` is Bessel-corrected like `torch.std`.

    Args:
        inputs: needs `rewards`, `response_mask`, `group_ids`.
        norm_by_std: divide by the group std; False gives Dr. GRPO (see `dr_grpo_advantages`).
        epsilon: added to the std so groups with identical rewards give 0, not 0/0.

    Returns:
        `(advantages, returns)`, both `[B, T]` float32, 0 outside the mask; `returns` is the
        sequence reward on each valid token (the undiscounted return-to-go of an outcome reward).

    Raises:
        ValueError: `inputs.group_ids` is None.
    """
    group_ids = _require_groups(inputs, "grpo")
    rewards, valid, mask = inputs.rewards.float(), inputs.valid, inputs.mask
    stats = _group_stats(rewards, valid, group_ids)
    adv = rewards - stats.mean
    if norm_by_std:
        adv = adv / (stats.std + epsilon)
    adv = torch.where(valid & (stats.count >= 2), adv, torch.zeros_like(adv))
    return _broadcast(adv, mask), _broadcast(rewards, mask & valid.unsqueeze(-1))


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO without the std division: `A_i = r_i - mean_g`.

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (Dr. GRPO, arXiv 2503.20783): dividing by the group std up-weights prompts that are almost
    always solved or almost always failed (a question-level difficulty bias). Pair it with the "seq-mean-token-sum-norm" loss aggregation.

    Returns / Raises: as `grpo_advantages`.
    """
    _require_groups(inputs, "dr_grpo")
    return grpo_advantages(inputs, norm_by_std=False)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: `A_i = r_i - (sum_{j != i} r_j) / (n_g - 1)` over valid samples.

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv 2402.14740), the RLOO estimator (after Kool et
    al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"). The baseline excludes the sample itself, so the estimator stays unbiased.

    Returns / Raises: as `grpo_advantages`.
    """
    group_ids = _require_groups(inputs, "rloo")
    rewards, valid, mask = inputs.rewards.float(), inputs.valid, inputs.mask
    stats = _group_stats(rewards, valid, group_ids)
    others = stats.count - 1.0
    baseline = (stats.total - torch.where(valid, rewards, torch.zeros_like(rewards))) / others.clamp_min(1.0)
    adv = torch.where(valid & (others >= 1), rewards - baseline, torch.zeros_like(rewards))
    return _broadcast(adv, mask), _broadcast(rewards, mask & valid.unsqueeze(-1))


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
def reinforce_pp_advantages(inputs: AdvantageInputs, *, gamma: float = 1.0,
                            epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over all valid tokens of the batch.

    `G_t = sum_{k >= t} gamma^(k-t) r_k` (token rewards, or the sequence reward on the last valid
    token), then `A_t = (G_t - mean) / (std + eps)` with mean/std over every valid token of the
    batch (global normalisation, no groups).

    Source: Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), global advantage normalisation.
    Call it on the whole optimizer-step batch: whitening per micro-batch changes the result.

    Args:
        inputs: needs `rewards` (or `token_rewards`) and `response_mask`.
        gamma: discount per token, in [0, 1].
        epsilon: added to the std.

    Returns:
        `(advantages, returns)` `[B, T]` float32; returns are the un-whitened `G_t`.

    Raises:
        ValueError: `gamma` outside [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    mask = inputs.mask
    returns = _discounted_returns(_token_rewards(inputs, inputs.rewards.float()), mask, gamma)
    return _masked_whiten(returns, mask, epsilon), returns


@ADVANTAGE_ESTIMATORS.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(inputs: AdvantageInputs, *,
                                     epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the batch's tokens.

    `A_i = r_i - mean_g`, broadcast over valid tokens, then whitened with mean/std over the valid
    tokens of sequences that have a baseline. Sequences of groups with < 2 valid members carry no
    signal: they get 0 and stay out of the whitening statistics (they would shift its mean).

    Source: Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), "REINFORCE++ w/ baseline"
    (group-mean baseline followed by global normalisation).

    Returns:
        `(advantages, returns)` `[B, T]` float32; returns are the sequence rewards on valid tokens.

    Raises:
        ValueError: `inputs.group_ids` is None.
    """
    group_ids = _require_groups(inputs, "reinforce_pp_baseline")
    rewards, valid, mask = inputs.rewards.float(), inputs.valid, inputs.mask
    stats = _group_stats(rewards, valid, group_ids)
    has_baseline = valid & (stats.count >= 2)
    token_mask = mask & has_baseline.unsqueeze(-1)
    centered = _broadcast(rewards - stats.mean, token_mask)
    return _masked_whiten(centered, token_mask, epsilon), _broadcast(rewards, mask & valid.unsqueeze(-1))


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = False, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`,
    `returns_t = A_t + V_t`, where "next" is the next *valid* token (masked positions such as tool
    output are skipped, so their values and rewards are never read) and `V = 0` after the last.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv 1506.02438), eq. 16; truncated form as in PPO (arXiv 1707.06347) eqs. 11-12.

    Args:
        inputs: needs `values` `[B, T]`, `response_mask`, and `rewards` or `token_rewards`.
        gamma: discount per token, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: whiten the advantages over the batch's valid tokens (common in PPO for LLMs).
        epsilon: added to the std when whitening.

    Returns:
        `(advantages, returns)` `[B, T]` float32, 0 outside the mask; `returns` are the value
        targets (computed before any whitening).

    Raises:
        ValueError: `inputs.values` is None, or `gamma`/`lam` outside [0, 1].
    """
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs inputs.values ([B, T] critic values)")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    mask = inputs.mask
    zero = torch.zeros((), device=mask.device)
    values = torch.where(mask, inputs.values.float(), zero)
    rewards = _token_rewards(inputs, inputs.rewards.float())
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        valid_t = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(valid_t, adv_t, next_adv)
        next_value = torch.where(valid_t, values[:, t], next_value)
        advantages[:, t] = torch.where(valid_t, adv_t, zero)
    returns = torch.where(mask, advantages + values, zero)
    if whiten:
        advantages = _masked_whiten(advantages, mask, epsilon)
    return advantages, returns
