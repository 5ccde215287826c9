"""Config loading: errors name the key, every checked-in config parses, the run dir gets the resolved config."""

from __future__ import annotations

from pathlib import Path

import pytest

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
