"""DAPO's data-side techniques: overlong reward shaping, overlong filtering, dynamic sampling.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
(arXiv 2503.14476), Sec. 3.2 (dynamic sampling) and Sec. 3.4 (overlong filtering and soft
overlong punishment, eq. 13).

Dynamic sampling drops groups whose rewards are all equal (all correct / all wrong): their
group-relative advantages are 0, so they only dilute the batch. `fill_groups_with_spread` keeps
asking for more groups until enough carry signal, and gives up with a clear error after
`max_rounds` instead of spinning forever on a dataset that is too easy or too hard.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from async_rl.algorithms.advantages import has_spread

__all__ = [
    "GroupRewards",
    "overlong_reward_shaping",
    "overlong_filter_mask",
    "group_has_spread",
    "filter_groups_with_spread",
    "rewards_have_spread",
    "DynamicSamplingResult",
    "fill_groups_with_spread",
]

# Default group layout of `fill_groups_with_spread`: (group id, one reward per sample).
GroupRewards = tuple[Hashable, Sequence[float]]


def overlong_reward_shaping(rewards: Tensor, response_lengths: Tensor, *, max_response_tokens: int,
                            buffer_tokens: int, penalty_factor: float) -> Tensor:
    """Add DAPO's soft overlong punishment to sequence rewards.

    With `L = max_response_tokens`, `C = buffer_tokens`, `|y|` the response length (eq. 13):

        penalty = 0                          if |y| <= L - C
                = ((L - C) - |y|) / C        if L - C < |y| <= L     (linear from 0 to -1)
                = -1                         if |y| > L
        shaped  = reward + penalty_factor * penalty

    Args:
        rewards: `[B]` float base rewards.
        response_lengths: `[B]` int or float response lengths in tokens.
        max_response_tokens: L, the generation limit in tokens, > 0.
        buffer_tokens: C, width of the linear penalty zone in tokens, in (0, L].
        penalty_factor: scale of the full penalty, >= 0.

    Returns:
        `[B]` float32 shaped rewards.

    Raises:
        ValueError: parameters out of range, or shapes differ.

    Example: L 100, C 20, factor 1, base reward 1, lengths 70 / 90 / 100 -> 1.0 / 0.5 / 0.0.
    """
    if max_response_tokens <= 0 or not 0 < buffer_tokens <= max_response_tokens:
        raise ValueError(f"need max_response_tokens > 0 and 0 < buffer_tokens <= max_response_tokens, "
                         f"got {max_response_tokens} and {buffer_tokens}")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    if rewards.shape != response_lengths.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and response_lengths "
                         f"{tuple(response_lengths.shape)} must both be [B]")
    length = response_lengths.float()
    start = float(max_response_tokens - buffer_tokens)
    penalty = ((start - length) / buffer_tokens).clamp(-1.0, 0.0)
    return rewards.float() + penalty_factor * penalty


def overlong_filter_mask(finish_reasons: Sequence[str]) -> Tensor:
    """Loss-mask rows for DAPO's overlong filtering: truncated samples are not trained on.

    Args:
        finish_reasons: `B` strings from the generator ("stop", "length", "abort", ...).

    Returns:
        `[B]` bool, False where the finish reason is "length" (cut at the token limit).
    """
    return torch.tensor([reason != "length" for reason in finish_reasons], dtype=torch.bool)


def _check_finite(rewards: Tensor) -> None:
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("non-finite reward in a group: fix the reward function; NaN rewards would "
                         "silently decide which groups are kept")


def group_has_spread(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Whether each group's rewards differ by more than float rounding over its valid samples.

    "Differ" is the estimators' rule (`async_rl.algorithms.advantages.has_spread`, on the rewards
    as float32), so a group with spread gets non-zero group-relative advantages and a group
    without gets exactly 0.

    Args:
        rewards: `[B]` float or integer rewards.
        group_ids: `[B]` integer group of each sample.
        valid: optional `[B]` bool; invalid samples (e.g. without a reward) are ignored.

    Returns:
        `[G]` bool, one entry per group in `torch.unique(group_ids)` order (sorted ids). A group
        with fewer than two valid samples has no spread.

    Raises:
        ValueError: a tensor is not 1-D of length B or has the wrong dtype (non-numeric rewards,
            non-integer group ids, non-bool `valid`), or a valid reward is NaN/inf.
    """
    if not isinstance(rewards, Tensor) or not isinstance(group_ids, Tensor):
        raise ValueError(f"rewards and group_ids must be tensors, got {type(rewards).__name__} and "
                         f"{type(group_ids).__name__}")
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    if rewards.dtype == torch.bool or rewards.is_complex() or group_ids.is_floating_point() \
            or group_ids.is_complex() or group_ids.dtype == torch.bool:
        raise ValueError(f"rewards must be real numbers and group_ids integers, got dtypes {rewards.dtype} and "
                         f"{group_ids.dtype}")
    if valid is not None and (not isinstance(valid, Tensor) or valid.shape != rewards.shape
                              or valid.dtype != torch.bool):
        raise ValueError(f"valid must be a [B]={tuple(rewards.shape)} bool tensor, got {valid!r}")
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid
    r = rewards.float()
    _check_finite(r[valid])
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    low = torch.full((num_groups,), math.inf, device=r.device).scatter_reduce(
        0, inverse, torch.where(valid, r, math.inf), reduce="amin")
    high = torch.full((num_groups,), -math.inf, device=r.device).scatter_reduce(
        0, inverse, torch.where(valid, r, -math.inf), reduce="amax")
    count = torch.zeros(num_groups, device=r.device).index_add(0, inverse, valid.float())
    # All-invalid groups have high=-inf, low=+inf: has_spread is False for them as wanted.
    return (count >= 2) & has_spread(low, high)


def filter_groups_with_spread(rewards: Tensor, group_ids: Tensor, valid: Tensor | None = None) -> Tensor:
    """Per-sample keep mask of dynamic sampling: True for samples whose group has spread.

    Returns:
        `[B]` bool.

    Raises:
        ValueError: as `group_has_spread`.
    """
    spread = group_has_spread(rewards, group_ids, valid)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return spread[inverse]


def rewards_have_spread(rewards: Sequence[float], min_spread: float = 0.0) -> bool:
    """Pure-python spread test of one group, by the estimators' rule.

    True iff the group has at least two rewards, they differ by more than float rounding
    (`has_spread` on the rewards as float32: 0.1 + 0.2 and 0.3 are one float32 value, so no
    spread), and `max - min > min_spread`.

    Args:
        rewards: the group's rewards (real numbers; bool counts as 0/1).
        min_spread: threshold on `max - min`, >= 0.

    Raises:
        ValueError: `rewards` is not a sequence of real numbers (a `None` reward included), a
            reward is NaN/inf, or `min_spread` is negative or not a number.
    """
    if isinstance(rewards, (str, bytes)) or not isinstance(rewards, Sequence):
        raise ValueError(f"group rewards must be a sequence of numbers, got {type(rewards).__name__}")
    bad = [r for r in rewards if not isinstance(r, numbers.Real)]
    if bad:
        raise ValueError(f"group rewards must be real numbers, got {bad[0]!r} in {list(rewards)} (a reward of None "
                         f"means it could not be computed: reject that sample instead)")
    if not isinstance(min_spread, numbers.Real) or not min_spread >= 0:
        raise ValueError(f"min_spread must be a number >= 0, got {min_spread!r}")
    values = [float(r) for r in rewards]
    if not all(math.isfinite(r) for r in values):
        raise ValueError(f"non-finite reward in group rewards {values}")
    if len(values) < 2:
        return False
    as_f32 = torch.tensor(values, dtype=torch.float32)
    low, high = as_f32.min(), as_f32.max()
    return bool(has_spread(low, high)) and float(high - low) > min_spread


@dataclass
class DynamicSamplingResult:
    """Outcome of `fill_groups_with_spread`.

    Attributes:
        groups: exactly `target_groups` accepted groups, in arrival order.
        surplus: accepted groups beyond the target (from the last round); reuse them or drop them.
        num_rounds: calls made to the round generator, in [1, max_rounds].
        num_rejected: groups dropped for lack of spread.
    """

    groups: list[Any]
    surplus: list[Any] = field(default_factory=list)
    num_rounds: int = 0
    num_rejected: int = 0


def _default_rewards_of(group: Any) -> Sequence[float]:
    return group[1]


def fill_groups_with_spread(generate_round: Callable[[int], Iterable[Any]], *, target_groups: int,
                            max_rounds: int | None = None, max_groups: int | None = None, min_spread: float = 0.0,
                            rewards_of: Callable[[Any], Sequence[float]] = _default_rewards_of,
                            ) -> DynamicSamplingResult:
    """Dynamic sampling: generate rounds of groups until `target_groups` of them have spread.

    DAPO (arXiv 2503.14476, Sec. 3.2) bounds the search by generation rounds; a caller whose
    rounds take exactly the missing groups (async mode, from the replay buffer) bounds it by
    groups examined instead.

    Args:
        generate_round: called with the number of groups still missing; returns an iterable of
            groups, by default `(group_id, rewards)` tuples (any object works with `rewards_of`).
        target_groups: accepted groups needed, >= 1.
        max_rounds: upper bound on calls to `generate_round`, >= 1.
        max_groups: instead of `max_rounds`: no further round once this many groups (accepted
            and rejected) were examined, >= 1.
        min_spread: a group is accepted when `max(rewards) - min(rewards) > min_spread`.
        rewards_of: extracts the list of float rewards from a group.

    Returns:
        `DynamicSamplingResult`: `target_groups` groups, and accepted groups beyond them as surplus.

    Raises:
        ValueError: `target_groups` < 1, not exactly one of `max_rounds` / `max_groups` given or
            one < 1; a non-finite reward; or fewer than `target_groups` accepted groups when the
            budget is spent (the message gives the counts; the loop never runs longer).

    Example: a generator that only ever yields `("g", [5.0])` (one sample, no spread) is called
    `max_rounds` times, then ValueError.
    """
    if (max_rounds is None) == (max_groups is None):
        raise ValueError("fill_groups_with_spread: give exactly one of max_rounds and max_groups")
    budget = max_rounds if max_rounds is not None else max_groups
    if target_groups < 1 or budget < 1:
        raise ValueError(f"target_groups and max_rounds/max_groups must be >= 1, got {target_groups} and {budget}")
    accepted: list[Any] = []
    rejected = 0
    round_index = 0
    while (max_rounds is None or round_index < max_rounds) and \
            (max_groups is None or len(accepted) + rejected < max_groups):
        round_index += 1
        for group in generate_round(target_groups - len(accepted)):
            if rewards_have_spread(rewards_of(group), min_spread):
                accepted.append(group)
            else:
                rejected += 1
        if len(accepted) >= target_groups:
            return DynamicSamplingResult(groups=accepted[:target_groups], surplus=accepted[target_groups:],
                                         num_rounds=round_index, num_rejected=rejected)
    raise ValueError(
        f"dynamic sampling found only {len(accepted)} of {target_groups} groups with reward spread "
        f"after {round_index} rounds ({rejected} groups rejected with identical rewards); the prompts "
        f"are too easy or too hard for the policy, or the reward is constant: allow more rounds, "
        f"lower the target, or check the reward function")
