"""What learner ranks send each other besides tensors in collectives: msgpack, never pickle.

``torch.distributed``'s ``*_object`` collectives (``broadcast_object_list``, ``all_gather_object``)
pickle on the sender and unpickle on every receiver, and the learner's group spans nodes on a
cluster, so anyone who can write to its gloo connections could run code in every rank. Instead,
``pack`` turns a value into msgpack bytes and ``unpack`` rebuilds it without executing anything;
``broadcast`` and ``all_gather`` move those bytes as ``uint8`` tensors.

Encoding (msgpack, ``use_bin_type``): ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
lists and dicts are msgpack values; three ext types carry the rest:

==========  ====  ==========================================================================
type        code  payload (msgpack)
==========  ====  ==========================================================================
tensor      1     ``[dtype name ("float32"), shape, raw bytes (C order, this host's order)]``
TrainBatch  2     ``{field name: value}`` over every dataclass field (``extras`` a dict)
tuple       3     ``[items]``
==========  ====  ==========================================================================

Example: ``pack((1, torch.tensor([2.0])))`` is ext 3 of ``[1, ext 1 of ["float32", [1], 4 bytes]]``.
Tensors travel as CPU copies (``unpack`` returns CPU tensors); ranks of one group run the same
build, so byte order and dtype names agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from async_rl.buffers.trajectory import TrainBatch

_TENSOR, _BATCH, _TUPLE = 1, 2, 3
_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(TrainBatch))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _default(obj: Any) -> msgpack.ExtType:
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        return msgpack.ExtType(_TENSOR, msgpack.packb([name, list(obj.shape), _tensor_bytes(obj)], use_bin_type=True))
    if isinstance(obj, TrainBatch):
        fields = {name: getattr(obj, name) for name in _BATCH_FIELDS}
        return msgpack.ExtType(_BATCH, pack(fields))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, pack(list(obj)))
    # strict_types sends subclasses here too (an OrderedDict, a numpy float64): their base value.
    for base in (bool, int, float, str, bytes, list, dict):
        if isinstance(obj, base):
            return base(obj)
    raise TypeError(f"a {type(obj).__name__} cannot travel between learner ranks (msgpack carries None, bool, int, "
                    "float, str, bytes, lists, tuples, dicts, tensors and TrainBatch)")


def _tensor(payload: bytes) -> torch.Tensor:
    name, shape, raw = msgpack.unpackb(payload, raw=False)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"learner wire: unknown tensor dtype {name!r}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def _ext(code: int, payload: bytes) -> Any:
    if code == _TENSOR:
        return _tensor(payload)
    if code == _BATCH:
        fields = unpack(payload)
        if not isinstance(fields, dict) or set(fields) != set(_BATCH_FIELDS):
            raise ValueError(f"learner wire: a TrainBatch needs exactly the fields {_BATCH_FIELDS}")
        return TrainBatch(**fields)
    if code == _TUPLE:
        return tuple(unpack(payload))
    return msgpack.ExtType(code, payload)


def pack(obj: Any) -> bytes:
    """``obj`` as msgpack bytes (module docstring).

    Raises:
        TypeError: ``obj`` holds a value of another type (named in the message).
    """
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def unpack(data: bytes) -> Any:
    """The value ``pack`` encoded (tuples, tensors on CPU, ``TrainBatch``); nothing is executed.

    Raises:
        ValueError: an unknown dtype name or a ``TrainBatch`` with other fields.
    """
    return msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)


def _device(group) -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and a gloo+NCCL group) moves CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast(obj: Any, src: int = 0, group=None) -> Any:
    """Rank ``src``'s ``obj`` on every rank of ``group`` (collective; others pass anything, e.g.
    ``None``): its length as one int64, then its bytes as ``uint8``.

    Raises:
        TypeError: (on ``src``) ``obj`` cannot be packed; see ``pack``.
    """
    device = _device(group)
    mine = dist.get_rank() == src
    data = pack(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if mine
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=src, group=group)
    return obj if mine else unpack(buf.cpu().numpy().tobytes())


def all_gather(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj``, in rank order of ``group`` (collective): the lengths first, then the
    bytes padded to the longest.

    Raises:
        TypeError: ``obj`` cannot be packed; see ``pack``.
    """
    device = _device(group)
    world = dist.get_world_size(group)
    data = pack(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, mine.to(device), group=group)
    return [unpack(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]
