"""Fuzz tests (issue 18): seeded, bounded streams of malformed input at every door of the pipeline.

Each door gets a few thousand generated inputs, mixed with valid ones, from ``SEEDS``:

- dataset rows (``PromptDataset``, ``data.on_bad_row=skip``): lines that are not JSON or not
  objects, missing or malformed prompts and messages, wrong field types, over-long prompts;
- reward function outputs (``RewardScorer.score``): exceptions, ``None``, NaN/inf, wrong types,
  numpy scalars, out-of-range ints, dicts with junk extras (``REWARD_CASES``, one row per case);
- tool-call text (both parsers, then ``ToolExecutor``): truncated and nested tags, broken and
  deeply nested JSON, unicode, huge arguments, unknown tools, wrong argument types;
- ZeroMQ messages (``decode_messages``, then a real PUSH/PULL pair into a ``ReplayBuffer``):
  random bytes, bit flips, truncations, wrong frame counts, wrong msgpack types, absurd lengths,
  NaN log-probs (behavior and teacher), negative token ids, teacher token counts other than 0 or
  the response's, teacher top-k, routed-expert and observation-image counts that disagree with the
  body, negative top-k ids and expert indices, non-finite pixels, image grids with a value < 1 or
  of another patch count, duplicates, single trajectories and whole groups;

and one real async run (slow) takes all four at once. The contract everywhere: nothing raises
out of the pipeline, every rejection is counted under a known reason, and every accepted input
is used once. Each test prints its figures (inputs tried, outcomes by reason; ``pytest -s``) and
writes them to ``<tmp_path>/fuzz_report.json``.

Run with ``python -m pytest -q -s tests/test_fuzz.py`` (the pure-function tests take seconds;
``-m "not slow"`` leaves out the end-to-end run, 1-3 minutes).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
import os
import random
import re
import struct
import sys
import threading
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import zmq

from async_rl.buffers.replay import ReplayBuffer
from async_rl.buffers.trajectory import PER_TOKEN_DTYPES, Trajectory
from async_rl.buffers.transport import (SCHEMA_VERSION, GroupClosed, MalformedMessageError, TrajectoryGroup,
                                        ZmqTrajectoryReceiver, decode_messages, encode_message, pack_frame,
                                        split_frame)
from async_rl.data.builtin import ARITHMETIC_DATA_SOURCE
from async_rl.data.dataset import BAD_ROW_REASONS, BadRowError, PromptDataset
from async_rl.rewards.scorer import REJECT_REASONS as REWARD_REJECT_REASONS
from async_rl.rewards.scorer import RewardScorer
from async_rl.tools import ERROR_KINDS, ToolExecutor, ToolRegistry, tool
from async_rl.tools.parsers import HermesParser, Llama3JsonParser

SEEDS = (0, 1, 2, 3)
"""Every generator below is ``random.Random(seed)`` for each of these: the same inputs each run."""


def report(tmp_path: Path, category: str, figures: dict[str, Any]) -> None:
    """Print one category's figures (visible with ``pytest -s``) and write them as JSON."""
    print(f"\nfuzz {category}: {json.dumps(figures, sort_keys=True)}")
    (tmp_path / "fuzz_report.json").write_text(json.dumps({category: figures}, indent=1, sort_keys=True))


def junk_text(rng: random.Random, max_len: int = 20) -> str:
    """Random text: ASCII, markup characters, and code points from all planes (no surrogates,
    which UTF-8 cannot carry), no line breaks."""
    alphabets = ["abcxyz 0123456789", "{}[]\":,\\<>/|_'", "éß数学🙂\u200b\u2028\ufeff\x00\x7f"]
    out = []
    for _ in range(rng.randint(0, max_len)):
        if rng.random() < 0.1:
            c = chr(rng.choice([rng.randint(0x20, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
        else:
            c = rng.choice(rng.choice(alphabets))
        out.append(c)
    return "".join(out).replace("\n", " ").replace("\r", " ")


# ------------------------------------------------------------------------------------ dataset
MAX_PROMPT_TOKENS = 48


def _plain_row(a: int, b: int) -> dict[str, Any]:
    """An arithmetic row in the built-in data's layout."""
    return {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": ARITHMETIC_DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": {}}


def _good_row(rng: random.Random) -> dict[str, Any]:
    row = _plain_row(rng.randint(0, 19), rng.randint(0, 19))
    variant = rng.randrange(6)  # valid oddities: none of them is a reason to reject a row
    if variant == 1:
        row["unknown_field"] = junk_text(rng)
    elif variant == 2:
        row["prompt"][0]["content"] = junk_text(rng, 4)
    elif variant == 3:
        del row["reward_model"], row["data_source"], row["extra_info"]
    elif variant == 4:
        row["reward_model"]["ground_truth"] = rng.choice([7, 1.5, None, [1, 2], {"a": 1}])
    elif variant == 5:
        row["prompt"].insert(0, {"role": "system", "content": "", "name": "extra keys are fine"})
    return row


def _not_json(rng: random.Random) -> bytes:
    """One line that ``json.loads`` refuses (checked), no line break in it."""
    while True:
        kind = rng.randrange(6)
        if kind == 0:  # a valid row cut short
            text = json.dumps(_good_row(rng))
            line = text[: rng.randrange(1, len(text))].encode()
        elif kind == 1:
            line = junk_text(rng, 40).encode() or b"?"
        elif kind == 2:  # nested past the decoder's recursion limit
            line = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        elif kind == 3:
            line = rng.choice([b"{'prompt': 'single quotes'}", b"nan", b"{,}", b'{"a": 1,}', b"\x00"])
        elif kind == 4:  # invalid UTF-8, outside or inside a string
            text = json.dumps(_good_row(rng)).encode()
            at = rng.choice([0, text.index(b'"content": "') + 12])
            line = text[:at] + b"\xff\xfe" + text[at:]
        else:  # two objects on one line
            line = (json.dumps(_good_row(rng)) * 2).encode()
        if not line.strip() or b"\n" in line or b"\r" in line:
            continue
        try:
            json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            return line


def _bad_row(rng: random.Random, reason: str) -> bytes:
    """One jsonl line that the dataset must reject with ``reason``."""
    if reason == "not_json":
        return _not_json(rng)
    if reason == "not_an_object":
        return json.dumps(rng.choice([[_good_row(rng)], 5, "prompt", None, True, []])).encode()
    row = _good_row(rng)
    if reason == "missing_prompt":
        if rng.random() < 0.5:
            del row["prompt"]
        else:
            row["prompt"] = None
    elif reason == "bad_prompt":
        row["prompt"] = rng.choice(["1+2=", {}, [], 5, True, {"role": "user", "content": "x"}])
    elif reason == "bad_messages":
        bad = rng.choice(["x", None, [], {"role": "user"}, {"content": "x"}, {"role": 1, "content": "x"},
                          {"role": "user", "content": None}, {"role": "user", "content": ["a"]}])
        row["prompt"].insert(rng.randint(0, 1), bad)
    elif reason == "bad_data_source":
        row["data_source"] = rng.choice([5, ["a"], {"x": 1}, True, 1.5])
    elif reason == "bad_reward_model":
        row["reward_model"] = rng.choice(["42", [1], 3, True])
    elif reason == "bad_extra_info":
        row["extra_info"] = rng.choice(["x", [1], 3, True])
    elif reason == "too_long":
        row["prompt"][0]["content"] = "".join(rng.choice("0123456789+-*= ") for _ in range(400))
    else:
        raise AssertionError(reason)
    return json.dumps(row, ensure_ascii=rng.random() < 0.5).encode()


# Reasons the generator makes; "template_error" needs a template that refuses messages (the tiny
# model's ChatML renders any role) and "no_reference" a warm start: their own tests cover them.
DATASET_KINDS = ("not_json", "not_an_object", "missing_prompt", "bad_prompt", "bad_messages", "bad_data_source",
                 "bad_reward_model", "bad_extra_info", "too_long")


def fuzz_rows(seed: int, num_rows: int) -> tuple[list[bytes], list[str]]:
    """``num_rows`` jsonl lines (blank lines between some, which are not rows) and the expected
    outcome of each row: ``"ok"`` or its rejection reason."""
    rng = random.Random(seed)
    lines, expected = [], []
    for _ in range(num_rows):
        if rng.random() < 0.05:
            lines.append(rng.choice([b"", b"   ", b"\t"]))
        kind = "ok" if rng.random() < 0.4 else rng.choice(DATASET_KINDS)
        lines.append(json.dumps(_good_row(rng)).encode() if kind == "ok" else _bad_row(rng, kind))
        expected.append(kind)
    return lines, expected


def test_fuzz_dataset_rows_each_rejection_counted_by_reason(tmp_path, tiny_tokenizer):
    assert set(DATASET_KINDS) - {"too_long"} <= set(BAD_ROW_REASONS)
    totals: collections.Counter[str] = collections.Counter()
    for seed in SEEDS:
        lines, expected = fuzz_rows(seed, 500)
        path = tmp_path / f"fuzz{seed}.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        ds = PromptDataset([str(path)], tiny_tokenizer, MAX_PROMPT_TOKENS, seed=seed, on_bad_row="skip")
        want = collections.Counter(k for k in expected if k != "ok")
        assert ds.rejected == dict(want)
        # Every accepted row is there once, in file order, under its row number.
        assert [p.uid for p in ds.prompts] == [f"fuzz{seed}:{i}" for i, k in enumerate(expected) if k == "ok"]
        assert all(len(p.prompt_ids) <= MAX_PROMPT_TOKENS for p in ds.prompts)
        summary = ds.summary()
        assert summary["data/rejected_prompts_too_long"] == want["too_long"]
        assert summary["data/rejected_rows"] == sum(want.values()) - want["too_long"]
        assert {k: v for k, v in summary.items() if k.startswith("data/rejected_rows_")} == {
            f"data/rejected_rows_{r}": n for r, n in want.items() if r != "too_long"}
        totals.update(expected)
    report(tmp_path, "dataset_rows", {"seeds": list(SEEDS), "rows": sum(totals.values()), "outcomes": dict(totals)})


def test_fuzz_dataset_error_mode_names_each_reason(tmp_path, tiny_tokenizer):
    """``on_bad_row=error`` stops at a malformed row with its reason, file and row; over-long
    prompts are rejected in both modes; a file with nothing usable left is an error in both."""
    rng = random.Random(0)
    good = json.dumps(_good_row(rng)).encode()
    for reason in DATASET_KINDS:
        path = tmp_path / f"{reason}.jsonl"
        path.write_bytes(good + b"\n" + _bad_row(rng, reason) + b"\n")
        if reason == "too_long":
            assert PromptDataset([str(path)], tiny_tokenizer, MAX_PROMPT_TOKENS).rejected == {"too_long": 1}
            continue
        with pytest.raises(BadRowError) as info:
            PromptDataset([str(path)], tiny_tokenizer, MAX_PROMPT_TOKENS)
        assert info.value.reason == reason
        assert str(info.value).startswith(f"{path}: ") and re.search(r": (row 1 \(0-based\)|line 2): ", str(info.value))
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_bytes(b"\n".join(_bad_row(rng, r) for r in ("not_json", "missing_prompt", "too_long")) + b"\n")
    with pytest.raises(ValueError, match=r"no usable prompt .* \(rows rejected: missing_prompt 1, not_json 1, "
                                         r"too_long 1\)"):
        PromptDataset([str(only_bad)], tiny_tokenizer, MAX_PROMPT_TOKENS, on_bad_row="skip")
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        PromptDataset([str(only_bad)], tiny_tokenizer, MAX_PROMPT_TOKENS, on_bad_row="ignore")


def test_fuzz_dataset_template_error_and_missing_reference(tmp_path, tiny_tokenizer):
    """The two reasons the row generator does not make: a chat template that refuses the
    messages, and a row without the warm start's reference field."""
    path = tmp_path / "rows.jsonl"
    no_reference = _plain_row(1, 2)
    del no_reference["reward_model"]
    path.write_text("\n".join(json.dumps(r) for r in (_plain_row(3, 4), no_reference, _plain_row(5, 6))) + "\n")
    ds = PromptDataset([str(path)], tiny_tokenizer, MAX_PROMPT_TOKENS, reference_fields=("reward_model.ground_truth",),
                       on_bad_row="skip")
    assert ds.rejected == {"no_reference": 1} and len(ds) == 2

    class Refusing:
        """A tokenizer whose chat template raises for a "system" turn, as some templates do."""

        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "system" for m in messages):
                raise ValueError("System role not supported")
            return tiny_tokenizer.apply_chat_template(messages, **kw)

    system = _plain_row(7, 8)
    system["prompt"].insert(0, {"role": "system", "content": "be brief"})
    path.write_text("\n".join(json.dumps(r) for r in (_plain_row(9, 1), system)) + "\n")
    ds = PromptDataset([str(path)], Refusing(), MAX_PROMPT_TOKENS, on_bad_row="skip")
    assert ds.rejected == {"template_error": 1} and len(ds) == 1
    with pytest.raises(BadRowError, match=r"row 1 \(0-based\): the chat template refused .*System role not supported"):
        PromptDataset([str(path)], Refusing(), MAX_PROMPT_TOKENS)


# ------------------------------------------------------------------------------------ rewards
OK, ERROR, NO_REWARD = "ok", "error", "no_reward"


class _CustomError(Exception):
    """An exception type of the user's own."""


def _raises(exc: BaseException) -> Callable[..., Any]:
    def fn(*_):
        raise exc
    return fn


def _returns(value: Any) -> Callable[..., Any]:
    return lambda *_: value


def _divides_by_zero(*_):
    return 1 / 0


# (case, reward function, expected outcome, expected (score, extras) when OK). One row per case;
# a new kind of bad reward output is one more row.
REWARD_CASES: list[tuple[str, Callable[..., Any], str, tuple[float, dict] | None]] = [
    ("raise ValueError", _raises(ValueError("unreadable answer")), ERROR, None),
    ("raise KeyError", _raises(KeyError("ground_truth")), ERROR, None),
    ("raise ZeroDivisionError", _divides_by_zero, ERROR, None),
    ("raise RecursionError", _raises(RecursionError("maximum recursion depth exceeded")), ERROR, None),
    ("raise custom", _raises(_CustomError("judge unavailable")), ERROR, None),
    ("raise with a 100 kB message", _raises(ValueError("x" * 100_000)), ERROR, None),
    ("None", _returns(None), NO_REWARD, None),
    ("score None", _returns({"score": None, "acc": 1.0}), NO_REWARD, None),
    ("nan", _returns(math.nan), ERROR, None),
    ("inf", _returns(math.inf), ERROR, None),
    ("-inf", _returns(-math.inf), ERROR, None),
    ("numpy nan", _returns(np.float64("nan")), ERROR, None),
    ("numpy float32 inf", _returns(np.float32("inf")), ERROR, None),
    ("score nan", _returns({"score": math.nan}), ERROR, None),
    ("str", _returns("1.0"), ERROR, None),
    ("bytes", _returns(b"1"), ERROR, None),
    ("list", _returns([1.0]), ERROR, None),
    ("tuple", _returns((1.0, {"acc": 1.0})), ERROR, None),
    ("nested dict score", _returns({"score": {"value": 1.0}}), ERROR, None),
    ("str score", _returns({"score": "1"}), ERROR, None),
    ("dict without score", _returns({"acc": 1.0}), ERROR, None),
    ("complex", _returns(1j), ERROR, None),
    ("Decimal", _returns(Decimal("0.5")), ERROR, None),  # not a numbers.Real
    ("numpy bool", _returns(np.bool_(True)), ERROR, None),  # not a numbers.Real (Python's bool is)
    ("int 10**400", _returns(10**400), ERROR, None),
    ("object", _returns(object()), ERROR, None),
    ("float", _returns(0.25), OK, (0.25, {})),
    ("-0.0", _returns(-0.0), OK, (0.0, {})),
    ("largest float", _returns(sys.float_info.max), OK, (sys.float_info.max, {})),
    ("int", _returns(3), OK, (3.0, {})),
    ("int 10**20", _returns(10**20), OK, (1e20, {})),
    ("bool", _returns(True), OK, (1.0, {})),
    ("numpy float32", _returns(np.float32(0.5)), OK, (0.5, {})),
    ("numpy int64", _returns(np.int64(-2)), OK, (-2.0, {})),
    ("Fraction", _returns(Fraction(1, 4)), OK, (0.25, {})),
    ("dict with junk extras", _returns({"score": 1.0, "acc": 1, "note": "text", "bad": math.nan, "huge": 10**400,
                                        "np": np.float32(0.5), "list": [1.0]}), OK, (1.0, {"acc": 1.0, "np": 0.5})),
    # Slow, hanging and process-killing rewards need a worker process: WORKER_REWARD_CASES below.
]


def test_fuzz_reward_outputs_each_one_counted(tmp_path):
    """Thousands of calls, each case drawn at random, under both ``on_error`` modes: the scorer
    never raises, every score is finite, every failure is counted under its reason."""
    table = {name: (fn, outcome, value) for name, fn, outcome, value in REWARD_CASES}
    names = sorted(table)

    def reward(data_source, response_text, ground_truth, extra_info):
        return table[extra_info["case"]][0](data_source, response_text, ground_truth, extra_info)

    figures: dict[str, Any] = {"seeds": list(SEEDS), "cases": len(REWARD_CASES)}
    for on_error in ("reject", "zero"):
        scorer = RewardScorer(reward, on_error=on_error)
        outcomes: collections.Counter[str] = collections.Counter()
        reasons: collections.Counter[str] = collections.Counter()
        for seed in SEEDS:
            rng = random.Random(seed)
            for _ in range(500):
                case = rng.choice(names)
                _, outcome, value = table[case]
                result = scorer.score(junk_text(rng), junk_text(rng, 60), junk_text(rng, 5), {"case": case})
                outcomes[outcome] += 1
                assert type(result.score) is float and math.isfinite(result.score), case
                if outcome == OK:
                    assert (result.score, result.extras, result.rejected, result.error) == (*value, False, None), case
                    continue
                assert result.error and result.score == 0.0 and result.extras == {}, case
                rejected = outcome == NO_REWARD or on_error == "reject"
                assert (result.rejected, result.reason) == (rejected, outcome if rejected else None), case
                assert result.reason in (None, *REWARD_REJECT_REASONS)
                reasons[result.reason or "scored 0.0"] += 1
        total = sum(outcomes.values())
        assert scorer.counts() == {"reward/scored": total, "reward/errors": outcomes[ERROR],
                                   "reward/no_reward": outcomes[NO_REWARD],
                                   "reward/rejected": outcomes[NO_REWARD] + (outcomes[ERROR] if on_error == "reject" else 0),
                                   "reward/timeouts": 0, "reward/crashed": 0, "reward/too_large": 0}
        figures[f"on_error={on_error}"] = {"calls": total, "outcomes": dict(outcomes), "rejections": dict(reasons)}
    report(tmp_path, "reward_outputs", figures)


class _UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("__str__ failed")


def test_fuzz_reward_exception_that_cannot_be_printed():
    """Found by this fuzz test: an exception whose ``__str__`` raises was a crash of the scorer."""
    result = RewardScorer(_raises(_UnprintableError()), on_error="reject").score("x", "y", "z", None)
    assert result.rejected and result.reason == "error" and "str()" in result.error


WORKER_REWARD_MODULE = """
import math, os, time


def reward(data_source, response_text, ground_truth, extra_info):
    case = extra_info["case"]
    if case == "slow":  # past reward.timeout_s: the worker is killed
        time.sleep(3600)
    if case == "exit":
        os._exit(3)
    if case == "raise":
        raise ValueError("unreadable answer")
    if case == "huge dict":
        return {"score": 1.0, **{f"k{i}": 1.0 for i in range(5000)}}
    if case == "huge str":
        return "x" * 50_000_000
    if case == "nan":
        return math.nan
    if case == "None":
        return None
    return {"score": 0.5, "acc": 1.0}
"""

WORKER_REWARD_CASES = {"slow": "timeout", "exit": "crashed", "huge dict": "too_large", "huge str": ERROR,
                       "raise": ERROR, "nan": ERROR, "None": NO_REWARD, "ok": OK}
"""Case -> its outcome through a ``RewardWorkers`` pool (``reward.timeout_s`` 1 s)."""


def test_fuzz_reward_worker_pool_slow_crashing_huge(tmp_path):
    """Through worker processes (as every run scores): a reward that hangs, kills its process or
    returns something huge costs its sample, counted under its reason, never the scorer; the
    others keep their in-process outcomes. Seeded; hangs and exits are drawn rarely (each costs
    a worker: a 1 s deadline, then a new process)."""
    from async_rl.rewards.workers import RewardWorkers

    module = tmp_path / "fuzz_reward.py"
    module.write_text(WORKER_REWARD_MODULE)
    weights = {"slow": 1, "exit": 1, "huge dict": 2, "huge str": 1, "raise": 4, "nan": 4, "None": 4, "ok": 20}
    names = sorted(weights)
    scorer = RewardScorer(lambda *a: 0.0, on_error="zero",
                          workers=RewardWorkers(f"{module}:reward", num_workers=2, timeout_s=1.0))
    outcomes: collections.Counter[str] = collections.Counter()
    results: list[tuple[str, Any]] = []
    lock = threading.Lock()
    try:
        for seed in SEEDS:
            rng = random.Random(seed)
            for _ in range(40):
                case = rng.choices(names, [weights[n] for n in names])[0]
                outcomes[WORKER_REWARD_CASES[case]] += 1

                def done(result, case=case):
                    with lock:
                        results.append((case, result))

                scorer.submit(junk_text(rng), junk_text(rng, 60), junk_text(rng, 5), {"case": case}, done=done)
        scorer.drain()
    finally:
        scorer.close()
    assert len(results) == sum(outcomes.values()) == 40 * len(SEEDS)
    for case, result in results:
        expected = WORKER_REWARD_CASES[case]
        assert type(result.score) is float and math.isfinite(result.score), case
        if expected == OK:
            assert (result.score, result.extras, result.rejected) == (0.5, {"acc": 1.0}, False), case
        elif expected == ERROR:  # on_error=zero: scored 0, kept
            assert (result.score, result.rejected, result.reason) == (0.0, False, None) and result.error, case
        else:  # no reward, timeout, crash, too large: always rejected
            assert (result.rejected, result.reason) == (True, expected), case
    counts = scorer.counts()
    assert counts["reward/timeouts"] == outcomes["timeout"] > 0
    assert counts["reward/crashed"] == outcomes["crashed"] > 0
    assert counts["reward/too_large"] == outcomes["too_large"] > 0
    assert counts["reward/no_reward"] == outcomes[NO_REWARD]
    assert counts["reward/rejected"] == outcomes[NO_REWARD] + outcomes["timeout"] + outcomes["crashed"] + outcomes["too_large"]
    assert counts["reward/scored"] == len(results)
    report(tmp_path, "reward_worker_pool", {"seeds": list(SEEDS), "calls": len(results), "outcomes": dict(outcomes)})


# ------------------------------------------------------------------------------------- tools
@tool
def echo(text: str) -> str:
    """Return the first 50 characters of ``text``."""
    return text[:50]


@tool
def add(a: int, b: int = 0) -> int:
    """Add two integers."""
    return a + b


@tool
def noargs() -> str:
    """Take nothing."""
    return "done"


TOOL_NAMES = ["echo", "add", "noargs", "calculator", "no_such_tool", "", " ", "Echo", "echo ", "🙂", "a" * 100]
PARSE_ERRORS = {None, "malformed_json", "truncated", "not_an_object", "no_name"}


def _arguments(rng: random.Random) -> Any:
    return rng.choice([
        {"text": junk_text(rng)}, {"a": rng.randint(-9, 9), "b": rng.randint(-9, 9)}, {"a": "x"}, {"a": [1], "b": [2]},
        {}, {"unexpected": 1}, {"expression": rng.choice(["1+2*3", "9**9**9", "1/0", "(" * 300 + "1" + ")" * 300])},
        {"text": "x" * 100_000}, {"text": {"nested": [{"deep": None}]}}, json.dumps({"text": junk_text(rng)}),
        "not json {", "", [1, 2], 5, None, True, {"": 1}, {"text": "</tool_call><tool_call>"},
    ])


def _call_text(rng: random.Random) -> str:
    obj: dict[str, Any] = {"name": rng.choice(TOOL_NAMES + [None, 5, ["echo"], {"n": 1}])}
    key = rng.choice(["arguments", "parameters", None])
    if key is not None:
        obj[key] = _arguments(rng)
    if rng.random() < 0.05:
        del obj["name"]
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5)


def tool_text(rng: random.Random) -> str:
    """A generated assistant message: text, calls in both formats, stray and nested tags, deep
    nesting; then cut, or with characters deleted, inserted or repeated."""
    pieces = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.randrange(8)
        if kind == 0:
            pieces.append(junk_text(rng, 30))
        elif kind in (1, 2):
            pieces.append(f"<tool_call>\n{_call_text(rng)}\n</tool_call>")
        elif kind == 3:
            pieces.append(f"<tool_call><tool_call>{_call_text(rng)}</tool_call></tool_call>")
        elif kind == 4:
            pieces.append(rng.choice(["</tool_call>", "<tool_call>", "<|python_tag|>", ";"]))
        elif kind == 5:
            pieces.append("<tool_call>" + "[" * rng.choice([10, 100_000]) + "</tool_call>")
        elif kind == 6:
            pieces.append(_call_text(rng))  # llama3_json: bare objects
        else:
            pieces.append("<|python_tag|>" + "; ".join(_call_text(rng) for _ in range(rng.randint(1, 3))))
    text = rng.choice(["", "\n", " "]).join(pieces)
    for _ in range(rng.choice([0, 0, 1, 2])):
        if not text:
            break
        at = rng.randrange(len(text))
        text = rng.choice([text[:at], text[:at] + text[at + 1:], text[:at] + junk_text(rng, 3) + text[at:],
                           text[:at] + rng.choice(["<tool_call>", "</tool_call>", '"', "{"]) + text[at:],
                           text + text[at:]])
    return text


def test_fuzz_tool_call_text_parsed_and_dispatched_without_exceptions(tmp_path):
    from async_rl.tools import load_tools

    registry = ToolRegistry([echo, add, noargs, *load_tools("calculator")])
    executor = ToolExecutor(registry)
    parsers = {"hermes": HermesParser(), "llama3_json": Llama3JsonParser()}
    parse_outcomes = {name: collections.Counter() for name in parsers}
    results: collections.Counter[str] = collections.Counter()
    num_texts = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        for _ in range(500):
            text = tool_text(rng)
            num_texts += 1
            for name, parser in parsers.items():
                content, calls = parser.parse(text)
                assert isinstance(content, str)
                for call in calls:
                    assert call.error in PARSE_ERRORS, (name, text[:200], call)
                    if call.error is None:
                        assert isinstance(call.name, str) and call.name and isinstance(call.arguments, dict)
                    parse_outcomes[name][call.error or "ok"] += 1
                out = executor.execute(calls)
                assert len(out) == len(calls)
                for call, result in zip(calls, out):
                    assert isinstance(result.content, str)
                    if result.ok:
                        assert call.error is None and result.error_kind is None
                    else:
                        assert result.error_kind in ERROR_KINDS and result.content.startswith("Error: ")
                        # A parse fault is reported as itself; a well-formed call fails later.
                        if call.error is not None:
                            assert result.error_kind == call.error
                        else:
                            assert result.error_kind in ("unknown_tool", "bad_arguments", "tool_error", "no_name")
                        if result.error_kind == "unknown_tool":
                            assert call.name not in registry
                    results[result.error_kind or "ok"] += 1
    counts = executor.pop_counts()
    assert counts.pop("tools/calls") == sum(results.values())
    assert counts == {f"tools/{'ok' if k == 'ok' else 'error_' + k}": n for k, n in results.items()}
    assert executor.abandoned_threads == 0
    report(tmp_path, "tool_calls", {"seeds": list(SEEDS), "texts": num_texts,
                                    "parsed_calls": {k: dict(v) for k, v in parse_outcomes.items()},
                                    "dispatch_outcomes": dict(results)})


# --------------------------------------------------------------------------------- transport
def random_trajectory(rng: random.Random, tid: str | None = None, group_id: int | None = None) -> Trajectory:
    """A valid trajectory of random size and content, with the teacher's log-probs (on-policy
    distillation) half of the time, its top-k (K of 1 to 4) half of the time, routing replay's
    routed experts (1 to 3 layers x top 1 to 4, indices over all of int16's >= 0) half of the
    time, and observation images (1 or 2 of up to 2 x 3 x 3 patches of 1 to 6 values, float32's
    extremes among them) a third of the time."""
    group_id = rng.randint(0, 10**6) if group_id is None else group_id
    p, r = rng.randint(1, 12), rng.randint(0, 12)
    versions = sorted(rng.randint(0, 5) for _ in range(r))
    teacher = [rng.choice([-rng.expovariate(1.0), 0.0, -0.0, -1e308]) for _ in range(r)] if rng.random() < 0.5 else []
    k = rng.randint(1, 4) if rng.random() < 0.5 else 0
    topk_ids = [[rng.randint(0, 2**31 - 1) for _ in range(k)] for _ in range(r)] if k else []
    topk_lps = ([[rng.choice([-rng.expovariate(1.0), 0.0, -0.0, 1e-7, -3e38]) for _ in range(k)] for _ in range(r)]
                if k else [])
    layers, top_k = (rng.randint(1, 3), rng.randint(1, 4)) if rng.random() < 0.5 else (0, 0)
    routed = [[[rng.choice([0, 2**15 - 1, rng.randint(0, 255)]) for _ in range(top_k)] for _ in range(layers)]
              for _ in range(p + r - 1)] if layers else []  # [] also when one token (P + R - 1 = 0 rows)
    grid = [[rng.randint(1, 2), rng.randint(1, 3), rng.randint(1, 3)] for _ in range(rng.randint(1, 2))] \
        if rng.random() < 1 / 3 else []
    dim = rng.randint(1, 6)
    pixels = [[rng.choice([rng.gauss(0.0, 1.0), -0.0, 1e-45, 3.4e38, -3.4e38]) for _ in range(dim)]
              for _ in range(sum(t * h * w for t, h, w in grid))]
    return Trajectory(
        trajectory_id=tid or f"{group_id}/{rng.randint(0, 7)}", group_id=group_id, prompt_uid=junk_text(rng, 8),
        prompt_ids=[rng.randint(0, 2**31 - 1) for _ in range(p)],
        response_ids=[rng.randint(0, 150_000) for _ in range(r)],
        behavior_logprobs=[rng.choice([-rng.expovariate(1.0), 0.0, -0.0, -math.inf]) for _ in range(r)],
        loss_mask=[rng.randint(0, 1) for _ in range(r)], finish_reason=rng.choice(["stop", "length"]),
        policy_version=versions, reward=rng.uniform(-5, 5), reward_extras={"acc": float(rng.randint(0, 1))},
        response_text=junk_text(rng), generator_id=rng.randint(-1, 7), teacher_logprobs=teacher,
        teacher_topk_ids=topk_ids, teacher_topk_logprobs=topk_lps, routed_experts=routed,
        observation_pixel_values=pixels, observation_image_grid_thw=grid)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    return [lambda: rng.randint(-2**63, 2**64 - 1), lambda: rng.choice([0, 1, -1, 2**31, 2**32, 2**63 - 1]),
            lambda: rng.choice([math.nan, math.inf, -math.inf, 0.5, -0.0, 1e308]), lambda: junk_text(rng),
            lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 16))), lambda: None,
            lambda: rng.choice([True, False]),
            lambda: msgpack.ExtType(rng.randint(0, 127), bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))),
            lambda: "",
            lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))],
            lambda: {junk_text(rng, 6): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))},
            lambda: {"schema": SCHEMA_VERSION, "kind": "group_closed", "group_id": _random_value(rng, depth + 1),
                     "num_kept": _random_value(rng, depth + 1)}][kind]()


def _array(values: list, code: str) -> bytes:
    return struct.pack(f"<{len(values)}{code}", *values)


_BODY = ["behavior_logprobs", "teacher_logprobs", "observation_image_grid_thw", "policy_version", "prompt_ids",
         "response_ids", "teacher_topk_ids", "teacher_topk_logprobs", "observation_pixel_values", "routed_experts",
         "loss_mask"]
# Where a trajectory header holds its prompt, response and teacher counts, the top-k's K, the
# routing's layers and experts a token, and the observation images' patches, values a patch and
# images.
_P, _R, _T, _K, _L, _KR, _NX, _DX, _IX = 8, 9, 10, 11, 12, 13, 14, 15, 16


def _routed_entries(entries: Any) -> int:
    """The routed-expert entries of a valid message's trajectory headers: sum (P + R - 1) L k."""
    return sum((e[_P] + e[_R] - 1) * e[_L] * e[_KR] for e in entries if e[_L])


def _split(frame: bytes) -> tuple[Any, dict[str, bytes]]:
    """A valid frame's header and each body field's bytes (all trajectories' values of it)."""
    header, body = split_frame(frame)
    p = sum(e[_P] for e in header.get("trajectories", ()))
    r = sum(e[_R] for e in header.get("trajectories", ()))
    t = sum(e[_T] for e in header.get("trajectories", ()))
    q = sum(e[_R] * e[_K] for e in header.get("trajectories", ()))
    e = _routed_entries(header.get("trajectories", ()))
    i = sum(e[_IX] for e in header.get("trajectories", ()))
    x = sum(e[_NX] * e[_DX] for e in header.get("trajectories", ()))
    ends = list(itertools.accumulate([0, 8 * r, 8 * t, 24 * i, 8 * r, 4 * p, 4 * r, 4 * q, 4 * q, 4 * x, 2 * e, r]))
    return header, {name: bytes(body[ends[i]:ends[i + 1]]) for i, name in enumerate(_BODY)}


def _packed(header: Any, arrays: dict[str, Any] | None = None) -> bytes:
    return pack_frame(header, [arrays[n] for n in _BODY] if arrays else [])


def _semantic(rng: random.Random, header: dict, arrays: dict[str, bytes]) -> bytes:
    """A well-laid-out message holding a value the learner cannot train on (in every trajectory
    for an array, in one for a header field)."""
    entry = rng.choice(header["trajectories"])
    r = sum(e[_R] for e in header["trajectories"])
    t = sum(e[_T] for e in header["trajectories"])
    q = sum(e[_R] * e[_K] for e in header["trajectories"])
    e = _routed_entries(header["trajectories"])
    i = sum(e[_IX] for e in header["trajectories"])
    x = sum(e[_NX] * e[_DX] for e in header["trajectories"])
    kind = rng.choice([0, 5, 6, 7, 8] + [1, 2, 3, 4] * bool(r) + [9] * bool(t) + [10, 11] * bool(q) + [12] * bool(e)
                      + [13, 14, 15] * bool(i))
    if kind == 0:
        old = entry[_P]
        entry[_P] = rng.choice([3, 0])
        start = sum(e[_P] for e in header["trajectories"][:header["trajectories"].index(entry)])
        arrays["prompt_ids"] = (arrays["prompt_ids"][:4 * start] + _array([-1] * entry[_P], "i")
                                + arrays["prompt_ids"][4 * (start + old):])
    elif kind == 1:
        arrays["response_ids"] = _array([rng.randint(-2**31, -1)] * r, "i")
    elif kind == 2:
        arrays["behavior_logprobs"] = _array([rng.choice([math.nan, math.inf])] * r, "d")
    elif kind == 3:
        arrays["loss_mask"] = _array([rng.randint(2, 255)] * r, "B")
    elif kind == 4:
        arrays["policy_version"] = _array([rng.randint(-2**63, -1)] * r, "q")
    elif kind == 5:
        entry[5] = rng.choice([math.nan, math.inf, -math.inf])
    elif kind == 6:
        entry[6] = rng.choice([{"acc": math.nan}, {"acc": -math.inf}, {"acc": "1"}, {1: 1.0}, {"acc": 1}])
    elif kind == 7:
        entry[0] = rng.choice(["", "7", "7/", "7/x", "7/-1", "7/1 ", "7/١"])
    elif kind == 8:
        entry[_R] += 1  # arrays one short (the routing one row short too)
        if entry[_T]:
            entry[_T] += 1
    elif kind == 9:
        arrays["teacher_logprobs"] = _array([rng.choice([math.nan, math.inf, -math.inf])] * t, "d")
    elif kind == 10:
        arrays["teacher_topk_ids"] = _array([rng.randint(-2**31, -1)] * q, "i")
    elif kind == 11:
        arrays["teacher_topk_logprobs"] = _array([rng.choice([math.nan, math.inf, -math.inf, 0.5, 2e-6])] * q, "f")
    elif kind == 12:  # one negative expert index among valid ones, anywhere in the message's routing
        values = list(struct.unpack(f"<{e}h", arrays["routed_experts"]))
        values[rng.randrange(e)] = rng.choice([-1, -(2**15), rng.randint(-(2**15), -1)])
        arrays["routed_experts"] = _array(values, "h")
    elif kind == 13:  # one non-finite pixel value among valid ones
        values = list(struct.unpack(f"<{x}f", arrays["observation_pixel_values"]))
        values[rng.randrange(x)] = rng.choice([math.nan, math.inf, -math.inf])
        arrays["observation_pixel_values"] = _array(values, "f")
    else:  # one grid value < 1 (kind 14), or one grown by 1: a patch count other than N (kind 15)
        values = list(struct.unpack(f"<{3 * i}q", arrays["observation_image_grid_thw"]))
        at = rng.randrange(3 * i)
        values[at] = rng.choice([0, -1, -(2**63)]) if kind == 14 else values[at] + 1
        arrays["observation_image_grid_thw"] = _array(values, "q")
    return _packed(header, arrays)


def malformed_frames(rng: random.Random, valid: list[list[bytes]]) -> list[Any]:
    """One generated message (its frames), usually malformed, from a valid one."""
    frames = rng.choice(valid)
    frame = frames[0]
    kind = rng.randrange(10)
    if kind == 0:
        return [bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))]
    if kind == 1:
        flipped = bytearray(frame)
        for _ in range(rng.randint(1, 8)):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        return [bytes(flipped)]
    if kind == 2:
        return [frame[: rng.randrange(len(frame))]]
    if kind == 3:
        return [frame + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))]
    if kind == 4:
        return rng.choice([[], [frame, frame], [frame, b""], [b"", b"", b""]])
    if kind == 5:
        return [_packed(_random_value(rng))]
    header, arrays = _split(frame)
    entries = header.get("trajectories")
    if kind == 6:  # one field of the header or of a trajectory's header replaced, deleted, or one added
        if entries and rng.random() < 0.6:
            entry = rng.choice(entries)
            action, i = rng.randrange(3), rng.randrange(len(entry))
            if action == 0:
                entry[i] = _random_value(rng)
            elif action == 1:
                del entry[i]
            else:
                entry.insert(i, _random_value(rng))
            return [_packed(header, arrays)]
        key = rng.choice(sorted(header))
        action = rng.randrange(3)
        if action == 0:
            header[key] = _random_value(rng)
        elif action == 1:
            del header[key]
        else:
            header[junk_text(rng, 6) or "x"] = _random_value(rng)
        return [_packed(header, arrays)]
    if header["kind"] == "group_closed" or not entries:  # kinds 7-9 need a trajectory
        header.update({"num_kept": rng.choice([-1, -2**63, True]), "group_id": rng.choice([1.5, "3", None, 3])})
        return [_packed(header)]
    if kind == 7:  # absurd or mismatched lengths
        entry, i = rng.choice(entries), rng.choice([_P, _R, _T, _K, _L, _KR, _NX, _DX, _IX])
        entry[i] = rng.choice([2**31, 2**63 - 1, 2**64 - 1, -1, entry[i] + 1, max(0, entry[i] - 1)])
        return [_packed(header, arrays)]
    if kind == 8:  # a field's bytes truncated, grown, doubled, or the header's fields as schema 3's map
        name = rng.choice(_BODY)
        data = arrays[name]
        if rng.random() < 0.2:
            header["trajectories"] = [dict(zip(range(len(e)), e)) for e in entries]
            return [_packed(header, arrays)]
        arrays[name] = rng.choice([data[: rng.randrange(len(data))] if data else b"\x00",
                                   data + bytes(rng.randint(1, 9)), data * 2 if data else b"\x01" * 3])
        return [_packed(header, arrays)]
    return [_semantic(rng, header, arrays)]


# Every MalformedMessageError names its reason; these are the kinds, by the start of the text.
MALFORMED_REASONS = [
    ("frames", r"message has \d+ frames"),
    ("too_short", r"message is \d+ bytes, too short for its header"),
    ("not_msgpack", r"message header is not valid msgpack"),
    ("not_a_map", r"message header is a msgpack \w+, expected a map"),
    ("schema", r"schema version"),
    ("kind", r"message kind .* with fields"),
    ("trajectories", r"trajectories message has group_id"),
    ("trajectory_header", r"trajectory header \d+ is a msgpack"),
    ("field_type", r"field '\w+' of trajectory header \d+ is \w+, expected"),
    ("negative_count", r"field 'num_prompt_tokens' or 'num_response_tokens' of trajectory header \d+ is negative"),
    ("teacher_count", r"field 'num_teacher_tokens' of trajectory header \d+ is -?\d+, expected 0 or num_response_tokens"),
    ("topk_count", r"field 'teacher_top_k' of trajectory header \d+ is -?\d+, expected >= 0"),
    ("routed_count", r"fields 'routed_layers' and 'routed_top_k' of trajectory header \d+ are -?\d+ and -?\d+, "
                     r"expected"),
    ("image_count", r"fields 'num_image_patches', 'patch_dim' and 'num_images' of trajectory header \d+ are "
                    r"-?\d+, -?\d+ and -?\d+, expected all 0"),
    ("reward_extras_type", r"reward_extras must map str -> float"),
    ("body_size", r"message body is \d+ bytes, expected \d+ for \d+ trajectories"),
    ("trajectory_id", r"trajectory_id .* is not '<group>/<index in group>'"),
    ("values", r"trajectory '.*': (no prompt token|\w+ holds|reward is|reward_extras .* are not finite|group_id)"),
    ("group_closed", r"group_closed message has"),
]


def malformed_reason(error: MalformedMessageError) -> str:
    text = str(error)
    for reason, pattern in MALFORMED_REASONS:
        if re.match(pattern, text, re.DOTALL):
            return reason
    raise AssertionError(f"a rejection without a known reason: {text[:300]}")


def assert_trainable(msg: Any) -> None:
    """What an accepted message must be: the checks the decoder promises."""
    if isinstance(msg, GroupClosed):
        assert type(msg.group_id) is int and type(msg.num_kept) is int and msg.num_kept >= 0
        return
    assert isinstance(msg, Trajectory)
    r = len(msg.response_ids)
    assert len(msg.behavior_logprobs) == len(msg.loss_mask) == len(msg.policy_version) == r
    assert len(msg.teacher_logprobs) in (0, r) and all(map(math.isfinite, msg.teacher_logprobs.tolist()))
    ids, lps = msg.teacher_topk_ids, msg.teacher_topk_logprobs
    assert ids.shape == lps.shape and (ids.shape == (0, 0) or (ids.shape[0] == r and ids.shape[1] >= 1))
    assert (ids.dtype, lps.dtype) == (np.dtype("<i4"), np.dtype("<f4"))
    assert (ids >= 0).all() and (np.isfinite(lps) & (lps <= 1e-6)).all()
    routed = msg.routed_experts
    assert routed.dtype == np.dtype("<i2") and not routed.flags.writeable
    assert routed.shape == (0, 0, 0) or (routed.shape[0] == len(msg.prompt_ids) + r - 1 and min(routed.shape) >= 1)
    assert (routed >= 0).all()
    pixels, grid = msg.observation_pixel_values, msg.observation_image_grid_thw
    assert (pixels.dtype, grid.dtype) == (np.dtype("<f4"), np.dtype("<i8"))
    assert not pixels.flags.writeable and not grid.flags.writeable
    assert (pixels.shape, grid.shape) == ((0, 0), (0, 3)) or (min(pixels.shape) >= 1 and grid.shape[1] == 3)
    assert np.isfinite(pixels).all() and (grid >= 1).all()
    assert pixels.shape[0] == sum(t * h * w for t, h, w in grid.tolist())
    assert {name: getattr(msg, name).dtype for name in PER_TOKEN_DTYPES} == PER_TOKEN_DTYPES
    assert len(msg.prompt_ids) >= 1 and min(msg.prompt_ids.tolist() + msg.response_ids.tolist()) >= 0
    assert not any(math.isnan(x) or x == math.inf for x in msg.behavior_logprobs.tolist())
    assert set(msg.loss_mask) <= {0, 1} and all(v >= 0 for v in msg.policy_version)
    assert math.isfinite(msg.reward) and all(math.isfinite(v) for v in msg.reward_extras.values())
    assert all(type(k) is str and type(v) is float for k, v in msg.reward_extras.items())
    int(msg.trajectory_id.rsplit("/", 1)[1])  # how the learner orders a group


def decode_outcome(frames: list[Any]) -> tuple[str, Any]:
    """``("accepted", messages)``, ``("malformed", reason)`` (nothing of it accepted) or
    ``("partly accepted", reason)`` (a group message with trajectories refused alone); anything
    else raised fails the test."""
    try:
        messages, rejected = decode_messages(frames)
    except MalformedMessageError as e:
        return "malformed", malformed_reason(e)
    for msg in messages:
        assert_trainable(msg)
    if rejected:
        return ("partly accepted" if messages else "malformed"), malformed_reason(rejected[0])
    return "accepted", messages


def random_group(rng: random.Random) -> TrajectoryGroup:
    gid = rng.randint(0, 10**6)
    return TrajectoryGroup(gid, [random_trajectory(rng, f"{gid}/{i}", gid) for i in range(rng.randint(0, 4))])


def test_fuzz_decode_never_raises_anything_but_malformed(tmp_path):
    outcomes: collections.Counter[str] = collections.Counter()
    num = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        valid = [encode_message(random_trajectory(rng)) for _ in range(40)]
        valid += [encode_message(random_group(rng)) for _ in range(15)]
        valid += [encode_message(GroupClosed(rng.randint(0, 99), rng.randint(0, 8))) for _ in range(5)]
        for frames in valid:
            assert decode_outcome(frames)[0] == "accepted"
        for _ in range(2000):
            kind, what = decode_outcome(malformed_frames(rng, valid))
            outcomes[{"accepted": "accepted (still valid)", "malformed": what}.get(kind, f"{kind}: {what}")] += 1
            num += 1
    # The generator reaches every reason (a reason never met would be an untested branch).
    assert {reason for reason, _ in MALFORMED_REASONS} <= set(outcomes)
    report(tmp_path, "zmq_decode", {"seeds": list(SEEDS), "messages": num, "outcomes": dict(outcomes)})


def test_fuzz_zmq_pair_into_replay_buffer_stores_each_valid_trajectory_once(tmp_path):
    """Valid trajectories, re-sent duplicates, ``GroupClosed`` (some groups lose samples) and
    malformed messages, shuffled, through a real PUSH/PULL pair routed into a ``ReplayBuffer`` as
    the async loop routes them: malformed counted, duplicates dropped and counted, every valid
    distinct trajectory stored once and served once."""
    n = 4
    rng = random.Random(SEEDS[0])
    valid_ids, messages, closed = set(), [], {}
    for g in range(150):
        kept = n if rng.random() < 0.7 else rng.randint(0, n - 1)
        for i in rng.sample(range(n), kept):
            traj = random_trajectory(rng, f"{g}/{i}", g)
            valid_ids.add(traj.trajectory_id)
            messages.append(("valid", encode_message(traj)))
        if kept < n or rng.random() < 0.3:  # a full group may be closed too
            closed[g] = kept
            messages.append(("closed", encode_message(GroupClosed(g, kept))))
    originals = [m for m in messages if m[0] == "valid"]
    messages += [("duplicate", frames) for _, frames in rng.choices(originals, k=200)]
    messages += [("closed duplicate", encode_message(GroupClosed(g, k))) for g, k in rng.sample(sorted(closed.items()), 10)]
    pool = [frames for _, frames in originals[:50]]
    bad = 0
    while bad < 300:
        frames = malformed_frames(rng, pool)
        if frames and decode_outcome(frames)[0] == "malformed":  # ZeroMQ cannot send a 0-frame message
            messages.append(("malformed", frames))
            bad += 1
    rng.shuffle(messages)
    sent = collections.Counter(kind for kind, _ in messages)

    receiver = ZmqTrajectoryReceiver(hwm=64)
    buffer = ReplayBuffer(group_size=n, max_staleness=10)

    def send_all():
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 10_000)
        sock.connect(receiver.address)
        for _, frames in messages:
            sock.send_multipart(frames)
        sock.close()

    sender = threading.Thread(target=send_all, daemon=True)
    sender.start()
    deadline = time.monotonic() + 120  # only against a hang
    while receiver.num_received + receiver.num_malformed < len(messages):
        assert time.monotonic() < deadline, (receiver.num_received, receiver.num_malformed, len(messages))
        for msg in receiver.recv_many(512, timeout_s=0.1):
            if isinstance(msg, GroupClosed):
                buffer.close_group(msg.group_id, msg.num_kept)
            else:
                buffer.add(msg)
    sender.join(timeout=30)
    receiver.close()
    assert receiver.num_malformed == sent["malformed"]
    assert buffer.dropped == {"duplicate": sent["duplicate"], "late": 0, "stale": 0, "abandoned": 0}
    assert buffer.counters["added"] == len(valid_ids) == sent["valid"]
    rejected_groups = sum(1 for k in closed.values() if k == 0)
    assert buffer.dropped_groups["rejected"] == rejected_groups
    assert buffer.counters["rejected_samples"] == sum(n - k for k in closed.values())
    groups = buffer.get_groups(150 - rejected_groups, current_version=5)
    served = [t.trajectory_id for g in groups for t in g]
    assert sorted(served) == sorted(valid_ids)  # each valid distinct trajectory exactly once
    assert buffer.metrics()["buffer/num_samples"] == 0
    report(tmp_path, "zmq_pair", {"seed": SEEDS[0], "messages": len(messages), "sent": dict(sent),
                                  "malformed_counted": receiver.num_malformed,
                                  "duplicates_dropped": buffer.dropped["duplicate"], "stored": len(served)})


# -------------------------------------------------------------------------- the whole pipeline
FUZZ_REWARD = '''
import math, os, zlib

from async_rl.rewards import arithmetic_reward

LOG = {log!r}
# (kind, what the function returns); "raise" raises. A fixed share of samples, chosen by a hash
# of the response and the answer, gets one of these instead of its reward.
BAD = [("raise", None), ("none", None), ("score_none", {{"score": None, "acc": 0.0}}), ("nan", math.nan),
       ("inf", math.inf), ("str", "1.0"), ("list", [1.0]), ("no_score", {{"acc": 1.0}})]


def reward(data_source, response_text, ground_truth, extra_info):
    h = zlib.crc32(f"{{response_text}}|{{ground_truth}}".encode())
    if h % 100 >= 25:
        return arithmetic_reward(data_source, response_text, ground_truth, extra_info)
    kind, value = BAD[h // 100 % len(BAD)]
    with open(LOG, "a") as f:  # one short line per call: appends from several processes stay whole
        f.write(f"{{os.getpid()}} {{os.getppid()}} {{kind}}\\n")
    if kind == "raise":
        raise RuntimeError("judge unavailable")
    return value
'''

NUM_INJECTED = 6
"""Malformed messages, and duplicates of received trajectories, pushed into the trainer's receiver."""


class Injector:
    """Pushes extra messages into the trainer's trajectory receiver while the run goes on: after
    each of the first ``NUM_INJECTED`` trajectories the receiver reads, a copy of its frames (a
    duplicate) and one of ``malformed``, through a PUSH socket of its own (made on the receiver's
    thread, where it is used)."""

    def __init__(self, malformed: list[list[bytes]], group_size: int) -> None:
        self.malformed = list(malformed)
        self.group_size = group_size
        self.num_duplicates = 0
        self.num_malformed = 0
        self.foreign: collections.Counter[str] = collections.Counter()
        self._foreign_frames: set[bytes] = set()
        self.sock: zmq.Socket | None = None

    def foreign_messages(self, traj: Trajectory) -> list[tuple[str, Any]]:
        """Well-formed messages that no generator of the run sends, made from a real trajectory,
        each with the reason the loop must refuse it for (``Intake.route``)."""
        g, n = traj.group_id, self.group_size
        return [
            ("unknown_group", dataclasses.replace(traj, group_id=10**9, trajectory_id=f"{10**9}/0")),
            ("trajectory_id_of_another_group", dataclasses.replace(traj, trajectory_id=f"{g + 1}/0")),
            ("index_outside_group", dataclasses.replace(traj, trajectory_id=f"{g}/{n + 3}")),
            # Its own id: refused before the buffer sees it, so the id stays unseen.
            ("future_policy_version", dataclasses.replace(traj, policy_version=[10**6] * len(traj.policy_version))),
            ("contradicting_group_closed", GroupClosed(g, n + 1)),
        ]

    def wrap(self, receiver: ZmqTrajectoryReceiver) -> None:
        recv_frames = receiver._recv_frames

        def recv_and_inject(timeout_s):
            frames = recv_frames(timeout_s)
            if frames is not None and self.num_duplicates < NUM_INJECTED:
                try:
                    msg = next((m for m in decode_messages(frames)[0] if isinstance(m, Trajectory)), None)
                except MalformedMessageError:
                    msg = None
                if msg is not None and bytes(frames[0]) not in self._foreign_frames:
                    if self.sock is None:
                        self.sock = zmq.Context.instance().socket(zmq.PUSH)
                        self.sock.connect(receiver.address)
                        for reason, foreign in self.foreign_messages(msg):
                            encoded = encode_message(foreign)
                            self._foreign_frames.add(bytes(encoded[0]))  # not duplicated in turn
                            self.sock.send_multipart(encoded)
                            self.foreign[reason] += 1
                    # The duplicate: one trajectory of the message (the run sends groups), alone.
                    self.sock.send_multipart(encode_message(msg))
                    self.sock.send_multipart(self.malformed[self.num_malformed])
                    self.num_duplicates += 1
                    self.num_malformed += 1
            return frames

        receiver._recv_frames = recv_and_inject


@pytest.mark.slow
def test_fuzz_async_run_survives_bad_rows_rewards_and_messages(tmp_path, ray_session, monkeypatch):
    """A real async run fed seeded malformed rows and over-long prompts (skipped), reward outputs
    that raise or are no number (rejected), and malformed and duplicated ZeroMQ messages: it
    finishes, each rejection is in the summary under its reason with the right count, the
    ledger balances, and every trained trajectory is trained once."""
    import async_rl.loops.async_loop as async_loop
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import read_rows
    from async_rl.trainer import train
    from pipeline_helpers import small_run_cfg

    rng = random.Random(SEEDS[0])
    lines = [json.dumps(row).encode() for row in read_rows(resolve("builtin:arithmetic/train"))]
    bad_rows = collections.Counter()
    for kind in DATASET_KINDS:
        for _ in range(2):
            lines.insert(rng.randrange(len(lines) + 1), _bad_row(rng, kind))
            bad_rows[kind] += 1
    data = tmp_path / "train.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    log = tmp_path / "reward_calls.log"
    reward_file = tmp_path / "fuzz_reward.py"
    reward_file.write_text(FUZZ_REWARD.format(log=str(log)))

    pool = [encode_message(random_trajectory(rng, f"{g}/0", g)) for g in range(8)]
    malformed = []
    while len(malformed) < NUM_INJECTED:
        frames = malformed_frames(rng, pool)
        if frames and decode_outcome(frames)[0] == "malformed":
            malformed.append(frames)
    injector = Injector(malformed, group_size=4)
    make_transport = async_loop.make_transport

    def make_transport_with_injector(*args, **kwargs):
        receiver, factory = make_transport(*args, **kwargs)
        injector.wrap(receiver)
        return receiver, factory

    trained: list[str] = []
    learn_on = async_loop.learn_on

    def learn_on_recording(ctx, step, ro, **kwargs):
        trained.extend(t.trajectory_id for t in ro.trajectories)
        return learn_on(ctx, step, ro, **kwargs)

    monkeypatch.setattr(async_loop, "make_transport", make_transport_with_injector)
    monkeypatch.setattr(async_loop, "learn_on", learn_on_recording)
    try:
        summary = train(small_run_cfg(tmp_path, "fuzz", "trainer.mode=async", f"data.train_files=[{data}]",
                                      "data.on_bad_row=skip", f"reward.fn={reward_file}:reward",
                                      "reward.on_error=reject"))
    finally:
        if injector.sock is not None:
            injector.sock.close(linger=0)

    # Dataset: every bad row written is a skipped row under its reason.
    assert summary["data/rejected_prompts_too_long"] == bad_rows["too_long"]
    assert summary["data/rejected_rows"] == sum(bad_rows.values()) - bad_rows["too_long"]
    for kind, n in bad_rows.items():
        if kind != "too_long":
            assert summary[f"data/rejected_rows_{kind}"] == n
    # Rewards: every bad outcome of the generator actors (not the trainer's own evaluation) is a
    # counted rejection under reward.on_error=reject.
    # The reward runs in worker processes: the trainer's own (evaluation) are this process's children.
    calls = collections.Counter(kind for pid, ppid, kind in (line.split() for line in log.read_text().splitlines())
                                if os.getpid() not in (int(pid), int(ppid)))
    no_reward = calls["none"] + calls["score_none"]
    errors = sum(calls.values()) - no_reward
    assert errors > 0 and no_reward > 0
    assert (summary["reward/errors"], summary["reward/no_reward"], summary["reward/rejected"]) == (
        errors, no_reward, errors + no_reward)
    # Transport: each injected message counted, no real one refused.
    assert injector.num_malformed == injector.num_duplicates == NUM_INJECTED
    assert summary["pipeline/malformed_messages"] == NUM_INJECTED
    assert summary["pipeline/dropped_duplicate_samples"] == NUM_INJECTED
    # Well-formed messages no generator of the run sends: refused, each under its reason.
    assert sum(injector.foreign.values()) == summary["pipeline/refused_messages"] == 5
    for reason, n in injector.foreign.items():
        assert summary[f"pipeline/refused_messages_{reason}"] == n
    # The ledger balances, and each trained trajectory was trained once.
    ledger = {k: summary[f"pipeline/{k}"] for k in ("trained", "rejected", "stale", "abandoned",
                                                     "dynamic_sampling_dropped", "ready_unused", "partial_at_exit",
                                                     "queued_at_exit", "spread_partly_trained_at_exit",
                                                     "unstarted_or_in_engine_at_exit")}
    assert ledger["unstarted_or_in_engine_at_exit"] >= 0
    assert sum(ledger.values()) == summary["pipeline/dispatched"]
    assert summary["pipeline/trained"] == 12 and summary["last_step"] == 3
    assert len(trained) == len(set(trained)) > 0
    assert len({t.rsplit("/", 1)[0] for t in trained}) == 12
    report(tmp_path, "async_run", {
        "seed": SEEDS[0], "dataset_rows_rejected": {**{k: n for k, n in bad_rows.items()}},
        "reward_bad_outcomes": dict(calls), "reward_rejected": summary["reward/rejected"],
        "reward_scored": summary["reward/scored"], "malformed_messages": summary["pipeline/malformed_messages"],
        "duplicates_dropped": summary["pipeline/dropped_duplicate_samples"],
        "refused_messages": {k: v for k, v in summary.items() if k.startswith("pipeline/refused_messages_")},
        "trained_samples": len(trained),
        "ledger": {"dispatched": summary["pipeline/dispatched"], **ledger}})
