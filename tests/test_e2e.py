"""A short run of the real pipeline: built-in model and data, HF generator, FSDP2 learner, GRPO."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.trainer import train

ROOT = Path(__file__).resolve().parents[1]

FLAKY_REWARD = '''
import math
def reward(data_source, response_text, ground_truth, extra_info):
    if len(response_text) % 3 == 0:
        raise RuntimeError("reward service down")
    if len(response_text) % 3 == 1:
        return math.nan
    return {"score": float(response_text.strip() == ground_truth), "acc": float(response_text.strip() == ground_truth)}
'''


def _cfg(tmp_path, *extra):
    return load_config(ROOT / "configs/default.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=3",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=2",
        "trainer.warm_start.steps=3", "trainer.warm_start.batch_size=8", "data.val_max_prompts=8",
        "logging.progress=false", *extra])


@pytest.mark.slow
def test_short_run_end_to_end(tmp_path):
    summary = train(_cfg(tmp_path, "logging.wandb.mode=offline"))
    run = tmp_path / "run"
    wandb_runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(wandb_runs) == 1 and wandb_runs[0].stat().st_size > 0
    assert (run / "config.yaml").exists()
    assert load_config(run / "config.yaml").trainer.total_steps == 3
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] >= 1 and "policy/version" in l]
    assert [l["step"] for l in steps] == [1, 2, 3]
    for key in ("rollout/reward_mean", "loss/pg", "loss/clip_frac", "perf/gen_tokens_per_s",
                "perf/engine_tokens_per_s", "perf/train_tokens_per_s", "timing/generate_s",
                "timing/train_s", "mismatch/logprob_abs_diff", "staleness/max", "actor/grad_norm"):
        assert all(key in l for l in steps), key
    # Wall time since the previous step contains the step's generation time.
    assert all(0 < l["perf/gen_tokens_per_s"] <= l["perf/engine_tokens_per_s"] for l in steps)
    assert all(l["staleness/max"] == 0 for l in steps)
    # Sampling and learner agree on log-probs (same temperature, same weights).
    assert all(l["mismatch/logprob_abs_diff"] < 1e-4 for l in steps)
    # One policy version per training step, though the default recipe takes
    # learner.num_mini_batches=4 optimizer steps in each.
    assert [l["policy/version"] for l in steps] == [1, 2, 3]
    evals = [l for l in lines if "eval/accuracy" in l]
    assert [l["step"] for l in evals] == [0, 2, 3]
    assert summary["eval_step_0"] == evals[0]["eval/accuracy"]
    # The exported policy loads with transformers and equals what was trained.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final_model")
    AutoTokenizer.from_pretrained(run / "final_model")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Exported for inference: the KV cache the learner turns off is on again.
    assert json.loads((run / "final_model" / "config.json").read_text())["use_cache"] is True


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_failing_reward_is_counted_not_fatal(tmp_path, on_error):
    f = tmp_path / "flaky.py"
    f.write_text(FLAKY_REWARD)
    cfg = _cfg(tmp_path, f"reward.fn={f}:reward", f"reward.on_error={on_error}", "trainer.total_steps=2",
               "trainer.warm_start.steps=0", "trainer.eval_every_steps=0", "trainer.export_model=false")
    train(cfg)
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] >= 1 and "policy/version" in l]
    errors = sum(l["reward/errors"] for l in steps)
    assert errors > 0, "responses of every length modulo 3 occur, so both failure paths are hit"
    rejected = sum(l["reward/rejected"] + l["rollout/rejected_samples"] for l in steps)
    if on_error == "reject":
        assert sum(l["rollout/rejected_samples"] for l in steps) == errors
        assert all(l["rollout/num_trajectories"] == 16 - l["rollout/rejected_samples"] for l in steps)
    else:
        assert rejected == 0
        assert all(l["rollout/num_trajectories"] == 16 for l in steps)


def test_bad_dataset_is_one_line_and_leaves_no_run_dir(tmp_path, capsys):
    from async_rl.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data_source": "async_rl/arithmetic", "reward_model": {"ground_truth": "3"}}\n')
    rc = main(["train", "--config", str(ROOT / "configs/default.yaml"), f"data.train_files=[{bad}]",
               f"trainer.output_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip().splitlines() == [f"async-rl: error: {bad}: row 0 (0-based): missing required field 'prompt' "
                                        "(fields present: ['data_source', 'reward_model'])"]
    assert not (tmp_path / "runs").exists()


def test_unknown_data_source_fails_before_training(tmp_path):
    f = tmp_path / "odd.jsonl"
    f.write_text('{"prompt": [{"role": "user", "content": "1+2="}], "data_source": "my/odd_source"}\n')
    # No warm start: the row has no reference answer either, which would stop the run first.
    with pytest.raises(ValueError, match="my/odd_source"):
        train(_cfg(tmp_path, f"data.train_files=[{f}]", "data.val_files=[]", "trainer.warm_start.steps=0"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "dapo", "ppo"])
def test_every_algorithm_trains_by_config_alone(tmp_path, name):
    # DAPO's dynamic sampling needs groups with reward spread; the tiny warm start gives few, so
    # it may take several rounds (bounded by algorithm.max_generation_rounds).
    summary = train(_cfg(tmp_path, f"algorithm.name={name}", "trainer.total_steps=2", "trainer.eval_every_steps=0",
                         "trainer.warm_start.steps=40", "algorithm.max_generation_rounds=50",
                         "trainer.export_model=false"))
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] >= 1 and "policy/version" in l]
    assert [l["policy/version"] for l in steps] == [1, 2]
    assert all(l["loss/pg"] == l["loss/pg"] and abs(l["loss/pg"]) < 1e3 for l in steps)
    if name == "ppo":
        assert all("critic/vf_loss" in l and "critic/grad_norm" in l for l in steps)
    if name == "dapo":
        assert all(l["rollout/dynamic_sampling_rounds"] >= 1 for l in steps)
        assert all("reward/overlong_penalty_mean" in l for l in steps)
    assert summary["eval_final"] == summary["eval_final"]
