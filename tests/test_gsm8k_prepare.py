"""examples/gsm8k/prepare_data.py: row conversion and parquet layout, without any download."""

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_rl.rewards import default_reward_for

_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gsm8k" / "prepare_data.py"
_spec = importlib.util.spec_from_file_location("gsm8k_prepare_data", _SCRIPT)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

EXAMPLES = [
    {
        "question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
    },
    {
        "question": "A car costs $1,200 and a bike $34. What do both cost?",
        "answer": "1200 + 34 = <<1200+34=1234>>1234\n#### 1,234",
    },
]


def test_extract_gsm8k_answer():
    assert prepare.extract_gsm8k_answer("x\n#### 7") == "7"
    assert prepare.extract_gsm8k_answer("x\n#### 1,234\n") == "1234"
    assert prepare.extract_gsm8k_answer("#### -3") == "-3"
    with pytest.raises(ValueError, match="no '####'"):
        prepare.extract_gsm8k_answer("The answer is 7.")
    with pytest.raises(ValueError, match="empty"):
        prepare.extract_gsm8k_answer("The answer is 7.\n####  ")


def test_make_row():
    row = prepare.make_row(EXAMPLES[0], "train", 5)
    assert row == {
        "prompt": [
            {
                "role": "user",
                "content": "Tom has 3 apples and buys 4 more. How many apples does he have? "
                "Let's think step by step and output the final answer after \"####\".",
            }
        ],
        "data_source": "openai/gsm8k",
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {
            "split": "train",
            "index": 5,
            "answer": EXAMPLES[0]["answer"],
            "question": EXAMPLES[0]["question"],
        },
    }
    # The reference solution itself earns full reward from the dispatched reward function.
    reward = default_reward_for(row["data_source"])
    assert reward(row["data_source"], row["extra_info"]["answer"], "7", None)["score"] == 1.0


def test_parquet_layout_roundtrip(tmp_path):
    rows = [prepare.make_row(example, "test", i) for i, example in enumerate(EXAMPLES)]
    path = tmp_path / "test.parquet"
    prepare.write_parquet(rows, str(path))

    table = pq.read_table(path)
    schema = table.schema
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    assert schema.field("prompt").type == pa.list_(message)
    assert schema.field("data_source").type == pa.string()
    assert schema.field("ability").type == pa.string()
    assert schema.field("reward_model").type == pa.struct(
        [("style", pa.string()), ("ground_truth", pa.string())]
    )
    extra = schema.field("extra_info").type
    assert pa.types.is_struct(extra)
    assert {extra.field(i).name: extra.field(i).type for i in range(extra.num_fields)} == {
        "split": pa.string(),
        "index": pa.int64(),
        "answer": pa.string(),
        "question": pa.string(),
    }
    assert table.to_pylist() == rows
    assert [r["reward_model"]["ground_truth"] for r in table.to_pylist()] == ["7", "1234"]


def test_main_without_datasets_says_how_to_install(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(SystemExit, match=r"pip install 'async-rl\[datasets\]'"):
        prepare.main(["--out-dir", str(tmp_path / "out")])
