"""The weight sync layer: bucket layout, HF -> engine name mapping, the whole-update check (names,
shards, shapes, dtypes, tied heads, every problem in one line), the shm and broadcast transports
(exact bytes, slot reuse, errors before any byte moves, a failing receiver stopping the sender,
timeouts), and the HF engine receiving through it."""

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


def _run(transport: str, num_receivers: int, named, check=None, receiver_transports=None, receivers=None, **cfg_kw):
    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=0.02, **cfg_kw)
    sender = WeightSender(cfg, num_receivers, receiver_transports=receiver_transports)
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        try:
            rx = WeightReceiver(sender.init_info(), rank)
            if receivers is not None:
                receivers[rank] = rx
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
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

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


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_hf_engine_copies_each_update_once_into_reused_staging_and_swaps_it_in(tiny_model_path, tiny_tokenizer,
                                                                                 transport):
    # receive_weights stages into the tensors the previous update swapped out: the parameters'
    # storage alternates between two sets (no fresh memory per update), the learner's bytes land
    # exactly, the tie holds, and the engine reports each phase it timed.
    from transformers import AutoModelForCausalLM

    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    src = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.5), transport, ModuleWeights(src),
                          [LocalTarget(engine)])
    ptrs = lambda: [p.data_ptr() for p in engine.model.parameters()]  # noqa: E731
    seen = [ptrs()]
    try:
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in src.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            pub.push(version)
            seen.append(ptrs())
            for (n, a), (_, b) in zip(engine.model.named_parameters(), src.named_parameters()):
                assert torch.equal(a, b), (version, n)
            assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    finally:
        pub.close()
    assert seen[2] == seen[0] and seen[3] == seen[1] and not set(seen[0]) & set(seen[1])
    assert engine.policy_version == 3
    metrics = engine.last_weight_sync_metrics()
    assert set(metrics) == {"weight_sync/engine_s", "weight_sync/engine_copy_s", "weight_sync/engine_wait_s",
                            "weight_sync/engine_apply_s"}
    assert metrics["weight_sync/engine_copy_s"] > 0


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
    cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.02, timeout_s=300)
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
    with pytest.raises(ValueError, match=named[6][0]):
        sender.send(plan, bad)
    for t in threads:  # a guard against a hang, far below timeout_s: they must not wait it out
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
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


# ---------------------------------------------------------------------------------------- all or nothing
QWEN2_SPECS = {  # the HF layout a one-layer Qwen2 engine loads (hidden 8, 2 heads of 4, 1 KV head, MLP 16)
    "model.embed_tokens.weight": ("float32", (10, 8)), "lm_head.weight": ("float32", (10, 8)),
    "model.layers.0.self_attn.q_proj.weight": ("float32", (8, 8)), "model.layers.0.self_attn.k_proj.weight": ("float32", (4, 8)),
    "model.layers.0.self_attn.v_proj.weight": ("float32", (4, 8)), "model.layers.0.self_attn.q_proj.bias": ("float32", (8,)),
    "model.layers.0.self_attn.k_proj.bias": ("float32", (4,)), "model.layers.0.self_attn.v_proj.bias": ("float32", (4,)),
    "model.layers.0.self_attn.o_proj.weight": ("float32", (8, 8)), "model.layers.0.mlp.gate_proj.weight": ("float32", (16, 8)),
    "model.layers.0.mlp.up_proj.weight": ("float32", (16, 8)), "model.layers.0.mlp.down_proj.weight": ("float32", (8, 16)),
    "model.layers.0.input_layernorm.weight": ("float32", (8,)),
    "model.layers.0.post_attention_layernorm.weight": ("float32", (8,)), "model.norm.weight": ("float32", (8,))}
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _sent(**changes):
    """Every HF tensor of the tied one-layer model as the engine wants it, the head as an alias;
    ``changes``: ``{short name: (dtype, shape) or None (left out)}``, short = the last two segments."""
    out = []
    for n in QWEN2_HF + ["lm_head.weight"]:
        dtype, shape = QWEN2_SPECS[n]
        alias = "model.embed_tokens.weight" if n == "lm_head.weight" else None
        key = ".".join(n.split(".")[-2:])
        if key in changes:
            if changes[key] is None:
                continue
            dtype, shape = changes[key]
            alias = None if n == "lm_head.weight" else alias
        out.append((n, dtype, shape, alias))
    return out


@pytest.mark.parametrize("sent,error,fragments", [
    (_sent() + [("model.layers.0.mlp.gate_prj.weight", "float32", (16, 8), None)], KeyError,
     ["unknown weights", "gate_prj"]),
    (_sent(**{"v_proj.weight": None}), ValueError, [r"qkv_proj.weight[v_proj]", "without a tensor"]),
    (_sent(**{"k_proj.weight": ("float32", (8, 8))}), ValueError,
     ["'model.layers.0.self_attn.k_proj.weight' got (8, 8), engine expects (4, 8)"]),
    (_sent(**{"down_proj.weight": ("float32", (16, 8))}), ValueError, ["down_proj.weight' got (16, 8)", "(8, 16)"]),
    (_sent(**{"norm.weight": ("int64", (8,))}), ValueError, ["'model.norm.weight' got int64, engine holds float32"]),
    (_sent(**{"norm.weight": ("bool", (8,))}), ValueError, ["got bool", "the wire does not carry it"]),
    (_sent(**{"lm_head.weight": ("float32", (10, 8))}), ValueError, ["'lm_head.weight' and 'model.embed_tokens.weight'"]),
    (_sent(**{"norm.weight": ("int32", (8,)), "up_proj.weight": ("float32", (8, 16)), "o_proj.weight": None}), ValueError,
     ["o_proj.weight", "up_proj.weight' got (8, 16)", "norm.weight' got int32"]),
], ids=["unknown", "missing-shard", "fused-shard-shape", "shape", "int-dtype", "bool-dtype", "tied-twice", "all-at-once"])
def test_check_update_refuses_the_whole_update_naming_every_problem(sent, error, fragments):
    from async_rl.weight_sync import WeightUpdateError, check_update

    with pytest.raises(error) as err:
        check_update(sent, QWEN2_ENGINE, PACKED, TIED, QWEN2_SPECS)
    assert isinstance(err.value, WeightUpdateError)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_check_update_accepts_floats_of_any_precision_and_the_tied_head_as_alias():
    from async_rl.weight_sync import check_update, converts_to

    # The documented dtype rule: floating point converts to the engine's dtype, nothing else does.
    assert converts_to(torch.bfloat16, torch.float32) and converts_to("float64", "bfloat16")
    assert not converts_to(torch.int64, torch.float32) and not converts_to("bool", "float32")
    assert not converts_to(torch.float32, torch.int64) and converts_to("int64", torch.int64)
    sent = _sent(**{"q_proj.weight": ("bfloat16", (8, 8)), "norm.weight": ("float16", (8,)),
                    "down_proj.weight": ("float64", (8, 16))})
    mapping = check_update(sent, QWEN2_ENGINE, PACKED, TIED, QWEN2_SPECS)
    assert mapping["lm_head.weight"] == ("model.embed_tokens.weight", "tied")


def test_the_wire_refuses_dtypes_it_cannot_carry_and_tensors_that_contradict_the_plan():
    with pytest.raises(ValueError, match="'flags': dtype bool cannot travel"):
        plan_update([("w", torch.float32, (4,)), ("flags", torch.bool, (4,))], 0, 1024)
    plan = plan_update([("w", torch.float32, (4,))], 0, 1024)
    buf = torch.zeros(plan.bucket_nbytes[0], dtype=torch.uint8)
    with pytest.raises(ValueError, match="'w': dtype int64 does not convert to the plan's float32"):
        pack_bucket(buf, plan.buckets[0], {"w": torch.arange(4)})
    assert not buf.any()


@pytest.mark.parametrize("loader", ["raises", "reports"])
def test_a_receiver_failing_mid_update_stops_the_sender_with_its_error(loader):
    # Regression: a loader that raised mid-update left the sender waiting for its acknowledgement
    # until timeout_s (TimeoutError). One that reports its own error first has that one win.
    cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.02, timeout_s=30)
    sender = WeightSender(cfg, 1)
    named = _named()
    plan = sender.plan(named, 1)
    assert len(plan.buckets) > cfg.num_slots + 1  # the sender must wait for acknowledgements

    def receive():
        rx = WeightReceiver(sender.init_info(), 0)
        rx.connect()
        try:
            for i, _ in enumerate(rx.receive(plan)):
                if i == 1:
                    if loader == "reports":
                        rx.fail(plan, "OSError: disk on fire while loading bucket 1")
                    raise OSError("disk on fire while loading bucket 1")
        except OSError:
            pass

    th = threading.Thread(target=receive)
    th.start()
    sender.unlink_slots()
    expected = "disk on fire" if loader == "reports" else "receiver 0: stopped at bucket 1 of"
    with pytest.raises(RuntimeError, match=expected):
        sender.send(plan, named)
    th.join(timeout=30)
    sender.close()


def test_sglang_protocol_packs_buckets_back_to_back_as_flattened_buckets():
    # SGLang's update_weights_from_distributed(load_format="flattened_bucket") allocates one
    # tensor of the summed sizes and slices it in order: the plan must have no padding.
    meta = [("model.embed_tokens.weight", torch.float32, (7, 3)), ("model.layers.0.mlp.up_proj.weight", torch.float32, (5, 3)),
            ("model.layers.0.mlp.up_proj.bias", torch.float32, (5,)), ("model.norm.weight", torch.float32, (3,))]
    packed = plan_update(meta, 1, 1 << 20, align=1)
    offsets = [m.offset for b in packed.buckets for m in b]
    assert offsets == [0, 84, 144, 164] and packed.bucket_nbytes == [176]
    padded = plan_update(meta, 1, 1 << 20)
    assert [m.offset for b in padded.buckets for m in b] == [0, 128, 192, 256]
    # Mixed dtypes can leave a float32 tensor at an odd offset: refused, naming the fix.
    with pytest.raises(ValueError, match="wire_dtype"):
        plan_update([("a", torch.float16, (3,)), ("b", torch.float32, (2,))], 1, 1 << 20, align=1)
    cfg = WeightSyncConfig(transport="shm")
    sender = WeightSender(cfg, 1, protocol="sglang")
    try:
        assert sender.init_info()["protocol"] == "sglang"
        assert [m.offset for b in sender.plan_shapes(meta, 1).buckets for m in b] == offsets
    finally:
        sender.close()
    with pytest.raises(ValueError, match="protocol"):
        WeightSender(cfg, 1, protocol="grpc")


def test_sglang_transport_resolution():
    from async_rl.weight_sync import engine_protocol

    auto = WeightSyncConfig()
    assert resolve_transport(auto, "sglang", "sync") == "colocated"
    assert resolve_transport(auto, "sglang", "async") == "shm"
    assert [engine_protocol(b) for b in ("hf", "vllm", "sglang")] == ["async_rl", "async_rl", "sglang"]


# ---------------------------------------------------------------------------------------- shm + broadcast in one update
def test_a_mixed_update_delivers_every_byte_to_shm_and_broadcast_receivers():
    # Engines on the learner's host read the slots, the others take the same bytes by broadcast.
    named, receivers = _named(), {}
    plan, received, errors, metrics = _run("auto", 3, named, receiver_transports=["shm", "broadcast", "shm"],
                                           receivers=receivers, timeout_s=30)
    assert not errors
    assert len(plan.buckets) > 2  # more buckets than slots: the broadcast receiver's acks gate slot reuse too
    assert metrics["weight_sync/bytes"] == plan.total_bytes  # packed once, not once per receiver
    for r in range(3):
        assert set(received[r]) == {n for n, _ in named} | {"lm_head.weight"}
        for n, t in named:
            assert torch.equal(received[r][n], t), (r, n)
        assert torch.equal(received[r]["lm_head.weight"], dict(named)["embed"])
    assert [(rx.transport, rx.group_rank) for _, rx in sorted(receivers.items())] == [
        ("shm", None), ("broadcast", 1), ("shm", None)]
    assert receivers[0]._maps and not receivers[1]._maps  # a remote engine has no slot files to map


def test_mixed_sender_init_info_lists_each_receivers_transport_and_group_rank():
    cfg = WeightSyncConfig(transport="auto", bucket_size_mb=0.02)
    mixed = WeightSender(cfg, 4, receiver_transports=["broadcast", "shm", "broadcast", "shm"])
    uniform = WeightSender(cfg, 2, receiver_transports=["shm", "shm"])
    remote = WeightSender(cfg, 2, receiver_transports=["broadcast", "broadcast"])
    try:
        info = mixed.init_info()
        assert info["transport"] == "shm+broadcast" and info["transports"] == ["broadcast", "shm", "broadcast", "shm"]
        assert info["group_ranks"] == [1, None, 2, None] and info["world_size"] == 3 and info["num_receivers"] == 4
        assert len(info["slots"]) == cfg.num_slots
        # A list of equal entries is that single transport: no group, or no slots.
        assert (uniform.init_info()["transport"], uniform.init_info()["world_size"]) == ("shm", 1)
        assert remote.init_info()["transport"] == "broadcast" and remote.init_info()["slots"] == []
        assert (remote.init_info()["group_ranks"], remote.init_info()["world_size"]) == ([1, 2], 3)
    finally:
        for s in (mixed, uniform, remote):
            s.close()


def test_transports_for_targets_by_host():
    from async_rl.weight_sync import transports_for_targets

    auto = WeightSyncConfig()
    here_there_here = [True, False, True]
    assert transports_for_targets(auto, "vllm", "async", here_there_here) == ["shm", "broadcast", "shm"]
    assert transports_for_targets(auto, "hf", "async", here_there_here) == ["shm", "broadcast", "shm"]
    assert transports_for_targets(auto, "hf", "async", [True, True]) == ["shm", "shm"]
    # SGLang cannot mix: one remote engine makes every engine broadcast.
    assert transports_for_targets(auto, "sglang", "async", [True, False]) == ["broadcast", "broadcast"]
    assert transports_for_targets(auto, "sglang", "async", [True, True]) == ["shm", "shm"]
    # Sync mode: as resolve_transport (the engine lives in the learner's process, or beside it).
    assert transports_for_targets(auto, "hf", "sync", [True]) == ["colocated"]
    assert transports_for_targets(auto, "vllm", "sync", [True, True]) == ["shm", "shm"]
    # A forced transport applies to every target, wherever it runs.
    for forced in ("shm", "broadcast"):
        cfg = WeightSyncConfig(transport=forced)
        assert transports_for_targets(cfg, "vllm", "async", here_there_here) == [forced] * 3
    assert transports_for_targets(auto, "vllm", "async", []) == []


def test_a_sender_failure_mid_mixed_update_stops_both_kinds_of_receiver():
    # Both read the sender's error key while they wait: the shm receiver for the next bucket's
    # key, the broadcast receiver between slices of its collective (or when the group's
    # connection closes as the sender drops it). Neither waits out timeout_s (300 s) nor yields
    # a bucket past the failure, and the broadcast one leaves its group, taking no further update.
    cfg = WeightSyncConfig(bucket_size_mb=0.02, timeout_s=300)
    sender = WeightSender(cfg, 2, receiver_transports=["shm", "broadcast"])
    named = _named()
    plan = sender.plan(named, 1)
    bad = named[:6] + [(named[6][0], torch.zeros(3))] + named[7:]  # wrong shape in a later bucket
    first_bad = next(i for i, b in enumerate(plan.buckets) if any(m.name == named[6][0] for m in b))
    assert first_bad > 0
    outcomes: dict[int, tuple[int, BaseException]] = {}
    receivers: dict[int, WeightReceiver] = {}

    def receive(rank):
        rx = receivers[rank] = WeightReceiver(sender.init_info(), rank)
        rx.connect()
        n = 0
        try:
            for _ in rx.receive(plan):
                n += 1
        except BaseException as e:
            outcomes[rank] = (n, e)

    threads = [threading.Thread(target=receive, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    sender.connect()
    sender.unlink_slots()
    with pytest.raises(ValueError, match=named[6][0]):
        sender.send(plan, bad)
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)  # not at the 300 s timeout
    sender.close()
    assert sorted(outcomes) == [0, 1]
    for n, e in outcomes.values():
        assert isinstance(e, RuntimeError) and "sender: ValueError" in str(e) and named[6][0] in str(e), e
        assert n == first_bad
    # The group is gone on both sides: the sender refuses another update, naming why, and so
    # does the broadcast receiver (the publisher rebuilds the transport instead).
    assert sender.broken is not None and receivers[1].broken is not None and receivers[0].broken is None
    with pytest.raises(RuntimeError, match="rebuild the transport"):
        sender.send(sender.plan(named, 2), named)
    with pytest.raises(RuntimeError, match="connect a new receiver"):
        receivers[1].connect()


def test_mixed_transport_lists_are_refused_where_they_cannot_work():
    from async_rl.weight_sync import make_transport

    cfg = WeightSyncConfig(bucket_size_mb=0.02)
    with pytest.raises(ValueError, match="receiver_transports has 1 entries for 2 receivers"):
        WeightSender(cfg, 2, receiver_transports=["shm"])
    with pytest.raises(ValueError, match="shm or broadcast, not 'colocated'"):
        WeightSender(cfg, 2, receiver_transports=["shm", "colocated"])
    with pytest.raises(ValueError, match="weight_sync.transport=shm or broadcast") as err:
        WeightSender(cfg, 2, protocol="sglang", receiver_transports=["shm", "broadcast"])
    assert "SGLang" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="3 transports for 2 targets"):
        make_transport(cfg, ["shm", "broadcast", "shm"], [object(), object()])
    with pytest.raises(ValueError, match="colocated cannot mix"):
        make_transport(cfg, ["colocated", "shm"], [object(), object()])
    with pytest.raises(ValueError, match="'auto'"):
        make_transport(cfg, ["auto", "auto"], [object(), object()])


def test_publisher_mixes_shm_and_broadcast_into_two_hf_engines(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

    engines = [HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=8), tiny_tokenizer.pad_token_id)
               for _ in range(2)]
    src = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    assert not any(torch.equal(a, b) for (_, a), (_, b) in zip(engines[1].model.named_parameters(),
                                                                src.named_parameters()))
    pub = WeightPublisher(WeightSyncConfig(bucket_size_mb=0.5, timeout_s=60), ["shm", "broadcast"], ModuleWeights(src),
                          [LocalTarget(e) for e in engines])
    try:
        assert pub.transport_name == "shm+broadcast"
        assert [e._receiver.transport for e in engines] == ["shm", "broadcast"]
        pub.push(1)
        with torch.no_grad():
            for p in src.parameters():
                p.mul_(1.5)
        metrics = pub.push(2)  # the same slots and group carry a second update
        plan = pub.sender._last_plan
    finally:
        pub.close()
    assert len(plan.buckets) > pub.cfg.num_slots
    assert metrics["weight_sync/bytes"] == plan.total_bytes  # once per update, not once per engine
    assert pub.published_version == 2
    for k, engine in enumerate(engines):
        assert engine.policy_version == 2, k
        for (n, a), (_, b) in zip(engine.model.named_parameters(), src.named_parameters()):
            assert torch.equal(a, b), (k, n)
        assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()


class _JoiningEngine:
    """Connects like an engine would (joins the broadcast group)."""

    def connect_weight_sync(self, init_info, rank):
        self.receiver = WeightReceiver(init_info, rank)
        self.receiver.connect()


class _BrokenEngine:
    """Fails to connect, as a receiver on a node whose interface gloo cannot use."""

    def connect_weight_sync(self, init_info, rank):
        raise OSError("no interface holds 10.0.0.2")


def test_a_receiver_that_fails_to_connect_is_named_at_once_not_after_the_group_timeout():
    # Regression (found on the two-node test): the sender formed the broadcast group before
    # looking at the receivers, so one that had failed left it waiting out weight_sync.timeout_s
    # with a store error naming no one. The engines' threads give up at the same timeout.
    from async_rl.weight_sync import NamedTensors

    cfg = WeightSyncConfig(transport="broadcast", timeout_s=8)
    with pytest.raises(RuntimeError, match=r"receiver 1 failed to connect: OSError: no interface holds 10.0.0.2"):
        WeightPublisher(cfg, "broadcast", NamedTensors(_named()),
                        [LocalTarget(_JoiningEngine()), LocalTarget(_BrokenEngine())])


def test_a_broadcast_receiver_reads_the_senders_error_while_the_group_stays_up():
    # The receiver's own poll, without the help of the sender dropping the group: a sender that
    # posts an error while its group lives on (its connections open) still stops the receiver,
    # waiting in bucket 0's collective, within a poll, not at timeout_s (300 s).
    cfg = WeightSyncConfig(transport="broadcast", bucket_size_mb=0.02, timeout_s=300)
    sender = WeightSender(cfg, 1)
    plan = sender.plan(_named(), 1)
    rx = WeightReceiver(sender.init_info(), 0)
    outcome: list = []

    def receive() -> None:
        n = 0
        try:
            for _ in rx.receive(plan):
                n += 1
        except BaseException as e:
            outcome.append((n, e))

    th = threading.Thread(target=receive)
    th.start()
    sender.connect()
    while sender.store.add(f"{plan.update_id}/ready", 0) < 1:
        time.sleep(0.01)
    sender.store.set(f"{plan.update_id}/error", "sender: RuntimeError: learner stalled (test)")
    th.join(timeout=60)
    assert not th.is_alive()
    (n, e), = outcome
    assert n == 0 and isinstance(e, RuntimeError) and "learner stalled (test)" in str(e), e
    assert rx.broken is not None and rx.group is None
    sender._drop_group("test over")  # ends the receiver's abandoned collective (its release thread)
    sender.close()
