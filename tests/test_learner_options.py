"""Learner memory/precision options: activation checkpointing changes nothing but memory,
bf16 mixed precision keeps float32 master weights and stays close to float32, CPU offload is
refused on a CPU learner with the reason."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.learners.base import LearnerConfig


def _step(model_path: str, **kw) -> tuple[float, dict[str, torch.Tensor], "object"]:
    from multirank_worker import make_batch

    from async_rl.learners.fsdp import FSDPLearner

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

    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="ppo", loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(lr=1e-3, micro_batch_size=4, mixed_precision="bf16"), algo,
                          tiny_model_path, temperature=1.0, total_optimizer_steps=2)
    batch = make_batch()
    learner.prepare(batch)
    assert batch.extras["values"].dtype == torch.float32
    batch.extras["returns"] = batch.advantages.clone()
    metrics = learner.train_step(batch)
    assert torch.isfinite(torch.as_tensor(metrics["critic/vf_loss"]))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packing_gives_the_padded_log_probs_and_update(tiny_model_path, attn):
    """Packed micro-batches (one padding-free row, position ids restarting per sequence) score
    every label as the padded batch does, and one training step moves the weights the same."""
    from multirank_worker import make_batch

    loss, weights, learner = _step(tiny_model_path, attn_implementation=attn)
    loss_p, weights_p, packed = _step(tiny_model_path, attn_implementation=attn, packing=True,
                                      max_tokens_per_micro_batch=24)
    assert packed.model.config._attn_implementation == attn
    batch = make_batch()
    lp, lp_packed = learner.compute_logprobs(batch), packed.compute_logprobs(batch)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(lp_packed[valid], lp[valid], rtol=1e-5, atol=1e-5)
    assert (lp_packed[~valid] == 0).all()
    assert loss_p == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for name, w in weights.items():
        torch.testing.assert_close(weights_p[name], w, rtol=1e-4, atol=1e-6)


def test_packing_really_packs(tiny_model_path, monkeypatch):
    """The packed forward pass sees one row of exactly the real tokens and no attention mask."""
    from multirank_worker import make_batch

    _, _, learner = _step(tiny_model_path, packing=True, max_tokens_per_micro_batch=1000)
    seen = []
    forward = type(learner.model).forward

    def spy(self, *args, **kwargs):
        seen.append((kwargs["input_ids"].shape, kwargs.get("attention_mask")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(learner.model), "forward", spy)
    batch = make_batch()
    learner.compute_logprobs(batch)
    assert seen == [((1, int(batch.attention_mask.sum())), None)]


def test_packing_is_refused_when_the_attention_mixes_sequences(tiny_model_path, monkeypatch):
    """A model whose attention does not restart at packed position ids would leak across
    sequences: the learner probes it at start and refuses, naming the backend."""
    import async_rl.learners.fsdp as fsdp

    real = fsdp.pack_rows
    monkeypatch.setattr(fsdp, "pack_rows", lambda ids, mask, pos: (real(ids, mask, pos)[0],
                                                                   torch.arange(int(mask.sum()))[None]))
    with pytest.raises(ValueError, match=r"learner.packing=true: this model's attention \(sdpa\)"):
        _step(tiny_model_path, packing=True)


def test_optimizer_built_after_a_no_grad_pass_trains_every_parameter(tiny_model_path, monkeypatch):
    """Regression: FSDP2 left the root's parameters (embeddings, final norm) unsharded after a
    no-grad forward, so an optimizer built then (``reset_optimizer``, as ``begin_rl`` does)
    stepped copies the model never read and those weights stayed frozen."""
    from multirank_worker import make_batch
    from transformers import AutoModelForCausalLM

    from async_rl.learners.fsdp import FSDPLearner

    monkeypatch.setattr(FSDPLearner, "shard_one_rank", True)  # one fp32 rank is not wrapped otherwise

    start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(lr=1e-2, eps=1e-3, micro_batch_size=4), algo, tiny_model_path,
                          temperature=1.0, total_optimizer_steps=2)
    learner.compute_logprobs(make_batch())  # a no-grad pass first
    learner.reset_optimizer()
    assert all(hasattr(p, "full_tensor") for p in learner.model.parameters())  # sharded again
    batch = make_batch()
    learner.prepare(batch)
    learner.train_step(batch)
    weights = dict(learner.named_weights())
    frozen = [n for n, w in weights.items() if torch.equal(w, start[n].detach())]
    assert frozen == []


def test_exported_config_enables_the_kv_cache_and_leaves_the_learner_s_off(tiny_model_path, tmp_path):
    """``save_hf_model`` writes ``use_cache: true`` (the exported model is for inference) while the
    training copy keeps the ``false`` the learner set."""
    import json

    from transformers import AutoModelForCausalLM

    from async_rl.learners.base import save_hf_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.config.use_cache = False
    save_hf_model(model, str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True
    assert model.config.use_cache is False
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_one_fp32_rank_trains_unwrapped_with_the_fsdp2_update(tiny_model_path, tmp_path, monkeypatch):
    """One fp32 rank skips FSDP2 (plain parameters, no DTensor dispatch or hooks) and takes the
    update FSDP2 takes there: the same loss and weights after a step, and checkpoints that load
    across the two layouts (DCP stores global tensors)."""
    from torch.distributed.tensor import DTensor

    from async_rl.learners.fsdp import FSDPLearner

    loss, weights, plain = _step(tiny_model_path)
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    plain.save_checkpoint(str(tmp_path / "plain"))
    with monkeypatch.context() as m:
        m.setattr(FSDPLearner, "shard_one_rank", True)
        loss_fsdp, weights_fsdp, wrapped = _step(tiny_model_path)
        assert all(isinstance(p, DTensor) for p in wrapped.model.parameters())
        wrapped.load_checkpoint(str(tmp_path / "plain"))
        restored = {n: t.clone() for n, t in wrapped.named_weights()}
    assert loss == pytest.approx(loss_fsdp, rel=1e-6, abs=1e-8)
    assert sorted(weights) == sorted(weights_fsdp)
    for name, w in weights.items():
        torch.testing.assert_close(weights_fsdp[name], w, rtol=1e-5, atol=1e-7)
        assert torch.equal(restored[name], w), name
    # bf16 mixed precision is an FSDP2 policy: such a rank is still wrapped.
    _, _, bf16 = _step(tiny_model_path, mixed_precision="bf16")
    assert all(isinstance(p, DTensor) for p in bf16.model.parameters())


def test_the_mini_batch_order_follows_the_learner_seed(tiny_model_path):
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()

    def order(**kw):
        learner = FSDPLearner(LearnerConfig(num_mini_batches=4, **kw), algo, tiny_model_path, 1.0, 4)
        return [part.tolist() for part in learner._split(torch.arange(256), 4, epoch=0)]

    # A LearnerConfig built without a run's config (seed None) keeps the order of seed 0.
    assert order() == order(seed=0)
    assert order(seed=1) == order(seed=1)
    assert order(seed=1) != order(seed=0)
    assert sorted(sum(order(seed=1), [])) == list(range(256))  # every sample once


def test_groups_split_deals_whole_groups_into_mini_batches(tiny_model_path):
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(num_mini_batches=4, mini_batch_split="groups"), algo, tiny_model_path, 1.0, 4)
    group_ids = torch.arange(32).repeat_interleave(8) + 100  # 32 groups of 8, ids not from 0
    parts = learner._split(group_ids, 4, epoch=0)
    assert [len(p) for p in parts] == [64] * 4
    assert sorted(torch.cat(parts).tolist()) == list(range(256))  # every sample once
    for p in parts:
        ids = group_ids[p]
        assert len(set(ids.tolist())) == 8 and all((ids == g).sum() == 8 for g in ids.unique())
        assert p.tolist() == sorted(p.tolist())  # a group's rows stay in batch order
    # The deal is seeded per version: another version deals other groups together.
    learner.version += 1
    assert [set(group_ids[p].tolist()) for p in learner._split(group_ids, 4, epoch=0)] != \
        [set(group_ids[p].tolist()) for p in parts]
    # Samples mode (the default) splits groups across mini-batches.
    learner.cfg.mini_batch_split = "samples"
    assert any(len(set(group_ids[p].tolist())) > 8 for p in learner._split(group_ids, 4, epoch=0))
    with pytest.raises(ValueError, match="learner.mini_batch_split must be one of"):
        LearnerConfig(mini_batch_split="prompts")
