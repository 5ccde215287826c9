"""Pure-tensor RL algorithm library: log-probs, advantages, losses, aggregation, KL, DAPO tools.

Nothing here calls a model or syncs with `.item()` inside a loss; every function takes tensors
(per-token `[B, T]`) and returns tensors. Pick parts by spec (a registered name, `builtin:<name>`,
`pkg.module:attr` or `path/file.py:attr`; one resolver for every kind, `async_rl.utils.registry`):

    from async_rl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    adv, ret = ADVANTAGE_ESTIMATORS.get("grpo")(AdvantageInputs(rewards, mask, group_ids))
    inputs = PolicyLossInputs(logprobs, proximal, behavior, adv, mask, agg_mode="token-mean",
                              num_global_tokens=n_tok, num_global_seqs=n_seq)
    loss, metrics = POLICY_LOSSES.get("ppo_clip")(inputs, OffPolicyCorrection("tis"),
                                                  PPOClipOptions(clip_ratio_high=0.28))

Run the tests with `pytest tests/test_algorithms_*.py`.
"""

from async_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    EstimatorSpec,
    compute_advantages,
    register_estimator,
)
from async_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, count_normalizers
from async_rl.algorithms.critic import value_loss
from async_rl.algorithms.dapo import (
    DynamicSamplingResult,
    fill_groups_with_spread,
    filter_groups_with_spread,
    group_has_spread,
    overlong_filter_mask,
    overlong_reward_shaping,
)
from async_rl.algorithms.fixed_settings import FixedSetting, fixed_settings_of
from async_rl.algorithms.kl import apply_kl_reward_penalty, entropy_bonus, kl_loss, kl_penalty
from async_rl.algorithms.logprobs import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_max,
    masked_mean,
    masked_sum,
)
from async_rl.algorithms.loss_options import CISPOOptions, GSPOOptions, LossOptions, PolicyLoss, PPOClipOptions
from async_rl.algorithms.losses import (
    BEHAVIOR_CORRECTIONS,
    POLICY_LOSSES,
    OffPolicyCorrection,
    PolicyLossInputs,
    policy_loss,
    register_policy_loss,
)
from async_rl.utils.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "BEHAVIOR_CORRECTIONS",
    "CISPOOptions",
    "DynamicSamplingResult",
    "EstimatorSpec",
    "FixedSetting",
    "GSPOOptions",
    "LOSS_AGG_MODES",
    "LossOptions",
    "OffPolicyCorrection",
    "POLICY_LOSSES",
    "PPOClipOptions",
    "PolicyLoss",
    "PolicyLossInputs",
    "Registry",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "compute_advantages",
    "count_normalizers",
    "entropy_bonus",
    "entropy_from_logits",
    "fill_groups_with_spread",
    "filter_groups_with_spread",
    "fixed_settings_of",
    "group_has_spread",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "overlong_filter_mask",
    "overlong_reward_shaping",
    "policy_loss",
    "register_estimator",
    "register_policy_loss",
    "value_loss",
]
