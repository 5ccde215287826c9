"""The layout of one update: tensors by name, dtype and shape packed into flat buckets
(``plan_update``), and the one dtype rule of every engine (``converts_to``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)}
"""``{wire name: torch dtype}`` of every dtype a bucket can carry."""


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
        if sent not in DTYPES:
            return False
        sent = DTYPES[sent]
    if isinstance(target, str):
        target = DTYPES.get(target, getattr(torch, target, None))
        if not isinstance(target, torch.dtype):
            return False
    return sent == target or (sent.is_floating_point and target.is_floating_point)


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
                aliases: dict[str, str] | None = None, wire_dtype: torch.dtype | None = None,
                align: int = _ALIGN) -> UpdatePlan:
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
        align: byte alignment of each tensor's offset (64: vectorised copies). 1 packs tensors
            back to back, SGLang's ``flattened_bucket`` layout (``FlattenedTensorBucket``), which
            still needs each offset to be a multiple of its dtype's size.

    Raises:
        ValueError: a name listed twice, an alias whose target is not sent, a dtype the wire
            does not carry (``bool``, ``int8``, complex, float8...), or (``align=1``) a tensor
            whose packed offset is not a multiple of its dtype's size (mixed dtypes: set
            ``weight_sync.wire_dtype``).
    """
    seen: set[str] = set()
    items = []
    for name, dtype, shape in named_shapes:
        if name in seen:
            raise ValueError(f"weight {name!r} listed twice in one update")
        seen.add(name)
        if dtype_name(dtype) not in DTYPES:
            raise ValueError(f"weight {name!r}: dtype {dtype_name(dtype)} cannot travel on the wire "
                             f"(carried: {sorted(DTYPES)})")
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
    aligned = lambda n: -(-n // align) * align  # noqa: E731
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
            if start % torch.empty((), dtype=dtype).element_size():
                raise ValueError(f"weight {name!r} ({dtype_name(dtype)}) would start at byte {start} of a packed "
                                 f"bucket, not a multiple of its size: set weight_sync.wire_dtype so all weights "
                                 f"travel in one dtype")
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
        view = buf[m.offset : m.offset + m.nbytes].view(DTYPES[m.dtype]).view(m.shape)
        view.copy_(t.detach())


def unpack_bucket(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views ``(name, tensor)`` into the flat uint8 ``buf``, in plan order (aliases share bytes).

    The views are valid until ``buf`` is reused: a loader that keeps them must copy."""
    out = []
    byname = {m.name: m for m in metas}
    for m in metas:
        src = byname[m.alias_of] if m.alias_of is not None else m
        out.append((m.name, buf[src.offset : src.offset + src.nbytes].view(DTYPES[src.dtype]).view(src.shape)))
    return out
