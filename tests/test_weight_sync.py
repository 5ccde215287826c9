"""The weight sync layer: bucket layout, HF -> engine name mapping, the shm and broadcast
transports (exact bytes, slot reuse, errors before any byte moves, timeouts), and the HF engine
receiving through it."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from weight_helpers import WithExtraWeight

from async_rl.weight_sync import (LocalTarget, ModuleWeights, UpdatePlan, WeightPublisher, WeightReceiver, WeightSender,
                                  WeightSyncConfig, map_to_engine, pack_bucket, plan_update, resolve_transport,
                                  unpack_bucket)

QWEN2_ENGINE = [  # vLLM's parameter names for one Qwen2 layer, q/k/v and gate/up fused
    "model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
QWEN2_HF = [
    "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias",
    "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"]


# ---------------------------------------------------------------------------------------- layout
def test_plan_packs_and_unpacks_exactly_with_aliases_and_wire_dtype():
    torch.manual_seed(0)
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7)), ("big", torch.randn(40, 40)), ("c", torch.randn(2, 2))]
    plan = plan_update([(n, t.dtype, t.shape) for n, t in named], 4, bucket_bytes=256, aliases={"tied": "a"})
    # 'big' (6400 bytes) exceeds a 256-byte bucket: it gets one of its own; the rest share buckets.
    assert [[m.name for m in b] for b in plan.buckets] == [["a", "b", "tied"], ["big"], ["c"]]
    assert all(m.offset % 64 == 0 for b in plan.buckets for m in b)
    plan = UpdatePlan.from_dict(plan.to_dict())  # through the control plane
    got = {}
    for metas, size in zip(plan.buckets, plan.bucket_nbytes):
        buf = torch.zeros(size, dtype=torch.uint8)
        pack_bucket(buf, metas, dict(named))
        got.update({n: t.clone() for n, t in unpack_bucket(buf, metas)})
    assert set(got) == {"a", "b", "big", "c", "tied"}
    for n, t in named:
        assert torch.equal(got[n], t)
    assert torch.equal(got["tied"], got["a"])
    bf16 = plan_update([(n, t.dtype, t.shape) for n, t in named], 4, 1 << 20, wire_dtype=torch.bfloat16)
    assert bf16.total_bytes < plan.total_bytes and {m.dtype for b in bf16.buckets for m in b} == {"bfloat16"}


def test_plan_rejects_duplicates_and_dangling_aliases():
    with pytest.raises(ValueError, match="'a' listed twice"):
        plan_update([("a", torch.float32, (2,)), ("a", torch.float32, (2,))], 0, 64)
    with pytest.raises(ValueError, match="'lm_head.weight' points at 'embed'"):
        plan_update([("a", torch.float32, (2,))], 0, 64, aliases={"lm_head.weight": "embed"})


# ---------------------------------------------------------------------------------------- names
def test_name_map_untied_is_one_to_one_onto_fused_engine_parameters():
    engine = QWEN2_ENGINE + ["lm_head.weight"]
    mapping = map_to_engine(QWEN2_HF + ["lm_head.weight"], engine, PACKED)
    assert len(mapping) == len(QWEN2_HF) + 1 and len(set(mapping.values())) == len(mapping)
    assert mapping["model.layers.0.self_attn.k_proj.bias"] == ("model.layers.0.self_attn.qkv_proj.bias", "k_proj")
    assert mapping["model.layers.0.mlp.up_proj.weight"] == ("model.layers.0.mlp.gate_up_proj.weight", "up_proj")
    assert {e for e, _ in mapping.values()} == set(engine)


def test_name_map_tied_head_is_an_alias_of_the_embedding():
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    mapping = map_to_engine(QWEN2_HF + ["lm_head.weight"], QWEN2_ENGINE, PACKED, tied)
    assert mapping["lm_head.weight"] == ("model.embed_tokens.weight", "tied")
    assert {e for e, _ in mapping.values()} == set(QWEN2_ENGINE)


def test_name_map_errors_name_the_weight():
    with pytest.raises(KeyError, match="model.layers.0.self_attn.qq_proj.weight"):
        map_to_engine(QWEN2_HF + ["model.layers.0.self_attn.qq_proj.weight"], QWEN2_ENGINE, PACKED)
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[v_proj\]"):
        map_to_engine([n for n in QWEN2_HF if n != "model.layers.0.self_attn.v_proj.weight"], QWEN2_ENGINE, PACKED)
    with pytest.raises(ValueError, match="model.norm.weight"):
        map_to_engine([n for n in QWEN2_HF if n != "model.norm.weight"], QWEN2_ENGINE, PACKED)


def test_transport_resolution_and_config_errors():
    from async_rl.config import ConfigError, load_config

    cfg = WeightSyncConfig()
    assert resolve_transport(cfg, "hf", "sync") == "colocated"
    assert resolve_transport(cfg, "hf", "async") == resolve_transport(cfg, "vllm", "sync") == "shm"
    with pytest.raises(ValueError, match="weight_sync.transport"):
        WeightSyncConfig(transport="nccl-ish")
    with pytest.raises(ConfigError, match="colocated"):
        load_config("configs/default.yaml", ["trainer.mode=async", "weight_sync.transport=colocated"])


# ---------------------------------------------------------------------------------------- transports
def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"layer{i}.w", torch.randn(64, 33, generator=g)) for i in range(12)] + [("embed", torch.randn(50, 8, generator=g))]


def _run(transport: str, num_receivers: int, named, check=None, **cfg_kw):
    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=0.02, **cfg_kw)
    sender = WeightSender(cfg, num_receivers)
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        try:
            rx = WeightReceiver(sender.init_info(), rank)
            rx.connect()
            out = {}
            for bucket in rx.receive(UpdatePlan.from_dict(plan.to_dict()), check=check):
                out.update({n: t.clone() for n, t in bucket})
            received[rank] = out
        except BaseException as e:
            errors.append(e)

    plan = sender.plan(named, 7, aliases={"lm_head.weight": "embed"})
    threads = [threading.Thread(target=receive, args=(r,)) for r in range(num_receivers)]
    for t in threads:
        t.start()
    try:
        sender.connect()
        metrics = sender.send(plan, named)
    finally:
        for t in threads:
            t.join(timeout=30)
        sender.close()
    return plan, received, errors, metrics


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_transport_delivers_every_byte_to_every_receiver(transport):
    named = _named()
    plan, received, errors, metrics = _run(transport, 2, named)
    assert not errors
    assert len(plan.buckets) > 2  # more buckets than shm slots: slots were reused
    assert metrics["weight_sync/bytes"] == plan.total_bytes
    for r in range(2):
        assert set(received[r]) == {n for n, _ in named} | {"lm_head.weight"}
        for n, t in named:
            assert torch.equal(received[r][n], t), (r, n)
        assert torch.equal(received[r]["lm_head.weight"], dict(named)["embed"])


def test_receiver_refusing_the_plan_fails_the_sync_before_any_byte_moves():
    def check(names):
        raise KeyError("weight 'layer3.w' maps to no parameter of the engine's model")

    with pytest.raises(RuntimeError, match="layer3.w"):
        _run("shm", 2, _named(), check=check)


def test_a_receiver_that_never_connects_times_out_with_a_diagnostic():
    cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.02, timeout_s=1.0)
    sender = WeightSender(cfg, 2)
    named = _named()
    plan = sender.plan(named, 1)
    with pytest.raises(TimeoutError, match=r"0/2 receivers ready"):
        sender.send(plan, named)
    sender.close()


# ---------------------------------------------------------------------------------------- HF engine
@pytest.fixture(scope="module")
def hf_engine(tiny_model_path, tiny_tokenizer):
    from generators.base import GeneratorConfig
    from generators.hf import HFGenerator

    return HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=64), tiny_tokenizer.pad_token_id)


@pytest.mark.parametrize("transport", ["shm", "broadcast", "colocated"])
def test_hf_engine_loads_every_transport_exactly(hf_engine, tiny_model_path, transport):
    from transformers import AutoModelForCausalLM

    src = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    learner = ModuleWeights(src)
    assert learner.weight_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.5), transport, learner,
                          [LocalTarget(hf_engine)])
    pub.push(10)
    metrics = pub.push(11)  # a second update on the same sender and slots (the first one's keys are dropped)
    if pub.sender is not None:
        first = pub.sender._last_plan  # the plan of version 11; version 10's keys are gone
        assert pub.sender.store.check([f"{first.update_id}/ready"])
        assert pub.sender.store.num_keys() <= 3 + 2 * len(first.buckets)
    pub.close()
    assert hf_engine.policy_version == 11 and pub.published_version == 11
    for (n, a), (_, b) in zip(hf_engine.model.named_parameters(), src.named_parameters()):
        assert torch.equal(a, b), n
    if transport != "colocated":
        assert metrics["weight_sync/bytes"] > 0
    # The tie survived: the head is still the embedding.
    assert hf_engine.model.lm_head.weight.data_ptr() == hf_engine.model.model.embed_tokens.weight.data_ptr()


def test_hf_engine_refuses_an_unknown_name_and_stays_untouched(hf_engine):
    before = {n: p.detach().clone() for n, p in hf_engine.model.named_parameters()}
    learner = WithExtraWeight(hf_engine.model, "model.layers.0.mlp.gate_prj.weight", torch.zeros(3), offset=1.0)
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", learner, [LocalTarget(hf_engine)])
    version = hf_engine.policy_version
    with pytest.raises(RuntimeError, match="gate_prj"):
        pub.push(version + 1)
    pub.close()
    assert hf_engine.policy_version == version and pub.published_version is None
    for n, p in hf_engine.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_bucket_never_splits_a_decoder_layer():
    # A loader may keep a partial layer's tensors until the layer is whole (vLLM's layerwise
    # reload does), so a layer's q/k/v never straddle two buckets.
    shapes = [("model.embed_tokens.weight", torch.float32, (10, 4))]
    for i in range(3):
        shapes += [(f"model.layers.{i}.q.weight", torch.float32, (25,)), (f"model.layers.{i}.k.weight", torch.float32, (25,))]
    plan = plan_update(shapes, 0, bucket_bytes=150)
    layers = [{m.name.split(".")[2] for m in b if m.name.startswith("model.layers")} for b in plan.buckets]
    assert [len(x) for x in layers] == [0, 1, 1, 1]
    assert all(len(b) == 2 for b in plan.buckets[1:])  # q and k of one layer together, over the 150 bytes


def test_a_sender_failure_mid_update_stops_the_receivers_at_once():
    # Regression: a sender error after bucket 0 left shm receivers waiting out timeout_s.
    cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.02, timeout_s=60)
    sender = WeightSender(cfg, 2)
    named = _named()
    plan = sender.plan(named, 1)
    bad = named[:6] + [(named[6][0], torch.zeros(3))] + named[7:]  # wrong shape in a later bucket
    errors: list[BaseException] = []

    def receive(rank):
        rx = WeightReceiver(sender.init_info(), rank)
        rx.connect()
        try:
            for _ in rx.receive(plan):
                pass
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    sender.unlink_slots()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=named[6][0]):
        sender.send(plan, bad)
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - t0 < 10
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) and "sender: ValueError" in str(e) for e in errors)
    sender.close()


def test_shm_slot_files_are_gone_once_receivers_hold_them(hf_engine):
    import os

    learner = ModuleWeights(hf_engine.model)
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.5), "shm", learner, [LocalTarget(hf_engine)])
    paths = [p for p, _ in pub.sender.init_info()["slots"]]
    assert paths and not any(os.path.exists(p) for p in paths)  # unlinked, still mapped
    pub.push(hf_engine.policy_version + 1)  # and still carrying updates
    pub.close()
