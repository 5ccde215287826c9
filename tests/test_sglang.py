"""The SGLang generator against fresh engines: after every kind of update (colocated
``update_weights_from_tensor``, shm buckets, a broadcast group joined through
``init_weights_update_group`` + ``update_weights_from_distributed``, and updates landing
mid-generation in both partial-rollout modes) the engine's log-probs on fixed sequences equal
those of an engine started from the same weights (fp32, 1e-5); a refused update leaves it
untouched. Runs in the venv ``envs/sglang-cpu/build.sh`` builds (skipped elsewhere, saying so).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

sglang = pytest.importorskip("sglang", reason="SGLang is not in this venv: these tests run inside .venv-sglang "
                                              "(envs/sglang-cpu/build.sh), where tests/test_sglang_venv.py runs them")

from async_rl.generators.base import GeneratorConfig, SamplingParams  # noqa: E402
from async_rl.generators.sglang import SGLangGenerator, checkpoint_specs  # noqa: E402
from async_rl.weight_sync import LocalTarget, NamedTensors, WeightPublisher, WeightSyncConfig  # noqa: E402

pytestmark = pytest.mark.slow

SEQS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [3, 30, 40, 50, 60, 70, 80, 90]]
TOL = 1e-5
GREEDY = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(10**6,))


@pytest.fixture(scope="module")
def weights(tiny_model_path, tmp_path_factory):
    """``(dir0, w0, dir1, w1)``: the tiny model and a perturbed copy, each saved as an HF directory."""
    from transformers import AutoModelForCausalLM

    base = tiny_model_path
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    w1 = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    if model.config.tie_word_embeddings:
        w1["lm_head.weight"] = w1["model.embed_tokens.weight"]
    dir1 = tmp_path_factory.mktemp("w1")
    model.load_state_dict(w1)
    model.save_pretrained(dir1)
    return str(base), w0, str(dir1), w1


def _engine(path: str, **cfg) -> SGLangGenerator:
    return SGLangGenerator(path, GeneratorConfig(backend="sglang", **cfg), num_threads=1)


@pytest.fixture(scope="module")
def fresh(weights):
    """Log-probs of ``SEQS`` from engines started on w0 and on w1 (then closed)."""
    dir0, _, dir1, _ = weights
    out = {}
    for key, path in (("w0", dir0), ("w1", dir1)):
        e = _engine(path)
        try:
            out[key] = e.prompt_logprobs(SEQS)
            out[f"greedy_{key}"] = e.generate([SEQS[2]], 1, GREEDY)[0][0]
        finally:
            e.close()
    return out


@pytest.fixture(scope="module")
def engine(weights):
    e = _engine(weights[0], max_response_tokens=64)
    yield e
    e.close()


def _assert_equal(got, want):
    for g, w in zip(got, want):
        assert len(g) == len(w)
        assert max(abs(a - b) for a, b in zip(g, w)) < TOL


def _named(w: dict, tied: bool) -> list:
    return [(n, t) for n, t in w.items() if not (tied and n == "lm_head.weight")]


def test_fresh_engines_differ(fresh):
    # The checks below can fail: the two weight sets give different log-probs.
    assert max(abs(a - b) for g, w in zip(fresh["w0"], fresh["w1"]) for a, b in zip(g, w)) > 1e-2


def test_checkpoint_specs_read_headers_only(weights):
    specs, tied = checkpoint_specs(weights[0], "float32")
    assert specs["model.embed_tokens.weight"][0] == "float32"
    assert all(len(shape) in (1, 2) for _, shape in specs.values())


def test_colocated_update_equals_fresh_engine(engine, weights, fresh):
    _, w0, _, w1 = weights
    _assert_equal(engine.prompt_logprobs(SEQS), fresh["w0"])
    engine.update_weights(list(w1.items()), 1)
    assert engine.policy_version == 1
    _assert_equal(engine.prompt_logprobs(SEQS), fresh["w1"])
    engine.update_weights(list(w0.items()), 2)
    _assert_equal(engine.prompt_logprobs(SEQS), fresh["w0"])


def test_refused_update_leaves_engine_untouched(engine, weights, fresh):
    _, w0, _, w1 = weights
    engine.update_weights(list(w0.items()), 3)
    bad = dict(w1)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"].t().contiguous()
    with pytest.raises(ValueError, match="up_proj"):
        engine.update_weights(list(bad.items()), 4)
    with pytest.raises(KeyError, match="no_such"):
        engine.update_weights(list(w1.items()) + [("model.no_such.weight", torch.zeros(2))], 4)
    assert engine.policy_version == 3
    _assert_equal(engine.prompt_logprobs(SEQS), fresh["w0"])


def test_same_version_new_weights_reuse_no_cached_prefix(engine, weights, fresh):
    # The warm start's weights go out as version 0 again: a prompt cached under the old weights
    # must not be served from that cache afterwards (the salt counts loads, not versions).
    _, w0, _, w1 = weights
    engine.update_weights(list(w0.items()), 40)
    first = engine.generate([SEQS[2]], 1, GREEDY)[0][0]
    assert first.response_ids == fresh["greedy_w0"].response_ids
    engine.update_weights(list(w1.items()), 40)
    again = engine.generate([SEQS[2]], 1, GREEDY)[0][0]
    assert again.response_ids == fresh["greedy_w1"].response_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, fresh["greedy_w1"].logprobs)) < TOL


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_bucket_update_equals_fresh_engine(engine, weights, fresh, transport):
    _, w0, _, w1 = weights
    tied = bool(engine.weight_names()[2])
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
    # Small buckets: the update spans several of them.
    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=0.25, timeout_s=120)
    pub = WeightPublisher(cfg, transport, NamedTensors(_named(w1, tied), aliases), [LocalTarget(engine)],
                          protocol="sglang")
    try:
        pub.push(10)
        assert engine.policy_version == 10
        _assert_equal(engine.prompt_logprobs(SEQS), fresh["w1"])
        pub.learner = NamedTensors(_named(w0, tied), aliases)
        pub.push(11)
        _assert_equal(engine.prompt_logprobs(SEQS), fresh["w0"])
    finally:
        pub.close()


def _generate_during_update(engine, named, version, wait_s):
    # Starts a batch, loads ``named`` as ``version`` once decoding has begun, returns the samples.
    params = SamplingParams(temperature=1.0, max_tokens=128, stop_token_ids=(10**6,))
    result = {}
    t = threading.Thread(target=lambda: result.update(out=engine.generate([[5, 6, 7]] * 4, 2, params)))
    t.start()
    deadline = time.monotonic() + 60
    while engine._active == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert engine._active > 0, "generation did not start"
    time.sleep(wait_s)  # let decoding get going, so that responses straddle the update
    engine.update_weights(named, version)
    t.join(timeout=300)
    samples = [s for row in result["out"] for s in row]
    assert all(len(s.response_ids) == len(s.logprobs) == len(s.policy_version) for s in samples)
    assert all(s.finish_reason == "stop" or len(s.response_ids) == 128 for s in samples)
    return samples


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_update_mid_generation(engine, weights, fresh, mode):
    _, w0, _, w1 = weights
    engine.cfg.partial_rollout = mode
    try:
        straddled = False
        # A response can finish (stop token) before the update lands, or the update can land before
        # the first decoding step on a loaded machine: tries with different waits make sure one
        # response straddles it; every try must hold the invariants.
        for attempt, wait_s in enumerate((0.2, 0.5, 0.05, 1.0, 2.0)):
            v = 50 + 2 * attempt
            engine.update_weights(list(w0.items()), v)
            before = (engine.num_weight_updates_in_flight, engine.num_reissued)
            samples = _generate_during_update(engine, list(w1.items()), v + 1, wait_s)
            assert {x for s in samples for x in s.policy_version} <= {v, v + 1}
            assert all(s.policy_version == sorted(s.policy_version) for s in samples)
            if mode == "keep":
                assert engine.num_weight_updates_in_flight == before[0] + 1 and engine.num_reissued == before[1]
            else:
                assert engine.num_weight_updates_in_flight == before[0]
            straddled = any(len(set(s.policy_version)) == 2 for s in samples)
            if mode == "abort":
                straddled = straddled and engine.num_reissued > before[1]
            _assert_equal(engine.prompt_logprobs(SEQS), fresh["w1"])
            if straddled:
                break
        assert straddled, "no response straddled the update in 5 tries"
    finally:
        engine.cfg.partial_rollout = "keep"


def test_generate_contract(engine, weights):
    engine.update_weights(list(weights[1].items()), 30)
    stop = (7,)
    params = SamplingParams(temperature=1.0, max_tokens=16, stop_token_ids=stop)
    out = engine.generate([[5, 6], [8, 9, 10]], 3, params, seeds=[1, 2])
    assert [len(r) for r in out] == [3, 3]
    for s in (s for r in out for s in r):
        assert len(s.response_ids) == len(s.logprobs) == len(s.policy_version) <= 16
        assert all(lp <= 0 for lp in s.logprobs) and set(s.policy_version) == {30}
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stop or s.response_ids[-1] in engine_eos(weights[0])
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 16
    # top-k: behavior log-probs are of the truncated, renormalised distribution (>= the full one).
    full = engine.generate([[5, 6]], 1, SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(10**6,)))
    topk = engine.generate([[5, 6]], 1, SamplingParams(temperature=1.0, top_k=3, max_tokens=8,
                                                       stop_token_ids=(10**6,)))
    assert min(topk[0][0].logprobs) >= -torch.log(torch.tensor(3.0)).item() * 50  # finite and sane
    assert sum(topk[0][0].logprobs) / 8 > sum(full[0][0].logprobs) / 8


def test_top_logprobs(engine):
    """``SamplingParams.top_logprobs``: per sampled token the k most likely, most likely first,
    the sampled token's own log-prob no higher than the first (the OpenAI endpoint's top_logprobs)."""
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(10**6,), top_logprobs=3)
    (sample,), = engine.generate([[5, 6]], 1, params, seeds=[4])
    assert len(sample.top_logprobs) == len(sample.response_ids) == 6
    for lp, alts in zip(sample.logprobs, sample.top_logprobs):
        values = [v for _, v in alts]
        assert len(alts) == 3 and values == sorted(values, reverse=True) and lp <= values[0] + 1e-5


def engine_eos(path: str) -> set[int]:
    import json
    from pathlib import Path

    eos = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [eos])


# ------------------------------------------------------------------ the pipeline on SGLang
def _cfg(tmp_path, name, *extra):
    from pathlib import Path

    from async_rl.config import load_config

    root = Path(__file__).resolve().parents[1]
    return load_config(root / "configs/default.yaml", [
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=3",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=30", "trainer.warm_start.batch_size=16", "data.val_max_prompts=8",
        "trainer.export_model=false", "logging.progress=false", "generator.max_batch_size=8",
        "generator.backend=sglang", *extra])


def _steps(tmp_path, name):
    import json

    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["step"] >= 1 and "policy/version" in line]


def test_sync_mode_trains_on_sglang(tmp_path):
    from async_rl.trainer import train

    summary = train(_cfg(tmp_path, "sync"))
    steps = _steps(tmp_path, "sync")
    assert [s["policy/version"] for s in steps] == [1, 2, 3]
    # SGLang's sampled-token log-probs agree with the learner's recomputation (same weights).
    assert all(s["mismatch/logprob_abs_diff"] < 1e-4 and s["staleness/max"] == 0 for s in steps)
    assert all(s["weight_sync/bytes"] == 0 for s in steps if "weight_sync/bytes" in s)  # colocated: nothing packed
    assert "eval_final" in summary


def test_a_rollout_function_through_the_endpoint_on_sglang(tmp_path):
    """The OpenAI-compatible endpoint served on SGLang: the example agent's calls (chat with a
    calculator tool) are captured as its trajectories, their log-probs the learner's."""
    from pathlib import Path

    from async_rl.config import load_config
    from async_rl.trainer import train

    root = Path(__file__).resolve().parents[1]
    train(load_config(root / "examples/openai_agent/config.yaml", [
        f"endpoint.rollout={root}/examples/openai_agent/calculator_agent.py:rollout",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=agent", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=100", "data.val_max_prompts=8", "trainer.export_model=false",
        "logging.progress=false", "generator.max_batch_size=16", "generator.backend=sglang"]))
    steps = _steps(tmp_path, "agent")
    assert len(steps) == 2
    for s in steps:
        # After the warm start the model calls the calculator through the OpenAI tools API.
        assert s["rollout/num_trajectories"] == 16 and s["rollout/turns_mean"] > 1.5
        assert s["mismatch/logprob_abs_diff"] < 1e-4


def test_sync_mode_trains_lora_adapters_on_sglang(tmp_path):
    from async_rl.trainer import train

    train(_cfg(tmp_path, "lora", "learner.lora.rank=8", "learner.lr=1e-3"))
    steps = _steps(tmp_path, "lora")
    assert [s["policy/version"] for s in steps] == [1, 2, 3]
    # The engine samples from base + the learner's adapters: its log-probs match the learner's.
    assert all(s["mismatch/logprob_abs_diff"] < 1e-4 for s in steps)


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_async_mode_with_two_sglang_actors(tmp_path, transport, private_tmpdir):
    # The actors, killed once closed, leave nothing in their temp dir: over shm each engine's
    # weight loads hand file descriptors through multiprocessing's resource sharer, whose socket
    # directory only an exit handler removes.
    ray = pytest.importorskip("ray")
    from async_rl.trainer import train

    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    try:
        # Each actor starts its own engine before it can connect: on 2 shared, loaded cores that
        # took longer than the default 300 s once; this test is about correctness, not start-up time.
        summary = train(_cfg(tmp_path, transport, "trainer.mode=async", "generator.num_workers=2",
                             f"weight_sync.transport={transport}", "weight_sync.timeout_s=1200"))
    finally:
        ray.shutdown()
    steps = _steps(tmp_path, transport)
    # A version per mini-batch (async's default): 4 a step, each pushed to both actors.
    assert [s["policy/version"] for s in steps] == [4, 8, 12]
    # max_staleness 1, plus one version a share of a group dealt over 2 (trainer.group_spread) may wait.
    assert all(s["weight_sync/bytes"] > 0 and s["staleness/max"] <= 2 for s in steps)
    assert summary["pipeline/trained"] == 12
    assert sorted(p.name for p in private_tmpdir.iterdir()) == []


def test_close_leaves_no_engine_files_and_no_processes(weights):
    import os

    import psutil

    from async_rl.generators.sglang.process import engine_files

    e = _engine(weights[0])
    files, pids = engine_files(e.engine), list(e._child_pids)
    assert files and pids and any(os.path.exists(f) for f in files)
    # Idle, the engine's processes sleep (sleep_on_idle): a polling scheduler would use a whole
    # core (1.01 measured without it, 0.02 with), starving the learner on a few cores. Load on the
    # machine can only lower what a busy loop gets, so this bound never fails a sleeping engine.
    procs = [psutil.Process(p) for p in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(3.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    assert max(used) < 1.0, f"idle engine processes used {used} s of CPU in 3 s"
    e.close()
    e.close()  # idempotent
    assert [f for f in files if os.path.exists(f)] == []
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE] == []


_EXIT_SCRIPT = """
import subprocess, sys
if __name__ == "__main__":
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.sglang import SGLangGenerator
    # Its own stdout: one inherited would keep the test's pipe open until it ends.
    bystander = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    e = SGLangGenerator(sys.argv[1], GeneratorConfig(backend="sglang"), num_threads=1)
    print(bystander.pid, *e._child_pids, flush=True)
    # No close(): the interpreter's exit must stop the engine, and only the engine.
"""


def test_exit_without_close_stops_only_the_engine(weights, tmp_path):
    # SGLang's own exit hook kills every child of the process (Ray's workers, learner ranks, the
    # resource tracker); the generator replaces it with its close(), which stops only its engine.
    import os
    import subprocess
    import sys

    import psutil

    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), weights[0]], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    bystander, *engine_pids = (int(x) for x in proc.stdout.split())
    try:
        assert engine_pids and not any(psutil.pid_exists(p) for p in engine_pids)
        assert psutil.pid_exists(bystander), "the process's other child was killed at exit"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    finally:
        if psutil.pid_exists(bystander):
            psutil.Process(bystander).kill()


# ------------------------------------------------------------------ LoRA
LORA_RANK = 8


def _adapter(engine, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(n, 0.1 * torch.randn(shape, generator=g)) for n, (_, shape) in engine.weight_specs().items()]


def _lora_engine(path):
    from async_rl.utils.lora import LoRAConfig

    return SGLangGenerator(path, GeneratorConfig(backend="sglang"), num_threads=1, lora=LoRAConfig(rank=LORA_RANK))


def test_lora_updates_equal_a_fresh_engine_and_peft(weights):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    dir0 = weights[0]
    eng = _lora_engine(dir0)
    try:
        names = eng.weight_names()[0]
        assert names and all(n.startswith("base_model.model.") and (".lora_A." in n or ".lora_B." in n) for n in names)
        x1, x2 = _adapter(eng, 1), _adapter(eng, 2)
        base = eng.prompt_logprobs(SEQS)
        eng.update_weights(x1, 1)
        after_x1 = eng.prompt_logprobs(SEQS)
        cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.05, timeout_s=120)
        pub = WeightPublisher(cfg, "shm", NamedTensors(x2), [LocalTarget(eng)], protocol="sglang")
        try:
            pub.push(2)
        finally:
            pub.close()
        assert eng.policy_version == 2
        got = eng.prompt_logprobs(SEQS)
        # A refused adapter (one matrix transposed) leaves the engine on x2.
        bad = [(n, t.t().contiguous() if i == 0 else t) for i, (n, t) in enumerate(x2)]
        with pytest.raises(ValueError, match="lora_A"):
            eng.update_weights(bad, 3)
        _assert_equal(eng.prompt_logprobs(SEQS), got)
    finally:
        eng.close()
    fresh_eng = _lora_engine(dir0)
    try:
        fresh_eng.update_weights(x2, 2)
        _assert_equal(got, fresh_eng.prompt_logprobs(SEQS))
    finally:
        fresh_eng.close()
    # The adapters changed the model (so the comparisons above could fail) ...
    assert max(abs(a - b) for g, w in zip(base, after_x1) for a, b in zip(g, w)) > 1e-2
    assert max(abs(a - b) for g, w in zip(after_x1, got) for a, b in zip(g, w)) > 1e-2
    # ... and x2 on SGLang is x2 under peft (an independent implementation of the same adapter).
    model = AutoModelForCausalLM.from_pretrained(dir0, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=16.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    assert not set_peft_model_state_dict(peft_model, dict(x2)).unexpected_keys
    with torch.no_grad():
        for seq, lps in zip(SEQS, got):
            logits = peft_model(torch.tensor([seq])).logits[0].float()
            ref = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
            assert max(abs(a - b) for a, b in zip(lps, ref.tolist())) < 1e-4
