"""Where a push reads its weights from: the ``WeightSource`` protocol (a learner provides it) and
two plain sources, a module's parameters (``ModuleWeights``) and a fixed list (``NamedTensors``)."""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import torch


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """``{tied name: canonical name}`` of ``model``: parameters registered under two names
    (``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
            if canonical[id(p)] != n}


class ModuleWeights:
    """A plain ``nn.Module`` as the source of a ``WeightPublisher`` (what a learner provides:
    ``named_weights``, ``weight_metadata``, ``weight_aliases``); for tools, benchmarks and tests
    that push a Hugging Face model's weights without a learner. Parameters transformers keeps in
    another layout than the checkpoint's (stacked experts) go under their checkpoint names
    (``async_rl.weight_sync.layout``), as a learner sends them."""

    def __init__(self, model: torch.nn.Module) -> None:
        from async_rl.weight_sync.layout import CheckpointLayout

        self.model = model
        self.layout = CheckpointLayout(model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(checkpoint name, tensor)`` of every parameter, tied ones once."""
        return (item for n, p in self.model.named_parameters() for item in self.layout.split(n, p.detach()))

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` in ``named_weights`` order."""
        return [meta for n, p in self.model.named_parameters()
                for meta in self.layout.split_metadata(n, p.dtype, tuple(p.shape))]

    def weight_aliases(self) -> dict[str, str]:
        """``tied_aliases(model)`` with both sides under their checkpoint names (a vision-language
        model's tied embedding is ``model.language_model.embed_tokens`` in memory and
        ``model.embed_tokens`` on disk and on the wire)."""
        return {self.layout.checkpoint_names(k)[0]: self.layout.checkpoint_names(v)[0]
                for k, v in tied_aliases(self.model).items()}


class WeightSource(Protocol):
    """What a ``WeightPublisher`` reads weights from: a learner (``async_rl.learners.base.Learner``),
    a ``ModuleWeights``, or any object with these three methods."""

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors by Hugging Face name, each tied parameter once, in
        ``weight_metadata`` order. May be collective (every learner rank iterates)."""
        ...

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what ``named_weights`` yields, in order, without
        gathering anything (the plan is laid out from it before the first tensor is read)."""
        ...

    def weight_aliases(self) -> dict[str, str]:
        """``{tied name: name sent}`` (``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
        ...


class NamedTensors:
    """A fixed list of named tensors as a ``WeightSource`` (an engine's own ``update_weights``
    pushing through a one-target publisher).

    Args:
        named: ``(name, tensor)`` in send order.
        aliases: ``{alias: name sent}`` (tied weights).
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], aliases: dict[str, str] | None = None) -> None:
        self.named, self.aliases = list(named), dict(aliases or {})

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, in order."""
        return iter(self.named)

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor, in order."""
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.named]

    def weight_aliases(self) -> dict[str, str]:
        """``aliases``."""
        return dict(self.aliases)
