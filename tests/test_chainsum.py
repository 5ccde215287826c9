"""The built-in chain-sum task (``builtin:chainsum``) and its reward: disjoint splits, the
long-tailed answer lengths ``CHAINSUM_SPEC`` states, rows that load through ``PromptDataset`` and
fit ``configs/chainsum.yaml``, and the strict reward's hand-computed values."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.data.builtin import (
    CHAINSUM_DATA_SOURCE,
    CHAINSUM_SPEC,
    chainsum_terms,
    make_chainsum_row,
    resolve,
)
from async_rl.data.dataset import PromptDataset, read_rows
from async_rl.loops.base import DEFAULT_RESPONSE_FIELDS
from async_rl.rewards.chainsum import chainsum_reward
from async_rl.rewards.registry import REWARD_FUNCTIONS, default_reward_for
from task_helpers import assert_row_fits

ROOT = Path(__file__).resolve().parents[1]
SRC = CHAINSUM_DATA_SOURCE


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {split: read_rows(resolve(f"builtin:chainsum/{split}")) for split in ("train", "test")}


@pytest.fixture(scope="module")
def chainsum_job():
    return load_config(ROOT / "configs/chainsum.yaml")


def _content(row: dict) -> str:
    return row["prompt"][0]["content"]


def _p99(values: list[int]) -> int:
    """Nearest-rank 99th percentile: the value 99% of the sorted list lies at or below."""
    ordered = sorted(values)
    return ordered[int(0.99 * len(ordered))]


# ------------------------------------------------------------------------------------ the data
def test_row_layout_and_worked_example():
    row = make_chainsum_row([3, 8, 5, 1], "train", 0)
    assert row["prompt"] == [{"role": "user", "content": "3+8+5+1="}]
    assert row["data_source"] == SRC and row["reward_model"] == {"style": "rule", "ground_truth": "11 16 17"}
    assert row["extra_info"] == {"split": "train", "index": 0, "answer": "11 16 17", "total": 17}
    with pytest.raises(ValueError, match="two or more terms in 1..9"):
        make_chainsum_row([7], "train", 0)
    with pytest.raises(ValueError, match="two or more terms in 1..9"):
        make_chainsum_row([3, 10], "train", 0)


def test_splits_sizes_disjoint_and_consistent(splits):
    train, test = splits["train"], splits["test"]
    assert (len(train), len(test)) == (CHAINSUM_SPEC["num_train"], CHAINSUM_SPEC["num_test"])
    assert {_content(r) for r in train}.isdisjoint({_content(r) for r in test})
    for split, rows in splits.items():
        for i, row in enumerate(rows):
            terms = [int(t) for t in _content(row).rstrip("=").split("+")]
            assert row == make_chainsum_row(terms, split, i)  # the row is its prompt's own worked answer
            assert CHAINSUM_SPEC["min_terms"] <= len(terms) <= CHAINSUM_SPEC["max_terms"]


def test_answer_lengths_are_long_tailed_as_stated(splits):
    # Tokens of a response: one per character (byte-level tokenizer) plus EOS.
    for split, rows in splits.items():
        lengths = [len(r["extra_info"]["answer"]) + 1 for r in rows]
        median, p99 = statistics.median(lengths), _p99(lengths)
        assert 5 <= median <= 10 and p99 >= 4 * median and 40 <= p99 <= 75, (split, median, p99)
    train = [len(r["extra_info"]["answer"]) + 1 for r in splits["train"]]
    assert (statistics.median(train), _p99(train)) == (8, 70)  # the figures CHAINSUM_SPEC's comment states
    terms = [len(chainsum_terms(random.Random(i))) for i in range(2000)]
    assert sum(k <= 3 for k in terms) / len(terms) > 0.4 and max(terms) > 20


def test_rows_load_through_prompt_dataset_and_fit_chainsum_yaml(splits, chainsum_job, tiny_tokenizer):
    max_prompt, max_response = chainsum_job.data.max_prompt_tokens, chainsum_job.generator.max_response_tokens
    files = [resolve("builtin:chainsum/train"), resolve("builtin:chainsum/test")]
    ds = PromptDataset(files, tiny_tokenizer, max_prompt, reference_fields=DEFAULT_RESPONSE_FIELDS)
    assert len(ds) == sum(len(rows) for rows in splits.values()) and ds.rejected == {}
    assert ds.reference_sources == {"extra_info.answer": len(ds)}
    longest = max(len(p.prompt_ids) for p in ds.prompts)
    assert longest == 56 <= max_prompt  # 24 terms with the chat template
    for prompt in ds.prompts:
        assert prompt.data_source == SRC and prompt.reference == prompt.ground_truth
        assert chainsum_reward(SRC, prompt.reference, prompt.ground_truth, prompt.extra_info)["score"] == 1.0
    # The longest possible problem (24 nines) fits both budgets and the model's positions.
    worst = make_chainsum_row([9] * CHAINSUM_SPEC["max_terms"], "train", 0)
    assert_row_fits(tiny_tokenizer, worst, max_prompt, max_response)


# ---------------------------------------------------------------------------------- the reward
@pytest.mark.parametrize(
    ("response", "score", "final"),
    [
        ("11 16 17", 1.0, 1.0),  # 3+8+5+1: the exact chain
        ("11 16 17<|im_end|>", 1.0, 1.0),  # a trailing end marker is stripped
        (" 11  16\n17 <|im_end|>\n<|endoftext|>", 1.0, 1.0),  # whitespace normalised
        ("11 15 17", 0.0, 1.0),  # right total, wrong intermediate sum
        ("17", 0.0, 1.0),  # the total alone is not the worked answer
        ("11 16 17 done", 0.0, 1.0),  # extra text refused
        ("The sums: 11 16 17", 0.0, 1.0),
        ("11 16 18", 0.0, 0.0),
        ("11 16", 0.0, 0.0),  # stopped one sum short
        ("11 16 17 17", 0.0, 1.0),
        ("11,16,17", 0.0, 1.0),  # separators other than whitespace refused
        ("011 16 17", 0.0, 1.0),  # written as the task writes numbers, or not at all
        ("11 16 -17", 0.0, 0.0),
        ("", 0.0, 0.0),
        ("<|im_end|>", 0.0, 0.0),
    ],
)
def test_reward_hand_computed(response, score, final):
    assert chainsum_reward(SRC, response, "11 16 17", {"total": 17}) == {
        "score": score, "acc": score, "final_correct": final}


def test_reward_bad_input_refused_and_registered():
    with pytest.raises(TypeError, match="response_text must be a str, got NoneType"):
        chainsum_reward(SRC, None, "11 16 17", None)
    with pytest.raises(TypeError, match="got int"):
        chainsum_reward(SRC, 17, "11 16 17", None)
    for bad in (None, "", "eleven", "11, 16", 17):
        with pytest.raises(ValueError, match="ground_truth must be running sums"):
            chainsum_reward(SRC, "17", bad, None)
    first = chainsum_reward(SRC, "7", "7", None)
    first["score"] = -1.0  # a fresh dict each call
    assert chainsum_reward(SRC, "7", "7", None)["score"] == 1.0
    assert REWARD_FUNCTIONS["chainsum"] is chainsum_reward and default_reward_for(SRC) is chainsum_reward
