"""Datasets: the built-in verl layout, malformed rows, over-long prompts, deterministic order."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from async_rl.data.builtin import ARITHMETIC_DATA_SOURCE, resolve
from async_rl.data.dataset import PromptDataset, read_rows


def test_builtin_arithmetic_has_verl_layout():
    train, test = resolve("builtin:arithmetic/train"), resolve("builtin:arithmetic/test")
    schema = pq.read_schema(train)
    assert {"prompt", "data_source", "reward_model", "extra_info"} <= set(schema.names)
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)
    rows = read_rows(train)
    row = rows[0]
    assert row["data_source"] == ARITHMETIC_DATA_SOURCE
    assert row["prompt"][0]["role"] == "user"
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
    # Held-out problems never occur in training.
    train_q = {r["prompt"][0]["content"] for r in rows}
    test_q = {r["prompt"][0]["content"] for r in read_rows(test)}
    assert train_q.isdisjoint(test_q) and len(test_q) > 0


def test_builtin_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RL_CACHE", str(tmp_path))
    first = resolve("builtin:arithmetic/train")
    mtime = (tmp_path / first).stat().st_mtime_ns
    assert resolve("builtin:arithmetic/train") == first
    assert (tmp_path / first).stat().st_mtime_ns == mtime


def test_builtin_small_model_is_larger_with_the_same_tokenizer_and_its_context():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    small, tiny = resolve("builtin:small-qwen2"), resolve("builtin:tiny-qwen2")
    config = AutoConfig.from_pretrained(small)
    assert (config.hidden_size, config.num_hidden_layers, config.max_position_embeddings) == (256, 6, 512)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(small).parameters())
    assert 4.5e6 < params < 5.0e6
    small_tok, tiny_tok = AutoTokenizer.from_pretrained(small), AutoTokenizer.from_pretrained(tiny)
    assert small_tok.get_vocab() == tiny_tok.get_vocab() and small_tok.chat_template == tiny_tok.chat_template
    # Each tokenizer knows its model's context.
    assert (small_tok.model_max_length, tiny_tok.model_max_length) == (512, 256)


def test_unknown_builtin_lists_valid():
    with pytest.raises(ValueError, match="builtin:tiny-qwen2"):
        resolve("builtin:nope")
    with pytest.raises(ValueError, match="builtin:arithmetic/test"):
        resolve("builtin:arithmetic/validation")


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def _row(content="1+2=", gt="3"):
    return {"prompt": [{"role": "user", "content": content}], "data_source": ARITHMETIC_DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"answer": gt}}


def test_row_without_prompt_names_file_and_row(tmp_path, tiny_tokenizer):
    f = tmp_path / "bad.parquet"
    rows = [_row(), _row()]
    rows[1] = {k: v for k, v in rows[1].items() if k != "prompt"}
    rows[1]["question"] = "1+2="
    _write_parquet(f, rows)
    with pytest.raises(ValueError, match=r"bad.parquet: row 1 \(0-based\): missing required field 'prompt'"):
        PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=64)


def test_jsonl_row_without_prompt_and_bad_json(tmp_path, tiny_tokenizer):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(_row()) + "\n" + json.dumps({"data_source": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1 \(0-based\): missing required field 'prompt'"):
        PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=64)
    g = tmp_path / "broken.jsonl"
    g.write_text(json.dumps(_row()) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl: line 2: not valid JSON"):
        read_rows(g)


def test_malformed_messages_rejected(tmp_path, tiny_tokenizer):
    f = tmp_path / "msgs.jsonl"
    f.write_text(json.dumps({"prompt": "just a string"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 \(0-based\): 'prompt' must be a non-empty list"):
        PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=64)


def test_too_long_prompt_rejected_and_counted(tmp_path, tiny_tokenizer, caplog):
    f = tmp_path / "mixed.parquet"
    _write_parquet(f, [_row(), _row("1+2+3+4+5+6+7+8+9+10+11+12=", "78"), _row("4+5=", "9")])
    ds = PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=16)
    assert len(ds) == 2
    assert ds.num_rejected_too_long == 1
    assert "row 1" in caplog.text and "rejected" in caplog.text
    # Accepted prompts are never truncated.
    assert all(len(p.prompt_ids) <= 16 for p in ds.prompts)
    assert tiny_tokenizer.decode(ds.prompts[1].prompt_ids).count("4+5=") == 1


def test_order_is_seeded_and_resumable(tiny_tokenizer):
    train = resolve("builtin:arithmetic/train")
    a = PromptDataset([train], tiny_tokenizer, 64, seed=3)
    b = PromptDataset([train], tiny_tokenizer, 64, seed=3)
    first = [p.uid for p in a.next_batch(len(a) + 5)]  # crosses an epoch boundary
    assert first == [p.uid for p in b.next_batch(len(b) + 5)]
    assert len(set(first[: len(a)])) == len(a)  # one epoch visits every prompt once
    state = a.state_dict()
    nxt = [p.uid for p in a.next_batch(7)]
    c = PromptDataset([train], tiny_tokenizer, 64, seed=3)
    c.load_state_dict(state)
    assert [p.uid for p in c.next_batch(7)] == nxt


@pytest.mark.parametrize("delta, kept", [(-1, False), (0, True), (1, True)])
def test_prompt_of_exactly_max_prompt_tokens_is_accepted(tmp_path, tiny_tokenizer, delta, kept):
    from async_rl.data.dataset import render_prompt

    long_row, short_row = _row("12+34+56+78=", "180"), _row("1+2=", "3")
    length = len(render_prompt(tiny_tokenizer, long_row["prompt"]))
    assert len(render_prompt(tiny_tokenizer, short_row["prompt"])) < length - 1
    f = tmp_path / "edge.parquet"
    _write_parquet(f, [short_row, long_row])
    ds = PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=length + delta)
    assert ds.num_rejected_too_long == (0 if kept else 1)
    assert len(ds) == (2 if kept else 1)
    if kept:
        assert len(ds.prompts[1].prompt_ids) == length  # whole, never truncated


@pytest.mark.parametrize("limit, size", [(2, 2), (3, 3), (4, 3), (0, 3)])
def test_limit_at_the_number_of_prompts(tmp_path, tiny_tokenizer, limit, size):
    # data.val_max_prompts: at most `limit` accepted prompts, the first ones; 0 = all.
    f = tmp_path / "three.parquet"
    _write_parquet(f, [_row("1+2=", "3"), _row("2+2=", "4"), _row("3+2=", "5")])
    ds = PromptDataset([str(f)], tiny_tokenizer, max_prompt_tokens=64, limit=limit)
    assert [p.uid for p in ds] == [f"three:{i}" for i in range(size)]
