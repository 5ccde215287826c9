"""Reward registry, user-function loading, the arithmetic reward and RewardScorer error paths."""

import logging
import math
import textwrap

import pytest

from async_rl.rewards import (
    REWARD_FUNCTIONS,
    RewardResult,
    RewardScorer,
    arithmetic_reward,
    default_reward_for,
    get_reward_fn,
    gsm8k_reward,
    math_reward,
    register_reward,
)
from async_rl.rewards.arithmetic import canonical_integer

# --- arithmetic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("12", "12", 1.0),
        (" 12 \n", "12", 1.0),
        ("12<|im_end|>", "12", 1.0),
        ("12 <|im_end|>\n<|endoftext|>", "12", 1.0),
        ("12</s>", "12", 1.0),
        ("012", "12", 1.0),  # leading zeros: the value of a clean literal counts
        ("+12", "12", 1.0),
        ("-7", "-7", 1.0),
        ("-0", "0", 1.0),
        ("12abc", "12", 0.0),
        ("The answer is 12", "12", 0.0),
        ("12.0", "12", 0.0),
        ("1 2", "12", 0.0),
        ("13", "12", 0.0),
        ("-12", "12", 0.0),
        ("", "12", 0.0),
        ("<|im_end|>", "12", 0.0),
        ("\u0661\u0662", "12", 0.0),  # Arabic-Indic digits are not an ASCII integer literal
        ("1" * 5000, "1" * 5000, 1.0),  # beyond int()'s default digit limit: still compared
    ],
)
def test_arithmetic_reward(response, ground_truth, expected):
    assert arithmetic_reward("async_rl/arithmetic", response, ground_truth, None) == {
        "score": expected,
        "acc": expected,
    }


def test_arithmetic_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="integer literal"):
        arithmetic_reward("async_rl/arithmetic", "12", "twelve", None)


def test_canonical_integer():
    assert canonical_integer("007") == "7"
    assert canonical_integer("-000") == "0"
    assert canonical_integer(" -40 ") == "-40"
    assert canonical_integer("4e2") is None


def test_arithmetic_reward_returns_fresh_dict():
    first = arithmetic_reward("async_rl/arithmetic", "1", "1", None)
    first["score"] = -5.0
    assert arithmetic_reward("async_rl/arithmetic", "1", "1", None)["score"] == 1.0


# --- registry and loading -------------------------------------------------------------------


def test_builtins_registered():
    assert REWARD_FUNCTIONS["arithmetic"] is arithmetic_reward
    assert REWARD_FUNCTIONS["gsm8k"] is gsm8k_reward
    assert REWARD_FUNCTIONS["math"] is math_reward
    assert get_reward_fn("gsm8k") is gsm8k_reward


def test_unknown_name_lists_builtins_and_import_path_form():
    with pytest.raises(ValueError) as info:
        get_reward_fn("gsm9k")
    message = str(info.value)
    for name in ("arithmetic", "gsm8k", "math", "package.module:function", "file.py:function"):
        assert name in message


def test_register_duplicate_and_bad_names_raise():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("gsm8k")(lambda *args: 0.0)
    with pytest.raises(ValueError, match="':'"):
        register_reward("a:b")(lambda *args: 0.0)


def test_load_user_reward_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

            NOT_CALLABLE = 3
            """
        )
    )
    fn = get_reward_fn(f"{path}:compute_score")
    assert fn("custom", "ab", "ab", None) == {"score": 1.0, "length": 2}
    assert get_reward_fn(f"{path}:compute_score") is fn  # loaded once
    result = RewardScorer(fn).score("custom", "ab", "ab", {"k": 1})
    assert result == RewardResult(score=1.0, extras={"length": 2.0})

    with pytest.raises(ValueError, match="no attribute 'missing'"):
        get_reward_fn(f"{path}:missing")
    with pytest.raises(ValueError, match="not callable"):
        get_reward_fn(f"{path}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="not found"):
        get_reward_fn(f"{tmp_path / 'absent.py'}:compute_score")


def test_load_user_reward_from_module_path(tmp_path, monkeypatch):
    package = tmp_path / "user_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text("def length_reward(s, r, g, e):\n    return len(r)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward_fn("user_rewards_pkg.scores:length_reward")
    assert fn("s", "abc", "", None) == 3
    with pytest.raises(ValueError, match="not found"):
        get_reward_fn("user_rewards_pkg.nope:length_reward")


def test_default_reward_for():
    assert default_reward_for("openai/gsm8k") is gsm8k_reward
    assert default_reward_for("async_rl/arithmetic") is arithmetic_reward
    assert default_reward_for("lighteval/MATH") is math_reward
    with pytest.raises(ValueError) as info:
        default_reward_for("my/dataset")
    assert "'my/dataset'" in str(info.value)
    assert "package.module:function" in str(info.value)


# --- RewardScorer ---------------------------------------------------------------------------


def _raises(*args):
    raise ValueError("boom")


@pytest.mark.parametrize(
    "fn, reason_start",
    [
        (_raises, "raised ValueError: boom"),
        (lambda *args: math.nan, "non-finite score nan"),
        (lambda *args: math.inf, "non-finite score inf"),
        (lambda *args: {"score": -math.inf}, "non-finite score -inf"),
        (lambda *args: 10**400, "score out of float range"),
        (lambda *args: "1.0", "bad return type str"),
        # A None reward is not an error but a missing reward: tests/test_kl_reward_edges.py.
        (lambda *args: {"acc": 1.0}, "dict without 'score'"),
        (lambda *args: {"score": "high"}, "bad 'score' type str"),
    ],
)
@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_scorer_error_paths(fn, reason_start, on_error, caplog):
    scorer = RewardScorer(fn, on_error=on_error)
    with caplog.at_level(logging.WARNING, logger="async_rl.rewards.scorer"):
        result = scorer.score("src", "response", "gt", None)
    assert result.error.startswith(reason_start), result.error
    assert result.score == 0.0 and result.extras == {}
    assert result.rejected == (on_error == "reject")
    counts = (scorer.num_scored, scorer.num_errors, scorer.num_rejected)
    assert counts == (1, 1, int(on_error == "reject"))
    assert reason_start in caplog.text


@pytest.mark.parametrize(
    "value, expected",
    [
        (0.5, RewardResult(score=0.5)),
        (1, RewardResult(score=1.0)),
        (True, RewardResult(score=1.0)),
        ({"score": False, "acc": True}, RewardResult(score=0.0, extras={"acc": 1.0})),
        # Non-numeric and non-finite extras are left out; the score itself is fine.
        ({"score": 2, "pred": "72", "acc": math.nan}, RewardResult(score=2.0)),
    ],
)
def test_scorer_valid_values(value, expected):
    result = RewardScorer(lambda *args: value).score("src", "r", "g", None)
    assert result == expected
    assert type(result.score) is float


def test_scorer_passes_arguments_positionally():
    seen = []
    scorer = RewardScorer(lambda *args: seen.append(args) or 1.0)
    scorer.score("src", "resp", "gt", {"i": 3})
    assert seen == [("src", "resp", "gt", {"i": 3})]


def _metrics(scored, errors, rejected):
    return {"reward/scored": scored, "reward/errors": errors, "reward/no_reward": 0.0, "reward/rejected": rejected,
            "reward/timeouts": 0.0, "reward/crashed": 0.0, "reward/too_large": 0.0}


def test_scorer_counters_and_pop_metrics():
    outcomes = iter([1.0, math.nan, 0.0, "bad", 1.0])
    scorer = RewardScorer(lambda *args: next(outcomes), on_error="reject")
    for _ in range(3):
        scorer.score("src", "r", "g", None)
    assert scorer.pop_metrics() == _metrics(3.0, 1.0, 1.0)
    for _ in range(2):
        scorer.score("src", "r", "g", None)
    assert scorer.pop_metrics() == _metrics(2.0, 1.0, 1.0)
    assert scorer.pop_metrics() == _metrics(0.0, 0.0, 0.0)
    assert (scorer.num_scored, scorer.num_errors, scorer.num_rejected) == (5, 2, 2)


def test_scorer_logging_is_rate_limited(caplog):
    scorer = RewardScorer(_raises)
    with caplog.at_level(logging.WARNING, logger="async_rl.rewards.scorer"):
        for _ in range(1000):
            scorer.score("src", "r", "g", None)
    # 5 in full, then one line each at the 10th, 100th and 1000th failure.
    assert len(caplog.records) == 8
    assert "1000 failures so far" in caplog.records[-1].getMessage()
    assert scorer.num_errors == 1000


def test_scorer_rejects_bad_on_error():
    with pytest.raises(ValueError, match="on_error"):
        RewardScorer(arithmetic_reward, on_error="ignore")
