"""The weight sync layer: the learner's named tensors, packed into flat buckets, into every engine.

Transports (``weight_sync.transport``):

* ``colocated``: the engine lives in the learner's process (HF engine in sync mode); the learner
  hands it its full tensors by name, nothing is copied in between. (On GPU the same role is played
  by CUDA IPC handles; see ``bench/gpu_weight_sync.py``.)
* ``shm``: same host. The learner owns ``num_slots`` reusable shared-memory slots of
  ``bucket_size_mb`` (files under ``/dev/shm``, mapped once by every receiver); it copies bucket
  i into slot ``i % num_slots`` and announces it; receivers load straight from the slot and
  acknowledge. Measured 3-4x faster than any socket on these machines (``../shared/MEASURED.md``).
* ``broadcast``: a ``torch.distributed`` process group of its own (gloo on CPU, NCCL on GPU) with
  the learner's sender as rank 0 and generator k as rank k + 1; each bucket is one broadcast. It
  never touches the default group, which the learner's FSDP ranks and vLLM's workers own.

Protocol (one ``WeightSender`` on the learner, one ``WeightReceiver`` in each engine process):

1. **Rendezvous** (once). The sender starts a ``TCPStore`` and, for ``shm``, allocates its slots;
   ``init_info()`` is a plain dict (JSON-able: it travels through Ray or vLLM's
   ``init_weight_transfer_engine``) from which each receiver connects with its rank. For
   ``broadcast`` the process group forms when the sender and every receiver have connected (the
   caller runs both sides concurrently).
2. **Per-version update**. ``plan_update(named_shapes, version)`` lays the tensors out in buckets
   (names, dtypes, shapes, byte offsets; tied aliases carry no bytes; a decoder layer is never
   split across buckets, because a loader may keep a partial layer's tensors until it is whole). The
   plan goes to every generator through the control plane (a Ray call, or vLLM's ``update_weights``
   request) with the version. Each receiver first checks the whole plan against its engine
   (``check_update``, see *All or nothing* below) and posts ``ready`` or ``error`` to the store;
   the sender waits for all ``ready`` before moving a byte, so a bad update fails the sync before
   any engine is touched. A failure after that (the sender's, a receiver's, or one engine's load)
   is posted as ``error`` too: ``shm`` receivers and the sender stop at once, ``broadcast`` ones at
   the group's timeout. Then bucket by bucket: the sender packs (casting to the wire dtype),
   publishes (slot + store key, or broadcast), and receivers unpack views and hand them to their
   engine's loader, then acknowledge (``shm``: a slot is reused only after every receiver
   acknowledged it).
3. **Finalize**. A receiver's engine finishes its load (HF: swaps the staged tensors in; vLLM:
   layerwise reload finalization), then its control call returns. The caller bumps the published
   policy version only when every generator's call has returned: a sync is atomic from the
   learner's view, and a failed one publishes nothing.
4. **In-flight requests**: decided by the engine, per ``generator.partial_rollout``: ``keep``
   pauses the engine with requests frozen (their KV cache kept) and resumes them on the new
   weights; ``abort`` aborts them and re-issues their partial responses as prompt extensions.
   Prefix-cache entries of older versions are never reused (vLLM: requests are salted with the
   version; ``abort`` also clears the cache).

A sync that does not complete in ``weight_sync.timeout_s`` raises ``TimeoutError`` naming the
receivers that did not acknowledge and the bucket each reached.

**All or nothing.** Every engine, on every transport (``colocated`` included), with full weights
and with LoRA adapters, validates the whole update before the first byte of it is written
(``check_update``): every name maps to a parameter (fused q/k/v and gate/up shards, tied heads
as aliases), every parameter is covered exactly once, each tensor has its target's full
(unsharded) shape, and each dtype converts to the target's under one rule (``converts_to``):
a floating-point tensor loads into a floating-point parameter of any precision, rounded to the
parameter's dtype (exact when widening, e.g. a ``bfloat16`` wire into a ``float32`` engine;
narrowing is the engine's own precision setting, e.g. ``generator.vllm.dtype=bfloat16``); any
other pair must match exactly, so an integer, bool or complex tensor for a floating parameter is
refused, and so is a dtype the wire does not carry. Two different tensors for one tied parameter
are refused too (send one, the other as its alias). A refused update raises one line naming
every offending weight (expected against got) and leaves every engine bit-identical.

A failure after the first byte (the sender dies or raises mid-stream, a bucket fails to load, a
receiver times out) never leaves an engine sampling from a half-written model:

* **HF engine: staging.** Buckets are received into a copy of the targeted parameters (the
  whole model, or only the adapters with LoRA) while generation goes on, and swapped in between
  two decoding steps once the last bucket arrived; a failure before the swap drops the copy and
  the engine keeps its old weights and version. Peak memory is the model plus one copy of its
  parameters on the engine's device, cheap for the models the HF engine serves (the large-model
  engine is vLLM); the colocated path converts first and writes last, with no copy unless a dtype
  or device changes. Should the swap itself fail (a device fault), the engine is marked
  unusable, as below.
* **vLLM engine: unusable until repaired.** Its layerwise reload writes processed layers into
  the live weights in place as they complete (on the CPU build into oneDNN-packed kernels) and
  a second copy of a large model does not fit beside its KV cache, so it cannot stage. After a
  failure the reload is unwound (unprocessed layers get their old tensors back, the reload state
  is cleared) and, if any bucket had reached the model, the engine is marked unusable: requests
  frozen by the update are aborted, ``generate`` raises, and the next complete update makes it
  usable again. If no byte had reached the model it keeps serving its old weights. LoRA updates
  on vLLM are staged (every bucket is received before the adapter is swapped in), so only a
  failure inside the swap marks the engine unusable.

An engine's ``policy_version`` moves only with a complete update, and ``WeightPublisher`` publishes
a version only when every engine loaded all of it.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

TRANSPORTS = ("auto", "colocated", "shm", "broadcast")
WIRE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class WeightSyncConfig:
    """How new weights travel from the learner to the generators."""

    transport: str = "auto"
    """``colocated`` (engine in the learner's process), ``shm`` (same-host shared memory),
    ``broadcast`` (a torch.distributed group: gloo on CPU, NCCL on GPU), or ``auto``: colocated for
    the HF engine in sync mode, else shm."""
    bucket_size_mb: float = 256.0
    """Bucket size in MiB (> 0). A tensor larger than a bucket gets a bucket of its own size."""
    num_slots: int = 2
    """``shm``: reusable slots (>= 1); with 2 the learner packs bucket i+1 while engines load bucket i."""
    wire_dtype: str = "auto"
    """dtype on the wire: ``auto`` keeps the learner's; ``bfloat16``/``float16`` halve the bytes
    (the engine converts to its own dtype when loading)."""
    timeout_s: float = 300.0
    """A sync (all buckets to every generator, loaded) that takes longer fails with a diagnostic."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight_sync.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"weight_sync.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.num_slots < 1:
            raise ValueError(f"weight_sync.num_slots must be >= 1, got {self.num_slots}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"weight_sync.wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes."""
        return int(self.bucket_size_mb * 2**20)


def resolve_transport(cfg: WeightSyncConfig, backend: str, mode: str) -> str:
    """The transport ``auto`` means for an engine backend (``hf``/``vllm``) in a trainer mode."""
    if cfg.transport != "auto":
        return cfg.transport
    return "colocated" if (backend == "hf" and mode == "sync") else "shm"


# ---------------------------------------------------------------------------------------- the plan
_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire name of a dtype)."""
    return str(dtype).removeprefix("torch.")


def converts_to(sent: torch.dtype | str, target: torch.dtype | str) -> bool:
    """Whether a tensor of dtype ``sent`` may load into a parameter of dtype ``target``.

    The one dtype rule of every engine: equal dtypes, or both floating point (the tensor is then
    rounded to ``target``, as ``Tensor.to`` does: exact when widening, e.g. ``bfloat16`` ->
    ``float32``). Integer, bool and complex tensors load only into parameters of their own dtype.
    Names (``"float32"``) are accepted for either side; a name the wire does not carry is never
    convertible.
    """
    if isinstance(sent, str):
        if sent not in _DTYPES:
            return False
        sent = _DTYPES[sent]
    if isinstance(target, str):
        target = _DTYPES.get(target, getattr(torch, target, None))
        if not isinstance(target, torch.dtype):
            return False
    return sent == target or (sent.is_floating_point and target.is_floating_point)


class WeightUpdateError(ValueError):
    """A weight update refused before any byte of it was written; the message (one line) names
    every offending weight and what was wrong with it."""


class UnknownWeightError(WeightUpdateError, KeyError):
    """A ``WeightUpdateError`` whose update carries names the engine has no parameter for (also
    a ``KeyError``, what a lookup by an unknown name raises)."""

    def __str__(self) -> str:
        # KeyError's own __str__ quotes its argument as if it were the missing key.
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of an update: its Hugging Face name, wire dtype, shape and place in its bucket.

    ``alias_of`` names the tensor whose bytes it shares (tied embeddings: ``lm_head.weight``);
    an alias has no bytes of its own (``nbytes == 0``).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0
    alias_of: str | None = None


@dataclass
class UpdatePlan:
    """The layout of one weight update: ``buckets[i]`` lists the tensors packed in bucket i.

    Attributes:
        version: the policy version the update carries.
        buckets: tensor metadata per bucket, in send order (aliases ride in their target's bucket).
        bucket_nbytes: size of each bucket in bytes.
        update_id: unique per update (store keys are namespaced by it).
    """

    version: int
    buckets: list[list[TensorMeta]]
    bucket_nbytes: list[int]
    update_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def names(self) -> list[str]:
        return [m.name for b in self.buckets for m in b]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (the control plane carries it)."""
        return {"version": self.version, "update_id": self.update_id, "bucket_nbytes": list(self.bucket_nbytes),
                "buckets": [[[m.name, m.dtype, list(m.shape), m.offset, m.nbytes, m.alias_of] for m in b]
                            for b in self.buckets]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UpdatePlan":
        return cls(version=int(d["version"]), update_id=d["update_id"], bucket_nbytes=list(d["bucket_nbytes"]),
                   buckets=[[TensorMeta(n, dt, tuple(s), o, nb, a) for n, dt, s, o, nb, a in b] for b in d["buckets"]])


_ALIGN = 64  # byte alignment of each tensor inside a bucket (vectorised copies, any dtype)


def layer_key(name: str) -> str:
    """The decoder layer a weight belongs to: its name up to the outermost integer segment
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``), or the name itself."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return name


def plan_update(named_shapes: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int, bucket_bytes: int,
                aliases: dict[str, str] | None = None, wire_dtype: torch.dtype | None = None) -> UpdatePlan:
    """Lay out tensors in buckets of about ``bucket_bytes``, never splitting a decoder layer.

    A loader may hold on to the tensors of a layer until the whole layer has arrived (vLLM's
    layerwise reload defers a layer's processing until all its weights are loaded, keeping the
    views it was given); a bucket that ended inside a layer would have its memory reused while
    still referenced. So consecutive weights of one layer (``layer_key``) share a bucket, and a
    layer larger than ``bucket_bytes`` gets a bucket of its own size.

    Args:
        named_shapes: ``(name, dtype, shape)`` of every tensor to send, in send order.
        version: policy version of the update.
        bucket_bytes: target bucket size in bytes (> 0).
        aliases: ``{alias: target}``: names loaded from the target's bytes (tied weights).
        wire_dtype: cast floating tensors to this dtype on the wire (None keeps each dtype).

    Raises:
        ValueError: a name listed twice, an alias whose target is not sent, or a dtype the wire
            does not carry (``bool``, ``int8``, complex, float8...).
    """
    seen: set[str] = set()
    items = []
    for name, dtype, shape in named_shapes:
        if name in seen:
            raise ValueError(f"weight {name!r} listed twice in one update")
        seen.add(name)
        if dtype_name(dtype) not in _DTYPES:
            raise ValueError(f"weight {name!r}: dtype {dtype_name(dtype)} cannot travel on the wire "
                             f"(carried: {sorted(_DTYPES)})")
        if wire_dtype is not None and dtype.is_floating_point:
            dtype = wire_dtype
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        items.append((name, dtype, tuple(int(s) for s in shape), nbytes))
    # Runs of consecutive weights of one layer.
    runs: list[list[tuple]] = []
    for it in items:
        if runs and layer_key(runs[-1][-1][0]) == layer_key(it[0]):
            runs[-1].append(it)
        else:
            runs.append([it])
    aligned = lambda n: -(-n // _ALIGN) * _ALIGN  # noqa: E731
    buckets: list[list[TensorMeta]] = [[]]
    sizes = [0]
    where: dict[str, int] = {}
    for run in runs:
        run_bytes = sum(aligned(nb) for *_, nb in run)
        if buckets[-1] and aligned(sizes[-1]) + run_bytes > bucket_bytes:
            buckets.append([])
            sizes.append(0)
        for name, dtype, shape, nbytes in run:
            start = aligned(sizes[-1])
            buckets[-1].append(TensorMeta(name, dtype_name(dtype), shape, start, nbytes))
            sizes[-1] = start + nbytes
            where[name] = len(buckets) - 1
    for alias, target in (aliases or {}).items():
        if target not in where:
            raise ValueError(f"alias {alias!r} points at {target!r}, which is not in the update")
        if alias in seen:
            raise ValueError(f"weight {alias!r} listed twice in one update")
        seen.add(alias)
        t = next(m for m in buckets[where[target]] if m.name == target)
        buckets[where[target]].append(TensorMeta(alias, t.dtype, t.shape, t.offset, 0, alias_of=target))
    return UpdatePlan(version=version, buckets=buckets, bucket_nbytes=sizes)


def pack_bucket(buf: torch.Tensor, metas: Sequence[TensorMeta], tensors: dict[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the flat uint8 ``buf`` at their planned offsets, cast to the wire dtype.

    Raises:
        ValueError: a tensor whose shape differs from the plan's, or whose dtype does not convert
            to the plan's (``converts_to``: an integer tensor where the plan announced floats).
    """
    for m in metas:
        if m.alias_of is not None:
            continue
        t = tensors[m.name]
        if tuple(t.shape) != m.shape:
            raise ValueError(f"weight {m.name!r}: shape {tuple(t.shape)} differs from the plan's {m.shape}")
        if not converts_to(t.dtype, m.dtype):
            raise ValueError(f"weight {m.name!r}: dtype {dtype_name(t.dtype)} does not convert to the plan's {m.dtype}")
        view = buf[m.offset : m.offset + m.nbytes].view(_DTYPES[m.dtype]).view(m.shape)
        view.copy_(t.detach())


def unpack_bucket(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views ``(name, tensor)`` into the flat uint8 ``buf``, in plan order (aliases share bytes).

    The views are valid until ``buf`` is reused: a loader that keeps them must copy."""
    out = []
    byname = {m.name: m for m in metas}
    for m in metas:
        src = byname[m.alias_of] if m.alias_of is not None else m
        out.append((m.name, buf[src.offset : src.offset + src.nbytes].view(_DTYPES[src.dtype]).view(src.shape)))
    return out


# ---------------------------------------------------------------------------------------- name map
def _map_names(hf_names: Iterable[str], engine_names: Iterable[str], packed_modules: dict[str, list[str]] | None,
               tied: dict[str, str] | None):
    # Every problem at once: (mapping, unknown names, names covering a target twice, uncovered).
    engine = set(engine_names)
    packed = packed_modules or {}
    part_to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    tied = tied or {}
    out: dict[str, tuple[str, str | None]] = {}
    covered: dict[tuple[str, str | None], str] = {}
    unknown: list[str] = []
    twice: list[str] = []
    for name in hf_names:
        if name in tied and tied[name] in engine:
            out[name] = (tied[name], "tied")
            continue
        if name in engine:
            target = (name, None)
        else:
            target = None
            parts = name.split(".")
            for i, p in enumerate(parts):
                if p in part_to_fused:
                    fused = ".".join(parts[:i] + [part_to_fused[p]] + parts[i + 1 :])
                    if fused in engine:
                        target = (fused, p)
                    break
            if target is None:
                unknown.append(name)
                continue
        if target in covered:
            twice.append(f"weights {covered[target]!r} and {name!r} both load engine parameter {target[0]!r}"
                         + (f" shard {target[1]!r}" if target[1] else ""))
            continue
        covered[target] = name
        out[name] = target
    missing = []
    for e in sorted(engine):
        module, _, leaf = e.rpartition(".")
        fused = module.rsplit(".", 1)[-1]
        if fused in packed and (e, None) not in covered:
            missing += [f"{e}[{p}]" for p in packed[fused] if (e, p) not in covered]
        elif fused not in packed and (e, None) not in covered:
            missing.append(e)
    return out, unknown, twice, missing


def map_to_engine(hf_names: Iterable[str], engine_names: Iterable[str],
                  packed_modules: dict[str, list[str]] | None = None,
                  tied: dict[str, str] | None = None) -> dict[str, tuple[str, str | None]]:
    """Map each Hugging Face weight name onto the engine parameter (and shard) that loads it.

    An engine may fuse HF tensors (vLLM: ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
    ``gate_proj``/``up_proj`` into ``gate_up_proj``; ``packed_modules`` lists them as
    ``{fused: [parts]}``) and may drop a tied output head from its parameters (``tied``:
    ``{hf_name: engine_name}``, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
    Names only; ``check_update`` also checks shapes, dtypes and tied tensors.

    Returns:
        ``{hf_name: (engine_name, shard)}``, shard being the part name of a fused parameter,
        ``"tied"`` for a tied alias, or ``None``. Every engine parameter is covered, each shard of
        a fused one exactly once.

    Raises:
        KeyError: an HF name that maps to no engine parameter (named in the message).
        ValueError: an engine parameter (or a shard of one) that no HF name covers, or one
            covered twice (the leftovers are named).
    """
    out, unknown, twice, missing = _map_names(hf_names, engine_names, packed_modules, tied)
    if unknown:
        raise KeyError(f"weight {unknown[0]!r} maps to no parameter of the engine's model")
    if twice:
        raise ValueError(twice[0])
    if missing:
        raise ValueError(f"weight update leaves {len(missing)} engine parameters without a tensor: {missing[:8]}")
    return out


def _few(names: list[str], k: int = 8) -> str:
    return f"{names[:k]}" + (f" and {len(names) - k} more" if len(names) > k else "")


def check_update(sent: Iterable[tuple[str, torch.dtype | str, Sequence[int], str | None]], engine_names: Iterable[str],
                 packed_modules: dict[str, list[str]] | None = None, tied: dict[str, str] | None = None,
                 specs: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                 require_all: bool = True) -> dict[str, tuple[str, str | None]]:
    """Validate a whole weight update against an engine, before any byte of it is written.

    Checks, reporting every problem at once: each name sent once; each name maps to an engine
    parameter (``map_to_engine``: fused shards, tied aliases); with ``require_all`` every engine
    parameter (each shard of a fused one) is covered exactly once; each tensor's shape equals the
    engine's for that name and its dtype converts to the engine's (``converts_to``); a tied
    parameter gets at most one tensor of its own (its other names must be aliases of it).

    Args:
        sent: ``(name, dtype, shape, alias_of)`` of every tensor of the update: the dtype as a
            ``torch.dtype`` or its wire name, the full (unsharded) shape, and ``alias_of`` the
            name whose bytes an alias shares (``None`` for a tensor of its own).
        engine_names, packed_modules, tied: the engine's parameter names, fused modules and tied
            aliases, as for ``map_to_engine``.
        specs: ``{HF name: (dtype name, full shape)}`` the engine loads under each name it accepts
            (fused parts and tied aliases included); a name missing here gets no shape or dtype
            check, ``None`` skips them all.
        require_all: whether every engine parameter must receive a tensor.

    Returns:
        ``map_to_engine``'s mapping of the names sent.

    Raises:
        UnknownWeightError: (a ``KeyError``) names that map to no engine parameter; the message
            also lists any other problem.
        WeightUpdateError: (a ``ValueError``) anything else: a name listed twice, an engine
            parameter left without a tensor or loaded twice, a shape or dtype mismatch (``'name':
            got (384, 128), engine expects (128, 384)``), two tensors for one tied parameter.
    """
    sent = [(n, dt if isinstance(dt, str) else dtype_name(dt), tuple(int(x) for x in shape), alias)
            for n, dt, shape, alias in sent]
    tied = tied or {}
    problems: list[str] = []
    names = [n for n, *_ in sent]
    dup = sorted(n for n, k in Counter(names).items() if k > 1)
    if dup:
        problems.append(f"listed twice: {_few(dup)}")
    out, unknown, twice, missing = _map_names(dict.fromkeys(names), engine_names, packed_modules, tied)
    if unknown:
        problems.append(f"unknown weights (no engine parameter loads them): {_few(unknown)}")
    problems += twice[:8]
    if missing and require_all:
        problems.append(f"left {len(missing)} parameters unchanged (engine parameters without a tensor): "
                        f"{_few(missing)}")
    aliases = {n: a for n, _, _, a in sent if a is not None}
    for alias, target in tied.items():
        if alias in out and target in out and aliases.get(alias) != target and aliases.get(target) != alias:
            problems.append(f"{alias!r} and {target!r} are one tied engine parameter but were sent as two "
                            f"tensors (send one, the other as its alias)")
    shapes, dtypes = [], []
    for name, dt, shape, _ in sent:
        spec = (specs or {}).get(name)
        if spec is None or name not in out:
            continue
        want_dtype, want_shape = spec[0], tuple(spec[1])
        if shape != want_shape:
            shapes.append(f"{name!r} got {shape}, engine expects {want_shape}")
        if not converts_to(dt, want_dtype):
            why = "the wire does not carry it" if dt not in _DTYPES else "only floating-point weights convert"
            dtypes.append(f"{name!r} got {dt}, engine holds {want_dtype} ({why})")
    for what, found in (("wrong shape", shapes), ("wrong dtype", dtypes)):
        if found:
            problems.append(f"{what}: " + "; ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else ""))
    if problems:
        cls = UnknownWeightError if unknown else WeightUpdateError
        raise cls("weight update refused before any byte was written: " + " | ".join(problems))
    return out


# ---------------------------------------------------------------------------------------- sides
def _store_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def _slot_path(prefix: str, k: int) -> str:
    return f"/dev/shm/{prefix}-slot{k}" if os.path.isdir("/dev/shm") else os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"{prefix}-slot{k}")


class WeightSender:
    """The learner's end of the weight sync layer (see the module docstring for the protocol).

    Args:
        cfg: weight-sync settings; ``cfg.transport`` must be ``shm`` or ``broadcast``.
        num_receivers: generator engines that receive every update (>= 1).
        host: address receivers reach the store at (``127.0.0.1`` for one host).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL) for ``broadcast``.

    Raises:
        ValueError: a transport this class does not carry (``colocated`` needs no sender).
    """

    def __init__(self, cfg: WeightSyncConfig, num_receivers: int, host: str = "127.0.0.1", device: str = "cpu") -> None:
        import torch.distributed as dist

        if cfg.transport not in ("shm", "broadcast"):
            raise ValueError(f"WeightSender carries shm or broadcast, not {cfg.transport!r}")
        self.cfg, self.num_receivers, self.device = cfg, num_receivers, device
        self.store = dist.TCPStore(host, 0, num_receivers + 1, True, timeout=_store_timeout(cfg.timeout_s),
                                   wait_for_workers=False)
        self.host, self.port = host, self.store.port
        self.prefix = f"async-rl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slots: list[torch.Tensor] = []
        self._slot_paths: list[str] = []
        self._slot_bytes = 0
        self.group = None
        self.num_updates = 0
        if cfg.transport == "shm":
            self._alloc_slots(cfg.bucket_bytes)
        import atexit

        atexit.register(self._free_slots)

    def _alloc_slots(self, nbytes: int) -> None:
        self._free_slots()
        self._slot_bytes = nbytes
        self._slot_paths = [_slot_path(f"{self.prefix}-{nbytes}", k) for k in range(self.cfg.num_slots)]
        # torch.from_file(shared=True) maps the file MAP_SHARED: every process that maps it sees
        # one copy of the bytes, and the mapping is made once per slot, not once per update.
        self.slots = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in self._slot_paths]

    def _free_slots(self) -> None:
        for p in self._slot_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.slots, self._slot_paths = [], []

    def init_info(self) -> dict[str, Any]:
        """What a receiver needs to connect (JSON-able)."""
        return {"transport": self.cfg.transport, "host": self.host, "port": self.port,
                "world_size": self.num_receivers + 1, "timeout_s": self.cfg.timeout_s,
                "device": self.device, "prefix": self.prefix,
                "slots": [[p, self._slot_bytes] for p in self._slot_paths]}

    def unlink_slots(self) -> None:
        """Remove the slot files once every receiver has mapped them (``connect``): the memory
        stays shared through the mappings and is freed when the last process unmaps it, so a
        killed run leaves nothing behind in ``/dev/shm``."""
        for p in self._slot_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def connect(self) -> None:
        """Join the broadcast group (blocks until every receiver connects); no-op for ``shm``."""
        if self.cfg.transport == "broadcast" and self.group is None:
            self.group = _new_group(self.store, 0, self.num_receivers + 1, self.device, self.cfg.timeout_s, self.prefix)

    def plan(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int,
             aliases: dict[str, str] | None = None) -> UpdatePlan:
        """The bucket layout of ``named_tensors`` (full tensors, or DTensors: only shapes are read)."""
        return self.plan_shapes([(n, t.dtype, tuple(t.shape)) for n, t in named_tensors], version, aliases)

    def plan_shapes(self, meta: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int,
                    aliases: dict[str, str] | None = None) -> UpdatePlan:
        """The bucket layout of ``(name, dtype, full shape)`` entries (``plan_update``); grows the
        shm slots if one layer is larger than a bucket."""
        wire = None if self.cfg.wire_dtype == "auto" else _DTYPES[self.cfg.wire_dtype]
        plan = plan_update(meta, version, self.cfg.bucket_bytes, aliases, wire)
        if self.cfg.transport == "shm" and max(plan.bucket_nbytes) > self._slot_bytes:
            self._alloc_slots(max(plan.bucket_nbytes))  # one oversized tensor: grow the slots once
        return plan

    def send(self, plan: UpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float | None = None) -> dict[str, float]:
        """Stream ``tensors`` (in plan order; DTensors are gathered one at a time) to every receiver.

        Call while every receiver runs ``WeightReceiver.receive(plan)`` (concurrently).

        Returns:
            ``{"weight_sync/bytes", "weight_sync/pack_s", "weight_sync/send_s"}``.

        Raises:
            RuntimeError: a receiver reported an error (its message, e.g. an unknown weight name).
            TimeoutError: receivers did not get ready or acknowledge in time (which and where).
        """
        deadline = deadline or time.monotonic() + self.cfg.timeout_s
        self._forget_previous(plan)
        self._wait_count(plan, "ready", self.num_receivers, deadline)
        try:
            return self._send(plan, tensors, deadline)
        except BaseException as e:
            # Tell the receivers at once (shm receivers watch this key; broadcast receivers wait
            # out the group's timeout), rather than leaving them blocked on the next bucket.
            if not self.store.check([f"{plan.update_id}/error"]):
                self.store.set(f"{plan.update_id}/error", f"sender: {type(e).__name__}: {e}")
            raise

    def _send(self, plan: UpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float) -> dict[str, float]:
        it = iter(tensors)
        pack_s = send_s = 0.0
        nslots = len(self.slots)
        bcast_buf = None
        for i, metas in enumerate(plan.buckets):
            if i and self.store.check([f"{plan.update_id}/error"]):
                # A receiver gave up (its loader failed): broadcast receivers would leave the next
                # collective unmatched, shm ones would never acknowledge.
                raise RuntimeError(f"weight sync v{plan.version}: a generator failed: "
                                   f"{self.store.get(f'{plan.update_id}/error').decode()}")
            want = {m.name for m in metas if m.alias_of is None}
            got: dict[str, torch.Tensor] = {}
            while len(got) < len(want):
                name, t = next(it)
                if name not in want:
                    raise ValueError(f"weight {name!r} arrived out of plan order (bucket {i} expects {sorted(want)[:4]})")
                got[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
            t0 = time.perf_counter()
            if self.cfg.transport == "shm":
                if i >= nslots:  # slot reuse: every receiver must be done with bucket i - nslots
                    self._wait_count(plan, f"ack{i - nslots}", self.num_receivers, deadline)
                buf = self.slots[i % nslots][: plan.bucket_nbytes[i]]
                pack_bucket(buf, metas, got)
                t1 = time.perf_counter()
                self.store.set(f"{plan.update_id}/bucket{i}", f"{self._slot_paths[i % nslots]}:{self._slot_bytes}")
            else:
                if bcast_buf is None or bcast_buf.numel() < plan.bucket_nbytes[i]:
                    bcast_buf = torch.empty(max(plan.bucket_nbytes), dtype=torch.uint8, device=self.device)
                buf = bcast_buf[: plan.bucket_nbytes[i]]
                pack_bucket(buf, metas, got)
                t1 = time.perf_counter()
                self.group.broadcast(buf, 0).wait()
            pack_s += t1 - t0
            send_s += time.perf_counter() - t1
            del got
        self.num_updates += 1
        return {"weight_sync/bytes": float(plan.total_bytes), "weight_sync/pack_s": pack_s, "weight_sync/send_s": send_s}

    def _forget_previous(self, plan: UpdatePlan) -> None:
        # The previous update is complete (its caller waited for every engine): drop its keys so
        # a long run does not grow the store by a few keys per version.
        prev, self._last_plan = getattr(self, "_last_plan", None), plan
        if prev is None:
            return
        for key in ["ready", "error"] + [f"bucket{i}" for i in range(len(prev.buckets))] + \
                [f"ack{i}" for i in range(len(prev.buckets))]:
            self.store.delete_key(f"{prev.update_id}/{key}")

    def _wait_count(self, plan: UpdatePlan, key: str, n: int, deadline: float) -> None:
        full = f"{plan.update_id}/{key}"
        err = f"{plan.update_id}/error"
        while True:
            if self.store.check([err]):
                raise RuntimeError(f"weight sync v{plan.version}: a generator failed: {self.store.get(err).decode()}")
            if self.store.add(full, 0) >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(self.diagnose(plan, f"waiting for {n} receivers' {key!r}"))
            time.sleep(0.0005)

    def diagnose(self, plan: UpdatePlan, what: str) -> str:
        """Where each receiver stands in ``plan`` (for a timeout message)."""
        ready = self.store.add(f"{plan.update_id}/ready", 0)
        acks = [self.store.add(f"{plan.update_id}/ack{i}", 0) for i in range(len(plan.buckets))]
        return (f"weight sync v{plan.version} ({self.cfg.transport}) timed out after {self.cfg.timeout_s:.0f} s "
                f"{what}: {ready}/{self.num_receivers} receivers ready; acknowledgements per bucket {acks}")

    def close(self) -> None:
        """Release the slots (the files are unlinked; receivers' mappings stay valid until closed)."""
        self._free_slots()


def _new_group(store, rank: int, world: int, device: str, timeout_s: float, prefix: str):
    import torch.distributed as dist

    pstore = dist.PrefixStore(f"{prefix}/pg", store)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _store_timeout(timeout_s)
        return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    return dist.ProcessGroupGloo(pstore, rank, world, _store_timeout(timeout_s))


class WeightReceiver:
    """A generator's end of the weight sync layer (see the module docstring for the protocol).

    Args:
        init_info: ``WeightSender.init_info()``.
        rank: this receiver's index among the sender's receivers (0-based).
    """

    def __init__(self, init_info: dict[str, Any], rank: int) -> None:
        import torch.distributed as dist

        self.info, self.rank = dict(init_info), rank
        self.transport = init_info["transport"]
        self.store = dist.TCPStore(init_info["host"], int(init_info["port"]), int(init_info["world_size"]), False,
                                   timeout=_store_timeout(float(init_info["timeout_s"])))
        self.group = None
        self._maps: dict[str, torch.Tensor] = {}
        self._buf: torch.Tensor | None = None

    def connect(self) -> None:
        """Map the shm slots, or join the broadcast group (blocks until the sender and all
        receivers connect)."""
        for path, nbytes in self.info.get("slots", []):
            self._slot(path, int(nbytes))
        if self.transport == "broadcast" and self.group is None:
            self.group = _new_group(self.store, self.rank + 1, int(self.info["world_size"]), self.info["device"],
                                    float(self.info["timeout_s"]), self.info["prefix"])

    def fail(self, plan: UpdatePlan, message: str) -> None:
        """Tell the sender this update cannot be loaded (it raises ``RuntimeError`` with ``message``).

        The first error posted for an update stands (it is the cause; later ones are its echoes)."""
        key = f"{plan.update_id}/error"
        if not self.store.check([key]):
            self.store.set(key, f"receiver {self.rank}: {message}")

    def receive(self, plan: UpdatePlan, check=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket's ``(name, tensor)`` views in plan order.

        Args:
            plan: the update's layout.
            check: optional callable on ``plan.names`` run before any byte moves (the engine's
                check of the whole plan, ``check_update``); if it raises, the sender is told and
                the error propagates.

        A yielded bucket's views are valid only until the next one is requested: the loader must
        consume (or copy) them before asking for the next. If the loader stops early (it raised,
        or closed this iterator) the sender is told, so it stops instead of waiting for
        acknowledgements; a loader that ``fail``s with its own message inside the loop, before
        leaving it, has that message reach the sender instead.

        Raises:
            RuntimeError: the sender (or another receiver) reported an error mid-update.
            TimeoutError: a bucket did not arrive within ``timeout_s`` (``shm``).
        """
        if check is not None:
            try:
                check(plan.names)
            except Exception as e:
                self.fail(plan, f"{type(e).__name__}: {e}")
                raise
        self.connect()
        self.store.add(f"{plan.update_id}/ready", 1)
        i, complete = 0, False
        try:
            for i, metas in enumerate(plan.buckets):
                if self.transport == "shm":
                    key = f"{plan.update_id}/bucket{i}"
                    self._wait_key(plan, key)
                    path, nbytes = self.store.get(key).decode().rsplit(":", 1)
                    buf = self._slot(path, int(nbytes))[: plan.bucket_nbytes[i]]
                else:
                    if self._buf is None or self._buf.numel() < plan.bucket_nbytes[i]:
                        self._buf = torch.empty(max(plan.bucket_nbytes), dtype=torch.uint8, device=self.info["device"])
                    buf = self._buf[: plan.bucket_nbytes[i]]
                    self.group.broadcast(buf, 0).wait()
                yield unpack_bucket(buf, metas)
                self.store.add(f"{plan.update_id}/ack{i}", 1)
            complete = True
        finally:
            if not complete:
                try:
                    self.fail(plan, f"stopped at bucket {i} of {len(plan.buckets)}")
                except Exception:  # noqa: BLE001 - the store may be gone with the sender; the cause propagates
                    pass

    def _wait_key(self, plan: UpdatePlan, key: str) -> None:
        err = f"{plan.update_id}/error"
        deadline = time.monotonic() + float(self.info["timeout_s"])
        while not self.store.check([key]):
            if self.store.check([err]):
                raise RuntimeError(f"weight sync v{plan.version} aborted: {self.store.get(err).decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight sync v{plan.version}: receiver {self.rank} waited "
                                   f"{self.info['timeout_s']} s for {key!r}")
            time.sleep(0.0002)

    def _slot(self, path: str, nbytes: int) -> torch.Tensor:
        # Mapped once per slot file; the sender allocates new files only if a bucket outgrows them.
        if path not in self._maps:
            self._maps[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return self._maps[path]

    def close(self) -> None:
        """Drop the slot mappings and the receive buffer."""
        self._maps.clear()
        self._buf = None


# ---------------------------------------------------------------------------------------- driver
def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{tied name: canonical name}`` of ``model``: parameters registered under two names
    (``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n}


class ModuleWeights:
    """A plain ``nn.Module`` as the source of a ``WeightPublisher`` (what a learner provides:
    ``named_weights``, ``weight_metadata``, ``weight_aliases``); for tools, benchmarks and tests
    that push a Hugging Face model's weights without a learner."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter, tied ones once."""
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` in ``named_weights`` order."""
        return [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def weight_aliases(self) -> dict[str, str]:
        """``tied_aliases(model)``."""
        return tied_aliases(self.model)


class LocalTarget:
    """A generator engine object in this process (sync mode), driven from a helper thread so the
    learner's thread can stream the buckets meanwhile."""

    def __init__(self, engine) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-recv")

    def connect(self, init_info: dict[str, Any], rank: int):
        return self._pool.submit(self.engine.connect_weight_sync, init_info, rank)

    def receive(self, plan: dict[str, Any], version: int):
        return self._pool.submit(self.engine.receive_weights, plan, version)

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        from concurrent.futures import wait

        done, pending = wait(handles, timeout=timeout_s)
        if pending:
            raise TimeoutError
        return [h.result() for h in handles]


class RayTarget:
    """A generator actor (``async_rl.generators.pool.GeneratorWorker``) reached through Ray calls."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def connect(self, init_info: dict[str, Any], rank: int):
        return self.actor.connect_weight_sync.remote(init_info, rank)

    def receive(self, plan: dict[str, Any], version: int):
        return self.actor.receive_weights.remote(plan, version)

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        import ray

        ready, pending = ray.wait(handles, num_returns=len(handles), timeout=timeout_s)
        if pending:
            raise TimeoutError
        return ray.get(handles)


class WeightPublisher:
    """The learner's driver: one call of ``push`` moves one policy version into every generator.

    Args:
        cfg: weight-sync settings.
        transport: the resolved transport (``resolve_transport``).
        learner: has ``named_weights()`` (full tensors by HF name, tied ones once) and
            ``weight_aliases()`` (``{tied name: name sent}``).
        targets: ``LocalTarget``s or ``RayTarget``s (all of one kind).
        device: where the learner's tensors live: ``cuda`` makes ``broadcast`` use NCCL.

    Raises:
        ValueError: ``colocated`` with targets that are not in this process.
    """

    def __init__(self, cfg: WeightSyncConfig, transport: str, learner, targets: list, device: str = "cpu") -> None:
        self.cfg, self.transport, self.learner, self.targets = cfg, transport, learner, targets
        self.sender: WeightSender | None = None
        self.published_version: int | None = None
        if transport == "colocated":
            if not all(isinstance(t, LocalTarget) for t in targets):
                raise ValueError("weight_sync.transport=colocated needs the engine in the learner's process "
                                 "(sync mode, generator.backend=hf); use shm or broadcast")
            return
        self.sender = WeightSender(replace_transport(cfg, transport), len(targets), device=device)
        handles = [t.connect(self.sender.init_info(), r) for r, t in enumerate(targets)]
        self.sender.connect()  # broadcast: the group forms here, with every receiver joining
        self._wait(handles, None, "connecting")
        self.sender.unlink_slots()

    def _wait(self, handles: list, plan: UpdatePlan | None, what: str, timeout_s: float | None = None) -> list:
        try:
            return type(self.targets[0]).wait(handles, timeout_s or self.cfg.timeout_s)
        except TimeoutError:
            where = self.sender.diagnose(plan, what) if (self.sender and plan) else \
                f"weight sync ({self.transport}) timed out after {self.cfg.timeout_s:.0f} s {what}"
            raise TimeoutError(where) from None

    def push(self, version: int) -> dict[str, float]:
        """Send the learner's current weights as ``version``; returns once every generator has
        loaded them (then, and only then, ``published_version = version``).

        A failed push publishes nothing: each engine either refused the update before any write
        (unchanged), dropped its staged copy (HF: old weights and version), or is marked unusable
        until a complete update (vLLM, after a failure past its first loaded bucket). See the
        module docstring, *All or nothing*.

        Returns:
            ``timing/weight_sync_s`` and, for shm/broadcast, bytes moved and pack/send seconds.

        Raises:
            RuntimeError: a generator rejected the update (the message names the weights and what
                was wrong) or failed loading it.
            KeyError, ValueError: ``colocated``: the engine's own refusal (``check_update``).
            Exception: whatever the learner's ``named_weights`` raised mid-stream (re-raised once
                the engines have settled).
            TimeoutError: the sync did not finish in ``weight_sync.timeout_s`` (who, where).
        """
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        if self.transport == "colocated":
            for t in self.targets:
                t.engine.update_weights(self.learner.named_weights(), version)
        else:
            deadline = time.monotonic() + self.cfg.timeout_s
            if hasattr(self.learner, "weight_metadata"):
                # Shapes without gathering: send() then gathers one tensor at a time.
                meta = self.learner.weight_metadata()
                named = self.learner.named_weights()
            else:
                named = list(self.learner.named_weights())
                meta = [(n, t.dtype, tuple(t.shape)) for n, t in named]
            plan = self.sender.plan_shapes(meta, version, self.learner.weight_aliases())
            handles = [t.receive(plan.to_dict(), version) for t in self.targets]
            try:
                metrics = self.sender.send(plan, named, deadline)
            except Exception as sent:
                # Let every engine settle first (a staged copy dropped, or the engine marked
                # unusable), so that none is still loading when the caller sees the error; a
                # receiver's own exception names the weight, so surface it too.
                try:
                    self._wait(handles, plan, "collecting the receivers' errors", timeout_s=30)
                except Exception as cause:
                    if isinstance(sent, RuntimeError) and str(cause) not in str(sent):
                        raise RuntimeError(f"{sent} ({type(cause).__name__}: {cause})") from cause
                    raise sent from cause
                raise
            self._wait(handles, plan, "waiting for the engines to load", max(1.0, deadline - time.monotonic()))
        self.published_version = version
        metrics["timing/weight_sync_s"] = time.perf_counter() - t0
        if metrics.get("weight_sync/bytes"):
            metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / 1e9 / metrics["timing/weight_sync_s"]
        return metrics

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def replace_transport(cfg: WeightSyncConfig, transport: str) -> WeightSyncConfig:
    """``cfg`` with ``transport`` resolved (``auto`` replaced)."""
    import dataclasses

    return dataclasses.replace(cfg, transport=transport)
