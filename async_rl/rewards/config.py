"""Reward configuration (``reward.*`` keys)."""

from __future__ import annotations

from dataclasses import dataclass

from async_rl.rewards.scorer import ON_ERROR_MODES


@dataclass
class RewardConfig:
    """Which reward function scores responses, and what happens when it fails."""

    fn: str | None = None
    """A built-in name (``arithmetic``, ``gsm8k``, ``math``), ``pkg.module:function`` or
    ``path/to/file.py:function``; ``None`` picks the built-in for each row's ``data_source``."""
    on_error: str = "zero"
    """When the function raises or returns a non-finite or malformed value: ``zero`` (the sample
    gets reward 0 and is trained on) or ``reject`` (the sample is dropped and counted)."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_MODES:
            raise ValueError(f"reward.on_error must be one of {ON_ERROR_MODES}, got {self.on_error!r}")
