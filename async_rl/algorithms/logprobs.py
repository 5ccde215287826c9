"""Token log-probabilities, entropies and masked reductions.

Everything here is pure torch, runs on any device, never calls `.item()` and keeps gradients.
Per-token tensors are `[B, T]` (batch of padded sequences) but every function also accepts any
leading shape, e.g. packed `[T]` sequences (`logits [T, V]`, `labels [T]`).

Masked reductions select with `torch.where` instead of multiplying by the mask: `NaN * 0` is
`NaN`, so a multiplied-out padded slot holding NaN/inf would poison the whole reduction (and its
gradient). With `where`, masked slots contribute exactly 0 to values and gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "logprobs_from_logits",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
    "masked_max",
    "masked_count",
]


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each label under `softmax(logits / temperature)`.

    Computed as `z[label] - logsumexp(z)` with `z = float32(logits) / temperature`, which never
    materialises the full `[B, T, V]` log-softmax and is exact for bf16/fp16 logits because the
    reduction runs in float32. Temperature must match the sampler's, otherwise learner and engine
    log-probs disagree systematically.

    Args:
        logits: `[B, T, V]` float (any float dtype), unnormalised scores; `V` is the vocab size.
        labels: `[B, T]` int64 token ids in `[0, V)` (the tokens whose log-prob is wanted,
            usually the input ids shifted left by one).
        temperature: sampling temperature, > 0.

    Returns:
        `[B, T]` float32 log-probabilities in nats (<= 0).

    Raises:
        ValueError: `temperature <= 0`, or `labels.shape != logits.shape[:-1]`.

    Example: temperature 0.5, logits `[2, 0]`, label 0 -> `4 - log(e^4 + 1) = -0.0181`.
    """
    _check_temperature(temperature)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits shape without the "
                         f"vocab dim {tuple(logits.shape[:-1])}")
    z = logits.float() / temperature
    picked = torch.gather(z, -1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy `H = -sum_v p_v log p_v` of `p = softmax(logits / temperature)`, per position.

    Computed as `logsumexp(z) - sum_v p_v z_v` (float32), the form that stays finite when some
    logits are `-inf` (vocab masking): those entries get `p_v = 0` and their `z_v` is replaced by 0
    so `0 * -inf` cannot produce NaN in the value or the gradient.

    Args:
        logits: `[B, T, V]` float, unnormalised scores.
        temperature: > 0, the sampler's temperature.

    Returns:
        `[B, T]` float32 entropy in nats, in `[0, log V]`.

    Raises:
        ValueError: `temperature <= 0`.

    Example: temperature 0.5, logits `[2, 0]` -> p = `[0.9820, 0.0180]`, H = 0.0901 nats.
    """
    _check_temperature(temperature)
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    z_finite = torch.where(torch.isneginf(z), torch.zeros_like(z), z)
    return lse.squeeze(-1) - (p * z_finite).sum(dim=-1)


def _bool_mask(x: Tensor, mask: Tensor) -> Tensor:
    try:
        return torch.broadcast_to(mask.bool(), x.shape)
    except RuntimeError as e:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not broadcast to {tuple(x.shape)}") from e


def masked_count(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Number of selected entries of `mask` (broadcast to `x`), as float32, reduced over `dim`.

    Raises:
        ValueError: `mask` does not broadcast to `x.shape`.
    """
    m = _bool_mask(x, mask)
    return m.sum(dim=dim, dtype=torch.float32) if dim is not None else m.sum(dtype=torch.float32)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of `x` over entries where `mask` is true; masked entries contribute exactly 0.

    Masked entries may hold NaN/inf: they are selected out with `torch.where`, so neither the
    value nor the gradient is affected. A NaN in a *selected* entry propagates (it is a real bug).

    Args:
        x: float tensor, e.g. `[B, T]`.
        mask: bool or 0/1 tensor broadcastable to `x`, true on entries to keep.
        dim: dims to reduce; `None` reduces everything to a scalar.

    Returns:
        `x.dtype` tensor with `dim` reduced.

    Raises:
        ValueError: `mask` does not broadcast to `x.shape`.
    """
    kept = torch.where(_bool_mask(x, mask), x, torch.zeros_like(x))
    return kept.sum(dim=dim) if dim is not None else kept.sum()


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of `x` over entries where `mask` is true (see `masked_sum` for NaN handling).

    An all-masked slice has mean 0 (its count is clamped to 1): a micro-batch without valid tokens
    must log 0, not NaN, and contribute no gradient.

    Args:
        x: float tensor, e.g. `[B, T]`.
        mask: bool or 0/1 tensor broadcastable to `x`.
        dim: dims to reduce; `None` -> scalar.

    Returns:
        float tensor with `dim` reduced (float32 when `x` is float32).

    Raises:
        ValueError: `mask` does not broadcast to `x.shape`.

    Example: `x = [[-0.5, -0.5, 7, nan]]`, `mask = [[1, 1, 0, 0]]` -> `-0.5`.
    """
    count = masked_count(x, mask, dim).clamp_min(1.0)
    return masked_sum(x, mask, dim) / count


def masked_max(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Max of `x` over entries where `mask` is true; 0 for an all-masked slice.

    Raises:
        ValueError: `mask` does not broadcast to `x.shape`.
    """
    m = _bool_mask(x, mask)
    filled = torch.where(m, x, torch.full_like(x, float("-inf")))
    if dim is None:
        return torch.where(m.any(), filled.max(), torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(m.any(dim=dim), filled.amax(dim=dim), torch.zeros((), dtype=x.dtype, device=x.device))
