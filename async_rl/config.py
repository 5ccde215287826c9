"""The typed config tree and its loader.

A run's configuration is one dataclass tree (``Config``); each section is defined next to the
component it configures. ``load_config`` merges, in order, the schema defaults, a sparse YAML
file and dotted CLI overrides (``trainer.total_steps=20``) with omegaconf structured configs, then
converts the result back to dataclasses, so code never sees a ``DictConfig``. Each dataclass
validates its own fields in ``__post_init__``.

Errors are ``ConfigError`` (a ``ValueError``) naming the dotted key: an unknown key (with the
closest valid key), a value of the wrong type, a missing required value (``???``), or a value out
of range.

The loader also keeps which keys the user set (those the YAML file or the overrides name), not only
their values: a setting the selected policy loss or advantage estimator fixes
(``async_rl.algorithms.fixed_settings``) replaces the default or preset value of a key the user
did not set, and refuses a key the user set to another value.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from async_rl.step.agent import AgentConfig
from async_rl.step.episodes import EnvConfig, env_gives_reward
from async_rl.endpoint.rollouts import EndpointConfig
from async_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from async_rl.algorithms.config import ASYNC_CLIP_RATIO_C, PRESETS, AlgorithmConfig
from async_rl.algorithms.fixed_settings import FixedSetting, fixed_settings_of
from async_rl.algorithms.losses import POLICY_LOSSES
from async_rl.loops.base import TrainerConfig
from async_rl.data.dataset import DataConfig
from async_rl.runtime.metrics import LoggingConfig
from async_rl.rewards import get_reward_fn
from async_rl.rewards.config import RewardConfig
from async_rl.runtime.cluster import ray_address
from async_rl.step.rollout import longest_sequence
from async_rl.weight_sync import WeightSyncConfig
from async_rl.generators.base import GeneratorConfig
from async_rl.generators.capabilities import engine_capabilities, engines_that
from async_rl.learners.base import LearnerConfig
from async_rl.learners.capabilities import learner_capabilities, learners_that, model_parallel_sizes
from async_rl.utils.lora import LoRAConfig


class ConfigError(ValueError):
    """A configuration problem, with a message that names the offending key."""


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = "???"
    """Hugging Face model directory, or ``builtin:tiny-qwen2`` (built locally, no download)."""
    tokenizer_path: str | None = None
    """Tokenizer directory; ``None`` = ``path``."""


@dataclass
class Config:
    """Root of the config tree; one attribute per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass schema (sections and leaves)."""
    keys = []
    hints = get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if is_dataclass(hints[f.name]):
            keys.extend(_all_keys(hints[f.name], key + "."))
    return keys


def _closest(key: str) -> str:
    valid = _all_keys(Config)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not match:
        # A misspelt leaf under a right section: compare the last part within that section.
        section, _, leaf = key.rpartition(".")
        siblings = [k for k in valid if k.rpartition(".")[0] == section]
        names = difflib.get_close_matches(leaf, [s.rpartition(".")[2] for s in siblings], n=1, cutoff=0.5)
        match = [f"{section}.{names[0]}" if section else names[0]] if names else []
    return f" (did you mean '{match[0]}'?)" if match else ""


def _translate(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or "?"
    msg = str(err).splitlines()[0]
    if isinstance(err, ConfigKeyError):
        return ConfigError(f"{origin}: unknown config key '{key}'{_closest(str(key))}")
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(f"{origin}: missing required value '{key}' (set it in the YAML file or as {key}=...)")
    if isinstance(err, ValidationError):
        return ConfigError(f"{origin}: bad value for '{key}': {msg}")
    return ConfigError(f"{origin}: {msg} (key '{key}')")


def _read_yaml(path: Path) -> DictConfig:
    """The mapping a YAML config file holds.

    Raises:
        ConfigError: ``path`` is a directory or unreadable, is not valid YAML (the message gives
            the parser's line and column, 1-based), or its top level is not a mapping.
    """
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    try:
        loaded = OmegaConf.load(path)
    except yaml.MarkedYAMLError as e:
        where = [f"{text} (line {mark.line + 1}, column {mark.column + 1})"
                 for text, mark in ((e.context, e.context_mark), (e.problem, e.problem_mark)) if text and mark]
        raise ConfigError(f"{path}: not valid YAML: {': '.join(where) or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, trainer:, ...), "
                          f"got a {type(loaded).__name__.removesuffix('Config').lower()}")
    return loaded


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load a ``Config`` from a YAML file plus dotted overrides.

    Args:
        path: YAML file (sparse: only the keys that differ from the defaults), or ``None``. A
            run's saved ``config.yaml`` (fully resolved) loads too: every key counts as set, and
            the values a run resolved agree with what its loss and estimator fix.
        overrides: ``["trainer.total_steps=20", "algorithm.name=grpo"]``; values are parsed as
            YAML scalars/lists.

    Returns:
        The validated dataclass tree, with the settings the chosen policy loss and advantage
        estimator fix applied (``_resolve_fixed_settings``).

    Raises:
        ConfigError: unknown key, wrong type, missing required value, malformed override or an
            out-of-range value (the message names the key); a ``path`` that is a directory, is not
            valid YAML or does not hold a mapping (the message names the file); a key set to a
            value other than the one the chosen loss or estimator fixes, or a loss and an
            estimator fixing one key to different values (the message names both keys).
        FileNotFoundError: ``path`` does not exist.
    """
    schema = OmegaConf.structured(Config)
    merged = schema
    given: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            from_file = _read_yaml(path)
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as e:
            raise _translate(e, str(path)) from None
        given.update(_given_keys(from_file, schema, f"in {path}"))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
    try:
        from_command_line = OmegaConf.from_dotlist(list(overrides))
        merged = OmegaConf.merge(merged, from_command_line)
    except OmegaConfBaseException as e:
        raise _translate(e, "command line") from None
    given.update(_given_keys(from_command_line, schema, "on the command line"))
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _translate(e, str(path or "config")) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _cross_validate(cfg, given)
    return cfg


def _given_keys(tree: DictConfig, schema: DictConfig, origin: str) -> dict[str, str]:
    """The dotted keys ``tree`` (a YAML file's mapping or the overrides) sets, sections and leaves,
    each mapped to ``origin`` (``"on the command line"``, ``"in <file>"``). A key given as null
    where the schema's default is null too asks for that default and does not count as set
    (``algorithm.loss_agg_mode: null`` means "the preset's")."""
    keys: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        for name, value in node.items():
            key = f"{prefix}{name}"
            if value is None and OmegaConf.select(schema, key, default=None, throw_on_missing=False) is None:
                continue
            keys[key] = origin
            if isinstance(value, dict):
                walk(value, key + ".")

    walk(OmegaConf.to_container(tree, resolve=False), "")
    return keys


def _config_value(value: Any) -> str:
    """``value`` as a user would type it in an override (``false``, ``null``, ``token-mean``)."""
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _resolve_fixed_settings(cfg: Config, given: Mapping[str, str]) -> None:
    """Apply the settings the chosen policy loss and advantage estimator fix
    (``fixed_settings``, ``async_rl.algorithms.fixed_settings``), before any default is derived.

    For each fixed key: one the user did not set takes the fixed value (over the schema's default
    and the preset's; one info line where that differs from what the key would have held); one
    the user set must already hold it. The loss and the estimator are those the config names, or
    its preset's.

    Args:
        cfg: the config as loaded, nothing resolved yet.
        given: the keys the user set (YAML file and overrides; ``_given_keys``), each with where.

    Raises:
        ConfigError: one line: the loss or estimator spec cannot be resolved (naming its key); a
            key the user set to another value (naming the loss or estimator key, the fixed key and
            both values, and where it was set); the loss and the estimator fix one key to
            different values (naming both); a declaration names a key the schema does not have or
            a value it refuses.
    """
    algo = cfg.algorithm
    fixed: dict[str, tuple[str, str, FixedSetting]] = {}
    for field_name, registry, noun in (("policy_loss", POLICY_LOSSES, "policy loss"),
                                        ("advantage_estimator", ADVANTAGE_ESTIMATORS, "advantage estimator")):
        spec = getattr(algo, field_name)
        chosen = f"algorithm.{field_name}={spec}"
        if spec is None:
            spec = PRESETS[algo.name][field_name]
            chosen = f"algorithm.{field_name}={spec} (preset algorithm.name={algo.name})"
        try:
            declared = fixed_settings_of(registry.get(spec), f"{noun} {spec!r}")
        except ValueError as e:
            raise ConfigError(f"algorithm.{field_name}: {e}") from None
        for key, setting in declared.items():
            if key in fixed and fixed[key][2].value != setting.value:
                other, other_noun, other_setting = fixed[key]
                raise ConfigError(
                    f"{other} fixes {key}={_config_value(other_setting.value)} ({other_setting.source}) but {chosen} "
                    f"fixes it to {_config_value(setting.value)} ({setting.source}): choose another {other_noun} "
                    f"or {noun}")
            fixed[key] = (chosen, noun, setting)
    for key, (chosen, noun, setting) in fixed.items():
        parent, leaf = _fixed_key_owner(cfg, key, chosen)
        value = _typed_fixed_value(parent, leaf, key, setting.value, chosen)
        current = getattr(parent, leaf)
        if key in given:
            if current != value:
                raise ConfigError(
                    f"{chosen} fixes {key}={_config_value(value)} ({setting.source}); {key}={_config_value(current)} "
                    f"was set {given[key]}: unset it or choose another {noun}")
            continue
        if current == value:
            continue
        otherwise = PRESETS[algo.name].get(leaf) if current is None and parent is algo else current
        setattr(parent, leaf, value)
        try:  # the section's own range checks, which ran at load on the value the key held then
            getattr(parent, "__post_init__", lambda: None)()
        except ValueError as e:
            raise ConfigError(f"{chosen} fixes {key}={_config_value(value)}: {e}") from None
        if otherwise != value:
            logging.getLogger(__name__).info("%s=%s, not %s: %s fixes it", key, _config_value(value),
                                             _config_value(otherwise), chosen)


def _fixed_key_owner(cfg: Config, key: str, chosen: str) -> tuple[Any, str]:
    """``(dataclass holding the field, field name)`` of the dotted ``key`` a fixed setting names.

    Raises:
        ConfigError: ``key`` is no field of the schema, or is a whole section.
    """
    *sections, leaf = key.split(".")
    node: Any = cfg
    for name in sections:
        node = getattr(node, name, None)
    if not is_dataclass(node) or leaf not in {f.name for f in fields(node)} or is_dataclass(getattr(node, leaf)):
        raise ConfigError(f"{chosen} fixes {key}, which is not a config key{_closest(key)}")
    return node, leaf


def _typed_fixed_value(parent: Any, leaf: str, key: str, value: Any, chosen: str) -> Any:
    """``value`` converted to the type of field ``leaf`` of ``parent``'s schema, as a YAML value
    would be (a user declaration's ``"false"`` becomes ``False``).

    Raises:
        ConfigError: the schema refuses ``value`` for that field.
    """
    node = OmegaConf.structured(type(parent))
    try:
        node[leaf] = value
    except OmegaConfBaseException as e:
        raise ConfigError(f"{chosen} fixes {key}={_config_value(value)}: {str(e).splitlines()[0]}") from None
    return OmegaConf.to_container(node)[leaf]


def _cross_validate(cfg: Config, given: Mapping[str, str] | None = None) -> None:
    """Resolve what the config leaves to be derived and refuse combinations no single field's
    check can see; ``given`` holds the keys the user set (``load_config``), for the settings the
    chosen loss and estimator fix (``_resolve_fixed_settings``).

    Raises:
        ConfigError: one line naming the keys in conflict.
    """
    _resolve_fixed_settings(cfg, given or {})
    if cfg.algorithm.behavior_correction is None:
        # Async samples come from older policies: weight them by pi_prox / mu, truncated (the
        # decoupled PPO objective of AReaL, arXiv 2505.24298). In sync mode pi_prox == mu up to
        # float noise, so no weight is needed.
        cfg.algorithm.behavior_correction = "tis" if cfg.trainer.mode == "async" else "none"
    if cfg.algorithm.clip_ratio_c is None and cfg.trainer.mode == "async":
        # Tokens an older policy sampled can be unlikely under pi_prox; one optimizer step later
        # their ratio pi_theta / pi_prox runs to the hundreds (on the default job a step's largest
        # ratio passed 3 in 25 of 300 async steps, up to 777; in 20 of 300 sync steps, up to 4.8),
        # and with A < 0 PPO's clip leaves that term unbounded. Dual clip bounds it (Ye et al.
        # 2020, arXiv 1912.09729; verl's default 3.0).
        cfg.algorithm.clip_ratio_c = ASYNC_CLIP_RATIO_C
    if cfg.trainer.max_staleness is None:
        # Async without staleness would idle the generators while the learner trains.
        cfg.trainer.max_staleness = 0 if cfg.trainer.mode == "sync" else 1
    if cfg.learner.seed is None:
        # One key seeds the run: the mini-batch order was the same for every trainer.seed.
        cfg.learner.seed = cfg.trainer.seed
    if cfg.trainer.policy_version_per is None:
        cfg.trainer.policy_version_per = _default_version_unit(cfg)
    if cfg.algorithm.bypass_proximal is None:
        # One-step off-policy data: clipping against the policy that sampled learned more per
        # sample than the recomputed proximal policy on the default job's same seeds, and saves
        # that pass, a forward per step (AlgorithmConfig.bypass_proximal has the figures).
        cfg.algorithm.bypass_proximal = cfg.trainer.mode == "async" and cfg.trainer.max_staleness == 1
    cfg.algorithm.apply_preset()
    if cfg.algorithm.loss_horizon_tokens is None:
        # Dr.GRPO's constant horizon: the longest response the generator may produce.
        cfg.algorithm.loss_horizon_tokens = cfg.generator.max_response_tokens
    n = cfg.trainer.samples_per_prompt
    _check_specs(cfg)
    needs_groups = cfg.algorithm.needs_groups
    if n < 2 and needs_groups:
        raise ConfigError(
            f"trainer.samples_per_prompt={n}: the {cfg.algorithm.advantage_estimator} "
            "estimator compares samples within a group and needs at least 2 per prompt")
    _check_colocated(cfg)
    _check_env(cfg)
    _check_routing_replay(cfg)
    if n < 2 and cfg.algorithm.dynamic_sampling:
        raise ConfigError(f"trainer.samples_per_prompt={n}: dynamic sampling keeps groups whose rewards "
                          "differ, which needs at least 2 samples per prompt")
    if cfg.trainer.mode == "async" and "generator.num_workers" not in (given or {}):
        if ray_address(cfg.trainer):
            # A joined cluster places the actors on its nodes, whose cores the driver's affinity
            # does not show: two, the default wherever the cores allow more than one.
            cfg.generator.num_workers = 2
        # Left unset, it never asks for an actor that no group in flight could feed.
        cfg.generator.num_workers = min(cfg.generator.num_workers,
                                        (cfg.trainer.max_staleness + 1) * cfg.trainer.prompts_per_step)
    _check_splits(cfg)
    _check_version_unit(cfg)
    _check_group_spread(cfg)
    _check_token_budgets(cfg)
    _check_lora(cfg)
    _check_partial_rollout(cfg)


def _rollout_function(cfg: Config, registry) -> Any:
    try:
        return registry.get(cfg.endpoint.rollout)
    except ValueError as e:
        raise ConfigError(f"endpoint.rollout: {e}") from None


def _check_env(cfg: Config) -> None:
    """An environment is the rollout's one road: it answers every turn and gives the reward, or
    leaves the reward to the run's (``Environment.reward_from_run``: then ``reward.fn`` may be set).
    A rollout function (``endpoint.rollout``) is a road of its own: it runs the episode and returns
    the reward, so it excludes ``env.name``, ``agent.tools`` and ``reward.fn``."""
    if cfg.endpoint.enabled:
        for key, value in (("env.name", cfg.env.name), ("agent.tools", cfg.agent.tools), ("reward.fn", cfg.reward.fn)):
            if value:
                raise ConfigError(f"endpoint.rollout={cfg.endpoint.rollout} and {key}={value} are both set: the rollout "
                                  "function runs the whole episode and returns its reward, so unset one of them")
        from async_rl.endpoint.rollouts import ROLLOUT_FUNCTIONS

        try:
            ROLLOUT_FUNCTIONS.get(cfg.endpoint.rollout)
        except ValueError as e:
            raise ConfigError(f"endpoint.rollout: {e}") from None
    env_files = [f for f in [*cfg.data.train_files, *cfg.data.val_files] if f.startswith("env:")]
    if env_files and cfg.endpoint.enabled:
        from async_rl.endpoint.rollouts import ROLLOUT_FUNCTIONS

        if cfg.env.enabled or not hasattr(_rollout_function(cfg, ROLLOUT_FUNCTIONS), "task_rows"):
            raise ConfigError(f"data files {env_files} are a rollout function's task rows, but endpoint.rollout="
                              f"{cfg.endpoint.rollout} offers none (no task_rows); name data files of your own")
    elif env_files and not cfg.env.enabled:
        raise ConfigError(f"data files {env_files} are an environment's task rows, but env.name is unset")
    if not cfg.env.enabled:
        return
    if cfg.agent.enabled:
        raise ConfigError(f"env.name={cfg.env.name} and agent.tools={cfg.agent.tools} are both set: an environment "
                          "runs the whole episode (it offers tools itself, as Environment.tools), so set one of them")
    from async_rl.envs import ENVIRONMENTS, make_env

    if cfg.reward.fn and env_gives_reward(cfg.env):
        raise ConfigError(f"env.name={cfg.env.name} and reward.fn={cfg.reward.fn} are both set: the environment's "
                          "return is the reward; unset reward.fn (reward.model may still add a model's score)")

    try:
        make_env(cfg.env.name, cfg.env.args)
    except ValueError as e:
        raise ConfigError(f"env.name: {e}") from None
    if env_files and not hasattr(ENVIRONMENTS.get(cfg.env.name), "task_rows"):
        raise ConfigError(f"data files {env_files}: environment {cfg.env.name!r} offers no task rows; name data "
                          "files of your own")


def _default_version_unit(cfg: Config) -> str:
    """``trainer.policy_version_per`` when unset: ``mini_batch`` for async runs where it applies
    (whole groups per mini-batch, ``learner.num_epochs`` 1, ``max_staleness`` >= 1), else ``step``.

    Why: with a version per step, one-step-stale data trails the weights it trains by a whole
    step of optimizer steps (4 on the default job), and clipping against the policy that sampled
    it then clips 2.6x sync's share of tokens. A version per mini-batch cuts that lag to one
    optimizer step: on the default job (5 seeds) it reached the target on every seed against 3 of
    5, and on reasoning-gym's spell_backward (2 seeds) it kept a gain that a version per step lost
    (figures: docs/time_to_accuracy.md). ``max_staleness`` 0 keeps ``step``: async then trains on
    exactly the samples sync mode would."""
    t_cfg = cfg.trainer
    applies = t_cfg.mode == "async" and t_cfg.max_staleness >= 1 and _mini_batch_version_problem(cfg) is None
    return "mini_batch" if applies else "step"


def _mini_batch_version_problem(cfg: Config) -> str | None:
    """Why a mini-batch cannot be a policy version of this run (one line), or ``None``."""
    t_cfg, lrn = cfg.trainer, cfg.learner
    if t_cfg.prompts_per_step % lrn.num_mini_batches:
        return (f"trainer.policy_version_per=mini_batch takes whole groups per mini-batch: "
                f"trainer.prompts_per_step={t_cfg.prompts_per_step} is not a multiple of "
                f"learner.num_mini_batches={lrn.num_mini_batches}")
    if lrn.num_epochs != 1:
        return (f"trainer.policy_version_per=mini_batch publishes after each optimizer step: "
                f"learner.num_epochs={lrn.num_epochs} would train twice on a published version; set it to 1")
    return None


DEFAULT_GROUP_SPREAD = 2
"""``trainer.group_spread`` where it applies and is unset. On the default job (5 seeds, one warm
start) async mode reached sync's target in 238 steps with whole groups per optimizer step (1),
in 218 with each group dealt over 2 versions and in 190 over 4, against sync's 220; but 4 shares
made a step's training the longest (a prompt shared by 2 rows of a mini-batch instead of 4 or
8), and its time to the target was the longest of the three (figures: docs/time_to_accuracy.md)."""


def _group_spread_problem(cfg: Config) -> str | None:
    """Why ``trainer.group_spread`` > 1 cannot serve this run (one line), or ``None``."""
    t_cfg, algo = cfg.trainer, cfg.algorithm
    if t_cfg.mode != "async" or t_cfg.policy_version_per != "mini_batch":
        return (f"deals groups over the versions of async mode with trainer.policy_version_per=mini_batch "
                f"(this run: mode={t_cfg.mode}, policy_version_per={t_cfg.policy_version_per})")
    if t_cfg.max_reuse != 1:
        return f"trains each sample once: trainer.max_reuse={t_cfg.max_reuse} must be 1"
    needs = [what for what, on in (("a critic", algo.needs_critic), ("a KL term (algorithm.kl_coef > 0)",
                                    algo.needs_reference), ("a teacher", algo.needs_teacher)) if on]
    if needs:
        return f"computes advantages on whole groups before the learner's passes, which {needs[0]} needs"
    return None


def _check_group_spread(cfg: Config) -> None:
    """Resolve an unset ``trainer.group_spread`` (``DEFAULT_GROUP_SPREAD`` where it applies, else
    1) and refuse one > 1 where it has no meaning or cannot be computed: it deals
    a group over the versions of async mode's ``policy_version_per=mini_batch``, and it computes
    advantages before the learner's passes, so nothing of them may need the learner (a critic's
    values, a KL term's reference) or a teacher."""
    t_cfg = cfg.trainer
    if t_cfg.group_spread is None:
        t_cfg.group_spread = DEFAULT_GROUP_SPREAD if _group_spread_problem(cfg) is None else 1
    if t_cfg.group_spread == 1:
        return
    problem = _group_spread_problem(cfg)
    if problem is not None:
        raise ConfigError(f"trainer.group_spread={t_cfg.group_spread} {problem}; set it to 1")


def _check_version_unit(cfg: Config) -> None:
    """Refuse ``trainer.policy_version_per=mini_batch`` where a mini-batch is not whole groups
    taken once: the groups of a step must divide evenly into ``learner.num_mini_batches`` (a group
    is the unit the buffer hands out and advantages compare within), and ``learner.num_epochs``
    must be 1 (a second pass over a step's batch would train on versions already published)."""
    if cfg.trainer.policy_version_per != "mini_batch":
        return
    problem = _mini_batch_version_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)


def _check_colocated(cfg: Config) -> None:
    """Refuse ``weight_sync.transport=colocated`` where the engine cannot live in the learner's
    process: async mode, or an engine whose class says it cannot (``EngineCapabilities.colocated``)."""
    if cfg.weight_sync.transport != "colocated":
        return
    if cfg.trainer.mode == "async" or not engine_capabilities(cfg.generator.backend).colocated:
        raise ConfigError(
            f"weight_sync.transport=colocated: the engine must live in the learner's process, which holds "
            f"only for trainer.mode=sync with generator.backend={engines_that(lambda c: c.colocated)} (got "
            f"{cfg.trainer.mode}, {cfg.generator.backend}); use shm (same host) or broadcast")


def _check_routing_replay(cfg: Config) -> None:
    """Refuse ``algorithm.routing_replay`` / ``record_routing`` where the routing cannot reach the
    learner yet (an engine that does not record it, or not in this configuration; a multi-turn
    rollout), and the MoE auxiliary losses on a learner that does not add them."""
    learner = learner_capabilities(cfg.learner.backend)
    for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        if getattr(cfg.algorithm, key) and not learner.moe_aux_losses:
            raise ConfigError(f"algorithm.{key}={getattr(cfg.algorithm, key)}: the {learner.name} learner does not "
                              f"add the MoE auxiliary losses yet; learner.backend="
                              f"{learners_that(lambda c: c.moe_aux_losses)} does, or set it to 0")
    if not cfg.algorithm.records_routing:
        return
    key = "routing_replay" if cfg.algorithm.routing_replay else "record_routing"
    engine = engine_capabilities(cfg.generator.backend)
    if not engine.records_routing:
        raise ConfigError(f"algorithm.{key}=true: the {engine.name} engine does not record routing yet; "
                          f"generator.backend={engines_that(lambda c: c.records_routing)} does")
    blocked = engine.routing_blocked_by(cfg.generator)
    if blocked:
        raise ConfigError(f"algorithm.{key}=true: the {engine.name} engine records routing with hooks on each "
                          f"router, which {blocked} would not run; set it to true")
    if cfg.env.enabled or cfg.agent.enabled or cfg.endpoint.enabled:
        raise ConfigError(f"algorithm.{key}=true runs on single-turn rollouts for now: a multi-turn "
                          "rollout (env.name, agent.tools, endpoint.rollout) does not record routing yet")


def _check_partial_rollout(cfg: Config) -> None:
    """Refuse a ``generator.partial_rollout`` mode the engine does not implement."""
    mode, backend = cfg.generator.partial_rollout, cfg.generator.backend
    caps = engine_capabilities(backend)
    if mode not in caps.partial_rollout:
        raise ConfigError(f"generator.partial_rollout={mode}: the {caps.name} engine (generator.backend={backend}) "
                          f"implements {' and '.join(caps.partial_rollout)}; engines with {mode}: "
                          f"{engines_that(lambda c: mode in c.partial_rollout)}")


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _check_splits(cfg: Config) -> None:
    """Refuse a config that leaves one of its splits without work.

    Every split of a step's work must get at least one sequence (or group), or the config is
    refused here, naming the keys and the derived numbers:

    - the step's ``prompts_per_step x samples_per_prompt`` sequences into
      ``learner.num_mini_batches`` mini-batches (an empty one would still take an optimizer and
      an LR-scheduler step; the critic shares this split);
    - each mini-batch over the learner's data-parallel ranks (``learner.world_size``, divided by
      the tensor and pipeline parallel sizes for ``learner.backend=megatron``): the batch is cut by ``tensor_split``, so
      the smallest mini-batch has ``floor(S / num_mini_batches)`` sequences;
    - async mode: ``generator.num_workers`` against the ``(max_staleness + 1) x prompts_per_step``
      groups admission control lets be in flight (``async_rl.buffers.replay.AdmissionController``);
    - the warm start's ``batch_size`` sequences over the data-parallel ranks.

    Micro-batches need no rule: they are cut from a rank's non-empty share and are never empty
    (``async_rl.learners.batching``). Dynamic sampling only adds groups; reward rejections may shrink a
    batch at run time, which the learner handles (``LearnerCore.train_step`` skips mini-batches
    without a loss token).
    """
    t, lrn = cfg.trainer, cfg.learner
    n, prompts = t.samples_per_prompt, t.prompts_per_step
    seqs = prompts * n
    per_step = f"trainer.prompts_per_step={prompts} x trainer.samples_per_prompt={n}"
    if lrn.num_mini_batches > seqs:
        raise ConfigError(f"learner.num_mini_batches={lrn.num_mini_batches} exceeds the "
                          f"{_plural(seqs, 'sequence')} per step ({per_step}): a mini-batch would be empty "
                          "and its optimizer step would train on nothing")
    smallest = seqs // lrn.num_mini_batches
    dp, dp_keys = lrn.data_parallel_size, _data_parallel_keys(lrn)
    if dp > smallest:
        raise ConfigError(f"{dp_keys} exceeds the {_plural(smallest, 'sequence')} of "
                          f"the smallest mini-batch ({per_step} = {seqs} sequences per step in "
                          f"learner.num_mini_batches={lrn.num_mini_batches}): a rank would get no sequence")
    if t.mode == "async":
        in_flight = (t.max_staleness + 1) * prompts
        if cfg.generator.num_workers > in_flight:
            raise ConfigError(
                f"generator.num_workers={cfg.generator.num_workers} exceeds the {_plural(in_flight, 'group')} "
                f"admission control lets be in flight in trainer.mode=async ((trainer.max_staleness="
                f"{t.max_staleness} + 1) x trainer.prompts_per_step={prompts}): a worker would never get a group")
    ws = t.warm_start
    if ws.steps > 0 and ws.batch_size < dp:
        raise ConfigError(f"trainer.warm_start.batch_size={ws.batch_size} is less than {dp_keys}: a rank would "
                          "get no warm-start sequence")


def _data_parallel_keys(lrn) -> str:
    """How a message names the data-parallel size: ``learner.world_size=4`` for FSDP2, or
    ``the 2 data-parallel rank(s) of learner.world_size=4 (...)`` for Megatron."""
    sizes = model_parallel_sizes(lrn)
    if not sizes:
        return f"learner.world_size={lrn.world_size}"
    split = ", ".join(f"{key}={size}" for key, size in sizes.items())
    return f"the {lrn.data_parallel_size} data-parallel rank(s) of learner.world_size={lrn.world_size} ({split})"


def _check_token_budgets(cfg: Config) -> None:
    """Refuse token budgets that the longest possible rollout sequence would exceed.

    A budget exactly met is fine: a sequence of exactly ``learner.max_tokens_per_micro_batch``
    tokens gets a micro-batch of its own, and vLLM runs a request up to exactly
    ``max_model_len`` tokens. (Warm-start sequences are reference answers of any length; a
    too-long one is still named at run time by ``async_rl.learners.batching.micro_batches_by_tokens``.)
    """
    longest, how = longest_sequence(cfg)
    budget = cfg.learner.max_tokens_per_micro_batch
    if 0 < budget < longest:
        raise ConfigError(f"learner.max_tokens_per_micro_batch={budget} is less than the {longest} tokens of the "
                          f"longest possible sequence ({how}): such a sequence would fit no micro-batch")
    caps = engine_capabilities(cfg.generator.backend)
    context = caps.context_length(cfg.generator)
    if 0 < context < longest:
        raise ConfigError(f"generator.{caps.context_key}={context} is less than the {longest} tokens of the "
                          f"longest possible sequence ({how}): {caps.name} would end responses before the limit")


def _check_specs(cfg: Config) -> None:
    """Resolve every part the config names by spec (loss, estimator, reward) and build the loss's
    options, so a bad one stops at load with its key, before a model loads or a run directory is made."""
    checks = [("algorithm.policy_loss", lambda: cfg.algorithm.policy_loss_fn),
              ("algorithm.advantage_estimator", lambda: cfg.algorithm.estimator)]
    if cfg.reward.fn:
        checks.append(("reward.fn", lambda: get_reward_fn(cfg.reward.fn)))
    for key, resolve_spec in checks:
        try:
            resolve_spec()
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
    try:  # the loss's typed options: a bad loss_kwargs key or value, named in the message itself
        cfg.algorithm.loss_options()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_lora(cfg: Config) -> None:
    lora = cfg.learner.lora
    if lora.rank == 0 and lora != LoRAConfig():
        logging.getLogger(__name__).warning("learner.lora.* is set but learner.lora.rank=0: LoRA is off and "
                                            "those settings have no effect")
    if lora.rank == 0:
        return
    backend, transport = cfg.generator.backend, cfg.weight_sync.transport
    caps = engine_capabilities(backend)
    if transport != "auto" and transport not in caps.lora_transports:
        over = " or ".join(t for t in ("colocated", "shm", "broadcast") if t in caps.lora_transports)
        raise ConfigError(f"generator.backend={backend} with learner.lora.rank > 0: adapters reach {caps.name} "
                          f"over weight_sync.transport={over}, not over weight_sync.transport={transport}")
    if caps.lora_max_rank and lora.rank > caps.lora_max_rank:
        raise ConfigError(f"generator.backend={backend}: learner.lora.rank={lora.rank}: {caps.name} serves adapters "
                          f"up to rank {caps.lora_max_rank}")


SECRET_KEY = re.compile(r"api_?key$|(^|_)token$|secret|passw(or)?d|credential", re.IGNORECASE)
"""Config keys (and environment variables) whose string values are secrets: ``*_API_KEY``,
``*_TOKEN`` (not ``*_tokens``, the counts), ``*SECRET*``, ``*PASSWORD*``, ``*CREDENTIAL*``."""

NOT_SECRETS = frozenset({"judge_token"})
"""Config keys that match :data:`SECRET_KEY` but hold no secret (``reward.model.judge_token``: the
text a judge model answers with)."""

REDACTED = "***"
"""What a secret's value becomes wherever the run writes its config."""


def is_secret_key(key: Any) -> bool:
    """Whether a config key or environment variable name holds a secret (:data:`SECRET_KEY`)."""
    return isinstance(key, str) and key not in NOT_SECRETS and SECRET_KEY.search(key) is not None


def redact(tree: Any) -> Any:
    """``tree`` (dicts, lists, scalars) with the non-empty string value of every key matching
    :data:`SECRET_KEY` (less :data:`NOT_SECRETS`) replaced by :data:`REDACTED`, at any depth; the
    input is not changed."""
    if isinstance(tree, dict):
        return {k: REDACTED if is_secret_key(k) and isinstance(v, str) and v else redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return tree


def to_yaml(cfg: Config) -> str:
    """The fully resolved config as YAML (what is written to ``<run_dir>/config.yaml``), secrets
    redacted (``redact``)."""
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))


def to_dict(cfg: Config) -> dict[str, Any]:
    """The fully resolved config as plain python containers (what W&B records), secrets redacted
    (``redact``)."""
    return redact(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
