"""Checkpoint names of a transformers model's parameters: what a weight update carries.

transformers 5 holds some parameters in another layout than its checkpoints: a mixture-of-experts
layer keeps all its experts in two stacked parameters (Qwen3-MoE's
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``), while
its checkpoint (what ``save_pretrained`` writes) and every inference engine name one matrix per
expert (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``).
A weight update carries the checkpoint names: vLLM and SGLang load them with their own loaders
(into their fused MoE parameters), a bucket may split one layer's experts, and a Megatron learner
produces them from its own layout. ``CheckpointLayout`` maps between the two for one model:

* the sender (a learner's ``named_weights``) splits each in-memory parameter into its checkpoint
  tensors (views where the piece is contiguous, so nothing is copied);
* the receiver (the HF engine) writes each checkpoint tensor into its place in a staging tensor of
  the in-memory parameter.

The mapping is transformers' own: ``transformers.core_model_loading.revert_weight_conversion``
(what ``save_pretrained`` applies) run once per parameter on a tensor of element indices, so the
pieces are exactly save_pretrained's and any reversible conversion it knows (split, concatenate,
transpose) is covered without a rule of ours. Parameters the conversion leaves as they are (every
dense model's) map to themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


class LayoutError(ValueError):
    """A model whose conversion to checkpoint names is not a partition of its parameters (an
    element in two pieces or in none); one line naming the parameter."""


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor inside one in-memory parameter.

    Attributes:
        name: the checkpoint name (``model.layers.0.mlp.experts.3.gate_proj.weight``).
        param: the in-memory parameter's name (``model.layers.0.mlp.experts.gate_up_proj``).
        shape: the checkpoint tensor's shape.
        start, stop: where its elements lie in the flattened parameter, when contiguous there
            (then the tensor is ``param.flatten()[start:stop].view(shape)``); else both ``-1``.
        index: otherwise, an int64 tensor of ``shape`` holding each element's flat position in
            the parameter; ``None`` when contiguous.
    """

    name: str
    param: str
    shape: tuple[int, ...]
    start: int = -1
    stop: int = -1
    index: torch.Tensor | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of ``tensor`` (the whole parameter, its in-memory shape): a view where
        contiguous, else a gathered copy; ``shape``, ``tensor``'s dtype."""
        flat = tensor.reshape(-1)
        if self.index is None:
            return flat[self.start:self.stop].view(self.shape)
        return flat[self.index.to(flat.device)].view(self.shape)

    def put(self, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (this piece, ``shape``) into its place in ``buffer`` (a contiguous
        tensor of the whole parameter), converting to ``buffer``'s dtype."""
        flat = buffer.view(-1)
        src = tensor.reshape(-1)
        if self.index is None:
            flat[self.start:self.stop].copy_(src)
        else:
            flat[self.index.reshape(-1).to(flat.device)] = src.to(dtype=flat.dtype, device=flat.device)


class CheckpointLayout:
    """The checkpoint names of one transformers model's parameters (see the module docstring).

    Args:
        model: a ``transformers.PreTrainedModel`` (possibly sharded by FSDP2: only names and
            global shapes are read).
        names: optional ``(in-memory name, global shape)`` pairs to map instead of
            ``model.named_parameters()`` (a learner whose parameter names carry a wrapper's
            prefix passes the Hugging Face names).

    Raises:
        LayoutError: a conversion whose pieces do not cover each element of a parameter once.
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[tuple[str, tuple[int, ...]]] | None = None) -> None:
        if names is None:
            names = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        self.pieces: dict[str, list[Piece]] = {}
        """``{in-memory name: its pieces}`` for the parameters whose checkpoint layout differs."""
        revert = _reverter(model)
        for name, shape in names:
            if revert is None:
                continue
            numel = 1
            for d in shape:
                numel *= int(d)
            out = revert({name: torch.arange(numel, dtype=torch.int64).view(shape)})
            if list(out) == [name] and tuple(out[name].shape) == tuple(shape):
                if torch.equal(out[name].reshape(-1), torch.arange(numel)):
                    continue
            self.pieces[name] = [_piece(name, ck, idx) for ck, idx in out.items()]
            covered = torch.zeros(numel, dtype=torch.int64)
            for ck, idx in out.items():
                covered.index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64))
            if not bool((covered == 1).all()):
                raise LayoutError(f"parameter {name!r}: its checkpoint pieces {sorted(out)} do not cover each of "
                                  f"its {numel} elements exactly once")
        self.owner: dict[str, Piece] = {p.name: p for ps in self.pieces.values() for p in ps}
        """``{checkpoint name: its piece}`` for the parameters ``pieces`` holds."""

    @property
    def identity(self) -> bool:
        """True when every parameter's checkpoint name and shape are its own (dense models)."""
        return not self.pieces

    def split(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` of one in-memory parameter (full, its own shape):
        itself where the layout keeps it, else its pieces (views where contiguous)."""
        pieces = self.pieces.get(name)
        if pieces is None:
            yield name, tensor
            return
        for piece in pieces:
            yield piece.name, piece.take(tensor)

    def split_metadata(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]
                       ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(checkpoint name, dtype, shape)`` of what ``split`` yields for a parameter of
        ``name``, ``dtype`` and ``shape``, in the same order, reading no tensor."""
        pieces = self.pieces.get(name)
        if pieces is None:
            return [(name, dtype, tuple(shape))]
        return [(p.name, dtype, p.shape) for p in pieces]

    def checkpoint_names(self, name: str) -> list[str]:
        """The checkpoint names of in-memory parameter ``name`` (itself when kept)."""
        pieces = self.pieces.get(name)
        return [name] if pieces is None else [p.name for p in pieces]


def _piece(param: str, name: str, index: torch.Tensor) -> Piece:
    flat = index.reshape(-1)
    start = int(flat[0]) if flat.numel() else 0
    if flat.numel() and torch.equal(flat, torch.arange(start, start + flat.numel())):
        return Piece(name=name, param=param, shape=tuple(index.shape), start=start, stop=start + flat.numel())
    return Piece(name=name, param=param, shape=tuple(index.shape), index=index.clone())


def _reverter(model: torch.nn.Module):
    # transformers' own reverse conversion (what save_pretrained applies), or None for a model
    # transformers does not convert (older transformers, a plain module).
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    if not hasattr(model, "config"):
        return None
    return lambda state: revert_weight_conversion(model, state)
