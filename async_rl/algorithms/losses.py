"""Policy losses with off-policy (behaviour) correction, chosen by name from `POLICY_LOSSES`.

Three log-probs of the same sampled tokens enter every loss (each named by where it came from):

    logprobs            pi_theta,  current learner policy, carries grad
    proximal_logprobs   pi_prox,   learner policy before this optimizer step (recomputed)
    behavior_logprobs   mu,        the engine that sampled the tokens (maybe several versions old)

Decoupled PPO (Hilton et al. 2021, arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv 2505.24298)
splits the importance ratio in two: the trust region is enforced on `pi_theta / pi_prox` (clipped),
and the off-policyness `pi_prox / mu` is a detached weight that is truncated (TIS) or masked
(IcePop), per token or per sequence. `OffPolicyCorrection.bypass_proximal` sets `pi_prox := mu`
(no recompute; the clip then also absorbs the off-policyness). The same weight corrects training-inference mismatch
(different kernels / precision in engine and learner) even at staleness 0.

    per-token loss = w_behavior * l(ratio, A)       then aggregate_loss(..., agg_mode, N_tok, N_seq)

Every loss has the same call: one inputs object, one off-policy-correction config, and its own
typed options (`fn.options_type`, a frozen `LossOptions` subclass; `async_rl.algorithms.loss_options`):

    inputs = PolicyLossInputs(logprobs, proximal_logprobs, behavior_logprobs, advantages, loss_mask,
                              agg_mode="token-mean", num_global_tokens=N_tok, num_global_seqs=N_seq)
    correction = OffPolicyCorrection("tis", tis_cap=2.0)        # or algo.off_policy_correction()
    options = PPOClipOptions(clip_ratio_high=0.28)              # or algo.loss_options()
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(inputs, correction, options)
    # loss: 0-dim float32 with grad; metrics: dict of detached 0-dim tensors

The options check their own ranges when built (one line naming the field, or the config key when
built by `AlgorithmConfig.loss_options()`); a loss checks what only the call can get wrong
(shapes, a missing proximal pass, options of another loss). A loss of your own registers with
`register_policy_loss(name, options_type)`, or is a plain `fn(inputs, correction, **params)`
whose keyword parameters become its options (`keyword_loss`).

Each built-in loss declares the config values its definition fixes (`fn.fixed_settings`, dotted
key -> `FixedSetting`, `{}` when none; `async_rl.algorithms.fixed_settings`): GSPO fixes
`algorithm.loss_agg_mode=seq-mean-token-mean`, CISPO `token-mean`, PPO clip nothing.
`load_config` applies them where the user left the key unset and refuses a conflicting value.

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

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor

from async_rl.algorithms.aggregation import aggregate_loss
from async_rl.algorithms.fixed_settings import FixedSetting, check_fixed_settings
from async_rl.algorithms.kl import LOG_RATIO_CLAMP
from async_rl.algorithms.logprobs import masked_max, masked_mean, masked_sum
from async_rl.algorithms.loss_options import (CISPOOptions, GSPOOptions, LossOptions, PolicyLoss, PPOClipOptions,
                                              as_policy_loss, check_options)
from async_rl.utils.registry import Registry

__all__ = ["BEHAVIOR_CORRECTIONS", "OffPolicyCorrection", "POLICY_LOSSES", "PolicyLossInputs", "policy_loss",
           "register_policy_loss"]

POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss", coerce=as_policy_loss,
    help="A policy loss is fn(inputs: PolicyLossInputs, correction: OffPolicyCorrection, options) -> (loss, metrics) "
         "with fn.options_type its LossOptions class, or fn(inputs, correction, **params).")


def register_policy_loss(name: str, options_type: type[LossOptions], *,
                         fixed_settings: Mapping[str, FixedSetting] | None = None) -> Callable[[Callable], Callable]:
    """Decorator that sets ``fn.options_type = options_type``, registers ``fn`` in
    ``POLICY_LOSSES`` under ``name`` and returns ``fn`` (called as ``fn(inputs, correction, options)``).

    Args:
        name: the registered name.
        options_type: the loss's ``LossOptions`` subclass.
        fixed_settings: the config values the loss's definition fixes (dotted key ->
            ``FixedSetting``; ``async_rl.algorithms.fixed_settings``), set as ``fn.fixed_settings``;
            every built-in declares them, ``{}`` when it fixes nothing. ``None`` (a user loss that
            does not opt in) declares nothing.

    Raises:
        ValueError: as ``Registry.register`` (taken or malformed name); ``options_type`` is not a
            ``LossOptions`` subclass; ``fixed_settings`` is malformed (``check_fixed_settings``).
    """
    if not (isinstance(options_type, type) and issubclass(options_type, LossOptions)):
        raise ValueError(f"policy loss {name!r}: options_type must be a LossOptions subclass, got {options_type!r}")
    fixed = check_fixed_settings(f"policy loss {name!r}", fixed_settings)

    def decorator(fn: Callable) -> Callable:
        fn.options_type = options_type  # type: ignore[attr-defined]
        if fixed is not None:
            fn.fixed_settings = fixed  # type: ignore[attr-defined]
        return POLICY_LOSSES.register(name, fn)

    return decorator

BEHAVIOR_CORRECTIONS: tuple[str, ...] = ("none", "tis", "icepop", "seq_tis", "seq_icepop")


@dataclass
class PolicyLossInputs:
    """What every policy loss reads for one micro-batch (B sequences, T padded label positions).

    Attributes:
        logprobs: `[B, T]` float32 log pi_theta of the sampled tokens, with grad.
        proximal_logprobs: `[B, T]` float32 log pi_prox (the learner before this optimizer step,
            detached); may be None iff the correction has `bypass_proximal`.
        behavior_logprobs: `[B, T]` float32 log mu (the engine that sampled the tokens).
        advantages: `[B, T]` float32.
        loss_mask: `[B, T]` bool or 0/1; 1 on the tokens the loss covers.
        agg_mode: one of `LOSS_AGG_MODES`, see `aggregate_loss`.
        num_global_tokens: valid tokens of the whole optimizer step (all micro-batches and
            ranks), the `token-mean` normaliser; float or 0-dim tensor.
        num_global_seqs: sequences with a valid token in the optimizer step, the `seq-mean-*`
            normaliser.
        horizon: constant horizon in tokens for `seq-mean-token-sum-norm` (Dr. GRPO), else None.
    """

    logprobs: Tensor
    proximal_logprobs: Tensor | None
    behavior_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    agg_mode: str
    num_global_tokens: float | Tensor
    num_global_seqs: float | Tensor
    horizon: int | None = None


@dataclass(frozen=True)
class OffPolicyCorrection:
    """How the off-policyness `pi_prox / mu` weights each token (decoupled PPO, Hilton et al.
    2021, arXiv 2110.00641; AReaL, arXiv 2505.24298). Built once per run from the config
    (`AlgorithmConfig.off_policy_correction()`), whose checks are the user-facing range checks.

    Attributes:
        behavior_correction: "none" (w = 1) | "tis" (w = min(pi_prox / mu, tis_cap), truncated
            importance sampling, Ionides 2008; Yao et al. 2025 "Your efficient RL framework
            secretly brings you off-policy RL training") | "icepop" (w = pi_prox / mu inside
            `[icepop_low, icepop_high]`, 0 outside; IcePop, Ling team 2025) | "seq_tis" /
            "seq_icepop" (the same on the sequence's product of token ratios).
        tis_cap: truncation cap C of the TIS weight (> 0).
        icepop_low, icepop_high: IcePop band, 0 < low < high.
        bypass_proximal: use `behavior_logprobs` as `proximal_logprobs` (no recompute pass; the
            clip then also absorbs the off-policyness).

    Raises:
        ValueError: (at construction) an unknown `behavior_correction`.
    """

    behavior_correction: str = "none"
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    bypass_proximal: bool = False

    def __post_init__(self) -> None:
        if self.behavior_correction not in BEHAVIOR_CORRECTIONS:
            raise ValueError(f"unknown behavior_correction {self.behavior_correction!r}; valid: "
                             f"{', '.join(BEHAVIOR_CORRECTIONS)}")


def policy_loss(name: str, inputs: PolicyLossInputs, correction: OffPolicyCorrection | None = None,
                options: LossOptions | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Resolve policy loss `name` (a registered name or a spec, see `async_rl.utils.registry`) and call
    it as `fn(inputs, correction, options)`; `correction` None = no correction, `options` None =
    the loss's defaults (`fn.options_type()`).

    Returns:
        `(loss, metrics)`: 0-dim loss with grad, dict of detached 0-dim metric tensors.

    Raises:
        ValueError: unknown name, or the loss's own errors.
        TypeError: `options` is not of the loss's options type.
    """
    fn = POLICY_LOSSES.get(name)
    return fn(inputs, correction if correction is not None else OffPolicyCorrection(),
              options if options is not None else fn.options_type())


# ----------------------------------------------------------------------------------------------
# shared machinery


def _k3(log_r: Tensor) -> Tensor:
    """Schulman's k3 `(r - 1) - log r`, which estimates KL(q || p) for `r = p / q`, x ~ q."""
    return torch.expm1(log_r) - log_r


@dataclass
class _Prepared:
    mask: Tensor  # [B, T] bool
    proximal: Tensor  # [B, T] float32 log pi_prox (behavior log-probs when bypassing)
    log_ratio: Tensor  # [B, T] log(pi_theta / pi_prox), clamped, 0 outside mask, with grad
    advantages: Tensor  # [B, T] float32, 0 outside mask
    behavior_weight: Tensor  # [B, T] detached w = f(pi_prox / mu)
    metrics: dict[str, Tensor]


def _behavior_weight(log_w: Tensor, mask: Tensor, c: OffPolicyCorrection) -> tuple[Tensor, Tensor]:
    """`(w, truncated)` `[B, T]` from the detached token log-ratios `log(pi_prox / mu)`."""
    zero = torch.zeros((), dtype=torch.float32, device=log_w.device)
    if c.behavior_correction.startswith("seq_"):
        # Sequence-level weight: product of the token ratios, the importance weight of the whole
        # response; truncating or masking it treats the response as one sample.
        log_w = torch.where(mask, masked_sum(log_w, mask, dim=-1).unsqueeze(-1), zero)
    raw_w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if c.behavior_correction in ("tis", "seq_tis"):
        return raw_w.clamp(max=c.tis_cap), raw_w > c.tis_cap
    if c.behavior_correction in ("icepop", "seq_icepop"):
        keep = (raw_w >= c.icepop_low) & (raw_w <= c.icepop_high)
        return torch.where(keep, raw_w, zero), ~keep
    return torch.ones_like(raw_w), torch.zeros_like(mask)


def _prepare(inputs: PolicyLossInputs, correction: OffPolicyCorrection) -> _Prepared:
    bypass = correction.bypass_proximal
    if inputs.proximal_logprobs is None and not bypass:
        raise ValueError("proximal_logprobs is None: recompute them with the learner's pre-update "
                         "weights, or set bypass_proximal=True to use behavior_logprobs instead")
    logprobs, behavior = inputs.logprobs, inputs.behavior_logprobs
    proximal = behavior if bypass else inputs.proximal_logprobs
    shapes = {n: tuple(t.shape) for n, t in [("logprobs", logprobs), ("proximal_logprobs", proximal),
                                               ("behavior_logprobs", behavior),
                                               ("advantages", inputs.advantages), ("loss_mask", inputs.loss_mask)]}
    if len(set(shapes.values())) != 1 or logprobs.dim() != 2:
        raise ValueError(f"policy loss inputs must all be [B, T], got {shapes}")

    mask = inputs.loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    logprobs, proximal, behavior = logprobs.float(), proximal.float(), behavior.float()

    # Select before subtracting: where() sends zero gradient to unselected slots, and the
    # subtraction's backward passes that zero on unchanged, so NaN there never reaches logprobs.
    log_ratio = torch.where(mask, logprobs - proximal, zero).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = torch.where(mask, inputs.advantages.float(), zero)
    weight, truncated = _behavior_weight(torch.where(mask, proximal - behavior, zero).detach(), mask, correction)

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
    return _Prepared(mask=mask, proximal=proximal, log_ratio=log_ratio, advantages=adv, behavior_weight=weight,
                     metrics=metrics)


def _finish(per_token: Tensor, prep: _Prepared, clipped_high: Tensor, clipped_low: Tensor,
            inputs: PolicyLossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    loss = aggregate_loss(prep.behavior_weight * per_token, prep.mask, inputs.agg_mode,
                          num_global_tokens=inputs.num_global_tokens, num_global_seqs=inputs.num_global_seqs,
                          horizon=inputs.horizon)
    metrics = dict(prep.metrics)
    metrics["clip_frac"] = masked_mean((clipped_high | clipped_low).float(), prep.mask)
    metrics["clip_frac_high"] = masked_mean(clipped_high.float(), prep.mask)
    metrics["clip_frac_low"] = masked_mean(clipped_low.float(), prep.mask)
    return loss, {k: v.detach() for k, v in metrics.items()}


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


_NO_CORRECTION = OffPolicyCorrection()


# ----------------------------------------------------------------------------------------------
# losses


@register_policy_loss("ppo_clip", PPOClipOptions, fixed_settings={})
def ppo_clip_loss(inputs: PolicyLossInputs, correction: OffPolicyCorrection = _NO_CORRECTION,
                  options: PPOClipOptions = PPOClipOptions()) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate loss with decoupled ratio, clip-higher and optional dual clip.

    With `r = pi_theta / pi_prox` and `w` the detached behaviour weight:

        l = w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))           PPO eq. 7 (negated)
        l = min(l, -w A c)  where A < 0                                     dual clip, c > 1

    Sources: Schulman et al. 2017, PPO (arXiv 1707.06347), eq. 7; asymmetric "clip-higher"
    `eps_high > eps_low` from DAPO (Yu et al. 2025, arXiv 2503.14476), Sec. 3.1; dual clip from Ye et
    al. 2020 (arXiv 1912.09729), which bounds the loss of very large ratios with negative advantage;
    decoupled ratio from Hilton et al. 2021 / AReaL (arXiv 2505.24298).

    Fixed settings: none. PPO's objective is an expectation over timesteps and fixes no
    aggregation; GRPO (seq-mean-token-mean), DAPO (token-mean) and Dr. GRPO
    (seq-mean-token-sum-norm) each pair this same clipped term with their own.

    Args:
        inputs: the `[B, T]` tensors and the aggregation (see `PolicyLossInputs`).
        correction: the behaviour weight (see `OffPolicyCorrection`); default none.
        options: `PPOClipOptions`: eps_low in (0, 1], eps_high > 0 (`clip_ratio_low`,
            `clip_ratio_high`), the dual-clip bound c > 1 (`clip_ratio_c`; None or ``inf`` for no
            dual clip); ranges checked when the options are built.

    Returns:
        `(loss, metrics)`: 0-dim loss; metrics as in the module docstring. A token counts as
        "high"-clipped when r > 1 + eps_high with A > 0, "low"-clipped when r < 1 - eps_low with
        A < 0 or, with dual clip, r > c with A < 0.

    Raises:
        ValueError: shape mismatch, unknown agg_mode, or proximal_logprobs None without bypass.
        TypeError: `options` is not a `PPOClipOptions`.

    Example (eps 0.2): tokens (r, A) = (1.5, +1), (1.5, -1), (0.5, -1) -> clip_frac 2/3,
    clip_frac_high 1/3, clip_frac_low 1/3.
    """
    opts = check_options(options, PPOClipOptions, "ppo_clip_loss")
    clip_ratio_c = opts.clip_ratio_c
    prep = _prepare(inputs, correction)
    ratio, adv = torch.exp(prep.log_ratio), prep.advantages
    per_token, high, low = _clipped_surrogate(ratio, adv, opts.clip_ratio_low, opts.clip_ratio_high)
    if clip_ratio_c is not None and math.isfinite(clip_ratio_c):
        negative = adv < 0
        per_token = torch.where(negative, torch.minimum(per_token, -adv * clip_ratio_c), per_token)
        low = low | (negative & (ratio > clip_ratio_c))
    return _finish(per_token, prep, high & prep.mask, low & prep.mask, inputs)


@register_policy_loss("gspo", GSPOOptions, fixed_settings={"algorithm.loss_agg_mode": FixedSetting(
    "seq-mean-token-mean", "GSPO averages its length-normalised sequence objective over sequences; "
    "Zheng et al. 2025, arXiv 2507.18071")})
def gspo_loss(inputs: PolicyLossInputs, correction: OffPolicyCorrection = _NO_CORRECTION,
              options: GSPOOptions = GSPOOptions()) -> tuple[Tensor, dict[str, Tensor]]:
    """Group Sequence Policy Optimization: PPO clipping on a sequence-level ratio.

    `s_i = exp(mean_t log(pi_theta / pi_prox))` (geometric mean of the token ratios over the
    sequence's valid tokens). It is applied in the GSPO-token form
    `s_i,t = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]`, whose value is `s_i` and whose gradient
    is `s_i * grad log pi_theta(y_t)`; with per-sequence advantages and "seq-mean-token-mean"
    aggregation this equals sequence-level GSPO exactly.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071): the
    sequence ratio, its clipped objective, and the GSPO-token variant; defaults eps_low 3e-4,
    eps_high 4e-4 are the paper's. The mean log-ratio is clamped to +-`LOG_RATIO_CLAMP`.

    Fixed settings: `algorithm.loss_agg_mode=seq-mean-token-mean`. The paper's objective is
    `1/G sum_i min(s_i A_i, clip(s_i) A_i)`, a mean over the group's sequences of a term already
    normalised by the sequence's length (inside `s_i`); in the GSPO-token form that is the mean
    over each sequence's tokens, then over sequences. Any other aggregation weights sequences by
    their length and trains another objective.

    Args / Returns / Raises: as `ppo_clip_loss`, with `GSPOOptions` (no dual clip). The clip
    decision is per sequence, so all valid tokens of a sequence are clipped together.
    """
    opts = check_options(options, GSPOOptions, "gspo_loss")
    prep = _prepare(inputs, correction)
    mask = prep.mask
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    # Unclamped token log-ratios for the mean (one extreme token should move s_i by its share,
    # not by the clamp); only the mean is clamped before exp.
    lp = torch.where(mask, inputs.logprobs.float(), zero)
    token_log_ratio = torch.where(mask, inputs.logprobs.float() - prep.proximal, zero)
    seq_log_ratio = masked_mean(token_log_ratio.detach(), mask, dim=-1)
    seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).unsqueeze(-1)
    ratio = torch.exp(lp - lp.detach() + seq_log_ratio)
    per_token, high, low = _clipped_surrogate(ratio, prep.advantages, opts.clip_ratio_low, opts.clip_ratio_high)
    prep.metrics["ratio_mean"] = masked_mean(ratio.detach(), mask)
    prep.metrics["ratio_max"] = masked_max(ratio.detach(), mask)
    return _finish(per_token, prep, high & mask, low & mask, inputs)


@register_policy_loss("cispo", CISPOOptions, fixed_settings={"algorithm.loss_agg_mode": FixedSetting(
    "token-mean", "CISPO divides by the group's token count, 1/sum_i |o_i|; MiniMax 2025, arXiv 2506.13585, "
    "eq. 4")})
def cispo_loss(inputs: PolicyLossInputs, correction: OffPolicyCorrection = _NO_CORRECTION,
               options: CISPOOptions = CISPOOptions()) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, detached importance weight; no token is dropped.

        l = -w * sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta,   r = pi_theta / pi_prox

    Unlike PPO's clip, which zeroes the gradient of tokens outside the trust region (often rare
    "fork" tokens), CISPO keeps every token's gradient and only bounds its weight.

    Source: MiniMax 2025, "MiniMax-M1" (arXiv 2506.13585), eqs. 4-5. The paper leaves the lower
    bound off, hence the default `clip_ratio_low = 1.0` (weight floor 0); tune `clip_ratio_high`.

    Fixed settings: `algorithm.loss_agg_mode=token-mean`. Eq. 4 normalises the sum over every
    token of the group by the group's token count `1 / sum_i |o_i|` (DAPO's token-level loss),
    which is `token-mean`.

    Args / Raises: as `ppo_clip_loss`, with `CISPOOptions` (no dual clip).

    Returns:
        `(loss, metrics)`. The loss value is a surrogate (its gradient is the policy gradient);
        "high"/"low" clip fractions count tokens whose weight was truncated above / below,
        whatever the advantage sign, since the truncation scales the gradient for both signs.
    """
    opts = check_options(options, CISPOOptions, "cispo_loss")
    clip_ratio_low, clip_ratio_high = opts.clip_ratio_low, opts.clip_ratio_high
    prep = _prepare(inputs, correction)
    mask = prep.mask
    ratio = torch.exp(prep.log_ratio.detach())
    is_weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    lp = torch.where(mask, inputs.logprobs.float(), torch.zeros((), dtype=torch.float32, device=mask.device))
    per_token = -is_weight * prep.advantages * lp
    high = mask & (ratio > 1.0 + clip_ratio_high)
    low = mask & (ratio < 1.0 - clip_ratio_low)
    return _finish(per_token, prep, high, low, inputs)
