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
dapo           grpo            ppo_clip     token-mean                 clip-higher 0.28, dynamic sampling,
                                                                       overlong shaping (2503.14476)
ppo            gae             ppo_clip     token-mean                 critic + GAE (1707.06347, 1506.02438)
=============  ==============  ===========  =========================  ============================

A policy loss or estimator whose definition fixes a setting declares it (``fixed_settings``,
``async_rl.algorithms.fixed_settings``): ``gspo`` fixes ``loss_agg_mode=seq-mean-token-mean``,
``cispo`` ``token-mean``, ``dr_grpo`` ``seq-mean-token-sum-norm`` and ``norm_adv_by_std=false``.
``load_config`` gives such a field the fixed value when the user did not set it (over the
preset's) and refuses a different value the user set.

The ``ppo`` preset (and any config whose estimator declares ``needs_critic``, as ``gae`` does)
trains a critic next to the policy (``learner.critic``); ``kl_coef > 0`` makes the learner keep a
frozen reference policy. What an estimator needs (critic, per-token rewards, groups) and which
fields become its keyword arguments is declared by the estimator itself (``EstimatorSpec`` in
``async_rl.algorithms.advantages``), not listed here.

The checks in ``AlgorithmConfig.__post_init__`` check this section's fields at load; the policy
loss's options (``loss_options()``: one frozen ``LossOptions`` per loss, from these fields and
``loss_kwargs``, ``async_rl.algorithms.loss_options``) check their own ranges when built, naming
the key. The losses and the ``OffPolicyCorrection`` built from this config trust both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS, EstimatorSpec
from async_rl.algorithms.aggregation import LOSS_AGG_MODES
from async_rl.algorithms.distill import DistillConfig
from async_rl.algorithms.kl import K3_CLAMP, KL_KINDS
from async_rl.algorithms.loss_options import LossOptions, PolicyLoss
from async_rl.algorithms.losses import BEHAVIOR_CORRECTIONS, POLICY_LOSSES, OffPolicyCorrection

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "dr_grpo": {"advantage_estimator": "dr_grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "seq-mean-token-sum-norm"},
    "rloo": {"advantage_estimator": "rloo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "reinforce_pp": {"advantage_estimator": "reinforce_pp", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
    "dapo": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean",
             "clip_ratio_high": 0.28, "dynamic_sampling": True, "overlong_buffer_frac": 0.2},
    "ppo": {"advantage_estimator": "gae", "policy_loss": "ppo_clip", "loss_agg_mode": "token-mean"},
}
KL_ESTIMATORS = KL_KINDS
# Dual-clip bound async mode takes when algorithm.clip_ratio_c is unset (load_config resolves it,
# as it does behavior_correction): verl's default c (Ye et al. 2020, arXiv 1912.09729).
ASYNC_CLIP_RATIO_C = 3.0
# Fields a preset may leave at None for apply_preset to fill; a resolved config has none of them None.
PRESET_FIELDS = ("advantage_estimator", "policy_loss", "loss_agg_mode", "clip_ratio_high", "dynamic_sampling",
                 "overlong_buffer_frac", "behavior_correction", "bypass_proximal")


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and their coefficients."""

    name: str = "grpo"
    """Preset: one of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``dapo``, ``ppo``."""
    advantage_estimator: str | None = None
    """Registered estimator name or ``pkg.module:fn``; ``None`` = the preset's."""
    policy_loss: str | None = None
    """Registered policy loss name or ``pkg.module:fn``; ``None`` = the preset's."""
    loss_agg_mode: str | None = None
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm; ``None`` = the
    value the policy loss or estimator fixes (``gspo``: seq-mean-token-mean, ``cispo``: token-mean,
    ``dr_grpo``: seq-mean-token-sum-norm), else the preset's. Another value with those is refused."""
    loss_horizon_tokens: int | None = None
    """Constant horizon for ``seq-mean-token-sum-norm``, in tokens; ``None`` = the max response length."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group's reward std. ``dr_grpo`` fixes it to false (it never divides):
    left unset it becomes false there, set to true it is refused."""
    clip_ratio_low: float = 0.2
    """PPO clip epsilon below 1, in (0, 1]."""
    clip_ratio_high: float | None = None
    """PPO clip epsilon above 1 (clip-higher); ``None`` = ``clip_ratio_low`` or the preset's."""
    clip_ratio_c: float | None = None
    """Dual-clip bound c > 1 for negative advantages; ``.inf`` turns it off. ``None`` =
    ``ASYNC_CLIP_RATIO_C`` (3.0, verl's value) in async mode, off in sync mode."""
    behavior_correction: str | None = None
    """Off-policy weight pi_prox/mu: none | tis | icepop | seq_tis | seq_icepop; ``None`` = ``tis``
    in async mode (samples from older policies), ``none`` in sync mode."""
    tis_cap: float = 2.0
    """Truncation cap of the TIS weight (> 0)."""
    icepop_low: float = 0.5
    """IcePop band lower bound (> 0)."""
    icepop_high: float = 2.0
    """IcePop band upper bound (> icepop_low)."""
    routing_replay: bool = False
    """Rollout routing replay for a mixture-of-experts model (R3, Ma et al. 2025): the engine
    records the experts each token was routed to, the trajectory carries them, and the learner's
    forward passes (proximal, current, reference) use them, with gating weights from its own
    router so the router still trains (``async_rl.utils.moe``). Metrics ``moe/router_agreement``
    (without replay too: how often the learner's router picks what the engine's did) and
    ``moe/load_*`` (FSDP2). Runs with the HF and vLLM engines, both learners, sync and async mode, single-turn
    rollouts; SGLang and multi-turn rollouts are refused in one line until they record it."""
    record_routing: bool = False
    """Record the engine's routing of a mixture-of-experts model in every trajectory without
    replaying it (``routing_replay`` records it too): the learner then reports
    ``moe/router_agreement`` (how often its router picks the experts the engine picked), the
    measure of what replay would change. Same engines and rollouts as ``routing_replay``."""
    moe_aux_loss_coef: float = 0.0
    """Weight of a mixture-of-experts policy's load-balancing loss in the training loss
    (``async_rl.utils.moe.load_balancing_loss``, Switch Transformer eq. 4; averaged over MoE
    layers, token-weighted over micro-batches; 0: off; metric ``moe/aux_loss`` either way).
    Typical: 1e-3 (Qwen3-MoE's ``router_aux_loss_coef``)."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss (``async_rl.utils.moe.router_z_loss``, ST-MoE eq. 5; 0: off;
    metric ``moe/z_loss`` either way). Typical: 1e-3."""
    bypass_proximal: bool | None = None
    """Use the behavior log-probs as proximal log-probs (skips the learner's recompute pass; the
    clip then bounds the update against the policy that sampled). ``None`` = on for one-step
    off-policy training (``trainer.mode=async`` with ``max_staleness`` 1, the async default),
    off otherwise. On the default job (``bench/bench_time_to_accuracy.py``, seeds 0-2, the same
    seeds for both) it ended with a held-out last-quarter accuracy of 0.723 +- 0.008 against the
    recomputed proximal policy's 0.707 +- 0.015 (greedy 0.805 against 0.770) in 25% less RL
    time; over seeds 0-4 it was 1.7 points (greedy 0.9) below sync mode's 0.724 +- 0.006, one
    seed's curve swinging by 20 points. Staler data keeps the decoupled objective of AReaL
    (arXiv 2505.24298), built for it; staleness 0 keeps sync mode's pass."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term (>= 0); 0 disables it (and the reference model)."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 | abs (Schulman, "Approximating KL divergence", 2020; verl's kl, mse,
    low_var_kl, abs)."""
    kl_k3_clamp: float | None = K3_CLAMP
    """Bound on the per-token k3 estimate in nats (> 0), as verl's ``low_var_kl`` (10); where it
    binds the token's KL gradient is 0. ``None`` = unbounded (one token with log-ratio 20 then adds
    4.85e8). The log-ratio itself is always clamped to +-20 before ``exp``."""
    use_kl_in_reward: bool = False
    """Apply the KL as a reward penalty instead of a loss term."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (>= 0)."""
    gamma: float = 1.0
    """Discount per token for ``gae`` and ``reinforce_pp``, in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1] (Schulman et al. 2015, arXiv 1506.02438)."""
    whiten_advantages: bool = True
    """``gae``: whiten advantages over the batch's valid tokens (standard for PPO on LLMs)."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts
    until the step is full; ``None`` = the preset's (on for ``dapo``)."""
    max_generation_rounds: int = 10
    """Dynamic sampling gives up with an error after this many generation rounds in one step (>= 1)."""
    overlong_buffer_frac: float | None = None
    """DAPO soft overlong punishment: width of the penalty zone before
    ``generator.max_response_tokens``, as a fraction of it in [0, 1]; 0 disables; ``None`` = the
    preset's (0.2 for ``dapo``, else 0)."""
    overlong_penalty_factor: float = 1.0
    """Reward subtracted at the length limit by the overlong punishment (>= 0)."""
    overlong_filter: bool = False
    """DAPO overlong filtering: truncated samples (finish reason ``length``) get no loss."""
    loss_kwargs: dict[str, float] = field(default_factory=dict)
    """Options of the policy loss by name, over its defaults and the ``algorithm.*`` fields it reads
    (for example GSPO's ``clip_ratio_low``/``clip_ratio_high``, which ``algorithm.clip_ratio_*``
    does not set); a key the loss does not take stops the run at load, naming it."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from one teacher or one per data source (``async_rl.algorithms.distill``)."""

    def __post_init__(self) -> None:
        # Presets are applied by apply_preset(), not here: omegaconf instantiates this class to
        # build the schema, and a preset filled in then would outlive a later algorithm.name=...
        if self.name not in PRESETS:
            raise ValueError(f"algorithm.name must be one of {sorted(PRESETS)}, got {self.name!r}")
        if self.loss_agg_mode is not None and self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"algorithm.loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if not 0 < self.clip_ratio_low <= 1 or (self.clip_ratio_high is not None and not self.clip_ratio_high > 0):
            raise ValueError(f"algorithm.clip_ratio_low must be in (0, 1] and clip_ratio_high > 0, got "
                             f"{self.clip_ratio_low}/{self.clip_ratio_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"algorithm.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.behavior_correction is not None and self.behavior_correction not in BEHAVIOR_CORRECTIONS:
            raise ValueError(f"algorithm.behavior_correction must be one of {BEHAVIOR_CORRECTIONS}, got {self.behavior_correction!r}")
        if not self.tis_cap > 0:
            raise ValueError(f"algorithm.tis_cap must be > 0, got {self.tis_cap}")
        for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"algorithm.{key} must be >= 0, got {getattr(self, key)}")
        if not 0 < self.icepop_low < self.icepop_high:
            raise ValueError(f"algorithm.icepop_low/high must satisfy 0 < low < high, got {self.icepop_low}/{self.icepop_high}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.kl_k3_clamp is not None and not self.kl_k3_clamp > 0:
            raise ValueError(f"algorithm.kl_k3_clamp must be > 0 or null, got {self.kl_k3_clamp}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("algorithm.kl_coef and algorithm.entropy_coef must be >= 0")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"algorithm.gamma and algorithm.lam must be in [0, 1], got {self.gamma}/{self.lam}")
        if self.max_generation_rounds < 1:
            raise ValueError(f"algorithm.max_generation_rounds must be >= 1, got {self.max_generation_rounds}")
        if self.overlong_buffer_frac is not None and not 0.0 <= self.overlong_buffer_frac <= 1.0:
            raise ValueError(f"algorithm.overlong_buffer_frac must be in [0, 1], got {self.overlong_buffer_frac}")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"algorithm.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")

    def apply_preset(self) -> "AlgorithmConfig":
        """Fill every field left at ``None`` from the preset ``name``; returns ``self``.

        Idempotent. ``load_config`` calls it; code that builds an ``AlgorithmConfig`` directly
        calls it before use (the learner does not: it requires a resolved config).
        """
        preset = PRESETS[self.name]
        for key in ("advantage_estimator", "policy_loss", "loss_agg_mode", "clip_ratio_high",
                    "dynamic_sampling", "overlong_buffer_frac"):
            if getattr(self, key) is None and key in preset:
                setattr(self, key, preset[key])
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio_low
        if self.dynamic_sampling is None:
            self.dynamic_sampling = False
        if self.overlong_buffer_frac is None:
            self.overlong_buffer_frac = 0.0
        if self.behavior_correction is None:
            # load_config resolves this by trainer mode first (tis in async); code that builds the
            # config directly and never says gets the plain decoupled loss.
            self.behavior_correction = "none"
        if self.bypass_proximal is None:
            # load_config resolves this by trainer mode and staleness first; code that builds the
            # config directly and never says gets the recomputed proximal policy.
            self.bypass_proximal = False
        return self

    def require_resolved(self) -> "AlgorithmConfig":
        """Return ``self`` if ``apply_preset`` has run (no preset field is None).

        Raises:
            ValueError: a preset field is still None; the message names them.
        """
        missing = [key for key in PRESET_FIELDS if getattr(self, key) is None]
        if missing:
            raise ValueError(f"AlgorithmConfig {self.name!r} is not resolved ({', '.join(missing)} still None): "
                             "call apply_preset() first (load_config does)")
        return self

    @property
    def estimator(self) -> EstimatorSpec:
        """The advantage estimator (``EstimatorSpec``: function plus its needs) of this config.

        Raises:
            ValueError: the estimator spec cannot be resolved (see ``async_rl.utils.registry``), or the
                preset has not been applied.
        """
        return ADVANTAGE_ESTIMATORS.get(self.require_resolved().advantage_estimator)

    @property
    def policy_loss_fn(self) -> PolicyLoss:
        """The policy loss function of this config (``policy_loss`` resolved: a built-in name,
        ``builtin:<name>``, an import path or a file), called ``fn(inputs, correction, options)``
        with ``options`` from ``loss_options()``.

        Raises:
            ValueError: the spec cannot be resolved (see ``async_rl.utils.registry``), or the preset has
                not been applied.
        """
        return POLICY_LOSSES.get(self.require_resolved().policy_loss)

    @property
    def records_routing(self) -> bool:
        """The engine records routing for the trajectories (``routing_replay`` or ``record_routing``)."""
        return self.routing_replay or self.record_routing

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator needs critic values (the learner then trains a critic)."""
        return self.estimator.needs_critic

    @property
    def needs_groups(self) -> bool:
        """Whether the advantage estimator compares samples of one prompt (needs >= 2 per prompt)."""
        return self.estimator.needs_groups

    @property
    def needs_reference(self) -> bool:
        """Whether a frozen reference policy is needed (a KL term with ``kl_coef > 0``)."""
        return self.kl_coef > 0

    @property
    def needs_teacher(self) -> bool:
        """Whether a teacher scores the samples (``distill.teacher`` or ``distill.teachers`` set)."""
        return self.distill.enabled

    def loss_options(self) -> LossOptions:
        """The options of the chosen policy loss, an instance of its ``options_type``
        (``LossOptions.from_algorithm``): its defaults, then the fields of this config it reads
        (``ppo_clip``: the clip bounds, whichever spec names it), then ``loss_kwargs``. Built once
        per learner.

        Raises:
            ValueError: the loss spec cannot be resolved, the preset has not been applied, or one
                line naming the key: a ``loss_kwargs`` key the loss does not take, a value out of
                range.
        """
        return self.policy_loss_fn.options_type.from_algorithm(self)

    def advantage_params(self) -> dict[str, Any]:
        """Keyword arguments for the chosen advantage estimator, as its ``EstimatorSpec.params``
        declares (``{}`` for a plain user function)."""
        return self.estimator.params(self)

    def off_policy_correction(self) -> OffPolicyCorrection:
        """The behaviour-weight settings every policy loss takes (preset applied first)."""
        self.require_resolved()
        return OffPolicyCorrection(self.behavior_correction, tis_cap=self.tis_cap, icepop_low=self.icepop_low,
                                   icepop_high=self.icepop_high, bypass_proximal=self.bypass_proximal)
