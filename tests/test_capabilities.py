"""Engines and learner backends say what they can do (issue 31): the config checks, the weight
transport and the generator factory follow an engine's or a learner's declared capabilities, so a
new backend is one class plus one registration, and the capabilities are read without importing
an engine library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.config import ConfigError, load_config
from async_rl.generators import make_generator
from async_rl.generators.capabilities import ENGINES, EngineCapabilities, engine_capabilities
from async_rl.learners.base import LearnerConfig, MegatronConfig
from async_rl.learners.capabilities import LEARNERS, LearnerCapabilities, learner_class
from async_rl.utils.lora import LoRAConfig
from async_rl.weight_sync import WeightSyncConfig, engine_protocol, resolve_transport, transports_for_targets

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "default.yaml"


class ToyEngine:
    """An engine no backend-name comparison could know: colocatable, SGLang's protocol, adapters
    over shm only, up to rank 8, no ``abort``, its context cap read from vLLM's key."""

    capabilities = EngineCapabilities(name="Toy", colocated=True, separate_processes=True, protocol="sglang",
                                      lora_transports=frozenset({"shm"}), lora_max_rank=8,
                                      partial_rollout=("keep",), context_key="vllm.max_model_len")
    made: list = []

    def __init__(self, model_path, cfg, pad_token_id, **kwargs):
        ToyEngine.made.append((model_path, kwargs))


class ToyLearner:
    """A learner backend without adapters or offload whose model spans ``megatron``'s sizes."""

    capabilities = LearnerCapabilities(name="Toy", lora=False, cpu_offload=False, hf_attention=False,
                                       parallel_settings="megatron", model_parallel=("tensor_parallel_size",))


@pytest.fixture
def toy():
    ENGINES.register("toy", ToyEngine)
    LEARNERS.register("toy", ToyLearner)
    try:
        yield
    finally:
        ENGINES.pop("toy")
        LEARNERS.pop("toy")


def test_transport_and_protocol_follow_the_engine_class(toy):
    auto = WeightSyncConfig()
    assert resolve_transport(auto, "toy", "sync") == "colocated"  # colocated=True
    assert resolve_transport(auto, "toy", "async") == "shm"
    assert engine_protocol("toy") == "sglang"
    # Its protocol cannot mix transports: one remote engine makes all broadcast.
    assert transports_for_targets(auto, "toy", "async", [True, False]) == ["broadcast", "broadcast"]
    assert transports_for_targets(auto, "vllm", "async", [True, False]) == ["shm", "broadcast"]


@pytest.mark.parametrize("overrides, message", [
    (["learner.lora.rank=4", "weight_sync.transport=broadcast"],
     "generator.backend=toy with learner.lora.rank > 0: adapters reach Toy over weight_sync.transport=shm, not "
     "over weight_sync.transport=broadcast"),
    (["learner.lora.rank=16"], "generator.backend=toy: learner.lora.rank=16: Toy serves adapters up to rank 8"),
    (["generator.partial_rollout=abort"],
     "generator.partial_rollout=abort: the Toy engine (generator.backend=toy) implements keep; engines with "
     "abort: hf or vllm or sglang"),
    (["generator.vllm.max_model_len=8"], "generator.vllm.max_model_len=8 is less than the"),
])
def test_config_checks_follow_the_engine_class(toy, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT, ["generator.backend=toy", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_colocated_refusal_names_the_engines_that_can():
    with pytest.raises(ConfigError, match="only for trainer.mode=sync with generator.backend=hf or sglang "
                                          r"\(got sync, vllm\)"):
        load_config(DEFAULT, ["generator.backend=vllm", "weight_sync.transport=colocated"])


def test_a_colocatable_engine_passes_where_a_name_list_would_refuse(toy):
    # Not hf or sglang, yet colocated in sync mode; adapters over its one LoRA transport.
    cfg = load_config(DEFAULT, ["generator.backend=toy", "weight_sync.transport=colocated"])
    assert cfg.weight_sync.transport == "colocated"
    cfg = load_config(DEFAULT, ["generator.backend=toy", "learner.lora.rank=8", "weight_sync.transport=shm"])
    assert cfg.learner.lora.rank == 8


def test_make_generator_builds_the_registered_class(toy):
    cfg = load_config(DEFAULT, ["generator.backend=toy"])
    ToyEngine.made.clear()
    engine = make_generator(cfg.generator, "some/model", 0, num_threads=3)
    assert isinstance(engine, ToyEngine)
    # separate_processes: it gets the thread count; picks_device=False: told cpu.
    assert ToyEngine.made == [("some/model", {"device": "cpu", "lora": None, "num_threads": 3})]


def test_learner_checks_follow_the_learner_class(toy):
    assert learner_class("toy") is ToyLearner
    with pytest.raises(ValueError, match=r"^learner.lora.rank > 0 needs learner.backend=fsdp2: the Toy learner "
                                         "trains full weights only$"):
        LearnerConfig(backend="toy", lora=LoRAConfig(rank=4))
    with pytest.raises(ValueError, match=r"is an FSDP2 option; with learner.backend=toy use "
                                         r"learner.megatron.tensor_parallel_size to fit"):
        LearnerConfig(backend="toy", cpu_offload=True)
    with pytest.raises(ValueError, match=r"learner.world_size=3 is not a multiple of "
                                         r"learner.megatron.tensor_parallel_size = 2$"):
        LearnerConfig(backend="toy", world_size=3, megatron=MegatronConfig(tensor_parallel_size=2))
    cfg = LearnerConfig(backend="toy", world_size=4)
    cfg.megatron.tensor_parallel_size = 2  # only tensor parallelism counts for this backend
    cfg.megatron.pipeline_parallel_size = 2
    assert cfg.data_parallel_size == 2


def test_unknown_backends_are_one_line():
    with pytest.raises(ValueError, match=r"^generator.backend must be one of \('hf', 'vllm', 'sglang'\), got 'tgi'$"):
        engine_capabilities("tgi")
    with pytest.raises(ValueError, match=r"^learner.backend must be one of \('fsdp2', 'megatron'\), got 'ds'$"):
        learner_class("ds")


def test_a_class_without_capabilities_is_refused_when_looked_up():
    ENGINES.register("bare", object)
    try:
        with pytest.raises(ValueError, match="declares no EngineCapabilities"):
            engine_capabilities("bare")
    finally:
        ENGINES.pop("bare")


def test_capabilities_are_read_without_engine_libraries():
    # Config time must not import vLLM, SGLang or megatron-core (each costs seconds or is absent).
    code = ("import sys\n"
            "from async_rl.generators.capabilities import ENGINES, engine_capabilities\n"
            "from async_rl.learners.capabilities import LEARNERS, learner_capabilities\n"
            "caps = [engine_capabilities(n) for n in ENGINES] + [learner_capabilities(n) for n in LEARNERS]\n"
            "print(len(caps), sorted(m for m in ('vllm', 'sglang', 'megatron.core') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.split("\n")[0] == "5 []", out.stdout + out.stderr


def test_the_hf_engine_s_device_is_its_config_key(monkeypatch):
    """With no device named, the HF engine gets ``generator.hf.device`` (``auto``: ``cuda`` where
    torch sees a GPU, else ``cpu``); an engine without a ``device_key`` keeps ``picks_device``."""
    import torch

    from async_rl.generators.base import GeneratorConfig, HFConfig

    caps = engine_capabilities("hf")
    assert caps.device_key == "hf.device"
    assert caps.default_device(GeneratorConfig()) == "cpu"  # the default: cpu, GPU or not
    assert caps.default_device(GeneratorConfig(hf=HFConfig(device="cuda"))) == "cuda"
    for seen, wanted in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: seen)
        assert caps.default_device(GeneratorConfig(hf=HFConfig(device="auto"))) == wanted
        assert HFConfig(device="auto").resolved_device() == wanted
        assert engine_capabilities("sglang").default_device(GeneratorConfig()) == wanted  # picks_device
        assert engine_capabilities("vllm").default_device(GeneratorConfig()) == "cpu"  # its build picks
    cfg = load_config(DEFAULT, ["generator.hf.device=auto", "generator.hf.dtype=bfloat16"])
    assert (cfg.generator.hf.device, cfg.generator.hf.dtype) == ("auto", "bfloat16")
    for key, bad in (("device", "gpu"), ("dtype", "int8")):
        with pytest.raises(ConfigError, match=f"generator.hf.{key} must be one of"):
            load_config(DEFAULT, [f"generator.hf.{key}={bad}"])
