"""Evaluation at k (``async_rl.step.eval_metrics``, ``trainer.eval_samples``): pass@k against the
unbiased estimator on hand-computed cases, maj@k's tie rule, the bootstrap standard error, the
per-source split, ``async-rl eval``'s table and JSON, and ``async-rl plot``'s at-k panel."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from async_rl.step.eval_metrics import (answer_key, at_k_metrics, bootstrap_se, k_values, majority_correct,
                                        pass_at_k)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs/default.yaml")


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 2 / 5),                 # k = 1: the fraction correct
    (4, 1, 2, 1 - 3 / 6),             # 1 - C(3,2)/C(4,2)
    (10, 3, 5, 1 - 21 / 252),         # 1 - C(7,5)/C(10,5)
    (8, 0, 8, 0.0),                   # none correct
    (8, 8, 1, 1.0),                   # all correct
    (8, 1, 8, 1.0),                   # k = n: any correct
    (8, 7, 2, 1.0),                   # n - c < k: every pair holds a correct one
    (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_on_hand_computed_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_form_everywhere():
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k: need"):
        pass_at_k(n, c, k)


def test_k_values_are_powers_of_two_and_n():
    assert k_values(1) == [1]
    assert k_values(8) == [1, 2, 4, 8]
    assert k_values(6) == [1, 2, 4, 6]


def test_majority_vote_and_its_tie_rule():
    assert majority_correct(["4", "4", "5"], [1, 1, 0]) == 1.0
    assert majority_correct(["5", "5", "4"], [0, 0, 1]) == 0.0
    # A tie: the mean over the tied answers (one right, one wrong), not whichever came first.
    assert majority_correct(["4", "5"], [1, 0]) == 0.5
    assert majority_correct(["5", "4"], [0, 1]) == 0.5
    assert majority_correct(["4", "5", "6", "6"], [1, 0, 0, 0]) == 0.0  # 6 wins alone
    assert majority_correct(["4", "4", "5", "5", "6"], [1, 1, 0, 0, 1]) == 0.5
    # No answer does not vote; none at all is 0.
    assert majority_correct([None, None, "4"], [0, 0, 1]) == 1.0
    assert majority_correct([None, None], [0, 0]) == 0.0
    # One answer judged differently by its wording: averaged.
    assert majority_correct(["4", "4", "5"], [1, 0, 1]) == 0.5
    with pytest.raises(ValueError, match="2 answers but 1"):
        majority_correct(["4", "5"], [1])


def test_answer_keys_compare_answers_not_spellings():
    assert answer_key("007") == answer_key(" 7 ") == "7"
    assert answer_key("-12") == "-12"
    assert answer_key("so the sum is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert answer_key("\\boxed{3} no wait \\boxed{4}") == "4"
    assert answer_key("first line\n  the answer is 5. \n") == "the answer is 5"
    assert answer_key("   \n") is None


def test_bootstrap_standard_error():
    assert bootstrap_se([0.7] * 50) == pytest.approx(0.0, abs=1e-12)
    assert bootstrap_se([1.0]) == 0.0
    values = [1.0] * 60 + [0.0] * 40
    analytic = math.sqrt(0.6 * 0.4 / 100)
    assert bootstrap_se(values, resamples=2000) == pytest.approx(analytic, rel=0.12)
    assert bootstrap_se(values, seed=3) == bootstrap_se(values, seed=3)  # seeded


def test_at_k_metrics_by_hand():
    per_prompt = [
        (["4", "4", "5", "4"], [1, 1, 0, 1]),      # c = 3 of 4
        (["9", "8", "8", "7"], [0, 0, 0, 0]),      # none
        (["2", "3"], [0, 1]),                      # two of four samples rejected: wrong, no vote
    ]
    out = at_k_metrics(per_prompt, 4)
    assert out["eval/pass@1"] == pytest.approx((3 / 4 + 0 + 1 / 4) / 3)
    assert out["eval/pass@2"] == pytest.approx((1.0 + 0 + (1 - math.comb(3, 2) / math.comb(4, 2))) / 3)
    assert out["eval/pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert out["eval/mean@4"] == pytest.approx(out["eval/pass@1"])
    assert out["eval/maj@4"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert out["eval/num_prompts_at_k"] == 3
    assert set(out) >= {"eval/pass@1_se", "eval/pass@4_se", "eval/mean@4_se", "eval/maj@4_se"}
    assert at_k_metrics([], 4) == {}
    with pytest.raises(ValueError, match="5 responses, more than the 4"):
        at_k_metrics([(["1"] * 5, [1] * 5)], 4)
    with pytest.raises(ValueError, match="correctness must be in"):
        at_k_metrics([(["1"], [2.0])], 4)


def test_at_k_per_data_source():
    from types import SimpleNamespace

    from async_rl.step.evaluation import at_k_of

    def traj(uid, text, acc):
        return SimpleNamespace(prompt_uid=uid, response_text=text, reward=acc, reward_extras={"acc": acc})

    dataset = [SimpleNamespace(uid="a", data_source="math"), SimpleNamespace(uid="b", data_source="code")]
    out = at_k_of([traj("a", "1", 1.0), traj("a", "2", 0.0), traj("b", "x", 0.0), traj("b", "x", 0.0)], dataset, 2)
    assert out["eval/pass@1"] == pytest.approx(0.25) and out["eval/pass@2"] == pytest.approx(0.5)
    assert out["eval/math/pass@2"] == 1.0 and out["eval/code/pass@2"] == 0.0
    assert out["eval/math/maj@2"] == 0.5  # a tie between "1" (right) and "2" (wrong)


def test_a_rejected_held_out_sample_counts_wrong_never_as_missing():
    # A reward that failed, or an environment's episode rejected for a fault: the prompt has no
    # trajectory. It counts wrong in eval/accuracy (as in pass@k), overall and per source, and an
    # evaluation whose every sample was rejected scores 0, not NaN.
    from types import SimpleNamespace

    from async_rl.step.evaluation import eval_metrics

    def traj(uid, acc):
        return SimpleNamespace(prompt_uid=uid, response_text="x", reward=acc, reward_extras={"acc": acc},
                               response_ids=[1, 2], policy_version=[0])

    dataset = [SimpleNamespace(uid=u, data_source=s) for u, s in (("a", "math"), ("b", "math"), ("c", "code"),
                                                                   ("d", "code"))]
    out = eval_metrics([traj("a", 1.0), traj("c", 1.0), traj("d", 0.0)], dataset, 3)
    assert out["eval/accuracy"] == 0.5 and out["eval/rejected"] == 1.0 and out["eval/num_prompts"] == 3.0
    assert out["eval/reward_mean"] == pytest.approx(2 / 3)
    assert out["eval/math/accuracy"] == 0.5 and out["eval/code/accuracy"] == 0.5
    assert out["eval/math/num_prompts"] == 1.0
    none = eval_metrics([], dataset, 3)
    assert none["eval/accuracy"] == 0.0 and none["eval/rejected"] == 4.0 and none["eval/math/accuracy"] == 0.0


def test_eval_command_prints_and_writes_at_k(tmp_path, capsys):
    from async_rl.cli import main

    out = tmp_path / "eval.json"
    argv = ["eval", "--config", DEFAULT, "--out", str(out), "data.val_max_prompts=12", "trainer.eval_samples=4",
            "trainer.eval_temperature=0.8", f"trainer.output_dir={tmp_path / 'runs'}"]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["samples"] == 4 and result["temperature"] == 0.8
    for key in ("eval/pass@1", "eval/pass@2", "eval/pass@4", "eval/mean@4", "eval/maj@4"):
        assert 0.0 <= result[key] <= 1.0 and result[f"{key}_se"] >= 0.0
    assert result["eval/pass@1"] <= result["eval/pass@2"] <= result["eval/pass@4"]
    assert result["eval/mean@4"] == pytest.approx(result["eval/pass@1"])  # a 0/1 reward
    assert result["eval/num_prompts_at_k"] == 12 and result["eval/policy_version"] == 0
    printed = capsys.readouterr().out
    assert "at k: 4 samples a prompt at temperature 0.8" in printed
    assert f"pass@4                {result['eval/pass@4']:.4f} ± {result['eval/pass@4_se']:.4f}" in printed


@pytest.mark.parametrize("override,message", [
    ("trainer.eval_samples=-1", "trainer.eval_samples must be >= 0"),
    ("trainer.eval_temperature=0", "trainer.eval_temperature must be > 0"),
])
def test_eval_at_k_settings_are_checked(override, message):
    from async_rl.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(DEFAULT, [override])


def test_plot_draws_the_at_k_panel(tmp_path):
    from async_rl.commands.plot import AT_K_TITLE, plot_runs

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "time_s": s, "rollout/reward_mean": 0.1 * s, "eval/accuracy": 0.1 * s,
              "eval/pass@1": 0.1 * s, "eval/pass@1_se": 0.02, "eval/pass@8": 0.2 * s, "eval/pass@8_se": 0.03,
              "eval/maj@8": 0.15 * s, "eval/maj@8_se": 0.02, "eval/pass@2": 0.15 * s} for s in (0, 1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    fig, _ = plot_runs([run])
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert AT_K_TITLE in titles
    panel = next(ax for ax in fig.axes if ax.get_title() == AT_K_TITLE)
    assert [ln.get_linestyle() for ln in panel.get_lines()] == ["-", "--", ":"]  # pass@1, pass@8, maj@8
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps({"step": 0, "time_s": 0, "eval/accuracy": 0.5}) + "\n")
    fig, _ = plot_runs([bare])
    assert AT_K_TITLE not in [ax.get_title() for ax in fig.axes]
