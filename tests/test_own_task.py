"""A user's own task: verl-layout jsonl rows, the warm start's reference field, a reward function
that fails (always, or sometimes), and the example in ``examples/own_task``."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from async_rl.cli import main
from async_rl.config import ConfigError, load_config
from async_rl.data.dataset import PromptDataset, field_value
from async_rl.loops.base import DEFAULT_RESPONSE_FIELDS, WarmStartConfig
from async_rl.rewards import RewardScorer, check_rewards_work, get_reward_fn
from async_rl.trainer import train

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_task"

ALWAYS_RAISES = '''
def score(data_source, response_text, ground_truth, extra_info):
    return parse(response_text)


def parse(text):
    raise RuntimeError("reward service down")
'''

# Fails on every third call, in call order: which calls fail does not depend on what the model writes.
EVERY_THIRD_RAISES = '''
_calls = [0]


def score(data_source, response_text, ground_truth, extra_info):
    _calls[0] += 1
    if _calls[0] % 3 == 0:
        raise ValueError(f"call {_calls[0]} failed")
    return float(response_text.strip() == ground_truth)
'''


def _row(i: int, **fields) -> dict:
    return {"data_source": "mine", "prompt": [{"role": "user", "content": f"{i}+1="}], **fields}


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(tmp_path, *extra) -> list[str]:
    """Overrides of a tiny sync run on the built-in task (2 prompts x 2 samples a step)."""
    return [f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2",
            "trainer.prompts_per_step=2", "trainer.samples_per_prompt=2", "trainer.eval_every_steps=0",
            "trainer.warm_start.steps=0", "data.val_files=[]", "trainer.export_model=false",
            "trainer.checkpoint.save_at_exit=false", "logging.progress=false", *extra]


def _line_of(source: str, start: str) -> int:
    """1-based line number of the first line of ``source`` that starts with ``start`` once indented."""
    return next(i for i, line in enumerate(source.splitlines(), 1) if line.strip().startswith(start))


def _steps(tmp_path) -> list[dict]:
    path = tmp_path / "run" / "metrics.jsonl"
    lines = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    return [l for l in lines if l["step"] >= 1 and "policy/version" in l]


# ------------------------------------------------------------------------ warm-start reference field
def test_field_value_walks_dotted_paths():
    row = {"answer": "7", "reward_model": {"ground_truth": 82}, "extra_info": {"answer": None}}
    assert field_value(row, "reward_model.ground_truth") == 82
    assert field_value(row, "answer") == "7"
    assert field_value(row, "extra_info.answer") is None          # stored None
    assert field_value(row, "extra_info.missing") is None
    assert field_value(row, "answer.deeper") is None              # a string is not a mapping


def test_warm_start_reads_any_field_of_a_verl_row(tmp_path, tiny_tokenizer, monkeypatch):
    """The default reads ``extra_info.answer`` where a row has it, else ``reward_model.ground_truth``;
    a set ``response_field`` reads that path, a top-level key included; the warm start trains on
    exactly that text followed by EOS."""
    import async_rl.step.evaluation as evaluation

    rows = [_row(0, reward_model={"style": "rule", "ground_truth": "1"}, extra_info={"answer": "one"}, answer="I"),
            _row(1, reward_model={"style": "rule", "ground_truth": "2"}, extra_info={"index": 1}, answer="II")]
    path = _jsonl(tmp_path / "mine.jsonl", rows)

    def load(cfg: WarmStartConfig) -> PromptDataset:
        return PromptDataset([str(path)], tiny_tokenizer, 64, reference_fields=cfg.reference_fields())

    default = load(WarmStartConfig(steps=1))
    assert [p.reference for p in default] == ["one", "2"]
    assert [p.reference_field for p in default] == list(DEFAULT_RESPONSE_FIELDS)
    assert default.reference_sources == {"extra_info.answer": 1, "reward_model.ground_truth": 1}
    assert [p.reference for p in load(WarmStartConfig(steps=1, response_field="reward_model.ground_truth"))] == ["1", "2"]
    top = load(WarmStartConfig(steps=1, response_field="answer"))
    assert [p.reference for p in top] == ["I", "II"]
    # Without a warm start no row needs a reference, and none is read.
    assert [p.reference for p in load(WarmStartConfig(steps=0))] == [None, None]

    seen = []
    monkeypatch.setattr(evaluation, "collate", lambda trajs, pad, images=None: seen.extend(trajs) or None)

    class Learner:
        def sft_step(self, batch, lr):
            return {"sft/loss": 0.0}

    ws = WarmStartConfig(steps=2, batch_size=4, response_field="answer")
    evaluation.warm_start(Learner(), top, tiny_tokenizer, ws, tiny_tokenizer.eos_token_id, 0, lambda msg: None)
    assert len(seen) == 8
    by_uid = {p.uid: p.reference for p in top}
    for t in seen:
        assert t.response_ids[-1] == tiny_tokenizer.eos_token_id
        assert tiny_tokenizer.decode(t.response_ids[:-1]) == by_uid[t.prompt_uid]


@pytest.mark.parametrize("field, named", [
    (None, "no 'extra_info.answer' or 'reward_model.ground_truth' field"),
    ("extra_info.solution", "no 'extra_info.solution' field"),
])
def test_row_without_the_reference_stops_before_training(tmp_path, field, named):
    rows = [_row(0, reward_model={"ground_truth": "1"}, extra_info={"solution": "1"}), _row(1, extra_info={})]
    path = _jsonl(tmp_path / "mine.jsonl", rows)
    extra = [] if field is None else [f"trainer.warm_start.response_field={field}"]
    cfg = load_config(ROOT / "configs/default.yaml", _args(tmp_path, f"data.train_files=[{path}]",
                                                           "trainer.warm_start.steps=5", "reward.fn=arithmetic", *extra))
    with pytest.raises(ValueError) as err:
        train(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: row 1 (0-based): {named}")
    assert "trainer.warm_start.response_field" in message and "trainer.warm_start.steps=0" in message
    # Refused while loading: no run directory, nothing trained.
    assert not (tmp_path / "run").exists()
    # The same rows train without a warm start (no reference needed).
    assert train(load_config(ROOT / "configs/default.yaml", _args(
        tmp_path, f"data.train_files=[{path}]", "reward.fn=arithmetic", "trainer.total_steps=1", *extra)))["last_step"] == 1


@pytest.mark.parametrize("field", ["", "reward_model.", ".answer", "a..b"])
def test_malformed_response_field_is_a_config_error(field):
    with pytest.raises(ConfigError, match="trainer.warm_start.response_field must be a dotted path"):
        load_config(ROOT / "configs/default.yaml", [f"trainer.warm_start.response_field='{field}'"])


# ---------------------------------------------------------------------------- failing reward functions
@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_always_raising_reward_stops_at_the_first_step(tmp_path, capsys, caplog, on_error):
    """Exit status 1, one error line naming the count, the user's file and line and the exception;
    its traceback logged once, not per sample; no step trained."""
    f = tmp_path / "always.py"
    f.write_text(ALWAYS_RAISES)
    with caplog.at_level(logging.WARNING, logger="async_rl.rewards.scorer"):
        status = main(["train", "--config", str(ROOT / "configs/default.yaml"),
                       *_args(tmp_path, f"reward.fn={f}:score", f"reward.on_error={on_error}")])
    assert status == 1
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("async-rl:")]
    assert len(errors) == 1
    assert errors[0].startswith(
        "async-rl: error: step 1: the reward function failed on every call (4 of 4); first error: "
        f"score ({f}:{_line_of(ALWAYS_RAISES, 'raise')} in parse): raised RuntimeError: reward service down")
    # The function runs in a reward worker process: its traceback comes back as text, logged once.
    tracebacks = [r.getMessage() for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]
    assert len(tracebacks) == 1 and "RuntimeError: reward service down" in tracebacks[0]
    assert _steps(tmp_path) == []


def test_always_raising_reward_under_dynamic_sampling_names_the_reward(tmp_path):
    """DAPO's dynamic sampling finds no group with reward spread when every reward failed; the
    error names the reward function, not the sampling budget."""
    f = tmp_path / "always.py"
    f.write_text(ALWAYS_RAISES)
    cfg = load_config(ROOT / "configs/default.yaml", _args(
        tmp_path, f"reward.fn={f}:score", "algorithm.dynamic_sampling=true", "algorithm.max_generation_rounds=2"))
    with pytest.raises(ValueError, match=r"^step 1: the reward function failed on every call \((\d+) of \1\); "
                                         r"first error: score \(.*\): raised RuntimeError: reward service down"):
        train(cfg)


@pytest.mark.slow
def test_always_raising_reward_stops_async_mode_at_the_first_step(tmp_path):
    """Async mode scores in the generator actors; under ``reward.on_error=reject`` no group ever
    completes, so the first step must notice while it waits (not after the 600 s stall timeout)."""
    f = tmp_path / "always.py"
    f.write_text(ALWAYS_RAISES)
    cfg = load_config(ROOT / "configs/default.yaml", _args(
        tmp_path, f"reward.fn={f}:score", "reward.on_error=reject", "trainer.mode=async", "generator.num_workers=1"))
    where = re.escape(f"{f}:{_line_of(ALWAYS_RAISES, 'raise')} in parse")
    with pytest.raises(ValueError, match=r"^step 1: the reward function failed on every call \((\d+) of \1\); "
                                         rf"first error: score \({where}\): raised RuntimeError: reward service down"):
        train(cfg)


def test_always_raising_reward_stops_at_the_step_0_evaluation(tmp_path, capsys):
    """With a warm start, the evaluation before it only warns (a model before its warm start may
    write anything); the step-0 evaluation after it stops the run, before any RL step."""
    f = tmp_path / "always.py"
    f.write_text(ALWAYS_RAISES)
    status = main(["train", "--config", str(ROOT / "configs/default.yaml"),
                   *_args(tmp_path, f"reward.fn={f}:score", "data.val_files=[builtin:arithmetic/test]",
                          "data.val_max_prompts=3", "trainer.warm_start.steps=1", "trainer.warm_start.batch_size=4")])
    out, err = capsys.readouterr()
    assert status == 1
    assert "warning: the reward function failed on every call of this evaluation" in out
    errors = [l for l in err.splitlines() if l.startswith("async-rl:")]
    assert len(errors) == 1 and errors[0].startswith(
        "async-rl: error: step 0 evaluation: the reward function failed on every call (3 of 3); first error: score (")
    assert _steps(tmp_path) == []


def test_sometimes_failing_reward_is_counted_per_step_and_summed_up(tmp_path, capsys, caplog):
    f = tmp_path / "every_third.py"
    f.write_text(EVERY_THIRD_RAISES)
    with caplog.at_level(logging.WARNING, logger="async_rl.rewards.scorer"):
        summary = train(load_config(ROOT / "configs/default.yaml", _args(tmp_path, f"reward.fn={f}:score",
                                                                         "trainer.total_steps=3")))
    calls_per_step = 2 * 2
    steps = _steps(tmp_path)
    assert [s["reward/scored"] for s in steps] == [calls_per_step] * 3
    # Calls are numbered in order over the run; step k makes calls k*4+1 .. k*4+4.
    expected = [sum(1 for c in range(k * calls_per_step + 1, (k + 1) * calls_per_step + 1) if c % 3 == 0)
                for k in range(3)]
    assert [s["reward/errors"] for s in steps] == expected
    assert summary["reward/errors"] == sum(expected) and summary["reward/scored"] == 3 * calls_per_step
    line = (f"reward function: {sum(expected)} of {3 * calls_per_step} training reward calls failed; "
            f"first error: score ({f}:{_line_of(EVERY_THIRD_RAISES, 'raise')}): raised ValueError: call 3 failed")
    assert capsys.readouterr().out.count(line) == 1
    assert summary["reward/first_error"] == line.split("first error: ")[1]
    assert len([r for r in caplog.records if "Traceback (most recent call last)" in r.getMessage()]) == 1


def test_check_rewards_work_needs_every_call_failed():
    check_rewards_work({"reward/scored": 0.0, "reward/errors": 0.0}, None, "step 1")      # no calls: nothing to judge
    check_rewards_work({"reward/scored": 8.0, "reward/errors": 7.0}, "x", "step 1")
    with pytest.raises(ValueError, match=r"^step 1: the reward function failed on every call \(8 of 8\); first error: x\."):
        check_rewards_work({"reward/scored": 8.0, "reward/errors": 8.0}, "x", "step 1")


# ------------------------------------------------------------------------------- examples/own_task
def test_own_task_example_loads_and_scores(tmp_path, tiny_tokenizer):
    """The committed files are what make_data.py writes; they load as a verl dataset whose warm
    start reads the ground truth; every prompt fits the default config's prompt limit; the
    reward scores a right, a partly right and a wrong answer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("own_task_make_data", EXAMPLE / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.main(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), f"rerun make_data.py: {name} differs"

    max_prompt_tokens = load_config(ROOT / "configs/default.yaml").data.max_prompt_tokens
    train_ds = PromptDataset([str(EXAMPLE / "train.jsonl")], tiny_tokenizer, max_prompt_tokens,
                             reference_fields=WarmStartConfig(steps=1).reference_fields())
    test_ds = PromptDataset([str(EXAMPLE / "test.jsonl")], tiny_tokenizer, max_prompt_tokens)
    assert (len(train_ds), len(test_ds)) == (40, 20)
    assert train_ds.num_rejected_too_long == 0 and test_ds.num_rejected_too_long == 0
    assert train_ds.reference_sources == {"reward_model.ground_truth": 40}
    words = {split: [p.extra_info["word"] for p in ds] for split, ds in (("train", train_ds), ("test", test_ds))}
    assert not set(words["train"]) & set(words["test"])
    for p in train_ds:
        assert p.reference == p.ground_truth == p.extra_info["word"].upper()
        assert p.messages == [{"role": "user", "content": f"Uppercase: {p.extra_info['word']}"}]

    score = RewardScorer(get_reward_fn(f"{EXAMPLE / 'reward.py'}:score")).score
    p = test_ds.prompts[0]
    word, truth = p.extra_info["word"], p.ground_truth
    right = score(p.data_source, f" {truth}", truth, p.extra_info)
    assert (right.score, right.extras, right.error) == (1.0, {"acc": 1.0}, None)
    partly = score(p.data_source, truth[:2] + "#", truth, p.extra_info)
    assert (partly.score, partly.extras["acc"]) == (pytest.approx(0.5 * 2 / 3), 0.0)
    wrong = score(p.data_source, word, truth, p.extra_info)
    assert (wrong.score, wrong.extras["acc"]) == (0.0, 0.0)
