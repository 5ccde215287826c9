"""The built-in skip-counting task (``builtin:skipcount``, the long-tailed job's): disjoint
splits, the long-tailed answer lengths ``SKIPCOUNT_SPEC`` states, rows that load through
``PromptDataset`` and fit ``configs/longtail.yaml``, and the chain reward that scores them."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.data.builtin import (
    SKIPCOUNT_DATA_SOURCE,
    SKIPCOUNT_LENGTHS,
    SKIPCOUNT_SPEC,
    make_skipcount_row,
    resolve,
    skipcount_problem,
)
from async_rl.data.dataset import PromptDataset, read_rows
from async_rl.loops.base import DEFAULT_RESPONSE_FIELDS
from async_rl.rewards.chainsum import chainsum_reward
from async_rl.rewards.registry import default_reward_for
from task_helpers import assert_row_fits

ROOT = Path(__file__).resolve().parents[1]
SRC = SKIPCOUNT_DATA_SOURCE


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {split: read_rows(resolve(f"builtin:skipcount/{split}")) for split in ("train", "test")}


def _problem(row: dict) -> tuple[int, int, int]:
    start, _, rest = row["prompt"][0]["content"].partition("-")
    step, _, floor = rest.partition(">")
    return int(start), int(step), int(floor)


def _p99(values: list[int]) -> int:
    """Nearest-rank 99th percentile: the value 99% of the sorted list lies at or below."""
    ordered = sorted(values)
    return ordered[int(0.99 * len(ordered))]


def test_row_layout_and_worked_example():
    row = make_skipcount_row(53, 5, 30, "train", 0)
    assert row["prompt"] == [{"role": "user", "content": "53-5>30"}]
    assert row["data_source"] == SRC and row["reward_model"] == {"style": "rule", "ground_truth": "48 43 38 33"}
    assert row["extra_info"] == {"split": "train", "index": 0, "answer": "48 43 38 33", "count": 4}
    assert make_skipcount_row(20, 5, 0, "test", 3)["reward_model"]["ground_truth"] == "15 10 5 0"  # the floor is reached
    assert make_skipcount_row(107, 1, 105, "test", 3)["reward_model"]["ground_truth"] == "106 105"  # a borrow-free step down
    assert make_skipcount_row(103, 4, 90, "test", 3)["reward_model"]["ground_truth"] == "99 95 91"  # 3 digits to 2
    for start, step, floor in ((34, 5, 30), (30, 0, 0), (30, 10, 0), (30, 5, -1)):
        with pytest.raises(ValueError, match="a step in 1..9, a floor >= 0 and a start >= floor \\+ step"):
            make_skipcount_row(start, step, floor, "train", 0)
    for bad in ({"max_step": 10}, {"max_floor": -1}, {"max_count": 0}, {"count_exponent": -1.0}):
        with pytest.raises(ValueError, match="skipcount spec needs max_count >= 1"):
            skipcount_problem(random.Random(0), {**SKIPCOUNT_SPEC, **bad})


def test_splits_sizes_disjoint_and_consistent(splits):
    train, test = splits["train"], splits["test"]
    assert (len(train), len(test)) == (SKIPCOUNT_SPEC["num_train"], SKIPCOUNT_SPEC["num_test"])
    assert {_problem(r) for r in train}.isdisjoint({_problem(r) for r in test})
    for split, rows in splits.items():
        for i, row in enumerate(rows):
            start, step, floor = _problem(row)
            assert row == make_skipcount_row(start, step, floor, split, i)  # the row is its prompt's own worked answer
            assert 1 <= row["extra_info"]["count"] <= SKIPCOUNT_SPEC["max_count"] and 1 <= step <= SKIPCOUNT_SPEC["max_step"]
            assert 0 <= floor <= SKIPCOUNT_SPEC["max_floor"]
    # Most problems are drawn once (13,775 distinct in 20,000): the warm start cannot memorise them.
    assert len({_problem(r) for r in train}) == 13775 and len({_problem(r) for r in test}) == 240


def test_answer_lengths_are_long_tailed_as_stated(splits):
    # Tokens of a response: one per character (byte-level tokenizer) plus EOS.
    train = [len(r["extra_info"]["answer"]) + 1 for r in splits["train"]]
    median, p99 = statistics.median(train), _p99(train)
    assert (median, p99, max(train)) == SKIPCOUNT_LENGTHS == (9, 83, 96)  # the figures SKIPCOUNT_SPEC's comment points to
    assert p99 >= 4 * median
    draws = [skipcount_problem(random.Random(i)) for i in range(3000)]
    counts = [(start - floor) // step for start, step, floor in draws]
    assert 0.45 < sum(c <= 2 for c in counts) / len(counts) < 0.55 and max(counts) == SKIPCOUNT_SPEC["max_count"]


def test_rows_load_through_prompt_dataset_and_fit_longtail(splits, tiny_tokenizer):
    longtail = load_config(ROOT / "configs/longtail.yaml")
    assert longtail.data.train_files == ["builtin:skipcount/train"] and longtail.data.val_files == ["builtin:skipcount/test"]
    max_prompt, max_response = longtail.data.max_prompt_tokens, longtail.generator.max_response_tokens
    files = [resolve("builtin:skipcount/train"), resolve("builtin:skipcount/test")]
    ds = PromptDataset(files, tiny_tokenizer, max_prompt, reference_fields=DEFAULT_RESPONSE_FIELDS)
    assert len(ds) == sum(len(rows) for rows in splits.values()) and ds.rejected == {}
    for prompt in ds.prompts:
        assert prompt.data_source == SRC and prompt.reference == prompt.ground_truth
    # The longest possible problem (24 numbers, step 9, floor 99) fits both budgets and the positions.
    worst = make_skipcount_row(99 + SKIPCOUNT_SPEC["max_count"] * 9 + 8, 9, 99, "train", 0)
    assert worst["extra_info"]["count"] == SKIPCOUNT_SPEC["max_count"] and len(worst["extra_info"]["answer"]) == 95
    assert_row_fits(tiny_tokenizer, worst, max_prompt, max_response)


@pytest.mark.parametrize(
    ("response", "score"),
    [("48 43 38 33", 1.0), ("48 43 38 33<|im_end|>", 1.0), ("48 43 38", 0.0), ("48 43 38 33 28", 0.0),
     ("48 43 39 33", 0.0), ("33", 0.0), ("", 0.0)],
)
def test_scored_by_the_chain_reward(response, score):
    reward = default_reward_for(SRC)
    assert reward is chainsum_reward
    assert reward(SRC, response, "48 43 38 33", None)["score"] == score
