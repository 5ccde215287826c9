"""Test helpers for the weight sync layer (importable from tests: pytest puts this folder on sys.path)."""

from __future__ import annotations

from typing import Iterator

import torch

from async_rl.weight_sync import ModuleWeights


class WithExtraWeight(ModuleWeights):
    """``ModuleWeights`` plus one more named tensor: an update an engine must refuse (tests)."""

    def __init__(self, model: torch.nn.Module, name: str, tensor: torch.Tensor, offset: float = 0.0) -> None:
        super().__init__(model)
        self.extra, self.offset = (name, tensor), offset

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's tensors (plus ``offset``, so a partial load would show) and the extra one."""
        yield from ((n, t + self.offset) for n, t in super().named_weights())
        yield self.extra

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The module's metadata and the extra tensor's."""
        return super().weight_metadata() + [(self.extra[0], self.extra[1].dtype, tuple(self.extra[1].shape))]
