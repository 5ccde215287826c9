"""The model-based reward (``reward.model``): scores equal a plain HF forward pass, batching and
truncation change nothing but what they should, it sums with a function reward, its config keys are
validated, and short sync and async runs train on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from async_rl.buffers.trajectory import Trajectory
from async_rl.config import ConfigError, load_config
from async_rl.data.builtin import resolve
from async_rl.rewards.config import RewardConfig
from async_rl.rewards.model import ModelInput, RewardModel
from async_rl.step.rollout import GroupRequest, make_scorer, sample_groups

ROOT = Path(__file__).resolve().parents[1]

ITEMS = [
    ModelInput([{"role": "user", "content": "37+45="}], "37+45=", "82"),
    ModelInput([{"role": "user", "content": "1+1="}], "1+1=", "a much longer wrong answer: 3"),
    ModelInput([], "2+2=", "4"),
    ModelInput([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "9+9="}], "9+9=", "18"),
]


@pytest.fixture(scope="module")
def classifier_dir() -> str:
    return resolve("builtin:tiny-qwen2-reward")


@pytest.fixture(scope="module")
def judge_dir() -> str:
    return resolve("builtin:tiny-qwen2")


def _hf_classifier_score(path: str, text: str) -> float:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return float(model(torch.tensor([tok(text)["input_ids"]])).logits[0, 0])


def test_classifier_scores_equal_a_direct_forward_pass(classifier_dir):
    rm = RewardModel(classifier_dir, "classifier", batch_size=4)
    scores, truncated = rm.score(ITEMS)
    assert truncated == 0
    # Chat messages are rendered with the reward model's own template; no messages: plain text.
    chat = rm.tokenizer.apply_chat_template([*ITEMS[0].messages, {"role": "assistant", "content": "82"}],
                                            tokenize=False)
    assert chat.startswith("<|im_start|>user\n37+45=<|im_end|>") and "assistant\n82" in chat
    assert rm.render(ITEMS[2]) == "2+2=4"
    direct = [_hf_classifier_score(classifier_dir, rm.render(item)) for item in ITEMS]
    assert scores == pytest.approx(direct, abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == len(scores), "distinct inputs score differently"


def test_batched_equals_unbatched(classifier_dir, judge_dir):
    for path, kind in ((classifier_dir, "classifier"), (judge_dir, "judge")):
        batched = RewardModel(path, kind, batch_size=3, judge_template=RewardConfig.judge_template).score(ITEMS)[0]
        single = RewardModel(path, kind, batch_size=1, judge_template=RewardConfig.judge_template).score(ITEMS)[0]
        assert batched == pytest.approx(single, abs=1e-5), kind


def test_judge_scores_the_probability_of_its_token(judge_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rm = RewardModel(judge_dir, "judge", judge_template="Q: {prompt} A: {response} ok?", judge_token=" yes")
    scores, _ = rm.score(ITEMS[:2])
    tok = AutoTokenizer.from_pretrained(judge_dir)
    model = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    token = tok(" yes", add_special_tokens=False)["input_ids"][0]
    for item, score in zip(ITEMS[:2], scores):
        text = f"Q: {item.prompt_text} A: {item.response} ok?"
        with torch.no_grad():
            logits = model(torch.tensor([tok(text)["input_ids"]])).logits[0, -1]
        assert score == pytest.approx(float(torch.softmax(logits, -1)[token]), abs=1e-6)
        assert 0.0 < score < 1.0


def test_truncation_keeps_the_end_and_is_counted(classifier_dir):
    rm = RewardModel(classifier_dir, "classifier", max_tokens=12)
    long_prompt = ModelInput([], "x" * 40 + "1+1=", "2")
    scores, truncated = rm.score([long_prompt, ModelInput([], "1=", "2")])
    assert truncated == 1 and rm.num_truncated == 1
    ids = rm.tokenizer(rm.render(long_prompt))["input_ids"][-12:]
    assert rm.tokenizer.decode(ids) == "x" * 7 + "1+1=2"
    assert scores[0] == pytest.approx(_hf_classifier_score(classifier_dir, rm.tokenizer.decode(ids)), abs=1e-5)


class _FakeEngine:
    """Finishes every sample at once with fixed response tokens (no model)."""

    def __init__(self, responses):
        self.responses = responses

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        from types import SimpleNamespace

        for i in range(len(prompts)):
            for j in range(n):
                ids = self.responses[(i * n + j) % len(self.responses)]
                on_sample(i, j, SimpleNamespace(response_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop",
                                                policy_version=[0] * len(ids)))


def _roll(scorer, tokenizer, responses):
    requests = [GroupRequest(group_id=g, prompt_ids=tokenizer("1+1=")["input_ids"], prompt_uid=str(g),
                             data_source="arithmetic", ground_truth="2", extra_info={}, n=2, seed=None,
                             messages=[{"role": "user", "content": "1+1="}]) for g in range(3)]
    engine = _FakeEngine([tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses])
    out: list[Trajectory] = []
    closed = []
    sample_groups(engine, requests, None, tokenizer, scorer, None, out.append, lambda r, k: closed.append(k))
    return sorted(out, key=lambda t: t.trajectory_id), closed


def test_function_plus_weighted_model_reward(classifier_dir):
    rm = RewardModel(classifier_dir, "classifier", batch_size=2)
    tok = rm.tokenizer
    responses = ["2", "3", "two"]
    fn_only, _ = _roll(make_scorer(RewardConfig(fn="arithmetic"), "zero"), tok, responses)
    summed = make_scorer(RewardConfig(fn="arithmetic", model=classifier_dir, model_weight=0.5, model_batch_size=2),
                         "zero", rm.score)
    both, closed = _roll(summed, tok, responses)
    model_only, _ = _roll(make_scorer(RewardConfig(model=classifier_dir), "zero", rm.score), tok, responses)
    assert closed == [2, 2, 2] and len(both) == 6
    for f, b, m in zip(fn_only, both, model_only):
        expected = rm.score([ModelInput([{"role": "user", "content": "1+1="}], "1+1=", b.response_text)])[0][0]
        assert b.reward_extras["model_score"] == pytest.approx(expected, abs=1e-5)
        assert b.reward == pytest.approx(f.reward + 0.5 * expected, abs=1e-5)
        assert m.reward == pytest.approx(expected, abs=1e-5)
        # Accuracy stays the verifiable function's; the model alone has none.
        assert b.reward_extras["acc"] == f.reward_extras.get("acc", float(f.reward >= 1.0))
        assert math.isnan(m.reward_extras["acc"])
    assert {f.reward for f in fn_only} == {0.0, 1.0}
    counts = summed.pop_metrics()
    assert counts["reward/scored"] == 6 and counts["reward/model_scored"] == 6
    assert counts["reward/model_errors"] == 0 and counts["reward/model_truncated"] == 0


@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_model_errors_follow_on_error(classifier_dir, on_error):
    rm = RewardModel(classifier_dir, "classifier")

    def broken(items):
        raise RuntimeError("judge out of memory")

    scorer = make_scorer(RewardConfig(fn="arithmetic", model=classifier_dir, on_error=on_error), on_error, broken)
    trajs, closed = _roll(scorer, rm.tokenizer, ["2", "3"])
    counts = scorer.pop_metrics()
    assert counts["reward/model_errors"] == 6 and counts["reward/model_scored"] == 6
    if on_error == "zero":
        assert [t.reward for t in trajs] == [1.0, 0.0] * 3 and closed == [2, 2, 2]
    else:
        assert trajs == [] and closed == [0, 0, 0] and counts["reward/model_rejected"] == 6
    assert "judge out of memory" in scorer.first_error
    from async_rl.rewards import check_rewards_work

    with pytest.raises(ValueError, match="reward model failed on every call"):
        check_rewards_work({"reward/model_scored": 6.0, "reward/model_errors": 6.0}, scorer.first_error, "step 1")


@pytest.mark.parametrize(("override", "message"), [
    ("reward.model=/no/such/dir", "reward.model='/no/such/dir': no such directory"),
    ("reward.model={tmp}", "holds no config.json"),
    ("reward.model_kind=reward", "reward.model_kind must be one of ('classifier', 'judge'), got 'reward'"),
    ("reward.model_batch_size=0", "reward.model_batch_size must be >= 1"),
    ("reward.model_max_tokens=0", "reward.model_max_tokens must be >= 1"),
])
def test_config_validation_names_the_key(tmp_path, override, message):
    with pytest.raises((ConfigError, ValueError)) as e:
        load_config(ROOT / "configs/default.yaml", [override.format(tmp=tmp_path)])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_classifier_with_several_labels_is_refused(tmp_path, classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir, num_labels=2,
                                                               ignore_mismatched_sizes=True)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(classifier_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=1"):
        RewardModel(str(tmp_path), "classifier")


def _run_cfg(tmp_path, classifier_dir, *extra):
    return load_config(ROOT / "configs/default.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2",
        "trainer.prompts_per_step=2", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=0", "data.val_max_prompts=4", "logging.progress=false",
        "trainer.export_model=false", f"reward.model={classifier_dir}", "reward.model_batch_size=4", *extra])


def _steps(tmp_path):
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [l for l in lines if l["step"] >= 1 and "policy/version" in l]


@pytest.mark.slow
def test_sync_run_trains_on_the_model_reward(tmp_path, classifier_dir):
    from async_rl.trainer import train

    train(_run_cfg(tmp_path, classifier_dir))
    steps = _steps(tmp_path)
    assert [l["step"] for l in steps] == [1, 2]
    for l in steps:
        assert l["reward/model_scored"] == 8 and l["reward/model_errors"] == 0
        assert l["reward/scored"] == 0, "no reward function runs when only reward.model is set"
        # Model scores of different responses differ, unlike a 0/1 reward on an untrained model.
        assert l["rollout/reward_std"] > 0 and l["rollout/reward_mean"] != 0
        assert l["rollout/model_score_mean"] == pytest.approx(l["rollout/reward_mean"], abs=1e-5)
        assert l["rollout/accuracy"] is None, "no verifiable reward, no accuracy (NaN, written as null)"


@pytest.mark.slow
def test_async_run_scores_in_the_reward_actor(tmp_path, classifier_dir):
    from async_rl.trainer import train

    train(_run_cfg(tmp_path, classifier_dir, "trainer.mode=async", "generator.num_workers=1",
                   "reward.fn=arithmetic", "reward.model_weight=0.5"))
    steps = _steps(tmp_path)
    assert [l["step"] for l in steps] == [1, 2]
    assert sum(l["reward/model_scored"] for l in steps) >= 16
    assert all(l["reward/model_errors"] == 0 for l in steps)
    assert all(l["rollout/reward_std"] > 0 for l in steps)
    # reward = arithmetic + 0.5 * model score; the arithmetic reward is 0 or 1 on each sample.
    assert all(-1e-5 <= l["rollout/reward_mean"] - 0.5 * l["rollout/model_score_mean"] <= 1.0 + 1e-5 for l in steps)
    assert all(l["rollout/accuracy"] is not None for l in steps), "accuracy is the arithmetic function's"
