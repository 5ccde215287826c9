"""Settings a loss's or estimator's definition fixes (``async_rl.algorithms.fixed_settings``).

Table-driven over every built-in policy loss and advantage estimator, read from the registries so
that one added later is covered without editing this file: each declares what it fixes; for each
fixed key, unset -> the fixed value, set to it -> accepted, set to anything else -> one
``ConfigError`` line naming both keys; a loss and an estimator fixing one key differently are
refused; a run's saved (fully resolved) config loads again; the algorithms page lists them all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from async_rl.algorithms import ADVANTAGE_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, FixedSetting, fixed_settings_of
from async_rl.config import ConfigError, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs/default.yaml"


def _builtin(obj) -> bool:
    fn = getattr(obj, "fn", obj)
    return getattr(fn, "__module__", "").startswith("async_rl.")


# (selector key, name, the registered object): every built-in loss and estimator.
BUILTINS = ([("algorithm.policy_loss", n, POLICY_LOSSES[n]) for n in POLICY_LOSSES.names()
             if _builtin(POLICY_LOSSES[n])] +
            [("algorithm.advantage_estimator", n, ADVANTAGE_ESTIMATORS[n]) for n in ADVANTAGE_ESTIMATORS.names()
             if _builtin(ADVANTAGE_ESTIMATORS[n])])
# (selector, name, fixed key, setting): every setting a built-in fixes.
FIXED = [(sel, name, key, setting) for sel, name, obj in BUILTINS for key, setting in fixed_settings_of(obj).items()]
LOSSES = [name for sel, name, _ in BUILTINS if sel == "algorithm.policy_loss"]
ESTIMATORS = [name for sel, name, _ in BUILTINS if sel == "algorithm.advantage_estimator"]


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _other_values(key: str, value) -> list:
    """Every value of ``key`` other than ``value`` that the schema accepts (a key that no table
    here knows fails the test, so a new kind of fixed key gets its conflicting values listed)."""
    if isinstance(value, bool):
        return [not value]
    if key == "algorithm.loss_agg_mode":
        return [mode for mode in LOSS_AGG_MODES if mode != value]
    raise AssertionError(f"no conflicting values known for fixed key {key}: add them to _other_values")


def _id(case) -> str:
    return "-".join(str(part).rpartition(".")[2] for part in case)


def test_the_registries_hold_builtins():
    assert LOSSES and ESTIMATORS and "gspo" in LOSSES and "dr_grpo" in ESTIMATORS


@pytest.mark.parametrize("selector, name, obj", BUILTINS, ids=[f"{s.rpartition('.')[2]}-{n}" for s, n, _ in BUILTINS])
def test_every_builtin_declares_its_fixed_settings(selector, name, obj):
    """Declared explicitly (``{}`` when nothing is fixed), each value with its source, each key one the
    config has; and selecting it alone (with the default partner) loads."""
    assert getattr(obj, "fixed_settings", None) is not None, f"{name} must declare fixed_settings ({{}} if none)"
    for key, setting in obj.fixed_settings.items():
        assert isinstance(setting, FixedSetting) and re.search(r"arXiv \d{4}\.\d{5}", setting.source), (key, setting)
    cfg = load_config(DEFAULT, [f"{selector}={name}"])
    for key, setting in obj.fixed_settings.items():
        assert _get(cfg, key) == setting.value


def test_the_settings_the_papers_fix():
    """The ones the issue names, spelled out: GSPO averages over sequences; Dr. GRPO neither divides by
    the std nor by the length; CISPO normalises by the token count; PPO clip and the other
    estimators fix nothing."""
    table = {(sel.rpartition(".")[2], name): {k: s.value for k, s in fixed_settings_of(obj).items()}
             for sel, name, obj in BUILTINS}
    assert table[("policy_loss", "gspo")] == {"algorithm.loss_agg_mode": "seq-mean-token-mean"}
    assert table[("policy_loss", "cispo")] == {"algorithm.loss_agg_mode": "token-mean"}
    assert table[("policy_loss", "ppo_clip")] == {}
    assert table[("advantage_estimator", "dr_grpo")] == {"algorithm.norm_adv_by_std": False,
                                                         "algorithm.loss_agg_mode": "seq-mean-token-sum-norm"}
    for name in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"):
        assert table[("advantage_estimator", name)] == {}


@pytest.mark.parametrize("selector, name, key, setting", FIXED, ids=[_id(c[:3]) for c in FIXED])
def test_an_unset_fixed_key_takes_the_fixed_value(selector, name, key, setting):
    assert _get(load_config(DEFAULT, [f"{selector}={name}"]), key) == setting.value


@pytest.mark.parametrize("selector, name, key, setting", FIXED, ids=[_id(c[:3]) for c in FIXED])
def test_a_fixed_key_set_to_the_fixed_value_is_accepted(selector, name, key, setting):
    cfg = load_config(DEFAULT, [f"{selector}={name}", f"{key}={_yaml(setting.value)}"])
    assert _get(cfg, key) == setting.value


CONFLICTS = [(sel, name, key, setting, other) for sel, name, key, setting in FIXED
             for other in _other_values(key, setting.value)]


@pytest.mark.parametrize("selector, name, key, setting, other", CONFLICTS, ids=[_id(c[:3] + c[4:]) for c in CONFLICTS])
def test_a_fixed_key_set_to_another_value_is_refused_in_one_line(selector, name, key, setting, other):
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, [f"{selector}={name}", f"{key}={_yaml(other)}"])
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{selector}={name} fixes {key}={_yaml(setting.value)}" in msg
    assert f"{key}={_yaml(other)} was set on the command line" in msg


def _config_file(tmp_path, algorithm: str) -> Path:
    """configs/default.yaml with its algorithm section replaced by ``algorithm`` (YAML lines)."""
    path = tmp_path / "run.yaml"
    text = DEFAULT.read_text()
    assert "algorithm:\n  name: grpo\n" in text
    path.write_text(text.replace("algorithm:\n  name: grpo\n", f"algorithm:\n{algorithm}"))
    return path


def test_a_fixed_key_set_in_the_yaml_file_names_the_file(tmp_path):
    path = _config_file(tmp_path, "  policy_loss: gspo\n  loss_agg_mode: seq-mean-token-sum\n")
    where = re.escape(str(path))
    with pytest.raises(ConfigError, match=rf"algorithm.loss_agg_mode=seq-mean-token-sum was set in {where}"):
        load_config(path)


def test_the_issue_example_is_refused():
    with pytest.raises(ConfigError, match=r"^algorithm.policy_loss=gspo fixes algorithm.loss_agg_mode="
                                          r"seq-mean-token-mean \(.*Zheng et al. 2025.*\); algorithm.loss_agg_mode="
                                          r"seq-mean-token-sum was set on the command line: unset it or choose "
                                          r"another policy loss$"):
        load_config(DEFAULT, ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=seq-mean-token-sum"])


@pytest.mark.parametrize("selector, name, obj", [b for b in BUILTINS if not b[2].fixed_settings],
                         ids=[f"{s.rpartition('.')[2]}-{n}" for s, n, o in BUILTINS if not o.fixed_settings])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_what_fixes_nothing_takes_every_setting(selector, name, obj, mode):
    """A loss or estimator that fixes nothing leaves every aggregation and std choice to the user."""
    for std in (True, False):
        cfg = load_config(DEFAULT, [f"{selector}={name}", f"algorithm.loss_agg_mode={mode}",
                                    f"algorithm.norm_adv_by_std={_yaml(std)}"])
        assert (cfg.algorithm.loss_agg_mode, cfg.algorithm.norm_adv_by_std) == (mode, std)


def _pair_conflict(loss: str, estimator: str) -> str | None:
    """The key the two fix to different values, or None."""
    fixed_by_loss = fixed_settings_of(POLICY_LOSSES[loss])
    for key, setting in fixed_settings_of(ADVANTAGE_ESTIMATORS[estimator]).items():
        if key in fixed_by_loss and fixed_by_loss[key].value != setting.value:
            return key
    return None


PAIRS = [(loss, est) for loss in LOSSES for est in ESTIMATORS]


@pytest.mark.parametrize("loss, estimator", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_a_loss_and_an_estimator_fixing_one_key_differently_are_refused(loss, estimator):
    overrides = [f"algorithm.policy_loss={loss}", f"algorithm.advantage_estimator={estimator}"]
    key = _pair_conflict(loss, estimator)
    if key is None:
        cfg = load_config(DEFAULT, overrides)
        for obj in (POLICY_LOSSES[loss], ADVANTAGE_ESTIMATORS[estimator]):
            for fixed_key, setting in fixed_settings_of(obj).items():
                assert _get(cfg, fixed_key) == setting.value
        return
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, overrides)
    msg = str(err.value)
    assert "\n" not in msg and key in msg
    assert f"algorithm.policy_loss={loss}" in msg and f"algorithm.advantage_estimator={estimator}" in msg


def test_the_cli_refuses_the_issue_example_in_one_line(capsys):
    from async_rl.cli import main

    assert main(["config", "--config", str(DEFAULT), "algorithm.policy_loss=gspo",
                 "algorithm.loss_agg_mode=seq-mean-token-sum"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "algorithm.policy_loss=gspo" in err and "algorithm.loss_agg_mode" in err


def test_a_preset_counts_as_the_selector_and_its_values_give_way():
    """``algorithm.name=dr_grpo`` selects the dr_grpo estimator: with GSPO the two fixes conflict; a
    preset's own aggregation (not the user's) gives way to the loss's."""
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator=dr_grpo \(preset algorithm.name=dr_grpo\)"):
        load_config(DEFAULT, ["algorithm.name=dr_grpo", "algorithm.policy_loss=gspo"])
    dapo = load_config(DEFAULT, ["algorithm.name=dapo", "algorithm.policy_loss=gspo"]).algorithm
    assert dapo.loss_agg_mode == "seq-mean-token-mean" and dapo.dynamic_sampling


def test_null_in_the_yaml_file_asks_for_the_default(tmp_path):
    path = _config_file(tmp_path, "  policy_loss: gspo\n  loss_agg_mode: null\n")
    assert load_config(path).algorithm.loss_agg_mode == "seq-mean-token-mean"


SAVED = [[f"{sel}={name}"] for sel, name, _ in BUILTINS] + [["algorithm.name=dr_grpo"], ["algorithm.name=dapo"]]


@pytest.mark.parametrize("overrides", SAVED, ids=[o[0].rpartition(".")[2] for o in SAVED])
def test_a_runs_saved_config_loads_again(tmp_path, overrides):
    """A run directory's config.yaml (``to_yaml``: every key set) loads to the same config: what it
    resolved agrees with what its loss and estimator fix."""
    cfg = load_config(DEFAULT, ["trainer.mode=async", *overrides])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path)
    assert again == cfg and to_yaml(again) == to_yaml(cfg)


def test_a_saved_config_holding_a_conflict_names_it_and_an_override_resolves_it(tmp_path):
    """A config written before the estimator declared its settings (dr_grpo with the schema's
    norm_adv_by_std true) is refused naming the file; the override the message asks for loads it."""
    cfg = load_config(DEFAULT, ["algorithm.name=dr_grpo"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg).replace("norm_adv_by_std: false", "norm_adv_by_std: true"))
    with pytest.raises(ConfigError, match=rf"algorithm.norm_adv_by_std=true was set in {re.escape(str(path))}"):
        load_config(path)
    assert load_config(path, ["algorithm.norm_adv_by_std=false"]) == cfg


def _write(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return str(path)


PLUGIN_LOSS = '''
from async_rl.algorithms import FixedSetting


def loss(inputs, correction, scale: float = 1.0):
    raise NotImplementedError


def declared(inputs, correction):
    raise NotImplementedError


declared.fixed_settings = {{"algorithm.loss_agg_mode": FixedSetting({value!r}, "a test's own definition")}}
'''


def test_a_user_loss_fixes_nothing_unless_it_opts_in(tmp_path):
    plugin = _write(tmp_path, "plugin_loss_ok", PLUGIN_LOSS.format(value="seq-mean-token-sum"))
    plain = load_config(DEFAULT, [f"algorithm.policy_loss={plugin}:loss",
                                  "algorithm.loss_agg_mode=seq-mean-token-mean"])
    assert plain.algorithm.loss_agg_mode == "seq-mean-token-mean"
    declared = load_config(DEFAULT, [f"algorithm.policy_loss={plugin}:declared"])
    assert declared.algorithm.loss_agg_mode == "seq-mean-token-sum"
    with pytest.raises(ConfigError, match=r"fixes algorithm.loss_agg_mode=seq-mean-token-sum \(a test's own defin"):
        load_config(DEFAULT, [f"algorithm.policy_loss={plugin}:declared", "algorithm.loss_agg_mode=token-mean"])


def test_a_user_declaration_with_a_bad_key_or_value_is_refused_at_load(tmp_path):
    bad_value = _write(tmp_path, "plugin_loss_bad_value", PLUGIN_LOSS.format(value="per-token"))
    with pytest.raises(ConfigError, match=r"fixes algorithm.loss_agg_mode=per-token: algorithm.loss_agg_mode must be"):
        load_config(DEFAULT, [f"algorithm.policy_loss={bad_value}:declared"])
    bad_key = _write(tmp_path, "plugin_loss_bad_key", PLUGIN_LOSS.format(value="token-mean").replace(
        "algorithm.loss_agg_mode", "algorithm.loss_agg"))
    with pytest.raises(ConfigError, match=r"fixes algorithm.loss_agg, which is not a config key"):
        load_config(DEFAULT, [f"algorithm.policy_loss={bad_key}:declared"])
    with pytest.raises(ValueError, match="needs a source"):
        FixedSetting("token-mean", "")


def test_a_user_estimator_spec_can_declare_and_conflict_with_the_loss(tmp_path):
    plugin = _write(tmp_path, "plugin_estimator", '''
from async_rl.algorithms import EstimatorSpec, FixedSetting
from async_rl.algorithms.advantages import grpo_advantages

SPEC = EstimatorSpec(grpo_advantages, needs_groups=True, fixed_settings={
    "algorithm.loss_agg_mode": FixedSetting("seq-mean-token-sum", "a test's own definition")})
''')
    cfg = load_config(DEFAULT, [f"algorithm.advantage_estimator={plugin}:SPEC"])
    assert cfg.algorithm.loss_agg_mode == "seq-mean-token-sum"
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss=gspo fixes .* but algorithm.advantage_estimator="):
        load_config(DEFAULT, [f"algorithm.advantage_estimator={plugin}:SPEC", "algorithm.policy_loss=gspo"])


def test_the_algorithms_page_lists_what_each_builtin_fixes():
    rows = {m.group(1): line for line in (ROOT / "docs/algorithms.md").read_text().splitlines()
            if (m := re.match(r"\| `(\w+)` \((?:loss|estimator)\) \|", line))}
    for _, name, obj in BUILTINS:
        assert name in rows, f"docs/algorithms.md: no row for {name} in 'Settings a loss fixes'"
        fixed = fixed_settings_of(obj)
        cell = rows[name].split("|")[2]
        if not fixed:
            assert "nothing" in cell, rows[name]
        for key, setting in fixed.items():
            assert f"`{key}={_yaml(setting.value)}`" in cell, rows[name]
