"""Bad weight updates and the learners that send them: the inputs of the all-or-nothing tests
(``test_weight_sync_atomic.py``, ``test_vllm.py``, ``test_lora.py``), one table for every engine and
transport. Importable from tests (pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

CASES = ("unknown", "missing", "shape", "dtype")
"""The kinds of bad update every engine and transport must refuse whole."""


class ListLearner:
    """A learner stand-in publishing a fixed list of named tensors (what ``WeightPublisher`` reads).

    Args:
        named: ``(name, tensor)`` in send order.
        aliases: ``{alias: name sent}`` (tied weights).
        die_after: raise ``RuntimeError("learner died ...")`` after yielding this many tensors (a
            sender that fails after the first bucket left); ``weight_metadata`` still lists all.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], aliases: dict[str, str] | None = None,
                 die_after: int | None = None) -> None:
        self.named, self.aliases, self.die_after = list(named), dict(aliases or {}), die_after

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors in order, or the first ``die_after`` of them and then ``RuntimeError``."""
        for i, item in enumerate(self.named):
            if self.die_after is not None and i == self.die_after:
                raise RuntimeError(f"learner died mid-update after {i} tensors (test)")
            yield item

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of every tensor, in order."""
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.named]

    def weight_aliases(self) -> dict[str, str]:
        """``aliases``."""
        return dict(self.aliases)


def offset(named: Sequence[tuple[str, torch.Tensor]], by: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``named`` plus ``by``: a partial load of them shows on every element."""
    return [(n, t.detach() + by) for n, t in named]


def bad_update(case: str, named: Sequence[tuple[str, torch.Tensor]], victim: str,
               unknown: str) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """One bad update built from a good one, and the fragments its error must contain.

    ``unknown``: every tensor plus ``(unknown, zeros)`` at the end (after every good byte);
    ``missing``: ``victim`` left out; ``shape``: ``victim`` transposed (same element count);
    ``dtype``: ``victim`` as ``int64`` (the same values rounded: a silent cast would load them).
    ``victim`` should be a 2-D, non-square tensor late in the update, so that a loader writing
    as it goes has already written the tensors before it.
    """
    named = list(named)
    good = dict(named)[victim]
    if case == "unknown":
        return named + [(unknown, torch.zeros(4))], [unknown]
    if case == "missing":
        return [(n, t) for n, t in named if n != victim], [victim]
    if case == "shape":
        assert good.dim() == 2 and good.shape[0] != good.shape[1]
        bad = good.t().contiguous()
        fragments = [victim, str(tuple(bad.shape)), str(tuple(good.shape))]
        return [(n, bad if n == victim else t) for n, t in named], fragments
    if case == "dtype":
        bad = (good * 100).round().to(torch.int64)
        return [(n, bad if n == victim else t) for n, t in named], [victim, "int64", "float32"]
    raise ValueError(case)


def refused_update(engine, bad: Sequence[tuple[str, torch.Tensor]], transport: str,
                   aliases: dict[str, str] | None = None) -> BaseException:
    """Push ``bad`` to ``engine`` through ``transport`` (``shm`` or ``broadcast`` via a
    ``WeightPublisher`` of 0.05 MiB buckets, or ``update_weights``: the engine's own call) and
    return the error that refused it; fails the test if it was accepted or a version published."""
    import pytest

    from async_rl.weight_sync import LocalTarget, WeightPublisher, WeightSyncConfig

    version = engine.policy_version + 1
    if transport == "update_weights":
        with pytest.raises((RuntimeError, ValueError)) as err:
            engine.update_weights(bad, version)
        return err.value
    pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=0.05), transport,
                          ListLearner(bad, aliases), [LocalTarget(engine)])
    try:
        with pytest.raises(RuntimeError) as err:
            pub.push(version)
    finally:
        pub.close()
    assert pub.published_version is None
    return err.value


def stacked_experts(named: Sequence[tuple[str, torch.Tensor]], layers: int = 4, experts: int = 8
                    ) -> list[tuple[str, torch.Tensor]]:
    """A per-expert update of the built-in MoE model rewritten in transformers 5's in-memory layout
    (each layer's experts as ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
    ``[E, H, I]``): the names an engine must refuse, since checkpoints and engines name one matrix
    per expert."""
    by = dict(named)
    out = [(n, t) for n, t in named if ".mlp.experts." not in n]
    for layer in range(layers):
        p = f"model.layers.{layer}.mlp.experts"
        out.append((f"{p}.gate_up_proj", torch.stack([torch.cat([by[f"{p}.{e}.gate_proj.weight"],
                                                                  by[f"{p}.{e}.up_proj.weight"]]) for e in range(experts)])))
        out.append((f"{p}.down_proj", torch.stack([by[f"{p}.{e}.down_proj.weight"] for e in range(experts)])))
    return out
