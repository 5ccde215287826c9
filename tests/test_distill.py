"""On-policy distillation: the advantage term, its metrics, the teacher model and its stage, the
batch builder's use of them, and the checks a run makes of its teachers."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.distill import DistillConfig, distill_advantages, reverse_kl_metrics
from async_rl.buffers.trajectory import Trajectory
from async_rl.rewards.teacher import TeacherInput, TeacherModel, TeacherStage, same_vocabulary
from async_rl.step.batch import make_batch


def _traj(gid: int, j: int, response: list[int], behavior: list[float], teacher: list[float] | None,
          reward: float = 1.0, mask: list[int] | None = None, uid: str | None = None) -> Trajectory:
    return Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid=uid or f"p{gid}", prompt_ids=[5, 6],
                      response_ids=response, behavior_logprobs=behavior,
                      loss_mask=mask if mask is not None else [1] * len(response), finish_reason="stop",
                      policy_version=[0] * len(response), reward=reward,
                      teacher_logprobs=teacher if teacher is not None else [])


# ------------------------------------------------------------------------------ the advantage term
def test_distill_advantages_hand_computed():
    adv = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    mu = torch.tensor([[0.0, -0.1, -1.0, 0.0]])
    q = torch.tensor([[0.0, -2.3, -0.5, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    out = distill_advantages(adv, mu, q, mask, coef=1.0)
    # token 1: 0.5 - (-0.1 + 2.3) = -1.7; token 2: 0.5 - (-1.0 + 0.5) = 1.0
    torch.testing.assert_close(out, torch.tensor([[0.0, -1.7, 1.0, 0.0]]))
    pure = distill_advantages(adv, mu, q, mask, coef=0.5, task_reward=False)
    torch.testing.assert_close(pure, torch.tensor([[0.0, -1.1, 0.25, 0.0]]))


def test_distill_advantages_ignores_garbage_outside_the_mask():
    mask = torch.tensor([[1.0, 0.0]])
    out = distill_advantages(torch.zeros(1, 2), torch.tensor([[-1.0, float("nan")]]),
                             torch.tensor([[-1.5, -float("inf")]]), mask, coef=2.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0]]))


def test_distill_advantages_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        distill_advantages(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 3), coef=1.0)


def test_reverse_kl_metrics_per_token_and_per_source():
    a = _traj(0, 0, [1, 2], [-0.5, -1.0], [-1.0, -1.0], uid="a")     # k1: 0.5, 0.0
    b = _traj(1, 0, [3, 4, 5], [-0.2, -0.2, -3.0], [-1.2, -0.2, -1.0], mask=[1, 1, 0], uid="b")  # 1.0, 0.0
    out = reverse_kl_metrics([a, b], source_of={"a": "src_a", "b": "src_b"}.get)
    assert out["distill/reverse_kl"] == pytest.approx(1.5 / 4)
    assert out["distill/src_a/reverse_kl"] == pytest.approx(0.25)
    assert out["distill/src_b/reverse_kl"] == pytest.approx(0.5)
    assert out["distill/teacher_logprob_mean"] == pytest.approx((-2.0 - 1.4) / 4)
    assert out["distill/behavior_logprob_mean"] == pytest.approx((-1.5 - 0.4) / 4)
    assert reverse_kl_metrics([_traj(2, 0, [1], [-0.1], None)]) == {}


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs,match", [
    ({"signal": "forward_kl"}, "signal"), ({"coef": 0.0}, "coef"), ({"batch_size": 0}, "batch_size"),
    ({"teachers": {"a": ""}}, "no teacher given"), ({"num_gpus": -1}, "num_gpus"),
])
def test_distill_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillConfig(**kwargs)


def test_distill_routes_and_coverage():
    assert not DistillConfig().enabled
    d = DistillConfig(teacher="T", teachers={"math": "M"})
    assert d.enabled and d.routes == {"*": "T", "math": "M"}
    assert d.teacher_of("math") == "M" and d.teacher_of("code") == "T"
    only = DistillConfig(teachers={"math": "M"})
    assert only.uncovered(["math", "code", "code", "chat"]) == ["chat", "code"]
    assert AlgorithmConfig(distill=d).needs_teacher


# ------------------------------------------------------------------------------ make_batch
def _algo(**distill) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", distill=DistillConfig(**distill)).apply_preset()


def test_make_batch_adds_the_teacher_term_to_the_task_advantage():
    trajs = [_traj(0, 0, [7, 8], [-0.5, -0.25], [-1.0, -0.25], reward=1.0),
             _traj(0, 1, [9], [-2.0], [-0.5], reward=0.0)]
    plain, _ = make_batch(trajs, _algo(), pad_token_id=0, max_response_tokens=8)
    batch, metrics = make_batch(trajs, _algo(teacher="T", coef=2.0), pad_token_id=0, max_response_tokens=8)
    assert "teacher_logprobs" not in batch.extras  # used for the advantage only, not sent to the learner
    # Label slot P-1 = 1 predicts the first response token.
    expected = plain.advantages.clone()
    expected[0, 1] -= 2.0 * 0.5
    expected[0, 2] -= 2.0 * 0.0
    expected[1, 1] -= 2.0 * (-1.5)
    torch.testing.assert_close(batch.advantages, expected)
    pure, _ = make_batch(trajs, _algo(teacher="T", task_reward=False), pad_token_id=0, max_response_tokens=8)
    torch.testing.assert_close(pure.advantages, torch.tensor([[0.0, -0.5, 0.0], [0.0, 1.5, 0.0]]))
    assert metrics["distill/advantage_mean"] == pytest.approx(float(batch.advantages.sum() / 3))


def test_make_batch_refuses_trajectories_without_teacher_logprobs():
    trajs = [_traj(0, 0, [7], [-0.5], None), _traj(0, 1, [9], [-2.0], None, reward=0.0)]
    with pytest.raises(ValueError, match="no teacher log-probs"):
        make_batch(trajs, _algo(teacher="T"), pad_token_id=0, max_response_tokens=8)


# ------------------------------------------------------------------------------ the teacher model
def _direct_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> np.ndarray:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return np.array([float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)])


def test_teacher_logprobs_equal_one_row_at_a_time(tiny_model_path):
    from transformers import AutoModelForCausalLM

    teacher = TeacherModel({"*": tiny_model_path}, tiny_model_path, temperature=0.7, batch_size=3, device="cpu")
    items = [TeacherInput("a", [1, 2, 3], [4, 5]), TeacherInput("b", [7], [8, 9, 10, 11]),
             TeacherInput("a", [12, 13, 14, 15, 16], [17]), TeacherInput("c", [3, 2], [])]
    rows = teacher.logprobs(items)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for item, row in zip(items, rows):
        assert row.dtype == np.float64 and row.shape == (len(item.response_ids),)
        np.testing.assert_allclose(row, _direct_logprobs(model, list(item.prompt_ids), list(item.response_ids), 0.7),
                                   atol=2e-5)


def _other_teacher(tmp_path, src: str, scale: float) -> str:
    """A copy of ``src`` whose weights are scaled (another teacher with the same tokenizer)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / f"teacher_{scale}"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def test_teachers_are_routed_by_data_source(tiny_model_path, tmp_path):
    other = _other_teacher(tmp_path, tiny_model_path, 3.0)
    teacher = TeacherModel({"*": tiny_model_path, "b": other}, tiny_model_path, device="cpu")
    items = [TeacherInput("a", [1, 2], [3, 4]), TeacherInput("b", [1, 2], [3, 4])]
    same, scaled = teacher.logprobs(items)
    alone = TeacherModel({"*": other}, tiny_model_path, device="cpu").logprobs([items[1]])[0]
    np.testing.assert_allclose(scaled, alone, atol=1e-6)
    assert np.abs(same - scaled).max() > 1e-2
    with pytest.raises(ValueError, match="no teacher for data source 'z'"):
        TeacherModel({"b": other}, tiny_model_path, device="cpu").logprobs([TeacherInput("z", [1], [2])])


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tiny_model_path, tmp_path):
    other = tmp_path / "other_tok"
    shutil.copytree(tiny_model_path, other)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_tool_token>"])
    tok.save_pretrained(other)
    assert "differs" in same_vocabulary(AutoTokenizer.from_pretrained(tiny_model_path), tok)
    with pytest.raises(ValueError) as e:
        TeacherModel({"math": str(other)}, tiny_model_path, device="cpu")
    assert "algorithm.distill.teachers[math]" in str(e.value) and "tokenizer" in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ the stage
def test_teacher_stage_sets_logprobs_counts_and_rejects_failures():
    calls = []

    def score(items):
        calls.append(len(items))
        out = []
        for item in items:
            if item.data_source == "boom":
                raise RuntimeError("teacher down")
            n = len(item.response_ids)
            out.append(np.full(n, math.nan) if item.data_source == "nan" else -np.arange(1, n + 1, dtype=float))
        return out

    stage = TeacherStage(score, batch_size=4)
    done: list = []
    good = _traj(0, 0, [1, 2], [-0.1, -0.1], None)
    stage.submit(TeacherInput("a", [5, 6], [1, 2]), good, done.append)
    stage.submit(None, None, done.append)  # rejected upstream: passes through, in order
    stage.drain()
    assert done[0] is good and done[1] is None
    np.testing.assert_array_equal(good.teacher_logprobs, [-1.0, -2.0])
    bad = _traj(1, 0, [3], [-0.1], None)
    stage.submit(TeacherInput("nan", [5], [3]), bad, done.append)
    stage.drain()
    assert done[2] is None and len(bad.teacher_logprobs) == 0
    stage.submit(TeacherInput("boom", [5], [3]), _traj(2, 0, [3], [-0.1], None), done.append)
    stage.drain()
    assert done[3] is None
    counts = stage.counts()
    assert counts["distill/teacher_scored"] == 3 and counts["distill/teacher_errors"] == 2
    assert counts["distill/teacher_rejected"] == 2 and counts["distill/teacher_tokens"] == 2
    assert stage.first_error.startswith("teacher: trajectory 1/0: the teacher gave 1 non-finite")
    assert stage.pop_metrics()["distill/teacher_scored"] == 3 and stage.pop_metrics()["distill/teacher_scored"] == 0


def test_teacher_stage_rejects_a_row_of_the_wrong_length():
    stage = TeacherStage(lambda items: [np.zeros(1) for _ in items], batch_size=2)
    done: list = []
    stage.submit(TeacherInput("a", [5], [1, 2]), _traj(0, 0, [1, 2], [-0.1, -0.1], None), done.append)
    stage.drain()
    assert done == [None] and "(1,) log-probs for 2 response tokens" in stage.first_error


# ------------------------------------------------------------------------------ runs
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _run_cfg(tmp_path, name: str, *extra):
    from async_rl.config import load_config

    # No warm start: the student starts as the built-in model, so a teacher that is that model
    # scores the first step's samples exactly as the sampler did.
    return load_config(ROOT / "configs/default.yaml", [
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=0", "data.val_max_prompts=8", "logging.progress=false", *extra])


def _steps(run_dir) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Training steps only: an evaluation that ended on the async pool has a record of its own.
    return {line["step"]: line for line in lines if line["step"] >= 1 and "policy/version" in line}


@pytest.mark.slow
def test_sync_distillation_on_fsdp2_and_megatron(tmp_path, tiny_model_path):
    """Sync mode: the teacher (another model with the student's tokenizer) scores every training
    sample before its step, and FSDP2 and Megatron train the same steps on the same advantages.
    (With no warm start every reward is 0 here: the teacher's term is the whole signal, so the
    two backends' updates agree to float precision rather than Adam's reading of rounding noise.)"""
    from async_rl.trainer import train

    teacher = (f"algorithm.distill.teacher={_other_teacher(tmp_path, tiny_model_path, 3.0)}",
               "algorithm.distill.coef=0.5")
    summary = train(_run_cfg(tmp_path, "fsdp", *teacher))
    train(_run_cfg(tmp_path, "mg", *teacher, "learner.backend=megatron"))
    fsdp, mg = _steps(tmp_path / "fsdp"), _steps(tmp_path / "mg")
    for step in (1, 2):
        assert fsdp[step]["distill/reverse_kl"] > 0.05
        assert fsdp[step]["distill/teacher_scored"] == 16 and fsdp[step]["distill/teacher_rejected"] == 0
        for key in ("distill/reverse_kl", "distill/advantage_mean", "loss/pg"):
            assert mg[step][key] == pytest.approx(fsdp[step][key], rel=1e-3, abs=1e-6), (step, key)
        # Summed in another order over other parameter shards: agrees to a few parts in 1000.
        assert mg[step]["actor/grad_norm"] == pytest.approx(fsdp[step]["actor/grad_norm"], rel=1e-2)
    # The student moves toward the teacher: the second step's samples are closer to it.
    assert fsdp[2]["distill/reverse_kl"] < fsdp[1]["distill/reverse_kl"]
    assert summary["distill/teacher_scored"] == 32


@pytest.mark.slow
def test_async_distillation_scores_in_the_teacher_actor(tmp_path, private_tmpdir):
    """Async mode: the teacher actor scores each worker's samples before their group is sent;
    with a version per step the first step trains on version 0's samples, the teacher's own."""
    from async_rl.trainer import train

    summary = train(_run_cfg(tmp_path, "async", "trainer.mode=async", "trainer.policy_version_per=step",
                             "algorithm.distill.teacher=builtin:tiny-qwen2"))
    steps = _steps(tmp_path / "async")
    assert steps[1]["staleness/max"] <= 1
    assert abs(steps[1]["distill/reverse_kl"]) < 1e-4
    assert all("distill/teacher_s" in s for s in steps.values())
    assert summary["distill/teacher_scored"] >= 32 and summary["distill/teacher_rejected"] == 0
    placement = json.loads((tmp_path / "async" / "placement.json").read_text())
    assert "teacher" in json.dumps(placement)


def _two_source_data(tmp_path) -> str:
    """The built-in addition rows split into two data sources (both scored by the arithmetic reward)."""
    import pyarrow.parquet as pq

    from async_rl.data.builtin import resolve

    rows = pq.read_table(resolve("builtin:arithmetic/train")).to_pylist()[:64]
    for i, row in enumerate(rows):
        row["data_source"] = "async_rl/arithmetic" if i % 2 else "async_rl/calc"
    path = tmp_path / "two_sources.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.slow
def test_two_teachers_routed_by_data_source_with_a_lora_student(tmp_path):
    """Multi-teacher distillation: each source's samples are scored by its own teacher. The
    LoRA student starts as the base model (LoRA's B is 0), which teaches one source; another
    teacher (the base model with scaled embeddings) teaches the other. At the first step the
    first source's reverse KL is 0 and the second's is not."""
    from async_rl.trainer import train

    base = str(__import__("async_rl.data.builtin", fromlist=["resolve"]).resolve("builtin:tiny-qwen2"))
    other = _other_teacher(tmp_path, base, 3.0)
    data = _two_source_data(tmp_path)
    summary = train(_run_cfg(tmp_path, "lora", f"data.train_files=[{data}]", "learner.lora.rank=4",
                             "learner.lora.alpha=8", f"algorithm.distill.teachers.async_rl/calc={base}",
                             f"algorithm.distill.teachers.async_rl/arithmetic={other}"))
    steps = _steps(tmp_path / "lora")
    assert abs(steps[1]["distill/async_rl/calc/reverse_kl"]) < 1e-6
    assert steps[1]["distill/async_rl/arithmetic/reverse_kl"] > 0.05
    assert summary["distill/teacher_rejected"] == 0


def test_an_infinite_behavior_logprob_costs_a_bounded_advantage():
    # The wire keeps -inf behavior log-probs (the losses clamp log-ratios); the teacher's term
    # is clamped the same way, at 20 nats.
    out = distill_advantages(torch.zeros(1, 2), torch.tensor([[-float("inf"), -0.5]]), torch.tensor([[-1.0, -1.0]]),
                             torch.ones(1, 2), coef=1.0)
    torch.testing.assert_close(out, torch.tensor([[20.0, -0.5]]))
    t = _traj(0, 0, [1, 2], [-math.inf, -0.5], [-1.0, -1.0])
    assert reverse_kl_metrics([t])["distill/reverse_kl"] == pytest.approx((-20.0 + 0.5) / 2)


def test_make_batch_with_no_response_token_needs_no_teacher_row():
    trajs = [_traj(0, 0, [], [], None), _traj(0, 1, [], [], None, reward=0.0)]
    batch, _ = make_batch(trajs, _algo(teacher="T"), pad_token_id=0, max_response_tokens=8)
    assert float(batch.advantages.abs().sum()) == 0.0


def test_a_run_refuses_bad_teachers_in_one_line_before_it_makes_its_directory(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    from async_rl.trainer import train

    with pytest.raises(ValueError, match=r"no teacher for data source\(s\) \['async_rl/arithmetic'\]"):
        train(_run_cfg(tmp_path, "uncovered", f"algorithm.distill.teachers.other={tiny_model_path}"))
    with pytest.raises(FileNotFoundError, match="algorithm.distill.teacher=/no/such/teacher: no such directory"):
        train(_run_cfg(tmp_path, "missing", "algorithm.distill.teacher=/no/such/teacher"))
    other = tmp_path / "other_tok"
    shutil.copytree(tiny_model_path, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra_tool_token>"])
    tok.save_pretrained(other)
    with pytest.raises(ValueError, match=r"algorithm.distill.teacher='.*other_tok': its tokenizer differs"):
        train(_run_cfg(tmp_path, "tokenizer", f"algorithm.distill.teacher={other}"))
    assert not any((tmp_path / name).exists() for name in ("uncovered", "missing", "tokenizer"))


@pytest.mark.slow
def test_vllm_engine_behavior_logprobs_meet_the_teacher_in_sync_mode(tmp_path):
    """vLLM samples (its own log-probs are the behavior log-probs), the HF teacher scores: with
    the teacher the student's own starting weights, the first step's reverse KL is 0 to float
    precision, so the two score the same tokens the same way."""
    pytest.importorskip("vllm")
    from async_rl.trainer import train

    summary = train(_run_cfg(tmp_path, "vllm", "generator.backend=vllm", "trainer.total_steps=1",
                             "algorithm.distill.teacher=builtin:tiny-qwen2"))
    step = _steps(tmp_path / "vllm")[1]
    assert abs(step["distill/reverse_kl"]) < 1e-5 and step["distill/teacher_scored"] == 16
    assert summary["distill/teacher_rejected"] == 0
