"""Weight updates into the HF engine are all-or-nothing, on every transport (colocated, shm,
broadcast), with full weights and with LoRA adapters: a bad update (unknown name, missing
parameter, wrong shape, wrong dtype, conflicting tied weights) is refused before any byte is
written, naming the offending weight, and leaves every parameter bit-identical; a sender that
fails after the first bucket leaves the engine on its old weights; a load that fails after the
first write leaves an engine that refuses to sample until a complete update succeeds. The
published version never moves for a failed update."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from update_cases import CASES, ListLearner, bad_update, offset

from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig
from async_rl.generators.base import GeneratorConfig, SamplingParams

TRANSPORTS = ("colocated", "shm", "broadcast")
BUCKET_MB = 0.05  # tiny model: one decoder layer per bucket, so an update spans several buckets


@pytest.fixture(scope="module")
def engines(tiny_model_path, tiny_tokenizer):
    """``{"full": HF engine, "lora": HF engine with rank-8 adapters}``."""
    from async_rl.generators.hf import HFGenerator
    from async_rl.utils.lora import LoRAConfig

    return {"full": HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=16), tiny_tokenizer.pad_token_id),
            "lora": HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=16), tiny_tokenizer.pad_token_id,
                                lora=LoRAConfig(rank=8))}


def _update(engine, kind: str):
    """(good update: the engine's own targets + 1, aliases, a late 2-D victim, an unknown name)."""
    if kind == "full":
        named = offset(engine.model.named_parameters())
        return (named, {"lm_head.weight": "model.embed_tokens.weight"}, "model.layers.2.mlp.down_proj.weight",
                "model.layers.0.mlp.gate_prj.weight")
    from async_rl.utils.lora import adapter_parameters

    named = offset(adapter_parameters(engine.model).items())
    return (named, {}, "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight",
            "base_model.model.lm_head.lora_A.weight")


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _assert_untouched(engine, before: dict[str, torch.Tensor]) -> None:
    changed = [n for n, p in engine.model.named_parameters() if not torch.equal(p, before[n])]
    assert not changed, f"{len(changed)} parameters changed by a failed update, e.g. {changed[:3]}"


def _greedy(engine) -> list[int]:
    p = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(1,))
    return engine.generate([[5, 6, 7, 8]], 1, p)[0][0].response_ids


def _publisher(engine, transport: str, learner, **cfg) -> WeightPublisher:
    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=BUCKET_MB, **cfg)
    return WeightPublisher(cfg, transport, learner, [LocalTarget(engine)])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_bad_update_is_refused_whole(engines, kind, case, transport):
    engine = engines[kind]
    named, aliases, victim, unknown = _update(engine, kind)
    bad, fragments = bad_update(case, named, victim, unknown)
    before, version = _snapshot(engine), engine.policy_version
    pub = _publisher(engine, transport, ListLearner(bad, aliases))
    try:
        with pytest.raises((RuntimeError, KeyError, ValueError)) as err:
            pub.push(version + 1)
    finally:
        pub.close()
    message = str(err.value)
    assert all(f in message for f in fragments), message
    assert "\n" not in message.strip()
    _assert_untouched(engine, before)
    assert engine.policy_version == version and pub.published_version is None
    _greedy(engine)  # still serves


@pytest.mark.parametrize("transport", ["colocated", "shm"])
def test_conflicting_tied_weights_are_refused(engines, transport):
    # The tiny model ties lm_head to the embedding: the engine holds one tensor for both names, so
    # an update carrying two different tensors for them cannot be loaded as sent.
    engine = engines["full"]
    named, _, _, _ = _update(engine, "full")
    embed = dict(named)["model.embed_tokens.weight"]
    bad = named + [("lm_head.weight", embed + 0.5)]
    before, version = _snapshot(engine), engine.policy_version
    pub = _publisher(engine, transport, ListLearner(bad))
    try:
        with pytest.raises((RuntimeError, ValueError), match="lm_head.weight"):
            pub.push(version + 1)
    finally:
        pub.close()
    _assert_untouched(engine, before)
    assert engine.policy_version == version and pub.published_version is None


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_sender_dying_mid_update_leaves_the_old_weights(engines, kind, transport):
    from async_rl.utils.lora import adapter_parameters

    engine = engines[kind]
    named, aliases, _, _ = _update(engine, kind)
    # Dies on the first tensor of layer 2: every bucket before it went out (and was loaded, if the
    # engine loaded as it received).
    die_after = next(i for i, (n, _) in enumerate(named) if ".layers.2." in n)
    before, version = _snapshot(engine), engine.policy_version
    # timeout_s as by default: a receiver that waited it out would hold the test for 300 s.
    pub = _publisher(engine, transport, ListLearner(named, aliases, die_after=die_after), timeout_s=300.0)
    try:
        with pytest.raises(RuntimeError, match="learner died"):
            pub.push(version + 1)
        _assert_untouched(engine, before)
        assert engine.policy_version == version and pub.published_version is None
        _greedy(engine)  # the old weights still serve
        # The next push loads whole (broadcast: the dropped group is formed anew first).
        pub.learner = ListLearner(named, aliases)
        pub.push(version + 1)
        assert engine.policy_version == version + 1 == pub.published_version
        targets = dict(engine.model.named_parameters()) if kind == "full" else adapter_parameters(engine.model)
        assert all(torch.equal(targets[n], t) for n, t in named)
    finally:
        pub.close()


class _FailsWhenCopied(torch.Tensor):
    """A tensor whose copy into a parameter fails (a device fault in the middle of a load)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("simulated device fault while copying into a parameter")
        return super().__torch_function__(func, types, args, kwargs or {})


def _half_written_update(engine):
    named, _, victim, _ = _update(engine, "full")
    return named, [(n, t.as_subclass(_FailsWhenCopied) if n == victim else t) for n, t in named]


def test_a_load_failing_after_the_first_write_leaves_an_engine_that_refuses_to_sample(tiny_model_path,
                                                                                     tiny_tokenizer):
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    good, failing = _half_written_update(engine)
    pub = _publisher(engine, "colocated", ListLearner(failing))
    with pytest.raises(RuntimeError, match="simulated device fault"):
        pub.push(1)
    assert engine.policy_version == 0 and pub.published_version is None
    with pytest.raises(RuntimeError, match="refuses to sample"):
        _greedy(engine)
    # A complete update makes it usable again, with exactly its weights.
    pub.learner = ListLearner(good)
    pub.push(2)
    assert engine.policy_version == 2 == pub.published_version
    got = dict(engine.model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in good)
    _greedy(engine)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_generation_in_flight_stops_when_an_update_fails_half_written(tiny_model_path, tiny_tokenizer, mode):
    # The update lands between two decoding steps of a running batch; once half of it is written
    # the batch must not decode another token with those weights.
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(tiny_model_path, GeneratorConfig(partial_rollout=mode), tiny_tokenizer.pad_token_id)
    _, failing = _half_written_update(engine)
    params = SamplingParams(temperature=1.0, max_tokens=200, stop_token_ids=(10**6,))
    out: list = []

    def run() -> None:
        try:
            out.append(engine.generate([[5, 6, 7, 8]] * 4, 2, params, seeds=[1, 2, 3, 4]))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    th = threading.Thread(target=run)
    th.start()
    while not engine._generating:
        time.sleep(0.005)
    with pytest.raises(RuntimeError, match="simulated device fault"):
        engine.update_weights(failing, 1)
    th.join(timeout=120)
    assert len(out) == 1 and isinstance(out[0], RuntimeError) and "refuses to sample" in str(out[0]), out
    assert engine.policy_version == 0
