"""What each rollout engine can do, declared by the engine class and read by name.

Every engine class carries a ``capabilities`` class attribute (``EngineCapabilities``); the
config checks (``async_rl.config``), the transport choice (``async_rl.weight_sync.config``) and
the trainer ask it instead of comparing backend names, so a new engine is one class plus one
``ENGINES.register`` line here.

``ENGINES`` maps a ``generator.backend`` name to the import path of its class: the class is
imported on first use only (``engine_class``). The engine modules import vLLM or SGLang inside
their functions, so reading a class's capabilities at config time loads neither.

    >>> engine_capabilities("sglang").colocated
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from async_rl.utils.registry import BackendRegistry

__all__ = ["ENGINES", "EngineCapabilities", "engine_capabilities", "engine_class", "engines_that"]

WIRE_PROTOCOLS = ("async_rl", "sglang")
"""Bucket protocols a ``WeightSender`` speaks (``async_rl.weight_sync.wire.PROTOCOLS``)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine backend can do; the ``capabilities`` class attribute of its engine class.

    Attributes:
        name: how messages name the engine (``vLLM``).
        colocated: the engine can run inside the learner's process and take weights in place
            (``weight_sync.transport=colocated``; ``auto`` picks it in sync mode).
        separate_processes: the engine decodes in processes of its own (vLLM's engine core,
            SGLang's scheduler), not on the trainer's threads; the sync loop's shared-core
            governor then stays off, as it would count their CPU time as another job's.
        protocol: the bucket protocol a ``WeightSender`` must speak to it (one of
            ``WIRE_PROTOCOLS``): ``async_rl`` (our ``WeightReceiver``) or ``sglang`` (SGLang's
            own ``init_weights_update_group`` / ``update_weights_from_distributed``).
        lora_transports: the ``weight_sync.transport`` values over which LoRA adapters reach the
            engine (``auto`` resolves to one of them or is refused at load).
        lora_max_rank: the largest ``learner.lora.rank`` it serves; 0 = no limit.
        partial_rollout: the ``generator.partial_rollout`` modes it implements.
        per_token: what each sampled token carries back in a ``Sample`` (all engines: the token
            id, its behavior log-prob under the sampling distribution, float32 nats, and the
            policy version that produced it).
        context_key: the ``generator.<key>`` (dotted) that caps prompt plus response tokens, e.g.
            ``vllm.max_model_len``, 0 meaning the checkpoint's; empty = no such cap.
        picks_device: with no device given, the engine runs on CUDA where torch sees a GPU
            (SGLang is told its device); otherwise it is given ``cpu`` and its own build picks.
        device_key: the ``generator.<key>`` (dotted) that names the engine's device when its
            caller names none (``hf.device``: ``cpu``, ``cuda`` or ``auto``); it overrides
            ``picks_device``. Empty = none.
        library: the top-level module of the engine library (``vllm``); empty = none beyond
            this package's dependencies.
        install: how to install ``library``, for the one-line error when it is missing.
        records_routing: it reports the experts a mixture-of-experts model routed each token to
            (``SamplingParams.return_routed_experts``), for ``algorithm.routing_replay``.
        routing_requires: the ``generator.<key>`` (dotted, a bool) that must be true for it to
            record routing (``vllm.enforce_eager``: hooks a compiled model would not run); empty = none.
        serves_images: it samples from prompts with images (``generate``'s ``images``: a
            vision-language model's ``ImageInputs`` per prompt, ``async_rl.data.images``).

    Raises:
        ValueError: an unknown ``protocol`` or ``partial_rollout`` mode (at class definition).
    """

    name: str
    colocated: bool
    separate_processes: bool
    protocol: str = "async_rl"
    lora_transports: frozenset[str] = frozenset({"colocated", "shm", "broadcast"})
    lora_max_rank: int = 0
    partial_rollout: tuple[str, ...] = ("keep", "abort")
    per_token: tuple[str, ...] = ("token_id", "logprob", "version")
    context_key: str = ""
    picks_device: bool = False
    device_key: str = ""
    library: str = ""
    install: str = ""
    records_routing: bool = False
    routing_requires: str = ""
    serves_images: bool = False

    def __post_init__(self) -> None:
        if self.protocol not in WIRE_PROTOCOLS:
            raise ValueError(f"engine {self.name}: unknown weight sync protocol {self.protocol!r} "
                             f"(one of {WIRE_PROTOCOLS})")
        bad = [m for m in self.partial_rollout if m not in ("keep", "abort")]
        if bad:
            raise ValueError(f"engine {self.name}: unknown partial_rollout mode {bad[0]!r} (keep or abort)")

    def routing_blocked_by(self, generator_cfg: Any) -> str | None:
        """Why this engine cannot record routing under ``generator_cfg`` (a ``GeneratorConfig``),
        as the ``generator.<key>=value`` to change, or ``None`` when it can."""
        if not self.routing_requires:
            return None
        value: Any = generator_cfg
        for part in self.routing_requires.split("."):
            value = getattr(value, part)
        return None if value else f"generator.{self.routing_requires}={value}"

    def context_length(self, generator_cfg: Any) -> int:
        """The engine's configured context cap in tokens (``context_key`` read from a
        ``GeneratorConfig``); 0 = the checkpoint's, or no ``context_key``."""
        value: Any = generator_cfg
        if not self.context_key:
            return 0
        for part in self.context_key.split("."):
            value = getattr(value, part)
        return int(value)

    def default_device(self, generator_cfg: Any) -> str:
        """The device an engine gets when its caller names none (``async_rl.generators.make_generator``):
        the ``device_key`` setting read from a ``GeneratorConfig`` (``auto``: ``cuda`` where torch
        sees a GPU, else ``cpu``); without one, ``cuda`` for a ``picks_device`` engine where torch
        sees a GPU, else ``cpu`` (vLLM's own build picks its platform)."""
        import torch

        if self.device_key:
            value: Any = generator_cfg
            for part in self.device_key.split("."):
                value = getattr(value, part)
            return ("cuda" if torch.cuda.is_available() else "cpu") if value == "auto" else str(value)
        return "cuda" if self.picks_device and torch.cuda.is_available() else "cpu"


ENGINES = BackendRegistry("generator backend", "generator.backend", EngineCapabilities)
"""``generator.backend`` name -> engine class (registered as an import path, imported on use)."""
ENGINES.register("hf", "async_rl.generators.hf:HFGenerator")
ENGINES.register("vllm", "async_rl.generators.vllm:VLLMGenerator")
ENGINES.register("sglang", "async_rl.generators.sglang:SGLangGenerator")

engine_class = ENGINES.backend_class
engine_capabilities = ENGINES.capabilities
engines_that = ENGINES.names_that
