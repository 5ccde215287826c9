"""The protocols list what the code calls, and every implementation has all of it: the engines
(``Generator``: HF and vLLM, the latter inspected without starting vLLM), the learner
(``Learner``), the publisher's targets (``WeightTarget``), weight sources (``WeightSource``) and
transports (``Transport``), and the two training loops (``Loop``).
So callers never probe with ``hasattr``. Plus the one weight path: ``colocated`` is a transport
object like the others, usable for an in-process evaluation engine whatever the trainer mode."""

from __future__ import annotations

import inspect
import re
import typing

import pytest
import torch

from async_rl.generators.base import Generator, GeneratorConfig, SamplingParams
from async_rl.learners.base import Learner
from async_rl.weight_sync import (BucketTransport, ColocatedTransport, LocalTarget, ModuleWeights, NamedTensors,
                                  RayTarget, Transport, WeightPublisher, WeightSource, WeightSyncConfig, WeightTarget,
                                  make_transport, resolve_transport)


def _members(proto: type) -> dict[str, object]:
    """``{name: declared value}`` of a protocol's public members (methods and annotated attributes).
    (``typing.get_protocol_members`` is Python 3.13+.)"""
    out: dict[str, object] = {n: None for n in typing.get_type_hints(proto) if not n.startswith("_")}
    out.update({n: v for n, v in vars(proto).items() if not n.startswith("_") and callable(getattr(proto, n))})
    return out


def _instance_attributes(cls: type) -> set[str]:
    """Names ``cls.__init__`` assigns on ``self`` (read from the source: no engine is started)."""
    src = inspect.getsource(cls.__init__)
    return {name for line in src.splitlines() if line.strip().startswith("self.") and "=" in line
            for name in re.findall(r"self\.(\w+)", line.split("=", 1)[0])}


def _check(cls: type, proto: type) -> None:
    attrs = _instance_attributes(cls) | {n for n in dir(cls) if not n.startswith("_")}
    for name, declared in _members(proto).items():
        assert name in attrs, f"{cls.__name__} lacks {proto.__name__}.{name}"
        if callable(declared):
            impl = getattr(cls, name)
            assert callable(impl), f"{cls.__name__}.{name} is not callable"
            want = [p for p in inspect.signature(declared).parameters if p != "self"]
            got = [p for p in inspect.signature(impl).parameters if p != "self"]
            # Same parameters in the same order (an implementation may take more after them).
            assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} does not take {proto.__name__}'s {want}"


def test_generator_protocol_lists_what_the_callers_use():
    assert set(_members(Generator)) == {
        "policy_version", "num_weight_updates_in_flight", "generate", "update_weights", "connect_weight_sync",
        "receive_weights", "weight_names", "close"}


def test_hf_engine_implements_the_whole_generator_protocol(tiny_model_path, tiny_tokenizer):
    from async_rl.generators.hf import HFGenerator

    _check(HFGenerator, Generator)
    engine = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    engine.close()  # nothing to release, and it still samples
    out = engine.generate([[5, 6, 7]], 1, SamplingParams(max_tokens=2, stop_token_ids=(1,)))
    assert len(out[0][0].response_ids) >= 1


def test_vllm_engine_implements_the_whole_generator_protocol():
    from async_rl.generators.vllm import VLLMGenerator

    _check(VLLMGenerator, Generator)


def test_learner_protocol_is_implemented_by_the_fsdp_learner():
    from async_rl.learners.fsdp import FSDPLearner

    assert {"version", "prepare", "train_step", "sft_step", "begin_rl", "compute_logprobs", "named_weights",
            "weight_metadata", "weight_aliases", "save_checkpoint", "load_checkpoint", "export_hf"} == set(_members(Learner))
    _check(FSDPLearner, Learner)


def test_learner_protocol_is_implemented_by_the_megatron_learner():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from async_rl.learners.megatron import MegatronLearner

    _check(MegatronLearner, Learner)


@pytest.mark.parametrize("cls", [LocalTarget, RayTarget])
def test_weight_targets_implement_the_protocol(cls):
    _check(cls, WeightTarget)


@pytest.mark.parametrize("cls", [ModuleWeights, NamedTensors])
def test_weight_sources_implement_the_protocol(cls):
    _check(cls, WeightSource)


@pytest.mark.parametrize("cls", [ColocatedTransport, BucketTransport])
def test_transports_implement_the_protocol(cls):
    _check(cls, Transport)


def test_colocated_is_a_transport_and_refuses_engines_of_other_processes():
    assert isinstance(make_transport(WeightSyncConfig(), "colocated", [LocalTarget(object())]), ColocatedTransport)
    with pytest.raises(ValueError, match="colocated needs the engine in the learner's process"):
        make_transport(WeightSyncConfig(), "colocated", [RayTarget(object())])
    with pytest.raises(TypeError, match="not in the learner's process"):
        RayTarget(object()).load([], 1)
    with pytest.raises(ValueError, match="resolve_transport first"):
        make_transport(WeightSyncConfig(), "auto", [])
    assert BucketTransport.push.__doc__ and ColocatedTransport.push.__doc__


def test_an_async_runs_evaluation_engine_takes_colocated_pushes(tiny_model_path, tiny_tokenizer):
    """Async mode's in-process HF evaluation engine: a second publisher, ``colocated`` over a
    ``LocalTarget``, whatever ``resolve_transport`` picks for the pool (``shm``)."""
    from transformers import AutoModelForCausalLM

    from async_rl.generators.hf import HFGenerator

    assert resolve_transport(WeightSyncConfig(), "hf", "async") == "shm"
    engine = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    src = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01)
    pub = WeightPublisher(WeightSyncConfig(), "colocated", ModuleWeights(src), [LocalTarget(engine)])
    assert pub.sender is None
    metrics = pub.push(3)
    pub.close()
    assert engine.policy_version == 3 and pub.published_version == 3 and metrics["timing/weight_sync_s"] >= 0
    for (n, a), (_, b) in zip(engine.model.named_parameters(), src.named_parameters()):
        assert torch.equal(a, b), n


def test_both_loops_implement_the_loop_protocol():
    from async_rl.loops.async_loop import AsyncLoop
    from async_rl.loops.base import Loop
    from async_rl.loops.sync import SyncLoop

    assert set(_members(Loop)) == {"step", "start_evaluation", "sync_eval_engine", "state_dict", "close",
                                   "evaluation_after_last_step"}
    for cls in (SyncLoop, AsyncLoop):
        _check(cls, Loop)
        assert list(inspect.signature(cls.__init__).parameters)[1:3] == ["ctx", "resume_state"]
