"""Advantage estimators, chosen by name from `ADVANTAGE_ESTIMATORS`.

Every estimator has the same call: `estimator(inputs: AdvantageInputs, **params) ->
(advantages [B, T] float32, returns [B, T] float32)`. `ADVANTAGE_ESTIMATORS.get(spec)` returns an
`EstimatorSpec`: the function plus what it needs from the rest of the system (a critic, per-token
rewards, groups) and which config fields become its keyword arguments, so the config, the learner
and `make_batch` ask the estimator instead of keeping lists of names. Built-in names:

    grpo                   (r - group mean) / (group std + eps)              DeepSeekMath
    dr_grpo                r - group mean (no std division)                  Dr. GRPO
    rloo                   r - mean of the *other* samples of the group      RLOO
    reinforce_pp           return-to-go whitened over the batch's tokens     REINFORCE++
    reinforce_pp_baseline  (r - group mean), then whitened over the batch    REINFORCE++ w/ baseline
    gae                    generalised advantage estimation with a critic    GAE / PPO

Each built-in estimator also declares the config values its definition fixes
(`EstimatorSpec.fixed_settings`, `{}` when none; `async_rl.algorithms.fixed_settings`): only
`dr_grpo` fixes any (`algorithm.norm_adv_by_std=false`, `algorithm.loss_agg_mode=
seq-mean-token-sum-norm`). The others define an advantage only; the aggregation belongs to the
loss or preset they are paired with (the `dapo` preset pairs `grpo` with `token-mean`).

Which samples are trained and which samples define the baseline are two separate things:
  * the *baseline* of a sample (its group's mean and std, the leave-one-out mean, the batch
    statistics of a whitening step) is taken over every sample that has a reward
    (`inputs.scored`, default: all). A sample without a reward (aborted, reward `None`) leaves
    the baseline and gets advantage 0;
  * the *loss* covers `response_mask` (the policy's own tokens). A sample whose row is all zero
    (no trainable token) still has a reward, so it stays in its group's statistics: filtering a
    sample out of the loss (DAPO's overlong filter, ...) never changes anyone else's advantage.
    `make_batch` therefore applies such filters to the loss mask *after* the estimator.

Rules shared by the group-based estimators (grpo, dr_grpo, rloo, reinforce_pp_baseline):
  * groups come only from `inputs.group_ids` (never from batch order or a group size);
  * a group with fewer than two scored samples has no baseline to compare against: its samples
    get advantage 0 (never NaN);
  * a group whose scored rewards are all equal carries no group-relative signal: its samples get
    exactly 0. "Equal" is up to float rounding (`has_spread`): rewards are read as float32 (a
    difference float32 cannot hold is rounding, not signal) and statistics run in float64, in
    which the mean of n equal float32 values is exactly that value.
Every step that divides by a standard deviation (GRPO's group std, REINFORCE++ batch whitening,
GAE whitening) treats a zero spread the same way, so it never divides a rounding residue by
`std + eps`. All estimators return 0 wherever `response_mask` is 0 and never read masked slots or
unscored rewards, so NaN there cannot leak.

Worked example (grpo): rewards `[1, 0, 5]`, group_ids `[7, 7, 9]`, masks all ones ->
group 7: mean 0.5, std 0.7071 -> advantages `+0.7071, -0.7071`; group 9 has one sample -> 0.
Rewards `[1, 1, 0, 0]` in one group with the last row's mask all zero (truncated, filtered out of
the loss) -> mean 0.5, std 0.5774 over all four -> `+0.866, +0.866, -0.866, 0`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from async_rl.algorithms.fixed_settings import FixedSetting, check_fixed_settings
from async_rl.utils.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageInputs", "EstimatorSpec", "ZERO_SPREAD_RTOL", "compute_advantages",
           "has_spread", "register_estimator"]


def _no_params(algo: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class EstimatorSpec:
    """An advantage estimator and what it needs; calling it calls `fn`.

    Attributes:
        fn: `fn(inputs: AdvantageInputs, **params) -> (advantages [B, T] float32, returns [B, T]
            float32)`.
        needs_critic: reads `inputs.values` (critic values V(s_t)); the learner then trains a
            critic and `make_batch` runs the learner's value pass.
        token_rewards: reads per-token rewards, so a KL-in-reward penalty is applied per token
            (InstructGPT, arXiv 2203.02155, eq. 2) rather than summed into the sequence reward.
        needs_groups: compares the samples of one prompt (`inputs.group_ids`), so a run needs at
            least 2 samples per prompt.
        params: `AlgorithmConfig -> dict` of keyword arguments for `fn` (read by
            `AlgorithmConfig.advantage_params`).
        fixed_settings: the config values the estimator's definition fixes (dotted key ->
            `FixedSetting`, `async_rl.algorithms.fixed_settings`); every built-in declares them,
            `{}` when it fixes nothing. `None` declares nothing.

    A user estimator named by import path may be a plain function, which gets the defaults
    (no critic, one reward per sequence, no groups, no keyword arguments from the config, no
    fixed settings), or an `EstimatorSpec` that declares its needs.

    Raises:
        ValueError: (at construction) `fixed_settings` is malformed (`check_fixed_settings`).
    """

    fn: Callable[..., tuple[Tensor, Tensor]]
    needs_critic: bool = False
    token_rewards: bool = False
    needs_groups: bool = False
    params: Callable[[Any], dict[str, Any]] = _no_params
    fixed_settings: Mapping[str, FixedSetting] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        owner = f"advantage estimator {getattr(self.fn, '__name__', self.fn)!r}"
        object.__setattr__(self, "fixed_settings", check_fixed_settings(owner, self.fixed_settings))

    def __call__(self, inputs: "AdvantageInputs", **params: Any) -> tuple[Tensor, Tensor]:
        return self.fn(inputs, **params)


def _as_estimator(kind: str, spec: str, obj: Any) -> EstimatorSpec:
    if isinstance(obj, EstimatorSpec):
        return obj
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r} is not callable (got {type(obj).__name__})")
    return EstimatorSpec(obj)


ADVANTAGE_ESTIMATORS: Registry[EstimatorSpec] = Registry(
    "advantage estimator", coerce=_as_estimator,
    help="An estimator is fn(inputs: AdvantageInputs, **params) -> (advantages, returns) or an EstimatorSpec.")


def register_estimator(name: str, *, needs_critic: bool = False, token_rewards: bool = False,
                       needs_groups: bool = False, params: Callable[[Any], dict[str, Any]] = _no_params,
                       fixed_settings: Mapping[str, FixedSetting] | None = None) -> Callable[[Callable], Callable]:
    """Decorator that registers `fn` in `ADVANTAGE_ESTIMATORS` as an `EstimatorSpec` with these
    needs and fixed settings (see its attributes) and returns `fn` unchanged.

    Raises:
        ValueError: as `Registry.register` (taken or malformed name); `fixed_settings` is
            malformed (`check_fixed_settings`).
    """

    def decorator(fn: Callable) -> Callable:
        ADVANTAGE_ESTIMATORS.register(name, EstimatorSpec(fn, needs_critic, token_rewards, needs_groups, params,
                                                          fixed_settings))
        return fn

    return decorator


ZERO_SPREAD_RTOL = 8 * torch.finfo(torch.float32).eps
"""Values within this relative distance of each other (``max - min <= ZERO_SPREAD_RTOL *
max |x|``, about 8 float32 steps) have no spread: what is left of a constant after float rounding
(for example float32 advantages recomputed from values) is not signal to be scaled up by a std."""


def has_spread(low: Tensor, high: Tensor) -> Tensor:
    """Whether values spanning ``[low, high]`` differ by more than float rounding.

    The one definition of "all equal" used by every estimator, by whitening, and by dynamic
    sampling (``async_rl.algorithms.dapo``), so a group dynamic sampling keeps always gets
    non-zero advantages and a group it would drop always gets exactly 0.

    Args:
        low: any shape, float; the smallest value of each set (``+inf`` for an empty set).
        high: same shape; the largest value (``-inf`` for an empty set).

    Returns:
        bool tensor of that shape: ``high - low > ZERO_SPREAD_RTOL * max(|low|, |high|)``; False
        for empty sets.

    Example: ``low 0.1, high 0.1 + 1e-9`` -> False; ``low 1.0, high 1.0 + 2**-18`` (32 float32
    steps) -> True.
    """
    low, high = low.double(), high.double()
    scale = torch.maximum(low.abs(), high.abs())
    return torch.isfinite(scale) & (high - low > ZERO_SPREAD_RTOL * scale)


@dataclass
class AdvantageInputs:
    """Per-batch inputs of an advantage estimator (B sequences, T padded response positions).

    Attributes:
        rewards: `[B]` float, one scalar reward per sequence; read as float32. Entries of
            unscored samples are never read (they may hold NaN).
        response_mask: `[B, T]` bool or 0/1, 1 on the policy's own response tokens (0 on padding
            and on tool/environment output in multi-turn rollouts). Advantages are 0 outside it.
            A row may be all zero (a sample filtered out of the loss): it keeps its place in
            the baseline.
        group_ids: `[B]` int64, the group (prompt) of each sequence; required by the
            group-based estimators.
        values: `[B, T]` float32 critic values V(s_t); required by "gae".
        token_rewards: `[B, T]` float per-token rewards (e.g. a KL penalty plus the outcome
            reward); if None the sequence reward sits on the last valid token ("gae",
            "reinforce_pp").
        scored: `[B]` bool, the samples that have a reward; they alone define baselines. None =
            every sample. Unscored samples get advantage and return 0.

    Raises:
        ValueError: (at construction) a tensor has the wrong rank or its size disagrees with B/T.
    """

    rewards: Tensor
    response_mask: Tensor
    group_ids: Tensor | None = None
    values: Tensor | None = None
    token_rewards: Tensor | None = None
    scored: Tensor | None = None

    def __post_init__(self) -> None:
        if self.response_mask.dim() != 2:
            raise ValueError(f"response_mask must be [B, T], got shape {tuple(self.response_mask.shape)}")
        batch = self.response_mask.shape[0]
        for name in ("rewards", "group_ids", "scored"):
            t = getattr(self, name)
            if t is not None and t.shape != (batch,):
                raise ValueError(f"{name} must be [B]=[{batch}], got shape {tuple(t.shape)}")
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
    def scored_mask(self) -> Tensor:
        """`[B]` bool, True for samples with a reward (all of them when `scored` is None)."""
        if self.scored is None:
            return torch.ones(self.response_mask.shape[0], dtype=torch.bool, device=self.response_mask.device)
        return self.scored.bool()


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


def _scored_rewards(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """`([B] float64 rewards, 0 where unscored; [B] bool scored)`.

    Rewards pass through float32 first: the batch holds them in float32, and a difference float32
    cannot represent (0.1 + 0.2 against 0.3) is rounding, not signal.

    Raises:
        ValueError: a scored reward is NaN or infinite.
    """
    scored = inputs.scored_mask
    r = inputs.rewards.float().double()
    # `where`, not a product: an unscored NaN times 0 is still NaN.
    r = torch.where(scored, r, torch.zeros_like(r))
    if not bool(torch.isfinite(r).all()):
        raise ValueError("non-finite reward for a scored sample: a reward that could not be computed must be "
                         "marked unscored (inputs.scored), never passed as NaN/inf")
    return r, scored


@dataclass
class _GroupStats:
    """Per-sequence view of its group's statistics over *scored* sequences, all `[B]`."""

    count: Tensor  # scored sequences in the group, float64
    total: Tensor  # sum of their rewards, float64
    mean: Tensor  # float64
    std: Tensor  # Bessel-corrected (n - 1), float64; 0 for groups of < 2 scored sequences
    signal: Tensor  # bool: >= 2 scored sequences whose rewards differ by more than rounding


def _group_stats(rewards: Tensor, scored: Tensor, group_ids: Tensor) -> _GroupStats:
    """Group statistics in float64 of `rewards` `[B]` (float64, 0 where unscored) over `scored`."""
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(unique_ids.numel(), dtype=torch.float64, device=rewards.device)
    count = zeros.index_add(0, inverse, scored.double())
    total = zeros.index_add(0, inverse, rewards)
    mean = total / count.clamp_min(1.0)
    dev = torch.where(scored, rewards - mean[inverse], torch.zeros_like(rewards))
    # Unbiased variance like torch.std (what GRPO implementations use); n - 1 clamped so singleton
    # groups give 0 instead of 0 / 0.
    var = zeros.index_add(0, inverse, dev * dev) / (count - 1.0).clamp_min(1.0)
    low = torch.full_like(zeros, math.inf).scatter_reduce(0, inverse, torch.where(scored, rewards, math.inf), "amin")
    high = torch.full_like(zeros, -math.inf).scatter_reduce(0, inverse, torch.where(scored, rewards, -math.inf),
                                                           "amax")
    signal = (count >= 2) & has_spread(low, high)
    return _GroupStats(count=count[inverse], total=total[inverse], mean=mean[inverse], std=var.sqrt()[inverse],
                       signal=signal[inverse] & scored)


def _broadcast(seq_values: Tensor, mask: Tensor) -> Tensor:
    """`[B]` -> `[B, T]` float32, 0 outside `mask`."""
    return torch.where(mask, seq_values.float().unsqueeze(-1), torch.zeros((), device=seq_values.device))


def _masked_whiten(x: Tensor, mask: Tensor, epsilon: float) -> Tensor:
    """`(x - mean) / (std + eps)` with mean and unbiased std over the selected entries, computed in
    float64; exactly 0 outside `mask`, and everywhere when the selected entries have no spread
    (`has_spread`: a rounding residue is never scaled up to unit size)."""
    x = x.double()
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    count = mask.sum().double()
    mean = torch.where(mask, x, zero).sum() / count.clamp_min(1.0)
    dev = torch.where(mask, x - mean, zero)
    var = (dev * dev).sum() / (count - 1.0).clamp_min(1.0)
    spread = has_spread(torch.where(mask, x, math.inf).amin(), torch.where(mask, x, -math.inf).amax())
    return torch.where(spread, dev / (var.sqrt() + epsilon), zero)


def _token_rewards(inputs: AdvantageInputs, rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards `[B, T]` float64, 0 outside `mask`; the sequence reward `rewards` `[B]`
    sits on the last valid token when `inputs.token_rewards` is None."""
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    if inputs.token_rewards is not None:
        return torch.where(mask, inputs.token_rewards.float().double(), zero)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1, keepdim=True)
    return torch.where(mask & (positions == last), rewards.unsqueeze(-1), zero)


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go `G_t = r_t + gamma * G_next` over valid tokens only (masked positions, e.g.
    tool output, are skipped and carry `G` through); 0 outside the mask; dtype of the input."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(mask[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(mask[:, t], running, torch.zeros_like(running))
    return returns


# ----------------------------------------------------------------------------------------------
# estimators


@register_estimator("grpo", needs_groups=True, params=lambda algo: {"norm_by_std": algo.norm_adv_by_std},
                    fixed_settings={})
def grpo_advantages(inputs: AdvantageInputs, *, norm_by_std: bool = True,
                    epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Group-relative advantage `A_i = (r_i - mean_g) / (std_g + eps)`, broadcast over tokens.

    Source: Shao et al. 2024, DeepSeekMath (arXiv 2402.03300), Sec. 4.1.2 "outcome supervision",
    `A_i,t = (r_i - mean(r)) / std(r)`. `std` is Bessel-corrected like `torch.std` (verl's
    `compute_grpo_outcome_advantage`); mean and std run over the group's scored samples, whether
    or not they are trained. A group without spread (`has_spread`) gets exactly 0.

    Args:
        inputs: needs `rewards`, `response_mask`, `group_ids` (and `scored` if some samples have
            no reward).
        norm_by_std: divide by the group std; False gives Dr. GRPO (see `dr_grpo_advantages`).
        epsilon: added to the std, as in verl (1e-6).

    Fixed settings: none. The std division is the `algorithm.norm_adv_by_std` knob this
    estimator exists to read (verl's `norm_adv_by_std_in_grpo`), and the GRPO paper's per-sequence
    length normalisation belongs to the loss's aggregation, not to the advantage: the `grpo`
    preset pairs it with `token-mean`, and DAPO (arXiv 2503.14476) uses it with its token-level loss.

    Returns:
        `(advantages, returns)`, both `[B, T]` float32, 0 outside the mask; `returns` is the
        sequence reward on each valid token of scored samples (the undiscounted return-to-go of
        an outcome reward).

    Raises:
        ValueError: `inputs.group_ids` is None, or a scored reward is NaN/inf.
    """
    group_ids = _require_groups(inputs, "grpo")
    rewards, scored = _scored_rewards(inputs)
    mask = inputs.mask
    stats = _group_stats(rewards, scored, group_ids)
    adv = rewards - stats.mean
    if norm_by_std:
        adv = adv / (stats.std + epsilon)
    adv = torch.where(stats.signal, adv, torch.zeros_like(adv))
    return _broadcast(adv, mask), _broadcast(rewards, mask & scored.unsqueeze(-1))


# Both settings Dr. GRPO fixes come from the same figure, which shows the two terms it removes.
_DR_GRPO = "Liu et al. 2025, arXiv 2503.20783, Fig. 1"


@register_estimator("dr_grpo", needs_groups=True, fixed_settings={
    "algorithm.norm_adv_by_std": FixedSetting(
        False, f"Dr. GRPO drops GRPO's division by the group's reward std; {_DR_GRPO}"),
    "algorithm.loss_agg_mode": FixedSetting(
        "seq-mean-token-sum-norm",
        f"Dr. GRPO divides a response's token sum by a constant, not its length; {_DR_GRPO}")})
def dr_grpo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GRPO without the std division: `A_i = r_i - mean_g`.

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (Dr. GRPO, arXiv 2503.20783): dividing by the group std up-weights prompts that are almost
    always solved or almost always failed (a question-level difficulty bias).

    Fixed settings: Dr. GRPO removes both of GRPO's normalisations (the paper's Fig. 1), so it
    fixes `algorithm.norm_adv_by_std=false` (this function never divides by the std; the setting
    keeps the config truthful) and `algorithm.loss_agg_mode=seq-mean-token-sum-norm` (each
    response's token sum over a constant horizon, the generation budget, instead of its length).

    Returns / Raises: as `grpo_advantages`.
    """
    _require_groups(inputs, "dr_grpo")
    return grpo_advantages(inputs, norm_by_std=False)


@register_estimator("rloo", needs_groups=True, fixed_settings={})
def rloo_advantages(inputs: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out: `A_i = r_i - (sum_{j != i} r_j) / (n_g - 1)` over scored samples.

    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (arXiv 2402.14740), the RLOO estimator (after Kool et
    al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"). The baseline excludes the
    sample itself, so the estimator stays unbiased. A group without spread gets exactly 0.

    Fixed settings: none; the estimator is the baseline, which any loss and aggregation can use.

    Returns / Raises: as `grpo_advantages`.
    """
    group_ids = _require_groups(inputs, "rloo")
    rewards, scored = _scored_rewards(inputs)
    mask = inputs.mask
    stats = _group_stats(rewards, scored, group_ids)
    baseline = (stats.total - rewards) / (stats.count - 1.0).clamp_min(1.0)
    adv = torch.where(stats.signal, rewards - baseline, torch.zeros_like(rewards))
    return _broadcast(adv, mask), _broadcast(rewards, mask & scored.unsqueeze(-1))


@register_estimator("reinforce_pp", token_rewards=True, params=lambda algo: {"gamma": algo.gamma},
                    fixed_settings={})
def reinforce_pp_advantages(inputs: AdvantageInputs, *, gamma: float = 1.0,
                            epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return-to-go, whitened over all valid tokens of the batch.

    `G_t = sum_{k >= t} gamma^(k-t) r_k` (token rewards, or the sequence reward on the last valid
    token), then `A_t = (G_t - mean) / (std + eps)` with mean/std over every valid token of the
    batch's scored samples (global normalisation, no groups); a batch whose returns have no
    spread gets exactly 0.

    Source: Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), global advantage normalisation.
    Call it on the whole optimizer-step batch: whitening per micro-batch changes the result.

    Fixed settings: none; the global normalisation that defines it happens here, whatever the
    config says, and `gamma` is a knob of the method.

    Args:
        inputs: needs `rewards` (or `token_rewards`) and `response_mask`.
        gamma: discount per token, in [0, 1].
        epsilon: added to the std.

    Returns:
        `(advantages, returns)` `[B, T]` float32; returns are the un-whitened `G_t`.

    Raises:
        ValueError: `gamma` outside [0, 1], or a scored reward is NaN/inf.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    rewards, scored = _scored_rewards(inputs)
    mask = inputs.mask & scored.unsqueeze(-1)
    returns = _discounted_returns(_token_rewards(inputs, rewards, mask), mask, gamma)
    return _masked_whiten(returns, mask, epsilon).float(), returns.float()


@register_estimator("reinforce_pp_baseline", needs_groups=True, fixed_settings={})
def reinforce_pp_baseline_advantages(inputs: AdvantageInputs, *,
                                     epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the batch's tokens.

    `A_i = r_i - mean_g`, broadcast over valid tokens, then whitened with mean/std over the valid
    tokens of sequences that have a baseline (as verl's `masked_whiten`). Groups with < 2 scored
    members carry no signal: they get 0 and stay out of the whitening statistics (they would
    shift its mean). Groups whose rewards are all equal get exactly 0 too; their (zero) centred
    values stay in the statistics, so every other group gets verl's value.

    Source: Hu et al. 2025, "REINFORCE++" (arXiv 2501.03262), "REINFORCE++ w/ baseline"
    (group-mean baseline followed by global normalisation).

    Fixed settings: none (as `reinforce_pp_advantages`: both steps happen here).

    Returns:
        `(advantages, returns)` `[B, T]` float32; returns are the sequence rewards on valid tokens.

    Raises:
        ValueError: `inputs.group_ids` is None, or a scored reward is NaN/inf.
    """
    group_ids = _require_groups(inputs, "reinforce_pp_baseline")
    rewards, scored = _scored_rewards(inputs)
    mask = inputs.mask
    stats = _group_stats(rewards, scored, group_ids)
    token_mask = mask & (scored & (stats.count >= 2)).unsqueeze(-1)
    centered = torch.where(token_mask, (rewards - stats.mean).unsqueeze(-1), torch.zeros((), dtype=torch.float64))
    adv = torch.where(stats.signal.unsqueeze(-1), _masked_whiten(centered, token_mask, epsilon), 0.0)
    return adv.float(), _broadcast(rewards, mask & scored.unsqueeze(-1))


@register_estimator("gae", needs_critic=True, token_rewards=True,
                    params=lambda algo: {"gamma": algo.gamma, "lam": algo.lam, "whiten": algo.whiten_advantages},
                    fixed_settings={})
def gae_advantages(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0,
                   whiten: bool = False, epsilon: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`,
    `returns_t = A_t + V_t`, where "next" is the next *valid* token (masked positions such as tool
    output are skipped, so their values and rewards are never read) and `V = 0` after the last.
    Computed in float64; unscored samples get 0 and stay out of the whitening statistics.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation" (arXiv 1506.02438), eq. 16; truncated form as in PPO (arXiv 1707.06347) eqs. 11-12.

    Fixed settings: none; `gamma` and `lam` are the method's own knobs, and whitening is a
    common practice, not part of its definition.

    Args:
        inputs: needs `values` `[B, T]`, `response_mask`, and `rewards` or `token_rewards`.
        gamma: discount per token, in [0, 1].
        lam: GAE lambda, in [0, 1].
        whiten: whiten the advantages over the batch's valid tokens (common in PPO for LLMs); a
            batch whose advantages have no spread (`has_spread`) gets exactly 0.
        epsilon: added to the std when whitening.

    Returns:
        `(advantages, returns)` `[B, T]` float32, 0 outside the mask; `returns` are the value
        targets (computed before any whitening).

    Raises:
        ValueError: `inputs.values` is None, `gamma`/`lam` outside [0, 1], or a scored reward is
            NaN/inf.
    """
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs inputs.values ([B, T] critic values)")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    rewards, scored = _scored_rewards(inputs)
    mask = inputs.mask & scored.unsqueeze(-1)
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    values = torch.where(mask, inputs.values.float().double(), zero)
    token_rewards = _token_rewards(inputs, rewards, mask)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        valid_t = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(valid_t, adv_t, next_adv)
        next_value = torch.where(valid_t, values[:, t], next_value)
        advantages[:, t] = torch.where(valid_t, adv_t, zero)
    returns = torch.where(mask, advantages + values, zero)
    if whiten:
        advantages = _masked_whiten(advantages, mask, epsilon)
    return advantages.float(), returns.float()
