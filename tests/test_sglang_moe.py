"""Mixture of experts on SGLang's CPU build (``builtin:tiny-qwen3-moe``: 4 layers, 8 experts, top-2).

SGLang's ``Qwen3MoeForCausalLM`` runs here without its CPU kernels: ``sgl_kernel`` is the
stand-in of ``envs/sglang-cpu`` (no AMX ops registered), so ``cpu_has_amx_support()`` is false,
routing takes SGLang's torch-native top-k and the experts ``moe_forward_native``
(``UnquantizedFusedMoEMethod.forward_cpu``), fp32. The engine loads the checkpoint, generates,
and its log-probs equal transformers' fp32 forward of the same weights (1e-5, as the dense
SGLang tests). A weight update carries each expert's projections under the checkpoint's names
(``mlp.experts.{E}.{gate,up,down}_proj.weight``, what the learners send; SGLang's ``load_weights``
stacks them itself); on every transport, also when a bucket boundary splits a layer's experts,
the engine then equals transformers' forward of the perturbed model, and the original weights
pushed back restore the original log-probs. An update that leaves an expert out, sends
transformers 5's stacked layout or a wrong shape is refused before any byte moves, naming it.
A short sync-mode run trains the model on SGLang. Runs in the venv ``envs/sglang-cpu/build.sh``
builds (skipped elsewhere, saying so).
"""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("sglang", reason="SGLang is not in this venv: these tests run inside .venv-sglang "
                                     "(envs/sglang-cpu/build.sh)")

from async_rl.generators.base import GeneratorConfig, SamplingParams  # noqa: E402
from async_rl.weight_sync import LocalTarget, NamedTensors, WeightPublisher, WeightSyncConfig  # noqa: E402
from update_cases import stacked_experts  # noqa: E402

pytestmark = pytest.mark.slow

SEQS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [3, 30, 40, 50, 60, 70, 80, 90], [100, 7, 230, 18, 64, 1, 2]]
EOS = 261
TOL = 1e-5


@pytest.fixture(scope="module")
def moe_path():
    from async_rl.data.builtin import resolve

    return resolve("builtin:tiny-qwen3-moe")


@pytest.fixture(scope="module")
def checkpoint(moe_path):
    """The model's own tensors, by checkpoint name (one matrix per expert), in file order."""
    from safetensors.torch import load_file

    named = list(load_file(f"{moe_path}/model.safetensors").items())
    assert sum(".mlp.experts." in n for n, _ in named) == 4 * 8 * 3
    return named


def _hf_logprobs(path: str, seqs: list[list[int]]) -> list[list[float]]:
    """transformers' fp32 forward of the checkpoint at ``path``: each token's log-prob given the
    tokens before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0, :-1].float(), dim=-1)
            out.append(lp[torch.arange(len(s) - 1), torch.tensor(s[1:])].tolist())
    return out


@pytest.fixture(scope="module")
def perturbed(checkpoint, moe_path, tmp_path_factory):
    """``(tensors, HF log-probs of SEQS)``: every tensor with noise added (each expert's gate/up/down,
    the routers, attention...), and transformers' forward of a checkpoint holding exactly those."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(11)
    named = [(n, t + torch.randn(t.shape, generator=g) * 0.05) for n, t in checkpoint]
    out = tmp_path_factory.mktemp("moe-perturbed") / "model"
    shutil.copytree(moe_path, out)
    save_file(dict(named), str(out / "model.safetensors"))
    return named, _hf_logprobs(str(out), SEQS)


@pytest.fixture(scope="module")
def original(moe_path):
    """transformers' log-probs of SEQS under the model on disk."""
    return _hf_logprobs(moe_path, SEQS)


@pytest.fixture(scope="module")
def engine(moe_path):
    from async_rl.generators.sglang import SGLangGenerator

    gen = SGLangGenerator(moe_path, GeneratorConfig(backend="sglang", max_response_tokens=32), num_threads=1)
    yield gen
    gen.close()


def _diff(got, want) -> float:
    assert [len(g) for g in got] == [len(w) for w in want]
    return max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))


def _split_order(named):
    """``named`` with layer 1's experts 4.. moved after layer 2: with small buckets layer 1's
    experts then arrive in two buckets with layer 2 between them."""
    moved = {n for n, _ in named if n.startswith("model.layers.1.mlp.experts.") and int(n.split(".")[5]) >= 4}
    late = [(n, t) for n, t in named if n in moved]
    rest = [(n, t) for n, t in named if n not in moved]
    at = max(i for i, (n, _) in enumerate(rest) if n.startswith("model.layers.2.")) + 1
    return rest[:at] + late + rest[at:]


def _push(engine, named, version: int, transport: str) -> None:
    if transport == "update_weights":
        engine.update_weights(named, version)
        return
    pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.05, timeout_s=120), transport,
                          NamedTensors(named), [LocalTarget(engine)], protocol="sglang")
    try:
        pub.push(version)
    finally:
        pub.close()


def test_loads_and_generates_what_transformers_computes(engine, moe_path, checkpoint, original):
    names, packed, tied = engine.weight_names()
    assert sorted(names) == sorted(n for n, _ in checkpoint) and not packed and not tied  # per-expert names
    assert _diff(engine.prompt_logprobs(SEQS), original) < TOL
    params = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(EOS,))
    groups = engine.generate(SEQS[:2], 2, params)
    assert [len(g) for g in groups] == [2, 2]
    for prompt, group in zip(SEQS, groups):
        for s in group:
            assert 0 < len(s.response_ids) == len(s.logprobs) <= 8 and set(s.policy_version) == {0}
            want = _hf_logprobs(moe_path, [prompt + s.response_ids])[0][len(prompt) - 1:]
            assert _diff([s.logprobs], [want]) < TOL


@pytest.mark.parametrize("transport", ["update_weights", "shm", "broadcast"])
def test_a_per_expert_update_equals_transformers_on_the_perturbed_model(engine, checkpoint, perturbed, original,
                                                                       transport):
    """Buckets of 0.05 MiB with layer 1's experts split across two (``update_weights`` loads all
    in one call); the original weights pushed back restore the original log-probs."""
    named, want = perturbed
    v = engine.policy_version
    _push(engine, _split_order(named), v + 1, transport)
    assert engine.policy_version == v + 1
    got = engine.prompt_logprobs(SEQS)
    assert _diff(got, want) < TOL
    assert _diff(got, original) > 1e-2  # the update changed the outputs (the comparison could fail)
    engine.update_weights(checkpoint, v + 2)
    assert _diff(engine.prompt_logprobs(SEQS), original) < TOL


BAD = {
    "one expert left out": (lambda named: [(n, t) for n, t in named
                                           if n != "model.layers.3.mlp.experts.6.down_proj.weight"],
                            ["left 1 parameters unchanged", "model.layers.3.mlp.experts.6.down_proj.weight"]),
    "stacked transformers-5 names": (stacked_experts, ["unknown weights", "model.layers.0.mlp.experts.gate_up_proj",
                                                "left 96 parameters unchanged"]),
    "an expert of the wrong shape": (lambda named: [(n, t[:64] if n == "model.layers.3.mlp.experts.7.up_proj.weight"
                                                     else t) for n, t in named],
                                     ["'model.layers.3.mlp.experts.7.up_proj.weight' got (64, 128), "
                                      "engine expects (128, 128)"]),
}


# The whole-update check is the receiver's, the same on every transport (the dense suite runs
# every case on all three): one transport here keeps the SGLang venv's share of CI short.
@pytest.mark.parametrize("transport", ["shm"])
@pytest.mark.parametrize("case", list(BAD))
def test_an_update_that_leaves_experts_out_is_refused_before_any_byte(engine, checkpoint, perturbed, original,
                                                                     transport, case):
    engine.update_weights(checkpoint, engine.policy_version + 1)
    version = engine.policy_version
    breaks, fragments = BAD[case]
    bad = breaks(_split_order(perturbed[0]))
    with pytest.raises((RuntimeError, ValueError, KeyError)) as err:
        _push(engine, bad, version + 1, transport)
    assert all(f in str(err.value) for f in fragments), str(err.value)
    assert engine.policy_version == version
    assert _diff(engine.prompt_logprobs(SEQS), original) < TOL


def test_sync_mode_trains_the_moe_model_on_sglang(tmp_path):
    """The learner's per-expert update after the warm start and each step reaches the engine:
    its sampled-token log-probs agree with the learner's recomputation (as the dense test)."""
    import json
    from pathlib import Path

    from async_rl.config import load_config
    from async_rl.trainer import train

    train(load_config(Path(__file__).resolve().parents[1] / "configs/default.yaml", [
        "model.path=builtin:tiny-qwen3-moe", "generator.backend=sglang", f"trainer.output_dir={tmp_path}",
        "trainer.run_name=run", "trainer.total_steps=2", "trainer.prompts_per_step=2",
        "trainer.samples_per_prompt=2", "trainer.eval_every_steps=0", "trainer.warm_start.steps=2",
        "trainer.warm_start.batch_size=4", "data.val_max_prompts=2", "logging.progress=false",
        "trainer.export_model=false"]))
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["step"] >= 1 and "policy/version" in line]
    assert [s["policy/version"] for s in steps] == [1, 2]
    assert all(s["mismatch/logprob_abs_diff"] < 1e-4 for s in steps), [s["mismatch/logprob_abs_diff"] for s in steps]
