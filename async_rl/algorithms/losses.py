"""Policy losses with off-policy (behaviour) correction, chosen by name from `POLICY_LOSSES`.

Three log-probs of the same sampled tokens enter every loss (house naming, see STYLE.md):

    logprobs            pi_theta,  current learner policy, carries grad
    proximal_logprobs   pi_prox,   learner policy before this optimizer step (recomputed)
    behavior_logprobs   mu,        the engine that sampled the tokens (maybe several versions old)

Decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv 2505.24298)
splits the importance ratio in two: the trust region is enforced on `pi_theta / pi_prox` (clipped),
and the off-policyness `pi_prox / mu` is a detached weight that is truncated (TIS) or masked
(IcePop), per token or per sequence. `bypass=True` sets `pi_prox := mu` (no recompute; the clip
then also absorbs the off-policyness). The same weight corrects training-inference mismatch
(different kernels / precision in engine and learner) even at staleness 0.

    per-token loss = w_behavior * l(ratio, A)       then aggregate_loss(..., agg_mode, N_tok, N_seq)

Every loss has the same call:

    loss, metrics = POLICY_LOSSES.get(name)(
        logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
        agg_mode="token-mean", num_global_tokens=N_tok, num_global_seqs=N_seq, **loss_params)

All per-token tensors are `[B, T]` float32. Masked slots may hold anything (NaN, inf): they are
selected out before any arithmetic, so they add 0 to the loss and 0 to every gradient, while a
NaN in a valid slot still makes the loss NaN. Log-ratios are clamped to +-`LOG_RATIO_CLAMP`
before `exp`.

Metrics are detached 0-dim tensors averaged over the valid tokens of this micro-batch (the caller
averages them over micro-batches and ranks): clip_frac, clip_frac_high, clip_frac_low, ratio_mean,
ratio_max, approx_kl, behavior_weight_mean, behavior_weight_trunc_frac,
mismatch_logprob_abs_diff, mismatch_kl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from async_rl.algorithms.aggregation import aggregate_loss
from async_rl.algorithms.kl import LOG_RATIO_CLAMP
from async_rl.algorithms.logprobs import masked_max, masked_mean, masked_sum
from async_rl.algorithms.registry import Registry

__all__ = ["BEHAVIOR_CORRECTIONS", "POLICY_LOSSES", "policy_loss"]

POLICY_LOSSES = Registry("policy loss")

BEHAVIOR_CORRECTIONS: tuple[str, ...] = ("none", "tis", "icepop", "seq_tis", "seq_icepop")


def policy_loss(name: str, logprobs: Tensor, proximal_logprobs: Tensor | None,
                behavior_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
    """Look up policy loss `name` in `POLICY_LOSSES` (or by import path) and call it.

    Returns:
        `(loss, metrics)`: 0-dim loss with grad, dict of detached 0-dim metric tensors.

    Raises:
        ValueError: unknown name, or the loss's own errors.
    """
    fn = POLICY_LOSSES.get(name)
    return fn(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask, **kwargs)


# ----------------------------------------------------------------------------------------------
# shared machinery


def _k3(log_r: Tensor) -> Tensor:
    """Schulman's k3 `(r - 1) - log r`, which estimates KL(q || p) for `r = p / q`, x ~ q."""
    return torch.expm1(log_r) - log_r


@dataclass
class _Prepared:
    mask: Tensor  # [B, T] bool
    log_ratio: Tensor  # [B, T] log(pi_theta / pi_prox), clamped, 0 outside mask, with grad
    advantages: Tensor  # [B, T] float32, 0 outside mask
    behavior_weight: Tensor  # [B, T] detached w = f(pi_prox / mu)
    metrics: dict[str, Tensor]


def _prepare(logprobs: Tensor, proximal_logprobs: Tensor | None, behavior_logprobs: Tensor,
             advantages: Tensor, loss_mask: Tensor, *, behavior_correction: str, tis_cap: float,
             icepop_low: float, icepop_high: float, bypass: bool) -> _Prepared:
    if behavior_correction not in BEHAVIOR_CORRECTIONS:
        raise ValueError(f"unknown behavior_correction {behavior_correction!r}; valid: "
                         f"{', '.join(BEHAVIOR_CORRECTIONS)}")
    if not tis_cap > 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if not 0 <= icepop_low < icepop_high:
        raise ValueError(f"need 0 <= icepop_low < icepop_high, got [{icepop_low}, {icepop_high}]")
    if proximal_logprobs is None and not bypass:
        raise ValueError("proximal_logprobs is None: recompute them with the learner's pre-update "
                         "weights, or pass bypass=True to use behavior_logprobs instead")
    proximal = behavior_logprobs if bypass else proximal_logprobs
    shapes = {n: tuple(t.shape) for n, t in [("logprobs", logprobs), ("proximal_logprobs", proximal),
                                               ("behavior_logprobs", behavior_logprobs),
                                               ("advantages", advantages), ("loss_mask", loss_mask)]}
    if len(set(shapes.values())) != 1 or logprobs.dim() != 2:
        raise ValueError(f"policy loss inputs must all be [B, T], got {shapes}")

    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    logprobs, proximal, behavior = logprobs.float(), proximal.float(), behavior_logprobs.float()

    # Select before subtracting: where() sends zero gradient to unselected slots, and the
    # subtraction's backward passes that zero on unchanged, so NaN there never reaches logprobs.
    log_ratio = torch.where(mask, logprobs - proximal, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(mask, advantages.float(), zero)

    behavior_log_w = torch.where(mask, proximal - behavior, zero).detach()
    if behavior_correction.startswith("seq_"):
        # Sequence-level weight: product of the token ratios, the importance weight of the whole
        # response; truncating or masking it treats the response as one sample.
        behavior_log_w = torch.where(mask, masked_sum(behavior_log_w, mask, dim=-1).unsqueeze(-1), zero)
    raw_w = torch.exp(behavior_log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if behavior_correction in ("tis", "seq_tis"):
        weight, truncated = raw_w.clamp(max=tis_cap), raw_w > tis_cap
    elif behavior_correction in ("icepop", "seq_icepop"):
        keep = (raw_w >= icepop_low) & (raw_w <= icepop_high)
        weight, truncated = torch.where(keep, raw_w, zero), ~keep
    else:
        weight, truncated = torch.ones_like(raw_w), torch.zeros_like(mask)

    # Mismatch between learner and engine on the same tokens. In bypass mode there is no separate
    # proximal pass, so the current (detached) log-probs stand in for the learner's view.
    learner = logprobs.detach() if bypass else proximal
    mismatch_log_r = torch.where(mask, learner - behavior, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_detached = torch.exp(log_ratio.detach())
    metrics = {
        "ratio_mean": masked_mean(ratio_detached, mask),
        "ratio_max": masked_max(ratio_detached, mask),
        "approx_kl": masked_mean(_k3(log_ratio.detach()), mask),
        "behavior_weight_mean": masked_mean(weight, mask),
        "behavior_weight_trunc_frac": masked_mean(truncated.float(), mask),
        "mismatch_logprob_abs_diff": masked_mean(mismatch_log_r.abs(), mask),
        # x ~ mu and r = pi_learner / mu, so k3 estimates KL(mu || pi_learner).
        "mismatch_kl": masked_mean(_k3(mismatch_log_r), mask),
    }
    return _Prepared(mask=mask, log_ratio=log_ratio, advantages=adv, behavior_weight=weight, metrics=metrics)


def _finish(per_token: Tensor, prep: _Prepared, clipped_high: Tensor, clipped_low: Tensor, *,
            agg_mode: str, num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
            horizon: int | None) -> tuple[Tensor, dict[str, Tensor]]:
    loss = aggregate_loss(prep.behavior_weight * per_token, prep.mask, agg_mode,
                          num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs,
                          horizon=horizon)
    metrics = dict(prep.metrics)
    metrics["clip_frac"] = masked_mean((clipped_high | clipped_low).float(), prep.mask)
    metrics["clip_frac_high"] = masked_mean(clipped_high.float(), prep.mask)
    metrics["clip_frac_low"] = masked_mean(clipped_low.float(), prep.mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


def _check_clip(clip_ratio_low: float, clip_ratio_high: float) -> None:
    if not 0 <= clip_ratio_low <= 1 or clip_ratio_high < 0:
        raise ValueError(f"need 0 <= clip_ratio_low <= 1 and clip_ratio_high >= 0, got "
                         f"low={clip_ratio_low}, high={clip_ratio_high}")


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_ratio_low: float,
                       clip_ratio_high: float) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's pessimistic clipped loss per token, and where the clip binds (zero gradient)."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    # The clip only binds (and kills the gradient) when it moves the loss up: above the range for
    # A > 0, below it for A < 0. Ratio > 1 + eps with A < 0 is *not* clipped.
    high = (adv > 0) & (ratio > 1.0 + clip_ratio_high)
    low = (adv < 0) & (ratio < 1.0 - clip_ratio_low)
    return per_token, high, low


# ----------------------------------------------------------------------------------------------
# losses


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logprobs: Tensor, proximal_logprobs: Tensor | None, behavior_logprobs: Tensor,
                  advantages: Tensor, loss_mask: Tensor, *, agg_mode: str,
                  num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
                  horizon: int | None = None, behavior_correction: str = "none",
                  tis_cap: float = 2.0, icepop_low: float = 0.5, icepop_high: float = 2.0,
                  bypass: bool = False, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                  clip_ratio_c: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss with decoupled ratio, clip-higher and optional dual clip.

    With `r = pi_theta / pi_prox` and `w` the detached behaviour weight:

        l = w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))           PPO eq. 7 (negated)
        l = min(l, -w A c)  where A < 0                                     dual clip, c > 1

    Sources: Schulman et al. 2017, PPO (arXiv 1707.06347), eq. 7; asymmetric "clip-higher"
    `eps_high > eps_low` from DAPO (Yu et al. 2025, arXiv 2503.14476), Sec. 3.1; dual clip from Ye et
    al. 2020 (arXiv 1912.09729), which bounds the loss of very large ratios with negative advantage;
    decoupled ratio from Hilton et al. 2021 / AReaL (arXiv 2505.24298).

    Args:
        logprobs: `[B, T]` float32 current log-probs (with grad).
        proximal_logprobs: `[B, T]` float32 pre-update learner log-probs; may be None iff bypass.
        behavior_logprobs: `[B, T]` float32 engine log-probs.
        advantages: `[B, T]` float32.
        loss_mask: `[B, T]` bool/0-1.
        agg_mode, num_global_tokens, num_global_seqs, horizon: see `aggregate_loss`.
        behavior_correction: "none" | "tis" | "icepop" | "seq_tis" | "seq_icepop".
        tis_cap: truncation cap C of the TIS weight `min(pi_prox / mu, C)`, > 0.
        icepop_low, icepop_high: IcePop keeps `pi_prox / mu` inside `[low, high]`, zeroes it outside.
        bypass: use `behavior_logprobs` as `proximal_logprobs`.
        clip_ratio_low, clip_ratio_high: eps_low in [0, 1], eps_high >= 0.
        clip_ratio_c: dual-clip bound c > 1, or None for no dual clip.

    Returns:
        `(loss, metrics)`: 0-dim loss; metrics as in the module docstring. A token counts as
        "high"-clipped when r > 1 + eps_high with A > 0, "low"-clipped when r < 1 - eps_low with
        A < 0 or, with dual clip, r > c with A < 0.

    Raises:
        ValueError: shape mismatch, bad clip / correction parameters, unknown agg_mode, or
            proximal_logprobs None without bypass.

    Example (eps 0.2): tokens (r, A) = (1.5, +1), (1.5, -1), (0.5, -1) -> clip_frac 2/3,
    clip_frac_high 1/3, clip_frac_low 1/3.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    prep = _prepare(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
                    behavior_correction=behavior_correction, tis_cap=tis_cap, icepop_low=icepop_low,
                    icepop_high=icepop_high, bypass=bypass)
    ratio, adv = torch.exp(prep.log_ratio), prep.advantages
    per_token, high, low = _clipped_surrogate(ratio, adv, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        negative = adv < 0
        per_token = torch.where(negative, torch.minimum(per_token, -adv * clip_ratio_c), per_token)
        low = low | (negative & (ratio > clip_ratio_c))
    return _finish(per_token, prep, high & prep.mask, low & prep.mask, agg_mode=agg_mode,
                   num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs, horizon=horizon)


@POLICY_LOSSES.register("gspo")
def gspo_loss(logprobs: Tensor, proximal_logprobs: Tensor | None, behavior_logprobs: Tensor,
              advantages: Tensor, loss_mask: Tensor, *, agg_mode: str,
              num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
              horizon: int | None = None, behavior_correction: str = "none",
              tis_cap: float = 2.0, icepop_low: float = 0.5, icepop_high: float = 2.0,
              bypass: bool = False, clip_ratio_low: float = 3e-4,
              clip_ratio_high: float = 4e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization: PPO clipping on a sequence-level ratio.

    `s_i = exp(mean_t log(pi_theta / pi_prox))` (geometric mean of the token ratios over the
    sequence's valid tokens). It is applied in the GSPO-token form
    `s_i,t = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]`, whose value is `s_i` and whose gradient
    is `s_i * grad log pi_theta(y_t)`; with per-sequence advantages and "seq-mean-token-mean"
    aggregation this equals sequence-level GSPO exactly.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071): the
    sequence ratio, its clipped objective, and the GSPO-token variant; defaults eps_low 3e-4,
    eps_high 4e-4 are the paper's. The mean log-ratio is clamped to +-`LOG_RATIO_CLAMP`.

    Args / Returns / Raises: as `ppo_clip_loss` (no dual clip). The clip decision is per
    sequence, so all valid tokens of a sequence are clipped together.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    prep = _prepare(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
                    behavior_correction=behavior_correction, tis_cap=tis_cap, icepop_low=icepop_low,
                    icepop_high=icepop_high, bypass=bypass)
    mask = prep.mask
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    proximal = behavior_logprobs if bypass else proximal_logprobs
    # Unclamped token log-ratios for the mean (one extreme token should move s_i by its share,
    # not by the clamp); only the mean is clamped before exp.
    token_log_ratio = torch.where(mask, logprobs.float() - proximal.float(), zero)
    seq_log_ratio = masked_mean(token_log_ratio.detach(), mask, dim=-1)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)
    lp = torch.where(mask, logprobs.float(), zero)
    ratio = torch.exp(lp - lp.detach() + seq_log_ratio)
    per_token, high, low = _clipped_surrogate(ratio, prep.advantages, clip_ratio_low, clip_ratio_high)
    prep.metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    prep.metrics["ratio_max"] = masked_max(ratio.detach(), mask)
    return _finish(per_token, prep, high & mask, low & mask, agg_mode=agg_mode,
                   num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs, horizon=horizon)


@POLICY_LOSSES.register("cispo")
def cispo_loss(logprobs: Tensor, proximal_logprobs: Tensor | None, behavior_logprobs: Tensor,
               advantages: Tensor, loss_mask: Tensor, *, agg_mode: str,
               num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
               horizon: int | None = None, behavior_correction: str = "none",
               tis_cap: float = 2.0, icepop_low: float = 0.5, icepop_high: float = 2.0,
               bypass: bool = False, clip_ratio_low: float = 1.0,
               clip_ratio_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, detached importance weight; no token is dropped.

        l = -w * sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta,   r = pi_theta / pi_prox

    Unlike PPO's clip, which zeroes the gradient of tokens outside the trust region (often rare
    "fork" tokens), CISPO keeps every token's gradient and only bounds its weight.

    Source: MiniMax 2025, "MiniMax-M1" (arXiv 2506.13585), eqs. 4-5. The paper leaves the lower
    bound off, hence the default `clip_ratio_low = 1.0` (weight floor 0); tune `clip_ratio_high`.

    Args / Raises: as `ppo_clip_loss` (no dual clip).

    Returns:
        `(loss, metrics)`. The loss value is a surrogate (its gradient is the policy gradient);
        "high"/"low" clip fractions count tokens whose weight was truncated above / below,
        whatever the advantage sign, since the truncation scales the gradient for both signs.
    """
    _check_clip(clip_ratio_low, clip_ratio_high)
    prep = _prepare(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
                    behavior_correction=behavior_correction, tis_cap=tis_cap, icepop_low=icepop_low,
                    icepop_high=icepop_high, bypass=bypass)
    mask = prep.mask
    ratio = torch.exp(prep.log_ratio.detach())
    is_weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    lp = torch.where(mask, logprobs.float(), torch.zeros((), dtype=torch.float32, device=logprobs.device))
    per_token = -is_weight * prep.advantages * lp
    high = mask & (ratio > 1.0 + clip_ratio_high)
    low = mask & (ratio < 1.0 - clip_ratio_low)
    return _finish(per_token, prep, high, low, agg_mode=agg_mode, num_global_tokens=num_global_tokens,
                   num_global_seqs=num_global_seqs, horizon=horizon)
