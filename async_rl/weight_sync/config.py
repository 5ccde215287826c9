"""Weight-sync settings (``weight_sync.*``) and the transport ``auto`` resolves to (one for all
engines: ``resolve_transport``; per engine by host: ``transports_for_targets``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from async_rl.generators.capabilities import engine_capabilities
from async_rl.weight_sync.protocols import PROTOCOLS

TRANSPORTS = ("auto", "colocated", "shm", "broadcast")
WIRE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class WeightSyncConfig:
    """How new weights travel from the learner to the generators."""

    transport: str = "auto"
    """``colocated`` (engine in the learner's process), ``shm`` (same-host shared memory),
    ``broadcast`` (a torch.distributed group: gloo on CPU, NCCL on GPU), or ``auto``: colocated for
    the HF and SGLang engines in sync mode (SGLang: ``update_weights_from_tensor``), else shm, and in
    async mode broadcast for the engines on other hosts than the learner's, in the same update
    (``transports_for_targets``; SGLang then takes broadcast for all)."""
    bucket_size_mb: float = 256.0
    """Bucket size in MiB (> 0). A tensor larger than a bucket gets a bucket of its own size."""
    num_slots: int = 2
    """``shm``: reusable slots (>= 1); with 2 the learner packs bucket i+1 while engines load bucket i."""
    wire_dtype: str = "auto"
    """dtype on the wire: ``auto`` keeps the learner's; ``bfloat16``/``float16`` halve the bytes
    (the engine converts to its own dtype when loading)."""
    timeout_s: float = 300.0
    """A sync (all buckets to every generator, loaded) that takes longer fails with a diagnostic."""
    overlap_push: bool = True
    """Async mode: the next training step starts while the previous version is pushed. The
    learner copies its weights into a staging buffer (one extra copy of the weights it sends, on
    their device; with LoRA only the adapters) and a background thread streams that copy to
    every engine; the version counts as published, for admission and staleness, only once every
    engine has loaded it. At most one push is in flight: the next one, a checkpoint, an
    evaluation, the exit probe and the end of the run wait for it first, and its failure is raised
    on the learner's thread at the next step. ``timing/weight_sync_s`` is then the learner's
    blocking seconds (the staging copy plus any wait for the previous push) and
    ``weight_sync/publish_lag_s`` the seconds until published. ``false``: every push blocks the
    learner until every engine has loaded it. Sync mode always pushes in place and ignores it."""
    probe_at_exit: bool = False
    """Async mode: at the end of the run every generator actor and the trainer's own engine
    (holding the learner's weights) greedily decode the same few prompts; tokens, log-probs and
    where each engine ran go to ``engine_probe.json`` in the run directory, the largest log-prob
    difference to ``weight_sync/probe_max_abs_logprob_diff`` in the summary. A check that every
    engine, on every node, ends on the learner's weights (costs one short greedy batch per actor)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.num_slots < 1:
            raise ValueError(f"weight_sync.num_slots must be >= 1, got {self.num_slots}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"weight_sync.wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if not isinstance(self.overlap_push, bool):
            raise ValueError(f"weight_sync.overlap_push must be true or false, got {self.overlap_push!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes."""
        return int(self.bucket_size_mb * 2**20)


def resolve_transport(cfg: WeightSyncConfig, backend: str, mode: str) -> str:
    """The transport ``auto`` means for an engine backend (``hf``/``vllm``/``sglang``) in a trainer
    mode: ``colocated`` in sync mode for an engine that can live in the learner's process
    (``EngineCapabilities.colocated``), else ``shm``.

    Raises:
        ValueError: an unknown backend.
    """
    if cfg.transport != "auto":
        return cfg.transport
    return "colocated" if (mode == "sync" and engine_capabilities(backend).colocated) else "shm"


def transports_for_targets(cfg: WeightSyncConfig, backend: str, mode: str, same_host: Sequence[bool]) -> list[str]:
    """The transport of each engine target in one update, by where it runs.

    A forced ``cfg.transport`` applies to every target. ``auto``: ``resolve_transport`` for each,
    except that in ``async`` mode a target off the learner's host gets ``broadcast`` (shared
    memory does not leave a host), and when the engine's protocol cannot mix transports in one
    update (``PROTOCOLS[...].mixed_transports``, false for SGLang, whose schedulers join the
    broadcast group themselves) one remote target makes every target ``broadcast``.

    Args:
        cfg: weight-sync settings.
        backend: the engine backend, ``hf``, ``vllm`` or ``sglang``.
        mode: the trainer mode, ``sync`` or ``async``.
        same_host: per target, whether it runs on the learner's host.

    Returns:
        One transport name per target (``colocated``, ``shm`` or ``broadcast``), e.g.
        ``["shm", "broadcast", "shm"]`` for ``auto``, ``vllm``, ``async``, ``[True, False, True]``.

    Raises:
        ValueError: an unknown backend.
    """
    if cfg.transport != "auto":
        return [cfg.transport] * len(same_host)
    local = resolve_transport(cfg, backend, mode)
    if mode != "async" or all(same_host):
        return [local] * len(same_host)
    if not PROTOCOLS[engine_protocol(backend)].mixed_transports:
        return ["broadcast"] * len(same_host)
    return [local if here else "broadcast" for here in same_host]


def engine_protocol(backend: str) -> str:
    """The bucket protocol a sender must speak to engines of ``backend``, as the engine class
    declares it (``EngineCapabilities.protocol``): ``sglang`` (a broadcast group SGLang's
    ``init_weights_update_group`` joins, contiguous ``flattened_bucket`` layout) or ``async_rl``
    (our own receivers: HF, vLLM).

    Raises:
        ValueError: an unknown backend.
    """
    return engine_capabilities(backend).protocol


def replace_transport(cfg: WeightSyncConfig, transport: str) -> WeightSyncConfig:
    """``cfg`` with ``transport`` resolved (``auto`` replaced)."""
    return dataclasses.replace(cfg, transport=transport)
