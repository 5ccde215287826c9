"""Learner memory/precision options: activation checkpointing changes nothing but memory,
bf16 mixed precision keeps float32 master weights and stays close to float32, CPU offload is
refused on a CPU learner with the reason."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from learners.base import LearnerConfig


def _step(model_path: str, **kw) -> tuple[float, dict[str, torch.Tensor], "object"]:
    from multirank_worker import make_batch

    from learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()
    cfg = LearnerConfig(lr=1e-2, eps=1e-3, micro_batch_size=4, **kw)
    learner = FSDPLearner(cfg, algo, model_path, temperature=1.0, total_optimizer_steps=2)
    batch = make_batch()
    learner.prepare(batch)
    metrics = learner.train_step(batch)
    return float(metrics["loss/pg"]), {n: t.clone() for n, t in learner.named_weights()}, learner


def test_activation_checkpointing_gives_the_same_update(tiny_model_path):
    loss, weights, _ = _step(tiny_model_path)
    loss_ac, weights_ac, learner = _step(tiny_model_path, activation_checkpointing=True)
    assert any("checkpoint_wrapped_module" in n for n, _ in learner.model.named_modules())
    assert sorted(weights_ac) == sorted(weights)  # Hugging Face names, as without checkpointing
    assert loss_ac == pytest.approx(loss, rel=1e-6, abs=1e-8)
    for name, w in weights.items():
        torch.testing.assert_close(weights_ac[name], w, rtol=1e-5, atol=1e-7)


def test_bf16_mixed_precision_keeps_fp32_master_weights(tiny_model_path):
    loss, weights, _ = _step(tiny_model_path)
    loss_mp, weights_mp, learner = _step(tiny_model_path, mixed_precision="bf16")
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert loss_mp == pytest.approx(loss, rel=5e-2, abs=1e-3)
    moved = [float((weights_mp[n] - w).abs().max()) for n, w in weights.items()]
    assert max(moved) < 5e-2  # the same update up to bf16 rounding of the forward pass


def test_auto_precision_is_fp32_on_cpu_and_offload_is_refused(tiny_model_path):
    _, _, learner = _step(tiny_model_path)
    assert learner._precision() == "fp32"
    with pytest.raises(ValueError, match="cpu_offload=true needs a CUDA learner"):
        _step(tiny_model_path, cpu_offload=True)
    with pytest.raises(ValueError, match="learner.mixed_precision"):
        LearnerConfig(mixed_precision="fp8")


def test_bf16_critic_step_runs_in_float32_head(tiny_model_path):
    """PPO's value head under bf16 mixed precision: float32 values, a finite value loss."""
    from multirank_worker import make_batch

    from learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="ppo", loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(lr=1e-3, micro_batch_size=4, mixed_precision="bf16"), algo,
                          tiny_model_path, temperature=1.0, total_optimizer_steps=2)
    batch = make_batch()
    learner.prepare(batch)
    assert batch.extras["values"].dtype == torch.float32
    batch.extras["returns"] = batch.advantages.clone()
    metrics = learner.train_step(batch)
    assert torch.isfinite(torch.as_tensor(metrics["critic/vf_loss"]))
