"""Critic (value function) loss for PPO with GAE advantages."""

from __future__ import annotations

import torch
from torch import Tensor

from async_rl.algorithms.aggregation import aggregate_loss
from async_rl.algorithms.logprobs import masked_mean

__all__ = ["value_loss"]


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, *,
               clip_range_value: float | None, agg_mode: str, num_global_tokens: float | Tensor,
               num_global_seqs: float | Tensor,
               horizon: int | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped squared-error value loss.

        v_clip = old + clip(v - old, -eps_v, eps_v)
        l      = 0.5 * max((v - R)^2, (v_clip - R)^2)

    Source: the value clipping of PPO's reference implementation (OpenAI baselines `ppo2`,
    accompanying Schulman et al. 2017, arXiv 1707.06347), analysed in Engstrom et al. 2020,
    "Implementation Matters in Deep Policy Gradients" (arXiv 2005.12729). It keeps the critic from
    moving further than `eps_v` from the values it had when the batch was collected.

    Args:
        values: `[B, T]` float32 current critic predictions (with grad).
        old_values: `[B, T]` float32 critic predictions at rollout time (no grad).
        returns: `[B, T]` float32 value targets, e.g. from the "gae" estimator.
        loss_mask: `[B, T]` bool/0-1; masked slots may hold NaN/inf, they add 0 and get 0 grad.
        clip_range_value: eps_v > 0 in reward units, or None for the plain squared error.
        agg_mode, num_global_tokens, num_global_seqs, horizon: see `aggregate_loss`.

    Returns:
        `(loss, metrics)`: 0-dim loss; detached metrics "vf_clip_frac" (valid tokens where the
        clipped term is the larger one) and "vpred_mean", over this micro-batch's valid tokens.

    Raises:
        ValueError: shape mismatch, `clip_range_value <= 0`, or as `aggregate_loss`.
    """
    if not values.shape == old_values.shape == returns.shape == loss_mask.shape:
        raise ValueError(f"values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
                         f"{tuple(returns.shape)} and loss_mask {tuple(loss_mask.shape)} must match")
    if clip_range_value is not None and not clip_range_value > 0:
        raise ValueError(f"clip_range_value must be > 0 or None, got {clip_range_value}")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=values.device)
    # Select before arithmetic so NaN in padded slots cannot reach the gradient (0 * NaN = NaN).
    v = torch.where(mask, values.float(), zero)
    old = torch.where(mask, old_values.float(), zero)
    target = torch.where(mask, returns.float(), zero)
    err = (v - target) ** 2
    if clip_range_value is None:
        per_token, clipped = 0.5 * err, torch.zeros_like(mask)
    else:
        v_clip = old + (v - old).clamp(-clip_range_value, clip_range_value)
        err_clip = (v_clip - target) ** 2
        per_token, clipped = 0.5 * torch.maximum(err, err_clip), mask & (err_clip > err)
    loss = aggregate_loss(per_token, mask, agg_mode, num_global_tokens=num_global_tokens,
                          num_global_seqs=num_global_seqs, horizon=horizon)
    metrics = {"vf_clip_frac": masked_mean(clipped.float(), mask).detach(),
               "vpred_mean": masked_mean(v.detach(), mask)}
    return loss, metrics
