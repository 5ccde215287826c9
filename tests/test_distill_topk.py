"""On-policy distillation from the teacher's top-k next-token distribution
(``algorithm.distill.signal=topk_reverse_kl`` / ``topk_forward_kl``): the coarse-grained
divergence, the teacher's top-k, the stage that carries it, the batch builder, and runs on both
learners in both modes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.distill import DistillConfig, topk_kl
from async_rl.buffers.trajectory import Trajectory
from async_rl.rewards.teacher import TeacherInput, TeacherModel, TeacherScores, TeacherStage
from async_rl.step.batch import make_batch
from test_distill import _other_teacher, _run_cfg, _steps  # the runs of the sampled-token signal's tests


# ------------------------------------------------------------------------------ the divergence
def _full_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    log_p, log_q = student_logits.log_softmax(-1), teacher_logits.log_softmax(-1)
    if kind == "reverse":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def test_topk_kl_hand_computed_with_and_without_the_rest_bucket():
    student, teacher = torch.tensor([[0.5, 0.5]]).log(), torch.tensor([[0.9, 0.1]]).log()
    reverse = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    forward = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
    assert float(topk_kl(student, teacher, "reverse")) == pytest.approx(reverse, rel=1e-6)
    assert float(topk_kl(student, teacher, "forward")) == pytest.approx(forward, rel=1e-6)
    # Top-1: the other token is the rest bucket, so the two-outcome divergence is unchanged.
    assert float(topk_kl(student[:, :1], teacher[:, :1], "reverse")) == pytest.approx(reverse, rel=1e-6)
    # Three tokens, top-1 {a}: the rest bucket merges b and c (0.3 + 0.2 against 0.05 + 0.05).
    s3, t3 = torch.tensor([0.5, 0.3, 0.2]).log(), torch.tensor([0.9, 0.05, 0.05]).log()
    merged = 0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1)
    assert float(topk_kl(s3[:1], t3[:1], "reverse")) == pytest.approx(merged, rel=1e-6)
    assert float(topk_kl(s3, t3, "reverse")) > merged  # merging outcomes lowers a KL


@pytest.mark.parametrize("kind", ["reverse", "forward"])
def test_topk_kl_is_the_full_kl_over_the_vocabulary_and_a_lower_bound_below_it(kind):
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(4, 6, 40, generator=gen) * 2
    teacher = torch.randn(4, 6, 40, generator=gen) * 2
    log_p, log_q = student.log_softmax(-1), teacher.log_softmax(-1)
    full = _full_kl(student, teacher, kind)
    everything = log_q.argsort(-1, descending=True)
    torch.testing.assert_close(topk_kl(log_p.gather(-1, everything), log_q.gather(-1, everything), kind), full,
                               rtol=1e-5, atol=1e-6)
    for k in (1, 5, 20):
        ids = everything[..., :k]
        part = topk_kl(log_p.gather(-1, ids), log_q.gather(-1, ids), kind)
        assert bool((part <= full + 1e-5).all()) and bool((part >= -1e-6).all())
    same = topk_kl(log_q.gather(-1, everything[..., :5]), log_q.gather(-1, everything[..., :5]), kind)
    assert float(same.abs().max()) < 1e-6


@pytest.mark.parametrize("kind", ["reverse", "forward"])
def test_topk_kl_gradient_over_the_vocabulary_is_the_full_kl_gradient(kind):
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(3, 30, generator=gen)
    logits_a = torch.randn(3, 30, generator=gen).requires_grad_()
    logits_b = logits_a.detach().clone().requires_grad_()
    ids = torch.arange(30).expand(3, 30)
    topk_kl(logits_a.log_softmax(-1).gather(-1, ids), teacher.log_softmax(-1).gather(-1, ids), kind).sum().backward()
    _full_kl(logits_b, teacher, kind).sum().backward()
    torch.testing.assert_close(logits_a.grad, logits_b.grad, rtol=1e-4, atol=1e-6)


def test_topk_kl_refuses_mismatched_shapes_and_unknown_kinds():
    with pytest.raises(ValueError, match="differ in shape"):
        topk_kl(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="kind"):
        topk_kl(torch.zeros(2, 3), torch.zeros(2, 3), "jsd")


def test_distill_config_top_k_and_signals():
    assert DistillConfig(teacher="T", signal="topk_reverse_kl").uses_topk
    assert not DistillConfig(teacher="T").uses_topk
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        DistillConfig(teacher="T", signal="topk_forward_kl", top_k=0)
    with pytest.raises(ValueError, match="signal must be one of"):
        DistillConfig(teacher="T", signal="topk_jsd")


# ------------------------------------------------------------------------------ the teacher's top-k
def test_teacher_top_k_is_the_models_own_at_every_response_position(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    items = [TeacherInput("a", [5, 6, 7], [8, 9]), TeacherInput("a", [5], [10, 11, 12])]
    teacher = TeacherModel({"*": tiny_model_path}, tiny_model_path, temperature=0.7, batch_size=2, top_k=4)
    for item, scored in zip(items, teacher.scores(items)):
        ids = torch.tensor([list(item.prompt_ids) + list(item.response_ids)])
        with torch.no_grad():
            log_q = torch.log_softmax(model(input_ids=ids).logits[0].float() / 0.7, -1)
        rows = log_q[len(item.prompt_ids) - 1 : len(item.prompt_ids) - 1 + len(item.response_ids)]
        values, indices = rows.topk(4, -1)
        assert scored.topk_ids.dtype == np.int32 and scored.topk_logprobs.dtype == np.float32
        np.testing.assert_array_equal(scored.topk_ids, indices.numpy())
        np.testing.assert_allclose(scored.topk_logprobs, values.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(scored.logprobs, rows.gather(-1, torch.tensor(item.response_ids)[:, None])[:, 0],
                                   rtol=1e-5, atol=1e-5)
    # A top-k beyond the vocabulary is the whole distribution; without one, none.
    whole = TeacherModel({"*": tiny_model_path}, tiny_model_path, top_k=10 * vocab).scores(items[:1])[0]
    assert whole.topk_ids.shape == (2, vocab)
    np.testing.assert_allclose(np.exp(whole.topk_logprobs.astype(np.float64)).sum(-1), 1.0, rtol=1e-4)
    plain = TeacherModel({"*": tiny_model_path}, tiny_model_path).scores(items[:1])[0]
    assert plain.topk_ids.shape == (0, 0)
    with pytest.raises(ValueError, match="top_k"):
        TeacherModel({"*": tiny_model_path}, tiny_model_path, top_k=-1)


def _traj(gid: int, j: int, response: list[int], reward: float = 1.0, topk: int = 0) -> Trajectory:
    r = len(response)
    return Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid=f"p{gid}", prompt_ids=[5, 6],
                      response_ids=response, behavior_logprobs=[-0.5] * r, loss_mask=[1] * r,
                      finish_reason="stop", policy_version=[0] * r, reward=reward,
                      teacher_logprobs=[-1.0] * r,
                      teacher_topk_ids=(np.tile(np.arange(topk, dtype=np.int32), (r, 1)) if topk
                                        else np.zeros((0, 0), np.int32)),
                      teacher_topk_logprobs=(np.full((r, topk), -2.0, np.float32) if topk
                                             else np.zeros((0, 0), np.float32)))


def test_teacher_stage_sets_the_top_k_and_rejects_a_malformed_one():
    def score(items):
        out = []
        for item in items:
            r = len(item.response_ids)
            k = 3 if item.data_source == "good" else 2
            ids = np.tile(np.arange(k, dtype=np.int32), (r if item.data_source != "short" else r - 1, 1))
            lps = np.full(ids.shape, -1.5 if item.data_source != "positive" else 0.5, np.float32)
            out.append(TeacherScores(-np.ones(r), ids, lps))
        return out

    stage = TeacherStage(score, batch_size=4)
    done: list = []
    good = _traj(0, 0, [1, 2])
    stage.submit(TeacherInput("good", [5, 6], [1, 2]), good, done.append)
    for k, source in enumerate(("short", "positive")):
        stage.submit(TeacherInput(source, [5, 6], [1, 2]), _traj(k + 1, 0, [1, 2]), done.append)
    stage.drain()
    assert done[0] is good and done[1] is None and done[2] is None
    assert good.teacher_topk_ids.shape == (2, 3) and good.teacher_topk_logprobs.dtype == np.float32
    np.testing.assert_array_equal(good.teacher_topk_logprobs, np.full((2, 3), -1.5, np.float32))
    counts = stage.counts()
    assert counts["distill/teacher_rejected"] == 2 and counts["distill/teacher_tokens"] == 2
    assert "top-k ids (1, 2)" in stage.first_error


# ------------------------------------------------------------------------------ the batch
def _algo(**distill) -> AlgorithmConfig:
    return AlgorithmConfig(name="grpo", distill=DistillConfig(**distill)).apply_preset()


def test_make_batch_with_a_top_k_signal_leaves_the_advantage_to_the_task_and_keeps_the_top_k():
    trajs = [_traj(0, 0, [7, 8], reward=1.0, topk=3), _traj(0, 1, [9], reward=0.0, topk=3)]
    plain, _ = make_batch(trajs, _algo(), pad_token_id=0, max_response_tokens=8)
    batch, _ = make_batch(trajs, _algo(teacher="T", signal="topk_reverse_kl", top_k=3), pad_token_id=0,
                          max_response_tokens=8)
    torch.testing.assert_close(batch.advantages, plain.advantages)  # no sampled-token term
    assert batch.extras["teacher_topk_ids"].shape == (2, 3, 3)
    assert batch.extras["teacher_topk_logprobs"].shape == (2, 3, 3)
    pure, _ = make_batch(trajs, _algo(teacher="T", signal="topk_forward_kl", top_k=3, task_reward=False),
                         pad_token_id=0, max_response_tokens=8)
    assert float(pure.advantages.abs().max()) == 0.0
    without = [_traj(0, 0, [7, 8]), _traj(0, 1, [9], reward=0.0)]
    with pytest.raises(ValueError, match="signal=topk_reverse_kl needs the teacher's top-k"):
        make_batch(without, _algo(teacher="T", signal="topk_reverse_kl"), pad_token_id=0, max_response_tokens=8)


# ------------------------------------------------------------------------------ runs
@pytest.mark.slow
def test_sync_top_k_distillation_on_fsdp2_and_megatron(tmp_path, tiny_model_path):
    """Sync mode, pure distillation with the teacher's whole distribution (top_k beyond the
    vocabulary): the learner's loss is the reverse KL over the vocabulary; FSDP2 and Megatron at
    tensor parallel 2, and at pipeline parallel 2 with packed rows, agree on it and on the update,
    and the student's next samples are closer to the teacher."""
    from async_rl.trainer import train

    teacher = (f"algorithm.distill.teacher={_other_teacher(tmp_path, tiny_model_path, 3.0)}",
               "algorithm.distill.signal=topk_reverse_kl", "algorithm.distill.top_k=100000",
               "algorithm.distill.task_reward=false", "learner.num_mini_batches=1")
    summary = train(_run_cfg(tmp_path, "fsdp", *teacher))
    train(_run_cfg(tmp_path, "tp", *teacher, "learner.backend=megatron", "learner.world_size=2",
                   "learner.megatron.tensor_parallel_size=2"))
    train(_run_cfg(tmp_path, "pp", *teacher, "learner.backend=megatron", "learner.world_size=2",
                   "learner.megatron.pipeline_parallel_size=2", "learner.packing=true"))
    fsdp = _steps(tmp_path / "fsdp")
    for mg in (_steps(tmp_path / "tp"), _steps(tmp_path / "pp")):
        for step in (1, 2):
            assert fsdp[step]["loss/distill_kl"] > 0.05
            assert fsdp[step]["loss/pg"] == 0.0  # pure distillation: the policy loss has no advantage
            for key in ("loss/distill_kl", "distill/reverse_kl"):
                assert mg[step][key] == pytest.approx(fsdp[step][key], rel=1e-4, abs=1e-6), (step, key)
            assert mg[step]["actor/grad_norm"] == pytest.approx(fsdp[step]["actor/grad_norm"], rel=1e-2)
    # The student moves toward the teacher: the second step's divergence (on its own samples) is lower.
    assert fsdp[2]["loss/distill_kl"] < fsdp[1]["loss/distill_kl"]
    assert summary["distill/teacher_rejected"] == 0


@pytest.mark.slow
def test_async_top_k_distillation_with_a_lora_student(tmp_path, private_tmpdir):
    """Async mode with a LoRA student: the teacher actor's top-k travels over the wire with each
    group, and the student starts as the teacher (LoRA's B is 0), so at the first step the
    learner's top-k divergence over samples of version 0 is float round-off."""
    from async_rl.trainer import train

    summary = train(_run_cfg(tmp_path, "async", "trainer.mode=async", "trainer.policy_version_per=step",
                                  "algorithm.distill.teacher=builtin:tiny-qwen2", "learner.lora.rank=4",
                                  "learner.lora.alpha=8", "algorithm.distill.signal=topk_forward_kl",
                                  "algorithm.distill.top_k=8"))
    steps = _steps(tmp_path / "async")
    assert steps[1]["staleness/max"] <= 1
    assert abs(steps[1]["loss/distill_kl"]) < 1e-5
    assert all("loss/distill_kl" in s for s in steps.values())
    assert summary["distill/teacher_scored"] >= 32 and summary["distill/teacher_rejected"] == 0
