"""Algorithm configuration: a named preset plus explicit overrides.

``algorithm.name`` picks a preset (advantage estimator, policy loss, aggregation, clipping); any
field left at ``None`` takes the preset's value, any field set explicitly wins. The presets:

=============  ==============  ===========  =========================  ============================
name           estimator       policy loss  aggregation                notes
=============  ==============  ===========  =========================  ============================
grpo           grpo            ppo_clip     token-mean                 DeepSeekMath (2402.03300)
dr_grpo        dr_grpo         ppo_clip     seq-mean-token-sum-norm    no std, constant horizon (2503.20783)
rloo           rloo            ppo_clip     token-mean                 leave-one-out baseline (2402.14740)
reinforce_pp   reinforce_pp    ppo_clip     token-mean                 batch-whitened (2501.03262)
dapo           grpo            ppo_clip     token-mean                 clip-higher 0.28 (2503.14476)
=============  ==============  ===========  =========================  ============================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.algorithms.aggregation import LOSS_AGG_MODES

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "dr_grpo": {"advantage_estimator": "dr_grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "seq-mean-token-sum-norm"},
    "rloo": {"advantage_estimator": "rloo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "dapo": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean",
             "clip_ratio_high": 0.28},
}
BEHAVIOR_CORRECTIONS = ("none", "tis", "icepop", "seq_tis", "seq_icepop")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and their coefficients."""

    name: str = "grpo"
    """Preset: one of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``dapo``."""
    advantage_estimator: str | None = None
    """Registered estimator name or ``pkg.module:fn``; ``None`` = the preset's."""
    policy_loss: str | None = None
    """Registered policy loss name or ``pkg.module:fn``; ``None`` = the preset's."""
    loss_agg_mode: str | None = None
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm; ``None`` = preset."""
    loss_horizon_tokens: int | None = None
    """Constant horizon for ``seq-mean-token-sum-norm``, in tokens; ``None`` = the max response length."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std (``dr_grpo`` never does)."""
    clip_ratio_low: float = 0.2
    """PPO clip epsilon below 1 (> 0)."""
    clip_ratio_high: float | None = None
    """PPO clip epsilon above 1 (clip-higher); ``None`` = ``clip_ratio_low`` or the preset's."""
    clip_ratio_c: float | None = None
    """Dual-clip bound for negative advantages (> 1); ``None`` disables it."""
    behavior_correction: str = "none"
    """Off-policy weight pi_prox/mu: none | tis | icepop | seq_tis | seq_icepop."""
    tis_cap: float = 2.0
    """Truncation cap of the TIS weight (> 0)."""
    icepop_low: float = 0.5
    """IcePop band lower bound (> 0)."""
    icepop_high: float = 2.0
    """IcePop band upper bound (> icepop_low)."""
    bypass_proximal: bool = False
    """Use the behavior log-probs as proximal log-probs (skips the learner's recompute pass)."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term (>= 0); 0 disables it (and the reference model)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 (Schulman, "Approximating KL divergence", 2020)."""
    use_kl_in_reward: bool = False
    """Apply the KL as a reward penalty instead of a loss term."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (>= 0)."""
    loss_kwargs: dict[str, float] = field(default_factory=dict)
    """Extra keyword arguments for the policy loss (for example GSPO's clip range), passed as given."""

    def __post_init__(self) -> None:
        # Presets are applied by apply_preset(), not here: omegaconf instantiates this class to
        # build the schema, and a preset filled in then would outlive a later algorithm.name=...
        if self.name not in PRESETS:
            raise ValueError(f"algorithm.name must be one of {sorted(PRESETS)}, got {self.name!r}")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if not self.clip_ratio_low > 0 or (self.clip_ratio_high is not None and not self.clip_ratio_high > 0):
            raise ValueError(f"algorithm.clip_ratio_low/high must be > 0, got {self.clip_ratio_low}/{self.clip_ratio_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"algorithm.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.behavior_correction not in BEHAVIOR_CORRECTIONS:
            raise ValueError(f"algorithm.behavior_correction must be one of {BEHAVIOR_CORRECTIONS}, got {self.behavior_correction!r}")
        if not self.tis_cap > 0:
            raise ValueError(f"algorithm.tis_cap must be > 0, got {self.tis_cap}")
        if not 0 < self.icepop_low < self.icepop_high:
            raise ValueError(f"algorithm.icepop_low/high must satisfy 0 < low < high, got {self.icepop_low}/{self.icepop_high}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("algorithm.kl_coef and algorithm.entropy_coef must be >= 0")
        if self.kl_coef > 0:
            raise ValueError("algorithm.kl_coef > 0 needs a reference model, which the learner does not provide yet")

    def apply_preset(self) -> "AlgorithmConfig":
        """Fill every field left at ``None`` from the preset ``name``; returns ``self``.

        Idempotent. ``load_config`` calls it; code that builds an ``AlgorithmConfig`` directly
        calls it before use.
        """
        preset = PRESETS[self.name]
        for key in ("advantage_estimator", "policy_loss", "loss_agg_mode", "clip_ratio_high"):
            if getattr(self, key) is None and key in preset:
                setattr(self, key, preset[key])
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio_low
        return self

    def loss_params(self) -> dict[str, Any]:
        """Keyword arguments for the chosen policy loss.

        ``ppo_clip`` gets the clip bounds of this config; GSPO and CISPO keep their papers'
        defaults (their ratios live on other scales) unless ``loss_kwargs`` sets them.
        """
        params: dict[str, Any] = {}
        if self.policy_loss == "ppo_clip":
            params = {"clip_ratio_low": self.clip_ratio_low, "clip_ratio_high": self.clip_ratio_high,
                      "clip_ratio_c": self.clip_ratio_c}
        return {**params, **self.loss_kwargs}

    def advantage_params(self) -> dict[str, Any]:
        """Keyword arguments for the chosen advantage estimator."""
        if self.advantage_estimator == "grpo":
            return {"norm_by_std": self.norm_adv_by_std}
        return {}
