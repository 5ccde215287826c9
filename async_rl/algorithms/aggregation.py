"""Reduce a per-token loss `[B, T]` to the scalar the optimizer sees.

The normalisers are *global*: they count valid tokens / valid sequences over every micro-batch
and every data-parallel rank of one optimizer step. Each micro-batch loss is then a partial sum of
the full-batch loss, so summing micro-batch losses (gradient accumulation) and summing gradients
across ranks (all-reduce SUM, not AVG) reproduce the full-batch loss and gradients exactly,
whatever the split.

Typical use in a training step:

    num_tokens, num_seqs = zero, zero
    for mb in micro_batches:                      # all micro-batches of this rank
        t, s = count_normalizers(mb.loss_mask)
        num_tokens, num_seqs = num_tokens + t, num_seqs + s
    all_reduce(num_tokens, SUM); all_reduce(num_seqs, SUM)   # across data-parallel ranks
    for mb in micro_batches:
        aggregate_loss(per_token_loss(mb), mb.loss_mask, mode, num_global_tokens=num_tokens,
                       num_global_seqs=num_seqs).backward()
    all_reduce(grads, SUM); optimizer.step()

A sequence is *valid* when it has at least one token with `loss_mask == 1`; fully masked
sequences (padding rows, samples dropped by a filter) count for nothing in any mode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rl.algorithms.logprobs import masked_count, masked_sum

__all__ = ["LOSS_AGG_MODES", "aggregate_loss", "count_normalizers"]

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def count_normalizers(loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Count valid tokens and valid sequences of one micro-batch.

    Sum the results over micro-batches and all-reduce (SUM) them over data-parallel ranks before
    passing them to `aggregate_loss`.

    Args:
        loss_mask: `[B, T]` bool or 0/1.

    Returns:
        `(num_tokens, num_seqs)`: 0-dim int64 tensors on `loss_mask.device`; `num_seqs` counts
        rows with at least one valid token.

    Raises:
        ValueError: `loss_mask` is not 2-D.

    Example: `loss_mask = [[1, 1, 1, 1], [0, 0, 0, 0]]` -> `(4, 1)`.
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    return mask.sum(dtype=torch.int64), mask.any(dim=-1).sum(dtype=torch.int64)


def _as_normalizer(value: float | Tensor, name: str, like: Tensor) -> Tensor:
    if not isinstance(value, Tensor):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        value = torch.tensor(float(value))
    # An optimizer step without any valid token must give loss 0 (numerator is 0), not 0/0.
    return value.to(device=like.device, dtype=torch.float32).clamp_min(1.0)


def aggregate_loss(per_token_loss: Tensor, loss_mask: Tensor, mode: str, *,
                   num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
                   horizon: int | None = None) -> Tensor:
    """Aggregate a per-token loss of one micro-batch with global normalisers.

    Modes (sums run over valid tokens / valid sequences of this micro-batch; `N_tok`, `N_seq` are
    the global normalisers; `n_i` the valid tokens of sequence i; `H` the horizon):

        token-mean               sum_i sum_t l_it / N_tok                    DAPO token-level loss
        seq-mean-token-mean      sum_i (sum_t l_it / n_i) / N_seq            GRPO paper, eq. 3
        seq-mean-token-sum       sum_i sum_t l_it / N_seq
        seq-mean-token-sum-norm  sum_i (sum_t l_it / H) / N_seq              Dr. GRPO (constant H)

    Sources: DAPO (Yu et al. 2025, arXiv 2503.14476), Sec. 3.3 "token-level policy gradient loss";
    DeepSeekMath (arXiv 2402.03300) GRPO objective; Dr. GRPO (Liu et al. 2025, arXiv 2503.20783),
    which replaces the per-sequence length `n_i` by a constant.

    Masked slots contribute exactly 0 to the value and 0 gradient, even when they hold NaN/inf;
    a NaN in a valid slot propagates to the loss.

    Args:
        per_token_loss: `[B, T]` float loss per token (with grad).
        loss_mask: `[B, T]` bool or 0/1, 1 on tokens that count.
        mode: one of `LOSS_AGG_MODES`.
        num_global_tokens: valid tokens of the whole optimizer step (all micro-batches and ranks),
            float or 0-dim tensor; values below 1 are treated as 1.
        num_global_seqs: valid sequences of the whole optimizer step, likewise.
        horizon: the constant `H` of "seq-mean-token-sum-norm", usually the max response length
            in tokens; ignored by the other modes.

    Returns:
        0-dim float tensor; summing it over micro-batches gives the full-step loss.

    Raises:
        ValueError: unknown mode, shape mismatch, negative python normaliser, or a missing /
            non-positive `horizon` for "seq-mean-token-sum-norm".

    Example: losses `[[1, 100], [1, -50]]`, mask `[[1, 0], [1, 0]]`, `num_global_tokens=2`,
    "token-mean" -> `(1 + 1) / 2 = 1.0`; the masked 100 and -50 get gradient 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    if per_token_loss.shape != loss_mask.shape or per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss {tuple(per_token_loss.shape)} and loss_mask "
                         f"{tuple(loss_mask.shape)} must both be [B, T]")
    mask = loss_mask.bool()
    if mode == "token-mean":
        return masked_sum(per_token_loss, mask) / _as_normalizer(num_global_tokens, "num_global_tokens",
                                                                  per_token_loss)
    num_seqs = _as_normalizer(num_global_seqs, "num_global_seqs", per_token_loss)
    seq_sums = masked_sum(per_token_loss, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        # Fully masked rows have sum 0 and count clamped to 1, so they add exactly 0.
        seq_losses = seq_sums / masked_count(per_token_loss, mask, dim=-1).clamp_min(1.0)
    elif mode == "seq-mean-token-sum":
        seq_losses = seq_sums
    else:
        if horizon is None or horizon <= 0:
            raise ValueError(f"loss aggregation 'seq-mean-token-sum-norm' needs horizon > 0 (the max "
                             f"response length in tokens), got {horizon}")
        seq_losses = seq_sums / float(horizon)
    return seq_losses.sum() / num_seqs
