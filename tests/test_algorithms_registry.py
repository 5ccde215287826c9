"""Registry lookups: duplicates, unknown names, import-path escape hatch."""

import math

import pytest

from async_rl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, Registry


def test_register_and_get():
    reg = Registry("widget")

    @reg.register("double")
    def double(x):
        return 2 * x

    assert reg.get("double") is double
    assert reg.names() == ("double",)
    assert "double" in reg


def test_duplicate_name_raises():
    reg = Registry("widget")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        POLICY_LOSSES.get("ppo_clipp")
    for name in ("ppo_clip", "gspo", "cispo"):
        assert name in str(info.value)


@pytest.mark.parametrize("path", ["math:sqrt", "math.sqrt"])
def test_import_path(path):
    assert Registry("widget").get(path) is math.sqrt


@pytest.mark.parametrize("path", ["no_such_module_xyz:fn", "math:no_such_fn", "math:pi", ":fn"])
def test_bad_import_path_raises_value_error(path):
    with pytest.raises(ValueError):
        Registry("widget").get(path)


def test_reserved_characters_in_names():
    with pytest.raises(ValueError):
        Registry("widget").register("a.b")


def test_builtin_names():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "dr_grpo", "rloo", "reinforce_pp",
                                                 "reinforce_pp_baseline", "gae"}
    assert set(POLICY_LOSSES.names()) == {"ppo_clip", "gspo", "cispo"}


# --- one resolver for every kind (issue 14) ---------------------------------------------------


def test_builtin_prefix_forces_a_registry_lookup():
    assert ADVANTAGE_ESTIMATORS.get("builtin:grpo") is ADVANTAGE_ESTIMATORS.get("grpo")
    with pytest.raises(ValueError, match="unknown widget 'builtin:math.sqrt'"):
        Registry("widget").get("builtin:math.sqrt")


def test_every_kind_reads_file_specs_and_shares_the_loaded_module(tmp_path):
    from async_rl.rewards import get_reward_fn
    from async_rl.tools import load_tools

    path = tmp_path / "plugins.py"
    path.write_text(
        "def my_loss(inputs, correction, scale=1.0):\n    return scale, {}\n\n"
        "def my_reward(ds, text, gt, extra):\n    return 1.0\n\n"
        "def shout(text: str) -> str:\n    return text.upper()\n"
    )
    loss = POLICY_LOSSES.get(f"{path}:my_loss")
    reward = get_reward_fn(f"{path}:my_reward")
    [tool] = load_tools(f"{path}:shout")
    assert loss(None, None, scale=2.0) == (2.0, {}) and reward("d", "x", "", None) == 1.0
    assert loss.__module__ == reward.__module__ == tool.fn.__module__


def test_unknown_spec_errors_name_kind_spec_and_valid_names():
    with pytest.raises(ValueError) as info:
        ADVANTAGE_ESTIMATORS.get("gpro")
    message = str(info.value)
    assert "\n" not in message and "advantage estimator 'gpro'" in message
    assert "grpo" in message and "package.module:function" in message and "file.py:function" in message


def test_estimators_declare_their_needs():
    from async_rl.algorithms import EstimatorSpec

    gae, grpo, rpp = (ADVANTAGE_ESTIMATORS.get(n) for n in ("gae", "grpo", "reinforce_pp"))
    assert isinstance(gae, EstimatorSpec) and gae.needs_critic and gae.token_rewards and not gae.needs_groups
    assert grpo.needs_groups and not grpo.needs_critic and not grpo.token_rewards
    assert rpp.token_rewards and not rpp.needs_groups
    # A plain user function gets the documented defaults.
    user = ADVANTAGE_ESTIMATORS.get("math:sqrt")
    assert user.fn is math.sqrt and (user.needs_critic, user.token_rewards, user.needs_groups) == (False,) * 3
    assert user.params(object()) == {}


def test_config_asks_the_estimator(tmp_path, monkeypatch):
    from async_rl.algorithms.config import AlgorithmConfig

    (tmp_path / "my_estimators.py").write_text(
        "from async_rl.algorithms import EstimatorSpec\n"
        "def _fn(inputs, *, gamma):\n    raise NotImplementedError\n"
        "CRITIC = EstimatorSpec(_fn, needs_critic=True, params=lambda algo: {'gamma': algo.gamma})\n"
        "def plain(inputs):\n    raise NotImplementedError\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with_critic = AlgorithmConfig(advantage_estimator="my_estimators:CRITIC", gamma=0.5).apply_preset()
    assert with_critic.needs_critic and with_critic.advantage_params() == {"gamma": 0.5}
    plain = AlgorithmConfig(advantage_estimator="my_estimators:plain").apply_preset()
    assert not plain.needs_critic and not plain.needs_groups and plain.advantage_params() == {}
    ppo = AlgorithmConfig(name="ppo").apply_preset()
    assert ppo.needs_critic and ppo.advantage_params() == {"gamma": 1.0, "lam": 1.0, "whiten": True}


def test_unresolved_config_is_refused_where_presets_are_needed():
    from async_rl.algorithms.config import AlgorithmConfig

    with pytest.raises(ValueError, match=r"apply_preset\(\)"):
        AlgorithmConfig().require_resolved()
    with pytest.raises(ValueError, match="advantage_estimator"):
        AlgorithmConfig().off_policy_correction()
    correction = AlgorithmConfig(behavior_correction="icepop", icepop_low=0.25).apply_preset().off_policy_correction()
    assert (correction.behavior_correction, correction.icepop_low, correction.bypass_proximal) == ("icepop", 0.25, False)
