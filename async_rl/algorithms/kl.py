"""KL estimators against a reference policy, and the entropy bonus.

The per-token KL `[B, T]` is used two ways:
  * as a loss term: `aggregate_loss(kl_penalty(logprobs, ref_logprobs, "k3", mask=m), m, mode, ...)`
    (GRPO style), or `kl_loss(...)` which does both;
  * as a reward penalty: `apply_kl_reward_penalty(token_rewards, kl, coef)` before advantage
    estimation (PPO / REINFORCE++ style, the KL is detached there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rl.algorithms.aggregation import aggregate_loss

__all__ = ["KL_KINDS", "K3_CLAMP", "LOG_RATIO_CLAMP", "kl_penalty", "kl_loss", "apply_kl_reward_penalty",
           "entropy_bonus"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")

K3_CLAMP = 10.0
"""Default bound on the per-token k3 estimate, in nats: verl's ``low_var_kl`` clamps it to
[-10, 10]. Without it one token whose log-ratio reaches the clamp below adds exp(20) - 21 = 4.85e8
to the loss."""

# exp(20) ~ 4.9e8: far beyond any ratio that still carries signal, yet finite in float32 after
# multiplication by an advantage, so one runaway token cannot turn the loss into inf/NaN.
LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str, *, mask: Tensor | None = None,
               clamp: float = LOG_RATIO_CLAMP, k3_clamp: float | None = K3_CLAMP) -> Tensor:
    """Per-token estimate of `KL(pi || pi_ref)` from log-probs of tokens sampled from `pi`.

    With `log r = ref_logprobs - logprobs` (the reference-over-policy log ratio):

        k1  = -log r                        unbiased, high variance, can be negative
        k2  = (log r)^2 / 2                 biased, low variance, >= 0
        k3  = clip((r - 1) - log r, +-c)    unbiased before the clip, low variance, >= 0
        abs = |log r|                       >= 0 (verl's "abs")

    Source: Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html); the
    names and the k3 bound `c = k3_clamp` follow verl's `kl_penalty` ("kl"/"k1", "mse"/"k2",
    "low_var_kl"/"k3", "abs"). `log r` is clamped to `[-clamp, clamp]` before `exp`; where either
    clamp binds the gradient is 0 (`torch.clamp`), so one runaway token cannot dominate the loss.

    Args:
        logprobs: `[B, T]` float32 log-probs of the sampled tokens under the policy (may carry
            grad).
        ref_logprobs: `[B, T]` float32 log-probs of the same tokens under the reference model.
        kind: "k1" | "k2" | "k3" | "abs".
        mask: optional `[B, T]` bool/0-1; where 0 the result is exactly 0 with zero gradient even
            if either input is NaN there (pass it whenever padded slots may hold garbage).
        clamp: bound on |log r|, > 0.
        k3_clamp: bound on the k3 value in nats (> 0), or None for none; other kinds ignore it.

    Returns:
        `[B, T]` float32 per-token KL estimate in nats.

    Raises:
        ValueError: unknown `kind`, shape mismatch, or `k3_clamp <= 0`.

    Example: logprobs 0, ref_logprobs 20 (log r = 20): k3 = exp(20) - 21 = 4.85e8 unbounded,
    10.0 with the default bound (gradient 0); abs = 20.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and ref_logprobs "
                         f"{tuple(ref_logprobs.shape)} must have the same shape")
    if k3_clamp is not None and not k3_clamp > 0:
        raise ValueError(f"k3_clamp must be > 0 or None, got {k3_clamp}")
    log_r = ref_logprobs.float() - logprobs.float()
    if mask is not None:
        log_r = torch.where(mask.bool(), log_r, torch.zeros_like(log_r))
    log_r = log_r.clamp(-clamp, clamp)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r * log_r
    if kind == "abs":
        return log_r.abs()
    k3 = torch.expm1(log_r) - log_r
    return k3 if k3_clamp is None else k3.clamp(-k3_clamp, k3_clamp)


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor, *, kind: str = "k3",
            agg_mode: str, num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
            horizon: int | None = None, k3_clamp: float | None = K3_CLAMP) -> Tensor:
    """`aggregate_loss` of `kl_penalty` over `loss_mask`: the KL term of the GRPO objective.

    Source: DeepSeekMath (arXiv 2402.03300), eq. 3 (KL term) and eq. 4 (k3 estimator).

    Args/Raises: as `kl_penalty` and `aggregate_loss`.

    Returns:
        0-dim float32 tensor; add `coef * kl_loss(...)` to the policy loss.
    """
    kl = kl_penalty(logprobs, ref_logprobs, kind, mask=loss_mask, k3_clamp=k3_clamp)
    return aggregate_loss(kl, loss_mask, agg_mode, num_global_tokens=num_global_tokens,
                          num_global_seqs=num_global_seqs, horizon=horizon)


def apply_kl_reward_penalty(token_rewards: Tensor, kl: Tensor, coef: float, *,
                            mask: Tensor | None = None) -> Tensor:
    """Per-token rewards minus `coef * kl` (KL detached), for estimators that take token rewards.

    Source: Ouyang et al. 2022 (InstructGPT, arXiv 2203.02155), eq. 2: reward
    `r - beta * log(pi / pi_ref)` per token; also REINFORCE++ (arXiv 2501.03262).

    Args:
        token_rewards: `[B, T]` float rewards (e.g. the outcome reward on the last valid token).
        kl: `[B, T]` per-token KL from `kl_penalty` (its gradient is dropped).
        coef: penalty coefficient beta, >= 0.
        mask: optional `[B, T]`; where 0 the output is 0.

    Returns:
        `[B, T]` float32 shaped rewards.

    Raises:
        ValueError: `coef < 0` or shape mismatch.
    """
    if coef < 0:
        raise ValueError(f"KL reward coefficient must be >= 0, got {coef}")
    if token_rewards.shape != kl.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)} and kl {tuple(kl.shape)} "
                         "must have the same shape")
    shaped = token_rewards.float() - coef * kl.detach().float()
    if mask is not None:
        shaped = torch.where(mask.bool(), shaped, torch.zeros_like(shaped))
    return shaped


def entropy_bonus(entropy: Tensor, loss_mask: Tensor, *, agg_mode: str,
                  num_global_tokens: float | Tensor, num_global_seqs: float | Tensor,
                  horizon: int | None = None) -> Tensor:
    """Aggregated entropy (nats) over valid tokens; subtract `coef * entropy_bonus(...)` from the
    loss to encourage exploration (entropy regularisation as in Mnih et al. 2016, A3C,
    arXiv 1602.01783).

    Args:
        entropy: `[B, T]` float32 per-token entropy, from `entropy_from_logits` (exact) or
            `-logprobs` of the sampled tokens (a one-sample estimate).
        loss_mask: `[B, T]` bool/0-1; padded slots may hold anything (NaN included).
        agg_mode, num_global_tokens, num_global_seqs, horizon: as `aggregate_loss`.

    Returns:
        0-dim float32 tensor, >= 0 when the valid entries are.

    Raises:
        ValueError: as `aggregate_loss`.

    Example: one sequence with sampled-token log-probs `[-0.5, -0.5, pad, pad]`, entropy
    `-logprobs`: "token-mean" -> 0.5 nats per token, "seq-mean-token-sum" -> 1.0 nats per sequence.
    """
    return aggregate_loss(entropy, loss_mask, agg_mode, num_global_tokens=num_global_tokens,
                          num_global_seqs=num_global_seqs, horizon=horizon)
