"""The on-disk format of a checkpoint's state files: nothing in a checkpoint is unpickled as code.

A checkpoint used to hold ``trainer_state.pt`` and ``learner/learner_state.pt`` written with
``torch.save`` and read with ``torch.load(weights_only=False)``: that unpickles by module path, so
moving a module broke old checkpoints, and a checkpoint from elsewhere could run any code on
load. ``FORMAT_VERSION`` 2 stores each state as two files:

    <name>.msgpack        {"format_version": 2, "state": ...}: dicts, lists, str, int, float, bool,
                          None, bytes (msgpack); tuples, tensors and NumPy arrays as msgpack
                          extension types (a tuple is a list inside; a tensor or array names its
                          entry in the safetensors file)
    <name>.safetensors    the tensors: RNG states (``uint8`` ``[5056]`` for torch's Mersenne
                          Twister), NumPy's ``uint32`` ``[624]`` key, ...

msgpack keeps what JSON would lose (integer dict keys, tuples as tuples through the extension,
floats bit for bit), so ``load_state(save_state(x)) == x`` for the states the trainer writes, and
RNG states round-trip exactly. Reading builds only those types; an unknown extension is refused.

The learners' sharded tensors stay in ``torch.distributed.checkpoint`` (DCP) directories. DCP
reads its ``.metadata`` index with ``pickle.load`` and the non-tensor entries of a state dict with
``torch.load(weights_only=False)`` (torch 2.13 ``distributed/checkpoint/filesystem.py``,
``default_planner.py``): ``SafeFileSystemReader`` and ``SafeLoadPlanner`` read both without running
code (an allow-list of DCP's own metadata classes; ``weights_only=True``), and
``safe_dcp_reads`` puts them under megatron-core's loader, which builds its own reader.

Source: msgpack extension types (https://github.com/msgpack/msgpack-python, "Extended types");
safetensors (https://huggingface.co/docs/safetensors); Python's "Restricting Globals"
(https://docs.python.org/3/library/pickle.html#restricting-globals) for the metadata unpickler.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

FORMAT_VERSION = 2
"""Checkpoint state format this code writes and reads. 1 was ``torch.save`` pickles (``*.pt``)."""

_TUPLE, _TENSOR, _NDARRAY = 1, 2, 3
"""msgpack extension type codes: a tuple (its items packed as a list), a tensor and a NumPy array
(the UTF-8 key of its entry in the safetensors file)."""


class CheckpointFormatError(ValueError):
    """A checkpoint file this code does not read: an older format, or contents it never writes."""


def old_format_message(path: str | Path, old_file: str) -> str:
    """The one line refusing a format-1 checkpoint (``old_file``, a ``torch.save`` pickle, found
    under ``path``): it names the format and what to do instead."""
    return (f"{path}: a checkpoint in format 1 ({old_file}, a pickle); this version reads format {FORMAT_VERSION} "
            "only, since loading a pickle can run code from the file: continue that run with the async-rl "
            "release that wrote it, or start a new run (trainer.overwrite=true)")


def _encoder(tensors: dict[str, torch.Tensor]):
    """msgpack's ``default`` hook: puts tensors and arrays into ``tensors`` and leaves references."""

    def default(obj: Any) -> msgpack.ExtType:
        if isinstance(obj, tuple):
            return msgpack.ExtType(_TUPLE, msgpack.packb(list(obj), default=default, strict_types=True))
        if isinstance(obj, torch.Tensor):
            key = f"t{len(tensors)}"
            # safetensors stores contiguous CPU tensors with storages of their own.
            tensors[key] = obj.detach().to("cpu").contiguous().clone()
            return msgpack.ExtType(_TENSOR, key.encode())
        if isinstance(obj, np.ndarray):
            key = f"t{len(tensors)}"
            tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
            return msgpack.ExtType(_NDARRAY, key.encode())
        if isinstance(obj, np.generic):  # a NumPy scalar: the Python number of the same value
            return obj.item()
        for base in (int, float, str):  # a subclass (IntEnum, ...) as its base value
            if isinstance(obj, base):
                return base(obj)
        raise TypeError(f"checkpoint state holds a {type(obj).__module__}.{type(obj).__qualname__}, which the "
                        "checkpoint format does not store (plain data, tuples, tensors and NumPy arrays only)")

    return default


def _decoder(tensors: dict[str, torch.Tensor], file: Path):
    """msgpack's ``ext_hook``: the inverse of ``_encoder``."""

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False))
        if code in (_TENSOR, _NDARRAY):
            key = data.decode()
            if key not in tensors:
                raise CheckpointFormatError(f"{file}: names tensor {key!r}, which its .safetensors file lacks")
            return tensors[key] if code == _TENSOR else tensors[key].numpy()
        raise CheckpointFormatError(f"{file}: unknown msgpack extension type {code}")

    return ext_hook


def save_state(directory: str | Path, name: str, state: dict[str, Any]) -> None:
    """Write ``state`` as ``<directory>/<name>.msgpack`` and ``<name>.safetensors``.

    Args:
        directory: an existing directory (a checkpoint's ``.tmp`` directory: the caller renames it
            once complete, which makes the write atomic).
        name: file stem, e.g. ``"trainer_state"``.
        state: dicts, lists, tuples, str, int, float, bool, None, bytes, torch tensors (any dtype
            and device; stored from the CPU) and NumPy arrays, nested.

    Raises:
        TypeError: anything else in ``state`` (the message names its type).
    """
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    packed = msgpack.packb({"format_version": FORMAT_VERSION, "state": state}, default=_encoder(tensors),
                           strict_types=True)
    directory = Path(directory)
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.msgpack").write_bytes(packed)


def has_state(directory: str | Path, name: str) -> bool:
    """Whether ``directory`` holds state ``name`` in this format (its ``.msgpack`` file)."""
    return (Path(directory) / f"{name}.msgpack").exists()


def load_state(directory: str | Path, name: str, old_file: str | None = None) -> dict[str, Any]:
    """Read what ``save_state`` wrote: the same values, tensors on the CPU.

    Args:
        directory, name: as ``save_state``.
        old_file: the file that held this state in format 1 (``"trainer_state.pt"``): found
            instead of ``<name>.msgpack``, it is refused (``old_format_message``), never read.

    Raises:
        FileNotFoundError: no ``<name>.msgpack`` in ``directory`` (nor ``old_file``).
        CheckpointFormatError: a format-1 ``old_file``; another ``format_version``; a tensor
            reference the ``.safetensors`` file lacks; an extension type this format does not use.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    file = directory / f"{name}.msgpack"
    if not file.exists():
        if old_file is not None and (directory / old_file).exists():
            raise CheckpointFormatError(old_format_message(directory, old_file))
        raise FileNotFoundError(f"{directory}: no {file.name}")
    tensor_file = directory / f"{name}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
    doc = msgpack.unpackb(file.read_bytes(), ext_hook=_decoder(tensors, file), raw=False, strict_map_key=False)
    version = doc.get("format_version") if isinstance(doc, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointFormatError(f"{file}: checkpoint format_version {version!r}, this code reads {FORMAT_VERSION}")
    return doc["state"]


LEARNER_STATE = "learner_state"
"""Stem of a learner checkpoint's own state (rank 0: policy version, LR schedules, layout)."""


def load_learner_state(path: str | Path) -> dict[str, Any]:
    """The ``learner_state`` of the learner checkpoint directory ``path`` (``load_state``).

    Raises:
        FileNotFoundError: ``path`` holds no learner checkpoint.
        CheckpointFormatError: a format-1 checkpoint (``learner_state.pt``), or see ``load_state``.
    """
    if not has_state(path, LEARNER_STATE) and not (Path(path) / "learner_state.pt").exists():
        raise FileNotFoundError(f"{path}: no learner checkpoint ({LEARNER_STATE}.msgpack is missing)")
    return load_state(path, LEARNER_STATE, old_file="learner_state.pt")


# ------------------------------------------------------------------ DCP without unpickling code
def _dcp_metadata_globals() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickle may name: DCP's metadata and plan dataclasses, the file
    reader's ``_StorageInfo``, ``torch.Size``, the dtype/layout/memory-format constants, ``OrderedDict``
    and ``PosixPath`` (what torch 2.13 writes, read off a saved index).
    Every one is plain data; none runs code when built."""
    import collections

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as pl

    allowed: dict[tuple[str, str], Any] = {
        (md.__name__, n): getattr(md, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                   "StorageMeta", "_MEM_FORMAT_ENCODING")
        if hasattr(md, n)}
    allowed[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    # megatron-core keeps the save plans it cached in the index (``Metadata.mcore_data``): DCP's
    # plan dataclasses and enums, plain data too.
    allowed.update({(pl.__name__, n): getattr(pl, n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                               "TensorWriteData", "LoadPlan", "ReadItem",
                                                               "LoadItemType") if hasattr(pl, n)})
    allowed[("torch", "Size")] = torch.Size
    # A layout pickles as ``_get_layout("torch.strided")`` (a lookup among torch's layouts), and
    # ``StorageMeta.checkpoint_id`` as the path it was saved to.
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = pathlib.PosixPath
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for n in dir(torch):
        value = getattr(torch, n, None)
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", n)] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index, refusing every global outside ``_dcp_metadata_globals``
    (``pickle``'s "Restricting Globals"): a crafted file cannot name ``os.system`` or a module to
    import."""

    def __init__(self, file, path: str) -> None:
        super().__init__(file)
        self._path = path
        self._allowed = _dcp_metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise CheckpointFormatError(f"{self._path}: the checkpoint index names {module}.{name}, which a DCP "
                                        "index never holds; refusing to load it") from None


def _safe_read_metadata(self, *args: Any, **kwargs: Any):
    """``FileSystemReader.read_metadata`` (torch 2.13) with ``_MetadataUnpickler`` for ``pickle.load``."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as metadata_file:
        metadata = _MetadataUnpickler(metadata_file, str(path)).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _safe_load_bytes(self, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` (torch 2.13) with ``weights_only=True``: a non-tensor
    entry (an optimizer's ``param_groups``) is read by torch's restricted unpickler."""
    from torch.distributed.checkpoint._nested_dict import set_element

    loaded = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
    else:
        self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_reader_and_planner(path: str):
    """A ``(storage_reader, planner)`` pair for ``torch.distributed.checkpoint.load`` that reads
    the checkpoint at ``path`` without unpickling code (see the module docstring).

    Raises (from ``dcp.load``): ``CheckpointFormatError`` for an index naming anything but DCP's
    metadata types; ``pickle.UnpicklingError`` for a non-tensor entry that is not plain data.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    reader = type("SafeFileSystemReader", (FileSystemReader,), {"read_metadata": _safe_read_metadata})(path)
    planner = type("SafeLoadPlanner", (DefaultLoadPlanner,), {"load_bytes": _safe_load_bytes})()
    return reader, planner


@contextmanager
def safe_dcp_reads() -> Iterator[None]:
    """For loaders that build their own DCP reader and planner (megatron-core's
    ``dist_checkpointing.load``): while the context lasts, every ``FileSystemReader`` reads its
    index with ``_MetadataUnpickler`` and every ``DefaultLoadPlanner`` its non-tensor entries with
    ``weights_only=True``. Restored on exit; not thread-safe (it swaps class attributes): load from
    one thread per process."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    saved = FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes
    FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = _safe_read_metadata, _safe_load_bytes
    try:
        yield
    finally:
        FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes = saved
