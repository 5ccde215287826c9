"""Download GSM8K and write it as verl-layout parquet files for async-rl.

Run::

    pip install 'async-rl[datasets]'
    python examples/gsm8k/prepare_data.py --out-dir data/gsm8k

writes ``<out-dir>/train.parquet`` (7,473 rows) and ``<out-dir>/test.parquet`` (1,319 rows).
Each row::

    prompt:       [{"role": "user", "content": "<question> Let's think step by step and output
                                                the final answer after \\"####\\"."}]
    data_source:  "openai/gsm8k"          (selects the built-in "gsm8k" reward)
    ability:      "math"
    reward_model: {"style": "rule", "ground_truth": "72"}
    extra_info:   {"split": "train", "index": 0, "answer": "<full solution>",
                   "question": "<question>"}
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable

DATA_SOURCE = "openai/gsm8k"
"""``data_source`` written into every row; the reward dispatch keys on it, so it stays fixed
even when the data is read from a mirror (``--source``)."""

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
"""Appended to each question so the policy ends with the format the "gsm8k" reward reads first."""

_FINAL_ANSWER = re.compile(r"####\s*(.*?)\s*\Z", re.DOTALL)


def extract_gsm8k_answer(solution: str) -> str:
    """Return the final answer of a GSM8K reference solution, without thousands separators.

    GSM8K solutions end with a line "#### <answer>", e.g. "...\\n#### 1,234" -> "1234".

    Args:
        solution: the dataset's ``answer`` field.

    Returns:
        The text after the last "####", stripped, with "," removed.

    Raises:
        ValueError: the solution has no "####" or nothing after it.
    """
    marker = solution.rfind("####")
    if marker == -1:
        raise ValueError(f"GSM8K solution has no '####' final-answer line: {solution[-200:]!r}")
    answer = _FINAL_ANSWER.match(solution, marker).group(1).replace(",", "")
    if not answer:
        raise ValueError(
            f"GSM8K solution has an empty '####' final-answer line: {solution[-200:]!r}"
        )
    return answer


def make_row(example: dict, split: str, index: int) -> dict:
    """Convert one GSM8K example into a verl-layout row.

    Args:
        example: a GSM8K record with string fields "question" and "answer" (the full solution).
        split: "train" or "test", stored in ``extra_info``.
        index: position of the example in its split, stored in ``extra_info``.

    Returns:
        The row as laid out in the module docstring.

    Raises:
        ValueError: the solution has no final answer (see ``extract_gsm8k_answer``).
        KeyError: ``example`` lacks "question" or "answer".
    """
    question = example["question"]
    solution = example["answer"]
    return {
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "data_source": DATA_SOURCE,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_gsm8k_answer(solution)},
        "extra_info": {"split": split, "index": index, "answer": solution, "question": question},
    }


def write_parquet(rows: Iterable[dict], path: str) -> None:
    """Write rows from ``make_row`` to one parquet file (nested list/struct columns).

    Args:
        rows: rows from ``make_row``.
        path: output file; its directory must exist.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out-dir", default="data/gsm8k", help="output folder (default: data/gsm8k)"
    )
    parser.add_argument(
        "--source",
        default="openai/gsm8k",
        help="Hugging Face dataset id or local copy to read (default: openai/gsm8k)",
    )
    parser.add_argument(
        "--subset", default="main", help="dataset configuration name; '' for none (default: main)"
    )
    args = parser.parse_args(argv)

    try:
        import datasets
    except ImportError:
        sys.exit("prepare_data.py needs the 'datasets' library: pip install 'async-rl[datasets]'")

    os.makedirs(args.out_dir, exist_ok=True)
    loaded = datasets.load_dataset(args.source, args.subset or None)
    for split in ("train", "test"):
        rows = (make_row(example, split, i) for i, example in enumerate(loaded[split]))
        path = os.path.join(args.out_dir, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"wrote {len(loaded[split])} rows to {path}")


if __name__ == "__main__":
    main()
