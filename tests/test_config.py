"""Config loading: errors name the key, every checked-in config parses, the run dir gets the resolved config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from async_rl.algorithms import PPOClipOptions
from async_rl.config import Config, ConfigError, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
CHECKED_IN = sorted(ROOT.glob("configs/*.yaml")) + sorted(ROOT.glob("examples/**/*.yaml"))


@pytest.mark.parametrize("path", CHECKED_IN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_checked_in_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.model.path and cfg.data.train_files


def test_checked_in_configs_exist():
    names = {p.name for p in CHECKED_IN}
    assert "default.yaml" in names and "gsm8k_qwen2.5_0.5b.yaml" in names


def test_overrides_are_typed_and_applied():
    cfg = load_config(ROOT / "configs/default.yaml", ["trainer.total_steps=20", "algorithm.name=dr_grpo",
                                                        "learner.betas=[0.8,0.9]"])
    assert cfg.trainer.total_steps == 20
    assert cfg.algorithm.advantage_estimator == "dr_grpo"
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.algorithm.loss_horizon_tokens == cfg.generator.max_response_tokens
    assert cfg.learner.betas == [0.8, 0.9]


def test_unknown_key_names_key_and_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.totl_steps' \(did you mean 'trainer.total_steps'\?\)"):
        load_config(ROOT / "configs/default.yaml", ["trainer.totl_steps=3"])


def test_unknown_key_in_yaml_names_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("model:\n  path: x\ndata:\n  train_files: [a]\nlearner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'learner.lrr' \(did you mean 'learner.lr'\?\)"):
        load_config(f)


def test_unknown_section_suggests_section():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainr' \(did you mean 'trainer'\?\)"):
        load_config(ROOT / "configs/default.yaml", ["trainr.total_steps=3"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"bad value for 'trainer.total_steps'"):
        load_config(ROOT / "configs/default.yaml", ["trainer.total_steps=abc"])


def test_missing_required_value_names_itself(tmp_path):
    f = tmp_path / "nomodel.yaml"
    f.write_text("data:\n  train_files: [a.parquet]\n")
    with pytest.raises(ConfigError, match=r"missing required value 'model.path'"):
        load_config(f)


def test_out_of_range_value_names_key():
    with pytest.raises(ConfigError, match=r"trainer.samples_per_prompt must be >= 1"):
        load_config(ROOT / "configs/default.yaml", ["trainer.samples_per_prompt=0"])
    with pytest.raises(ConfigError, match=r"algorithm.name must be one of"):
        load_config(ROOT / "configs/default.yaml", ["algorithm.name=nope"])
    with pytest.raises(ConfigError, match=r"generator.temperature must be > 0"):
        load_config(ROOT / "configs/default.yaml", ["generator.temperature=0"])
    with pytest.raises(ConfigError, match=r"trainer.serve_order must be dispatch or completion, got 'lifo'"):
        load_config(ROOT / "configs/default.yaml", ["trainer.serve_order=lifo"])
    assert load_config(ROOT / "configs/default.yaml").trainer.serve_order == "dispatch"


def test_group_estimator_needs_two_samples():
    with pytest.raises(ConfigError, match=r"samples_per_prompt=1.*at least 2"):
        load_config(ROOT / "configs/default.yaml", ["trainer.samples_per_prompt=1"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(ROOT / "configs/default.yaml", ["trainer.total_steps"])


def test_cli_exits_2_with_one_line(capsys):
    from async_rl.cli import main

    assert main(["config", "--config", str(ROOT / "configs/default.yaml"), "trainer.totl_steps=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.total_steps" in err and err.count("\n") == 1


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(ROOT / "configs/default.yaml", ["trainer.total_steps=7"])
    f = tmp_path / "resolved.yaml"
    f.write_text(to_yaml(cfg))
    again = load_config(f)
    assert again == cfg


def test_presets_select_everything_by_name():
    ppo = load_config(ROOT / "configs/default.yaml", ["algorithm.name=ppo"]).algorithm
    assert (ppo.advantage_estimator, ppo.needs_critic, ppo.dynamic_sampling) == ("gae", True, False)
    dapo = load_config(ROOT / "configs/default.yaml", ["algorithm.name=dapo"]).algorithm
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high, dapo.dynamic_sampling, dapo.overlong_buffer_frac) == (
        0.2, 0.28, True, 0.2)
    # An explicit field beats the preset.
    dapo = load_config(ROOT / "configs/default.yaml", ["algorithm.name=dapo", "algorithm.dynamic_sampling=false",
                                                       "algorithm.overlong_buffer_frac=0"]).algorithm
    assert (dapo.dynamic_sampling, dapo.overlong_buffer_frac) == (False, 0.0)
    grpo = load_config(ROOT / "configs/default.yaml").algorithm
    assert (grpo.needs_critic, grpo.needs_reference, grpo.dynamic_sampling, grpo.overlong_buffer_frac) == (
        False, False, False, 0.0)
    kl = load_config(ROOT / "configs/default.yaml", ["algorithm.kl_coef=0.01"]).algorithm
    assert kl.needs_reference


def test_dynamic_sampling_needs_two_samples():
    with pytest.raises(ConfigError, match=r"dynamic sampling.*at least 2"):
        load_config(ROOT / "configs/default.yaml", ["trainer.samples_per_prompt=1", "algorithm.name=ppo",
                                                    "algorithm.dynamic_sampling=true"])
    load_config(ROOT / "configs/default.yaml", ["trainer.samples_per_prompt=1", "algorithm.name=ppo"])


# ----------------------------------------------------------------------------- empty work (issue 13)
# Every split a config implies must get real work: a config that leaves a mini-batch, a learner
# rank, a generator worker or a warm-start rank without a sequence is refused at load, in one
# line naming the keys and the derived numbers. Each rule is tested at limit - 1, limit, limit + 1.

def _load(*overrides):
    return load_config(ROOT / "configs/default.yaml", list(overrides))


def test_issue_example_more_mini_batches_than_sequences_is_refused():
    with pytest.raises(ConfigError) as e:
        _load("trainer.prompts_per_step=1", "trainer.samples_per_prompt=2", "learner.num_mini_batches=4")
    msg = str(e.value)
    assert "\n" not in msg
    assert "learner.num_mini_batches=4" in msg and "2 sequences per step" in msg
    assert "trainer.prompts_per_step=1" in msg and "trainer.samples_per_prompt=2" in msg


@pytest.mark.parametrize("mini_batches, ok", [(2, True), (3, True), (4, False)])
def test_num_mini_batches_boundary(mini_batches, ok):
    # 1 prompt x 3 samples = 3 sequences per step: 3 mini-batches of one each is the limit.
    args = ("trainer.prompts_per_step=1", "trainer.samples_per_prompt=3", f"learner.num_mini_batches={mini_batches}")
    if ok:
        assert _load(*args).learner.num_mini_batches == mini_batches
    else:
        with pytest.raises(ConfigError, match=r"learner.num_mini_batches=4 exceeds the 3 sequences per step"):
            _load(*args)


@pytest.mark.parametrize("world, ok", [(1, True), (2, True), (3, False)])
def test_world_size_against_the_smallest_mini_batch(world, ok):
    # 5 sequences over 2 mini-batches are cut [3, 2]: the smaller one has 2, so 2 ranks is the limit.
    args = ("trainer.prompts_per_step=1", "trainer.samples_per_prompt=5", "learner.num_mini_batches=2",
            f"learner.world_size={world}")
    if ok:
        assert _load(*args).learner.world_size == world
    else:
        with pytest.raises(ConfigError) as e:
            _load(*args)
        msg = str(e.value)
        assert "learner.world_size=3" in msg and "learner.num_mini_batches=2" in msg and "2 sequences" in msg
        assert "trainer.prompts_per_step=1" in msg and "trainer.samples_per_prompt=5" in msg


@pytest.mark.parametrize("workers, ok", [(1, True), (2, True), (3, False)])
def test_async_workers_against_the_groups_in_flight(workers, ok):
    # Admission lets (max_staleness + 1) x prompts_per_step = 2 groups be in flight: a third
    # worker would never get one.
    args = ("trainer.mode=async", "trainer.max_staleness=1", "trainer.prompts_per_step=1",
            "trainer.samples_per_prompt=8", "learner.num_mini_batches=1", f"generator.num_workers={workers}")
    if ok:
        assert _load(*args).generator.num_workers == workers
    else:
        with pytest.raises(ConfigError) as e:
            _load(*args)
        msg = str(e.value)
        assert "generator.num_workers=3" in msg and "2 groups" in msg
        assert "trainer.max_staleness=1" in msg and "trainer.prompts_per_step=1" in msg


def test_async_workers_limit_follows_the_resolved_staleness():
    # max_staleness left unset resolves to 1 in async mode: 2 x 1 groups in flight.
    base = ("trainer.mode=async", "trainer.prompts_per_step=1", "trainer.samples_per_prompt=8",
            "learner.num_mini_batches=1")
    assert _load(*base, "generator.num_workers=2").trainer.max_staleness == 1
    with pytest.raises(ConfigError, match=r"generator.num_workers=3"):
        _load(*base, "generator.num_workers=3")
    with pytest.raises(ConfigError, match=r"generator.num_workers=2 .*1 group"):
        _load(*base, "trainer.max_staleness=0", "generator.num_workers=2")


def test_num_workers_unset_follows_the_cores_and_the_groups_in_flight(monkeypatch):
    import async_rl.generators.base as base

    # One actor beside the learner on 2 cores or fewer (no core runs two busy threads), else 2.
    assert [base.default_num_workers(c) for c in (1, 2, 3, 16)] == [1, 1, 2, 2]
    monkeypatch.setattr(base, "available_cores", lambda: 16)
    assert _load("trainer.mode=async").generator.num_workers == 2
    # Left unset, it is capped at the groups admission lets be in flight (here 1); set, it is refused.
    assert _load("trainer.mode=async", "trainer.max_staleness=0", "trainer.prompts_per_step=1",
                 "trainer.samples_per_prompt=8", "learner.num_mini_batches=1").generator.num_workers == 1
    with pytest.raises(ConfigError, match=r"generator.num_workers=2 exceeds the 1 group"):
        _load("trainer.mode=async", "trainer.max_staleness=0", "trainer.prompts_per_step=1",
              "trainer.samples_per_prompt=8", "learner.num_mini_batches=1", "generator.num_workers=2")
    # Set, it holds whatever the cores; null asks for the default.
    assert _load("trainer.mode=async", "generator.num_workers=3").generator.num_workers == 3
    assert _load("trainer.mode=async", "generator.num_workers=null").generator.num_workers == 2
    monkeypatch.setattr(base, "available_cores", lambda: 2)
    assert _load("trainer.mode=async").generator.num_workers == 1
    # Joining a cluster, the actors run on its nodes: two whatever the driver's cores, still capped.
    assert _load("trainer.mode=async", "trainer.ray_address=10.0.0.1:6379").generator.num_workers == 2
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert _load("trainer.mode=async").generator.num_workers == 2
    assert _load("trainer.mode=async", "trainer.max_staleness=0", "trainer.prompts_per_step=1",
                 "trainer.samples_per_prompt=8", "learner.num_mini_batches=1").generator.num_workers == 1
    assert _load("trainer.mode=async", "generator.num_workers=1").generator.num_workers == 1
    monkeypatch.delenv("RAY_ADDRESS")


def test_sync_mode_ignores_num_workers():
    # The pool exists only in async mode.
    cfg = _load("trainer.prompts_per_step=1", "trainer.samples_per_prompt=8", "learner.num_mini_batches=1",
                "generator.num_workers=8")
    assert cfg.generator.num_workers == 8


@pytest.mark.parametrize("batch_size, ok", [(1, False), (2, True), (3, True)])
def test_warm_start_batch_against_world_size(batch_size, ok):
    args = ("learner.world_size=2", "trainer.warm_start.steps=5", f"trainer.warm_start.batch_size={batch_size}")
    if ok:
        assert _load(*args).trainer.warm_start.batch_size == batch_size
    else:
        with pytest.raises(ConfigError, match=r"trainer.warm_start.batch_size=1 .*learner.world_size=2"):
            _load(*args)
    # Without a warm start its batch size splits nothing.
    assert _load("learner.world_size=2", "trainer.warm_start.steps=0", "trainer.warm_start.batch_size=1")


# ----------------------------------------------------------------------------- budgets exactly met

@pytest.mark.parametrize("budget, ok", [(39, False), (40, True), (41, True), (0, True)])
def test_micro_batch_token_budget_fits_the_longest_sequence(budget, ok):
    # default.yaml: prompts of at most 32 tokens, responses of at most 8: a sequence has <= 40.
    args = (f"learner.max_tokens_per_micro_batch={budget}",)
    if ok:
        assert _load(*args).learner.max_tokens_per_micro_batch == budget
    else:
        with pytest.raises(ConfigError) as e:
            _load(*args)
        msg = str(e.value)
        assert "learner.max_tokens_per_micro_batch=39" in msg and "40" in msg
        assert "data.max_prompt_tokens=32" in msg and "generator.max_response_tokens=8" in msg
    # Packing counts real tokens, and the longest sequence is as long either way.
    if not ok:
        with pytest.raises(ConfigError, match="learner.max_tokens_per_micro_batch=39"):
            _load(*args, "learner.packing=true")


def test_micro_batch_token_budget_counts_the_agent_response_limit():
    # With tools a response is a whole conversation: agent.max_response_tokens (160) + 64 prompt tokens.
    path = ROOT / "examples/calculator/config.yaml"
    assert load_config(path, ["learner.max_tokens_per_micro_batch=224"]).learner.max_tokens_per_micro_batch == 224
    with pytest.raises(ConfigError, match=r"learner.max_tokens_per_micro_batch=223 .*agent.max_response_tokens=160"):
        load_config(path, ["learner.max_tokens_per_micro_batch=223"])


@pytest.mark.parametrize("max_model_len, ok", [(39, False), (40, True), (41, True), (0, True)])
def test_vllm_context_fits_prompt_and_response(max_model_len, ok):
    args = ("generator.backend=vllm", "weight_sync.transport=shm", f"generator.vllm.max_model_len={max_model_len}")
    if ok:
        assert _load(*args).generator.vllm.max_model_len == max_model_len
    else:
        with pytest.raises(ConfigError, match=r"generator.vllm.max_model_len=39 .*40.*data.max_prompt_tokens=32"
                                              r".*generator.max_response_tokens=8"):
            _load(*args)
    # The HF engine does not use the vLLM section.
    assert _load("generator.vllm.max_model_len=39")


@pytest.mark.parametrize("overrides, want", [
    ((), None),                                                         # sync: off
    (("trainer.mode=async",), 3.0),                                      # async: verl's c
    (("trainer.mode=async", "algorithm.clip_ratio_c=inf"), math.inf),    # async, turned off
    (("trainer.mode=async", "algorithm.clip_ratio_c=5"), 5.0),
    (("algorithm.clip_ratio_c=2.5",), 2.5),
])
def test_dual_clip_defaults_on_in_async_mode_only(tmp_path, overrides, want):
    cfg = _load(*overrides)
    assert cfg.algorithm.clip_ratio_c == want
    assert cfg.algorithm.loss_options().clip_ratio_c == want
    # The resolved config.yaml a run writes loads back to the same bound (inf included).
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []).algorithm.clip_ratio_c == want


@pytest.mark.parametrize("overrides, want", [
    ((), False),                                                                   # sync: recompute
    (("trainer.mode=async",), True),                                               # one-step off-policy
    (("trainer.mode=async", "trainer.max_staleness=0"), False),                    # reproduces sync
    (("trainer.mode=async", "trainer.max_staleness=2"), False),                    # decoupled PPO
    (("trainer.mode=async", "algorithm.bypass_proximal=false"), False),            # the user's choice wins
    (("algorithm.bypass_proximal=true",), True),
])
def test_bypass_proximal_defaults_on_for_one_step_off_policy_only(tmp_path, overrides, want):
    cfg = _load(*overrides)
    assert cfg.algorithm.bypass_proximal is want
    assert cfg.algorithm.off_policy_correction().bypass_proximal is want
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []).algorithm.bypass_proximal is want


@pytest.mark.parametrize("overrides, want", [
    ((), 0),                                                     # trainer.seed's default
    (("trainer.seed=3",), 3),                                    # one key seeds the run
    (("trainer.seed=3", "learner.seed=7"), 7),                   # the user's choice wins
    (("trainer.seed=3", "learner.seed=0"), 0),
])
def test_learner_seed_follows_the_run_seed_unless_set(tmp_path, overrides, want):
    # The learner's mini-batch order was seeded by learner.seed (0) whatever trainer.seed said,
    # so runs of seeds 0-4 dealt every step's samples into the same mini-batches.
    cfg = _load(*overrides)
    assert cfg.learner.seed == want and cfg.learner.rng_seed == want
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path, []).learner.seed == want


def test_dual_clip_bound_at_or_below_one_is_refused():
    for bad in ("1", "0.5", "nan"):
        with pytest.raises(ConfigError, match="algorithm.clip_ratio_c must be > 1"):
            _load("trainer.mode=async", f"algorithm.clip_ratio_c={bad}")


@pytest.mark.parametrize("spec", ["ppo_clip", "builtin:ppo_clip", "async_rl.algorithms.losses:ppo_clip_loss"])
def test_every_spec_of_ppo_clip_gets_the_configured_clip_bounds(spec):
    # The spec string is not the loss: builtin:ppo_clip once lost clip_ratio_high=0.28 silently.
    cfg = load_config(ROOT / "configs/default.yaml", [f"algorithm.policy_loss={spec}", "algorithm.clip_ratio_high=0.28"])
    assert cfg.algorithm.loss_options() == PPOClipOptions(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)


@pytest.mark.parametrize("override,key", [("algorithm.policy_loss=nosuch", "algorithm.policy_loss"),
                                          ("algorithm.advantage_estimator=nosuch", "algorithm.advantage_estimator"),
                                          ("reward.fn=no/such/file.py:fn", "reward.fn")])
def test_a_bad_spec_stops_at_load_with_its_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "configs/default.yaml", [override])
    assert str(info.value).startswith(f"{key}: ") and "\n" not in str(info.value)


def test_sglang_refuses_lora_over_broadcast_and_a_short_context_by_key():
    with pytest.raises(ConfigError, match="generator.backend=sglang.*learner.lora.rank.*broadcast"):
        load_config(ROOT / "configs/default.yaml", ["generator.backend=sglang", "learner.lora.rank=8",
                                                    "weight_sync.transport=broadcast"])
    assert load_config(ROOT / "configs/default.yaml", ["generator.backend=sglang", "learner.lora.rank=8"])
    with pytest.raises(ConfigError, match="generator.sglang.context_length=16"):
        load_config(ROOT / "configs/default.yaml", ["generator.backend=sglang", "generator.sglang.context_length=16"])
    cfg = load_config(ROOT / "configs/default.yaml", ["generator.backend=sglang"])
    assert cfg.generator.sglang.dtype == "float32"
