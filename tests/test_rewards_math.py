"""The math-verify rewards "gsm8k" and "math", including calls from a worker thread."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from async_rl.rewards import RewardScorer, gsm8k_reward, math_reward
from async_rl.rewards.math_rewards import extract_gsm8k_prediction, last_boxed


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("She has 8 + 64 = 72 apples.\n#### 72", "72", 1.0),
        ("#### 72", "72", 1.0),
        ("The answer is \\boxed{72}", "72", 1.0),
        ("The answer is $\\boxed{72}$.", "72", 1.0),
        ("In total 1,234 people.", "1234", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("#### $72.00", "72", 1.0),
        ("#### -5", "-5", 1.0),
        ("\\boxed{\\$72 \\text{ dollars}}", "72", 1.0),
        ("First 5, then 70, finally 72", "72", 1.0),
        ("I think 72.\n#### 73", "72", 0.0),  # "####" wins over earlier numbers
        ("#### 71", "72", 0.0),
        ("The answer is \\boxed{71}", "72", 0.0),
        ("", "72", 0.0),
        ("no number here", "72", 0.0),
    ],
)
def test_gsm8k_reward(response, ground_truth, expected):
    assert gsm8k_reward("openai/gsm8k", response, ground_truth, None) == {
        "score": expected,
        "acc": expected,
    }


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
        ("\\boxed{3}", "\\boxed{3}", 1.0),
        ("first \\boxed{2} then \\fbox{3}", "3", 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("the answer is 3", "3", 0.0),  # MATH answers must be boxed
        ("\\boxed{" + "9" * 2000 + "}", "9", 0.0),  # over the length cap: not parsed
    ],
)
def test_math_reward(response, ground_truth, expected):
    assert math_reward("lighteval/MATH", response, ground_truth, None)["score"] == expected


def test_last_boxed():
    assert last_boxed("\\boxed{1} and \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\boxed{1} then \\boxed{2") == "1"  # unclosed box skipped
    assert last_boxed("no box") is None


def test_extract_gsm8k_prediction():
    assert extract_gsm8k_prediction("a 1,234,567 b") == "1234567"
    assert extract_gsm8k_prediction("(1,2)") == "2"  # not a thousands group
    assert extract_gsm8k_prediction("####\n+42") == "42"
    assert extract_gsm8k_prediction("#### none\n\\boxed{7}") == "7"


def test_rewards_work_from_worker_threads():
    # math-verify's default signal-based timeout raises ValueError outside the main thread.
    scorer = RewardScorer(gsm8k_reward, on_error="reject")
    cases = [("#### 72", "72", 1.0), ("\\boxed{9}", "8", 0.0), ("1,234", "1234", 1.0)] * 4
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda c: scorer.score("openai/gsm8k", c[0], c[1], None), cases))
    assert [r.score for r in results] == [c[2] for c in cases]
    assert scorer.num_errors == 0
    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(math_reward, "m", "\\boxed{\\frac{2}{4}}", "0.5", None)
        assert future.result()["score"] == 1.0
