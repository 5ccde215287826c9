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
