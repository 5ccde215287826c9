"""The learner on a CUDA device (skipped without one): the same update as on CPU in float32, and
a bf16 mixed-precision step with float32 master weights, and packed flash-attention varlen passes;
the Megatron learner on CUDA (Transformer Engine layer spec when it is installed) against its CPU
step."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.learners.base import LearnerConfig

pytestmark = pytest.mark.gpu


def _step(model_path: str, **kw):
    from multirank_worker import make_batch

    from async_rl.learners.launch import learner_class

    algo = AlgorithmConfig(name="ppo", kl_coef=0.01, loss_horizon_tokens=16).apply_preset()
    cfg = LearnerConfig(lr=1e-2, eps=1e-3, micro_batch_size=4, **kw)
    learner = learner_class(cfg)(cfg, algo, model_path, temperature=1.0, total_optimizer_steps=2)
    learner.begin_rl()
    batch = make_batch()
    learner.prepare(batch)
    batch.extras["returns"] = batch.advantages.clone()
    metrics = learner.train_step(batch)
    return metrics, {n: t.detach().cpu().clone() for n, t in learner.named_weights()}, learner


def test_cuda_fp32_step_equals_cpu(tiny_model_path):
    cpu_metrics, cpu_weights, _ = _step(tiny_model_path, device="cpu")
    gpu_metrics, gpu_weights, learner = _step(tiny_model_path, device="cuda", mixed_precision="fp32")
    assert learner.device.type == "cuda"
    assert float(gpu_metrics["loss/pg"]) == pytest.approx(float(cpu_metrics["loss/pg"]), rel=1e-3, abs=1e-5)
    assert float(gpu_metrics["critic/vf_loss"]) == pytest.approx(float(cpu_metrics["critic/vf_loss"]), rel=1e-3, abs=1e-5)
    for name, w in cpu_weights.items():
        torch.testing.assert_close(gpu_weights[name], w, rtol=1e-3, atol=1e-4)


def test_cuda_bf16_auto_precision(tiny_model_path):
    metrics, _, learner = _step(tiny_model_path, device="cuda")
    assert learner._precision() == "bf16"
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    assert torch.isfinite(torch.as_tensor(float(metrics["loss/pg"])))


def test_cuda_packing_with_flash_attention_varlen(tiny_model_path):
    """flash-attention's varlen kernel on packed rows scores the labels as the padded sdpa pass
    (bf16 compute, so within bf16 tolerance)."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from multirank_worker import make_batch

    _, _, padded = _step(tiny_model_path, device="cuda", attn_implementation="sdpa")
    _, _, packed = _step(tiny_model_path, device="cuda", attn_implementation="flash_attention_2",
                         packing=True, max_tokens_per_micro_batch=64)
    assert packed.model.config._attn_implementation == "flash_attention_2"
    batch = make_batch()
    valid = batch.attention_mask[:, 1:].bool()
    lp, lp_packed = padded.compute_logprobs(batch), packed.compute_logprobs(batch)
    torch.testing.assert_close(lp_packed[valid], lp[valid], rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_megatron_cuda_step_equals_cpu(tiny_model_path, precision):
    """``learner.backend=megatron`` on one GPU (Transformer Engine's layer spec when it imports,
    else the local one; bf16 autocast over float32 master weights) against the CPU step."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    cpu_metrics, cpu_weights, _ = _step(tiny_model_path, device="cpu", backend="megatron")
    gpu_metrics, gpu_weights, learner = _step(tiny_model_path, device="cuda", backend="megatron",
                                              mixed_precision=precision)
    assert learner.device.type == "cuda"
    tol = dict(rel=1e-3, abs=1e-5) if precision == "fp32" else dict(rel=5e-2, abs=1e-3)
    assert float(gpu_metrics["loss/pg"]) == pytest.approx(float(cpu_metrics["loss/pg"]), **tol)
    for name, w in cpu_weights.items():
        assert gpu_weights[name].dtype == torch.float32
        torch.testing.assert_close(gpu_weights[name], w, rtol=tol["rel"], atol=tol["abs"] * 10)
