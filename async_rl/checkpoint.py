"""Run checkpoints: save every K steps and at shutdown (SIGINT/SIGTERM too), resume exactly.

Layout under the run directory::

    <run_dir>/checkpoints/
        step_000003/                  one complete checkpoint, taken after training step 3
            learner/                  torch.distributed.checkpoint shards (FSDPLearner.save_checkpoint):
                                      policy + AdamW, critic + AdamW, reference policy, schedulers, version
            trainer_state.pt          step, RNG states, dataset position, loop state (sync: next group
                                      id; async: replay buffer contents, dispatch counters, prompts in
                                      flight), summary so far
        latest                        text file naming the newest complete checkpoint

A checkpoint is written into ``step_N.tmp`` and renamed to ``step_N`` only once every rank has
finished, then ``latest`` is updated: a run killed mid-save leaves the previous checkpoint as
the latest. ``trainer.checkpoint.keep_last`` bounds how many are kept.

``trainer.resume``: ``auto`` continues from ``<output_dir>/<run_name>/checkpoints/latest`` when
there is one (and starts fresh otherwise), a path resumes from that checkpoint directory (or a
run directory's latest). A resumed run skips the warm start and the step-0 evaluation, restores
everything above and continues at the next step: with the same config, a run of 6 steps and a
run of 3 steps resumed for 3 more train on the same data with the same weights (sync mode is
bit-exact on CPU; tests/test_checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

STATE_FORMAT = 1


@dataclass
class CheckpointConfig:
    """When checkpoints are written and how many are kept (``trainer.checkpoint.*``)."""

    every_steps: int = 0
    """Save after every K-th training step (>= 0); 0 = only at shutdown."""
    save_at_exit: bool = True
    """Save when the run ends: after the last step, or after the step in progress when SIGINT or
    SIGTERM arrives (a second signal stops at once, without saving)."""
    keep_last: int = 2
    """Complete checkpoints kept (>= 1); older ones are deleted after a save succeeds."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.keep_last < 1:
            raise ValueError(f"trainer.checkpoint needs every_steps >= 0 and keep_last >= 1, got "
                             f"{self.every_steps} and {self.keep_last}")


def checkpoints_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or ``None`` if it has none."""
    marker = checkpoints_dir(run_dir) / "latest"
    if not marker.exists():
        return None
    path = checkpoints_dir(run_dir) / marker.read_text().strip()
    return path if (path / "trainer_state.pt").exists() else None


def resolve_resume(resume: str | None, output_dir: str, run_name: str | None) -> Path | None:
    """The checkpoint directory a run resumes from, or ``None`` to start fresh.

    Args:
        resume: ``None`` (fresh), ``"auto"`` (this run's latest checkpoint if any), or a path to a
            checkpoint directory or to a run directory (its latest checkpoint).
        output_dir, run_name: where this run's directory is (``auto`` needs ``run_name``).

    Raises:
        ValueError: ``auto`` without ``trainer.run_name`` (a timestamped name never matches a
            previous run).
        FileNotFoundError: a path that is neither a checkpoint nor a run directory with one.
    """
    if resume is None:
        return None
    if resume == "auto":
        if run_name is None:
            raise ValueError("trainer.resume=auto needs trainer.run_name: the run directory to resume is "
                             "<output_dir>/<run_name>")
        return latest_checkpoint(Path(output_dir) / run_name)
    path = Path(resume)
    if (path / "trainer_state.pt").exists():
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"trainer.resume={resume}: neither a checkpoint directory (with trainer_state.pt) "
                                "nor a run directory with a complete checkpoint")
    return found


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states of this process."""

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: str | Path, step: int, learner, trainer_state: dict[str, Any], keep_last: int) -> Path:
    """Write one complete checkpoint after training step ``step``; returns its directory.

    Args:
        run_dir: the run directory.
        step: the training step just finished (>= 0).
        learner: the learner (``save_checkpoint(path)``, a collective call on every rank).
        trainer_state: picklable trainer-side state (see the module docstring).
        keep_last: complete checkpoints to keep, counting this one.

    Returns:
        ``<run_dir>/checkpoints/step_<step>``.
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    learner.save_checkpoint(str(tmp / "learner"))
    torch.save({"format": STATE_FORMAT, "step": step, **trainer_state}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    marker_tmp = root / "latest.tmp"
    marker_tmp.write_text(final.name)
    os.replace(marker_tmp, root / "latest")
    complete = sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp"))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer-side state of checkpoint ``path`` (``step`` and what ``save_checkpoint`` got).

    Raises:
        FileNotFoundError: no ``trainer_state.pt`` in ``path``.
        ValueError: a format this code does not read.
    """
    file = Path(path) / "trainer_state.pt"
    if not file.exists():
        raise FileNotFoundError(f"{path}: not a checkpoint (no trainer_state.pt)")
    state = torch.load(file, weights_only=False)
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{file}: checkpoint format {state.get('format')!r}, this code reads {STATE_FORMAT}")
    return state


class StopRequest:
    """SIGINT/SIGTERM handling for a training loop: the first signal asks the loop to stop after
    the step in progress (and save); a second one restores the previous handlers and re-raises
    (with the default action where the signal was inherited as ignored, as under ``nohup``).

    Use as a context manager around the loop; handlers are installed only in the main thread
    (``signal`` allows no other) and restored on exit.

    Attributes:
        signal_name: ``"SIGINT"``/``"SIGTERM"`` once a signal arrived, else ``None``.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            previous = self._previous.get(signum)
            self._restore()
            if previous in (signal.SIG_IGN, None):
                # Inherited as ignored (``nohup ... &``): a second signal must still stop at once.
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: stopping after the current step (send it again to stop at once)", self.signal_name)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
