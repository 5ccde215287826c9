"""Mixture-of-experts models (issue 36): the built-in tiny Qwen3-MoE, checkpoint names of stacked
experts on the weight path, the HF engine's recorded routing and routing replay in the FSDP2
learner (``async_rl.utils.moe``, ``algorithm.routing_replay``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.buffers.trajectory import Trajectory, collate
from async_rl.data.builtin import resolve

ROOT = Path(__file__).resolve().parents[1]
MOE = "builtin:tiny-qwen3-moe"


@pytest.fixture(scope="module")
def moe_path() -> str:
    return resolve(MOE)


@pytest.fixture(scope="module")
def moe_model(moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def _routing_of(model, ids: list[int]) -> torch.Tensor:
    from async_rl.utils.moe import RoutingRecorder

    with RoutingRecorder(model) as rec, torch.no_grad():
        model(torch.tensor([ids]))
        return rec.take()


# ------------------------------------------------------------------ the model and its names
def test_the_builtin_moe_model_is_a_qwen3_moe_with_8_experts_top_2(moe_path):
    from async_rl.utils.moe import moe_shape

    cfg = json.loads((Path(moe_path) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert moe_shape(cfg) == (4, 8, 2)
    assert moe_shape({"num_hidden_layers": 4, "vocab_size": 9}) is None  # dense
    assert moe_shape({"num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                      "decoder_sparse_step": 2, "mlp_only_layers": [1]}) == (1, 8, 2)  # layer 3 only


def test_weights_go_out_under_the_checkpoints_names_exactly(moe_model, moe_path):
    """A push carries what save_pretrained writes (one matrix per expert), as views of the
    stacked parameters, and the HF engine's staging puts every element back where it was."""
    from safetensors.torch import load_file

    from async_rl.generators.hf import stage_named_weights
    from async_rl.weight_sync import ModuleWeights

    source = ModuleWeights(moe_model)
    sent = list(source.named_weights())
    on_disk = load_file(str(Path(moe_path) / "model.safetensors"))
    assert sorted(n for n, _ in sent) == sorted(on_disk)
    assert all(torch.equal(t, on_disk[n]) for n, t in sent)
    assert [(n, tuple(t.shape)) for n, t in sent] == [(n, s) for n, _, s in source.weight_metadata()]
    stacked = moe_model.model.layers[0].mlp.experts.gate_up_proj
    piece = dict(sent)["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert piece.data_ptr() != 0 and piece.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    # Round trip: an update of perturbed checkpoint tensors lands element for element.
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    new = [(n, t + 0.01 * (k + 1)) for k, (n, t) in enumerate(sent)]
    for param, value in stage_named_weights(target, new):
        param.data.copy_(value)
    back = dict(ModuleWeights(target).named_weights())
    assert all(torch.equal(back[n], t) for n, t in new)


def test_an_update_missing_one_experts_matrix_is_refused_whole(moe_model, moe_path):
    from transformers import AutoModelForCausalLM

    from async_rl.generators.hf import load_named_weights
    from async_rl.weight_sync import ModuleWeights

    target = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    before = {n: p.clone() for n, p in target.named_parameters()}
    sent = [(n, t + 1) for n, t in ModuleWeights(moe_model).named_weights()
            if n != "model.layers.2.mlp.experts.5.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight"):
        load_named_weights(target, sent)
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


# ------------------------------------------------------------------ routing: record and replay
def test_the_hf_engine_records_the_routing_of_every_forwarded_token(moe_path, moe_model):
    """Prompt tokens, then every response token but the last, per layer: what a one-row forward of
    the same tokens routes them to (batched, left-padded decoding with a KV cache included)."""
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.hf import HFGenerator

    gen = HFGenerator(moe_path, GeneratorConfig(), pad_token_id=0)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
    out = gen.generate(prompts, 2, SamplingParams(max_tokens=7, stop_token_ids=(1,), return_routed_experts=True))
    for prompt, samples in zip(prompts, out):
        for s in samples:
            assert s.routed_experts.dtype == np.int16
            assert s.routed_experts.shape == (len(prompt) + len(s.response_ids) - 1, 4, 2)
            want = _routing_of(moe_model, prompt + s.response_ids[:-1])
            assert torch.equal(torch.from_numpy(s.routed_experts).sort(-1).values, want.sort(-1).values)
    plain = gen.generate(prompts, 1, SamplingParams(max_tokens=3, stop_token_ids=(1,)))
    assert plain[0][0].routed_experts is None
    dense = HFGenerator(resolve("builtin:tiny-qwen2"), GeneratorConfig(), pad_token_id=0)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM is not a mixture-of-experts model"):
        dense.generate(prompts, 1, SamplingParams(max_tokens=3, stop_token_ids=(1,), return_routed_experts=True))


def test_replay_without_replaying_is_the_routers_own_forward_bit_for_bit(moe_model):
    from async_rl.utils.moe import replay_routing

    ids = torch.randint(3, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, want_one = moe_model(ids).logits, moe_model(ids[:1]).logits
        routed = _routing_of(moe_model, ids[0].tolist())
        with replay_routing(moe_model, None, replay=False) as stats:
            got = moe_model(ids).logits
        # Replaying the router's own choice changes nothing either.
        with replay_routing(moe_model, routed.long(), replay=True) as again:
            one = moe_model(ids[:1]).logits
    assert torch.equal(got, want) and torch.equal(one, want_one)
    assert int(stats.load.sum()) == 3 * 11 * 4 * 2 and again.metrics()["moe/router_agreement"] == 1.0
    assert "forward" not in vars(moe_model.model.layers[0].mlp.gate)  # the router's own forward is back


def test_replay_uses_the_recorded_experts_and_still_trains_the_router(moe_model):
    """Forced experts are the ones used (a recorder sees them), unrecorded rows (-1) keep the
    router's own, the output moves, and the router's weight gets a gradient through the gates."""
    from async_rl.utils.moe import RoutingRecorder, replay_routing

    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    own = _routing_of(moe_model, ids[0].tolist()).long()
    forced = torch.tensor([6, 7]).expand(7, 4, 2).clone()
    forced[-1] = -1  # the last token: not recorded
    with torch.no_grad():
        want = moe_model(ids).logits
    moe_model.zero_grad()
    with RoutingRecorder(moe_model) as rec, replay_routing(moe_model, forced, replay=True) as stats:
        out = moe_model(ids).logits
        used = rec.take().long()
    assert torch.equal(used[:-1], forced[:-1]) and torch.equal(used[-1], own[-1])
    assert not torch.allclose(out, want, atol=1e-3)
    assert torch.allclose(out[0, -1:], out[0, -1:])  # computed
    out[0, :, 10].sum().backward()
    gate = moe_model.model.layers[1].mlp.gate.weight.grad
    assert gate is not None and float(gate.abs().sum()) > 0
    agreement = (forced[:-1].unsqueeze(-1) == own[:-1].unsqueeze(-2)).any(-1).float().mean()
    assert stats.metrics()["moe/router_agreement"] == pytest.approx(float(agreement))
    moe_model.zero_grad()


def test_replay_refuses_a_dense_model_and_routing_of_the_wrong_shape(moe_model):
    from transformers import AutoModelForCausalLM

    from async_rl.utils.moe import RoutingReplayError, replay_routing

    dense = AutoModelForCausalLM.from_pretrained(resolve("builtin:tiny-qwen2"))
    with pytest.raises(RoutingReplayError, match="needs a mixture-of-experts model; Qwen2ForCausalLM has no router"):
        with replay_routing(dense, None):
            pass
    with pytest.raises(RoutingReplayError, match=r"must be \[tokens, 4 MoE layers, top_k\]; got \[5, 3, 2\]"):
        with replay_routing(moe_model, torch.zeros(5, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(RoutingReplayError, match="routed experts for 5 tokens"):
        with replay_routing(moe_model, torch.zeros(5, 4, 2, dtype=torch.long)), torch.no_grad():
            moe_model(torch.tensor([[5, 6, 7]]))


# ------------------------------------------------------------------ trajectory and batch
def _traj(prompt: int, response: int, routed=None, tid: str = "0/0") -> Trajectory:
    return Trajectory(trajectory_id=tid, group_id=0, prompt_uid="u", prompt_ids=list(range(3, 3 + prompt)),
                      response_ids=[7] * response, behavior_logprobs=[-1.0] * response, loss_mask=[1] * response,
                      finish_reason="stop", policy_version=[0] * response,
                      **({} if routed is None else {"routed_experts": routed}))


def test_a_trajectory_holds_routing_for_p_plus_r_minus_1_tokens_or_refuses_it():
    t = _traj(3, 2, np.ones((4, 2, 2), np.int64))
    assert t.routed_experts.dtype == np.int16 and t.routed_experts.shape == (4, 2, 2)
    assert Trajectory(**t.as_dict()) == t
    assert _traj(3, 2).routed_experts.shape == (0, 0, 0)
    with pytest.raises(ValueError, match="routed_experts has 5 rows; the engine forwards P \\+ R - 1 = 4 tokens"):
        _traj(3, 2, np.ones((5, 2, 2), np.int64))
    with pytest.raises(ValueError, match="not an integer dtype"):
        _traj(3, 2, np.ones((4, 2, 2)))
    with pytest.raises(ValueError, match="negative expert index"):
        _traj(3, 2, -np.ones((4, 2, 2), np.int64))
    with pytest.raises(ValueError, match="expected 3-D"):
        _traj(3, 2, np.ones((4, 2), np.int64))
    with pytest.raises(ValueError, match="32767"):
        _traj(3, 2, np.full((4, 2, 2), 40000))


def test_collate_lays_routing_out_like_the_input_ids_with_minus_1_elsewhere():
    a = _traj(3, 2, np.arange(16).reshape(4, 2, 2), "0/0")
    b = _traj(2, 4, np.arange(100, 120).reshape(5, 2, 2), "0/1")
    batch = collate([a, b], pad_token_id=0)
    routed = batch.extras["routed_experts"]
    assert routed.shape == (2, 6, 2, 2) and routed.dtype == torch.int64
    assert torch.equal(routed[0, :4], torch.from_numpy(a.routed_experts).long()) and (routed[0, 4:] == -1).all()
    assert torch.equal(routed[1, :5], torch.from_numpy(b.routed_experts).long()) and (routed[1, 5:] == -1).all()
    assert batch.trimmed().extras["routed_experts"].shape[1] == batch.input_ids.shape[1]
    with pytest.raises(ValueError, match="trajectory 0/1 has routed experts of shape \\(0, 0, 0\\)"):
        collate([a, _traj(2, 4, tid="0/1")], pad_token_id=0)


# ------------------------------------------------------------------ the learner and the run
def _learner(moe_path, packing: bool, replay: bool = True):
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.config import load_config
    from async_rl.learners.fsdp import FSDPLearner

    cfg = load_config(ROOT / "configs/default.yaml", [f"model.path={MOE}", f"learner.packing={str(packing).lower()}",
                                                       f"algorithm.routing_replay={str(replay).lower()}"])
    return FSDPLearner(cfg.learner, cfg.algorithm, moe_path, temperature=1.0, total_optimizer_steps=10)


@pytest.mark.parametrize("packing", [False, True])
def test_the_fsdp2_learner_replays_the_batchs_routing_in_both_layouts(moe_path, moe_model, packing):
    """Log-probs with replay equal a forward with the recorded experts forced, and differ from
    the learner's own routing where the recorded experts differ from its own."""
    from async_rl.utils.moe import replay_routing

    learner = _learner(moe_path, packing)
    a = _traj(4, 3, np.ones((6, 4, 2), np.int16) * np.array([2, 5], np.int16), "0/0")
    b = _traj(2, 2, np.ones((3, 4, 2), np.int16) * np.array([0, 3], np.int16), "0/1")
    batch = collate([a, b], pad_token_id=0)
    with torch.no_grad():
        got = learner._forward(batch, with_entropy=False)[0]
        plain = collate([_traj(4, 3, tid="0/0"), _traj(2, 2, tid="0/1")], pad_token_id=0)
        own = learner._forward(plain, with_entropy=False)[0]
        for i, t in enumerate((a, b)):
            ids = torch.tensor([list(t.prompt_ids) + list(t.response_ids)])
            routed = torch.cat([torch.from_numpy(t.routed_experts).long(), -torch.ones(1, 4, 2, dtype=torch.long)])
            with replay_routing(moe_model, routed):
                logits = moe_model(ids).logits[0, :-1]
            want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            n = ids.shape[1] - 1
            assert torch.allclose(got[i, :n], want, atol=1e-5), (got[i, :n], want)
            assert not torch.allclose(own[i, :n], want, atol=1e-3)


def test_routing_replay_is_refused_where_the_routing_cannot_reach_the_learner(moe_path):
    from async_rl.config import ConfigError, load_config
    from async_rl.utils.moe import RoutingReplayError

    base = [f"model.path={MOE}", "algorithm.routing_replay=true"]
    for extra, match in ((["generator.backend=sglang"], "the SGLang engine does not record routing yet; "
                                                         "generator.backend=hf or vllm does"),
                         (["generator.backend=vllm", "generator.vllm.enforce_eager=false"],
                          "the vLLM engine records routing with hooks on each router, which "
                          "generator.vllm.enforce_eager=False would not run"),
                         (["learner.backend=megatron", "algorithm.moe_aux_loss_coef=0.001"],
                          "algorithm.moe_aux_loss_coef=0.001: the Megatron learner does not add the MoE auxiliary "
                          "losses yet; learner.backend=fsdp2 does")):
        with pytest.raises(ConfigError, match=match):
            load_config(ROOT / "configs/default.yaml", base + extra)
    with pytest.raises(RoutingReplayError, match="needs a mixture-of-experts model"):
        from async_rl.algorithms.config import AlgorithmConfig  # noqa: F401
        from async_rl.learners.fsdp import FSDPLearner

        cfg = load_config(ROOT / "configs/default.yaml", ["algorithm.record_routing=true"])
        FSDPLearner(cfg.learner, cfg.algorithm, resolve("builtin:tiny-qwen2"), temperature=1.0, total_optimizer_steps=1)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_a_run_with_routing_replay_reports_the_routers_agreement_and_load(tmp_path, mode):
    """Sync: the engine's routing reaches the learner in process; async: from the generator
    actors through the trajectory stream (wire schema 7 and later) and the replay buffer."""
    from async_rl.config import load_config
    from async_rl.trainer import train

    train(load_config(ROOT / "configs/default.yaml", [
        f"trainer.mode={mode}", f"model.path={MOE}", "algorithm.routing_replay=true", f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run", "trainer.total_steps=2", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2",
        "trainer.eval_every_steps=0", "trainer.warm_start.steps=2", "trainer.warm_start.batch_size=4",
        "data.val_max_prompts=2", "logging.progress=false", "trainer.export_model=false"]))
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if "moe/router_agreement" in l]
    assert [l["step"] for l in steps] == [1, 2]
    for l in steps:
        # Sync: the engine and the learner hold the same weights, so the first mini-batch agrees
        # exactly and later ones after an optimizer step may differ on a few near-tied tokens;
        # async: the samples are a version older.
        assert 0.9 < l["moe/router_agreement"] <= 1.0
        assert 1 / 8 <= l["moe/load_max"] <= 1 and 0 <= l["moe/load_min"] <= 1 / 8
        assert l["moe/aux_loss"] > 0 and l["moe/z_loss"] > 0
        if mode == "sync":
            assert l["mismatch/logprob_abs_diff"] < 1e-5


# ------------------------------------------------------------------ auxiliary losses
def test_the_load_balancing_loss_is_transformers_and_the_z_loss_is_st_moes():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from async_rl.utils.moe import load_balancing_loss, router_z_loss

    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(3)) * 2
    probs = torch.softmax(logits, -1)
    chosen = probs.topk(2, dim=-1).indices
    want = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert float(load_balancing_loss(probs, chosen)) == pytest.approx(float(want), rel=1e-6)
    # Perfect balance (every expert picked equally, uniform probabilities): exactly k.
    uniform = torch.full((8, 8), 1 / 8)
    assert float(load_balancing_loss(uniform, torch.arange(16).view(8, 2) % 8)) == pytest.approx(2.0)
    assert float(router_z_loss(logits)) == pytest.approx(float((torch.logsumexp(logits, -1) ** 2).mean()), rel=1e-6)


def test_the_auxiliary_losses_train_the_router_and_are_reported(moe_path):
    """With ``moe_aux_loss_coef`` the router's gradient gains the balancing term's: one step from
    the same weights on the same batch moves the routers differently, and both terms are reported."""
    from async_rl.config import load_config
    from async_rl.learners.fsdp import FSDPLearner

    def step(coef: float):
        cfg = load_config(ROOT / "configs/default.yaml", [f"model.path={MOE}", f"algorithm.moe_aux_loss_coef={coef}",
                                                           f"algorithm.moe_z_loss_coef={coef}", "learner.num_mini_batches=1"])
        learner = FSDPLearner(cfg.learner, cfg.algorithm, moe_path, temperature=1.0, total_optimizer_steps=10)
        batch = collate([_traj(4, 3, tid="0/0"), _traj(2, 2, tid="0/1")], pad_token_id=0)
        batch.advantages = batch.loss_mask * torch.tensor([[1.0], [-1.0]])
        learner.prepare(batch)
        metrics = learner.train_step(batch)
        return {k: float(v) for k, v in metrics.items()}, learner.model.model.layers[0].mlp.gate.weight.detach().clone()

    m0, w0 = step(0.0)
    m1, w1 = step(0.5)
    assert m0["moe/aux_loss"] == pytest.approx(m1["moe/aux_loss"]) and m0["moe/aux_loss"] > 0
    assert m0["moe/z_loss"] > 0 and not torch.allclose(w0, w1, atol=1e-7)
    with pytest.raises(ValueError, match="algorithm.moe_z_loss_coef must be >= 0, got -1.0"):
        load_config(ROOT / "configs/default.yaml", ["algorithm.moe_z_loss_coef=-1"])


@pytest.mark.parametrize("packing", [False, True])
def test_the_megatron_learner_replays_the_same_routing_as_fsdp2(moe_path, packing, monkeypatch):
    """The batch's recorded routing (forced away from both learners' own) gives the same log-probs
    on megatron-core's MoE layers as on transformers' (both replaying), padded rows for sequence
    parallelism included (their pad tokens route themselves)."""
    from async_rl.config import load_config
    from async_rl.learners.megatron import MegatronLearner

    a = _traj(4, 3, np.ones((6, 4, 2), np.int16) * np.array([2, 5], np.int16), "0/0")
    b = _traj(2, 2, np.ones((3, 4, 2), np.int16) * np.array([0, 3], np.int16), "0/1")
    batch = collate([a, b], pad_token_id=0)
    fsdp = _learner(moe_path, packing)
    cfg = load_config(ROOT / "configs/default.yaml", [f"model.path={MOE}", "learner.backend=megatron",
                                                       f"learner.packing={str(packing).lower()}",
                                                       "algorithm.routing_replay=true"])
    megatron = MegatronLearner(cfg.learner, cfg.algorithm, moe_path, temperature=1.0, total_optimizer_steps=10)
    with torch.no_grad():
        want = fsdp._forward(batch, with_entropy=False)[0]
        got = megatron._forward(batch, with_entropy=False)[0]
        monkeypatch.setattr(megatron, "_sequence_multiple", lambda: 5)
        padded = megatron._forward(batch, with_entropy=False)[0]
        megatron.algo.routing_replay = False
        own = megatron._forward(batch, with_entropy=False)[0]
    real = batch.attention_mask[:, 1:].bool()  # slots predicting padding hold what each layout leaves there
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[real], want[real], rtol=0, atol=1e-5)
    assert not torch.allclose(own[real], want[real], atol=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_with_replay_the_learner_uses_the_vllm_engines_experts(moe_path, moe_model):
    """The vLLM engine serves routers that differ from the learner's (a push of the same weights
    with noise on the routers only, standing in for an engine whose numerics pick other experts):
    without replay the learner's routers pick other experts for some tokens; with replay it uses
    exactly the ones the engine recorded, every token, every layer."""
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.vllm import VLLMGenerator
    from async_rl.utils.moe import RoutingRecorder, replay_routing
    from async_rl.weight_sync import ModuleWeights

    engine = VLLMGenerator(moe_path, GeneratorConfig(backend="vllm", max_batch_size=16), num_threads=2)
    try:
        torch.manual_seed(0)
        noisy = [(n, t + 0.3 * torch.randn_like(t) if n.endswith("mlp.gate.weight") else t)
                 for n, t in ModuleWeights(moe_model).named_weights()]
        engine.update_weights(noisy, version=1)
        prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42], [11, 12, 13, 14]]
        samples = [s for group in engine.generate(prompts, 2, SamplingParams(max_tokens=6, stop_token_ids=(1,),
                                                                                   return_routed_experts=True))
                   for s in group]
    finally:
        engine.close()
    prompt_of = [p for p in prompts for _ in range(2)]
    differ = 0
    for prompt, s in zip(prompt_of, samples):
        ids = torch.tensor([prompt + s.response_ids[:-1]])
        recorded = torch.from_numpy(s.routed_experts).long()
        assert recorded.shape == (ids.shape[1], 4, 2)
        with torch.no_grad(), RoutingRecorder(moe_model) as rec:
            moe_model(ids)
            own = rec.take().long()
            with replay_routing(moe_model, recorded):
                moe_model(ids)
            used = rec.take().long()
        assert torch.equal(used.sort(-1).values, recorded.sort(-1).values)
        differ += int((own.sort(-1).values != recorded.sort(-1).values).any(-1).sum())
    assert differ > 0  # without replay the learner would have routed some tokens elsewhere


def test_both_learners_report_the_same_router_statistics(moe_path):
    """Recorded routing that differs from the learners' own (replay off): one step of each learner
    from the same weights on the same batch reports the same agreement (proximal pass) and the same
    per-expert load (training passes)."""
    from async_rl.config import load_config
    from async_rl.learners.fsdp import FSDPLearner
    from async_rl.learners.megatron import MegatronLearner

    routed = np.ones((6, 4, 2), np.int16) * np.array([2, 5], np.int16)
    routed[::2] = _routing_of(_learner(moe_path, False).model, list(range(3, 7)) + [7, 7])[::2].numpy()
    metrics = {}
    for backend, cls in (("fsdp2", FSDPLearner), ("megatron", MegatronLearner)):
        cfg = load_config(ROOT / "configs/default.yaml", [f"model.path={MOE}", f"learner.backend={backend}",
                                                           "learner.num_mini_batches=1", "algorithm.record_routing=true"])
        learner = cls(cfg.learner, cfg.algorithm, moe_path, temperature=1.0, total_optimizer_steps=10)
        batch = collate([_traj(4, 3, routed, "0/0"), _traj(4, 3, routed, "0/1")], pad_token_id=0)
        batch.advantages = batch.loss_mask * torch.tensor([[1.0], [-1.0]])
        learner.prepare(batch)
        metrics[backend] = {k: float(v) for k, v in learner.train_step(batch).items() if k.startswith("moe/")}
    fsdp, megatron = metrics["fsdp2"], metrics["megatron"]
    assert 0.3 < fsdp["moe/router_agreement"] < 1.0
    for key in ("moe/router_agreement", "moe/load_max", "moe/load_min", "moe/load_cv"):
        assert megatron[key] == pytest.approx(fsdp[key], abs=1e-9), key
