"""Run checkpoints: save every K steps and at shutdown (SIGINT/SIGTERM too), resume exactly.

Layout under the run directory::

    <run_dir>/checkpoints/
        step_000003/                  one complete checkpoint, taken after training step 3
            learner/                  torch.distributed.checkpoint shards (FSDPLearner.save_checkpoint):
                                      policy + AdamW, critic + AdamW, reference policy, schedulers, version
            trainer_state.msgpack     step, RNG states, dataset position, loop state (sync: next group
            trainer_state.safetensors id; async: replay buffer contents, dispatch counters, prompts in
                                      flight), summary so far, the run's elapsed seconds
                                      (``elapsed_s``; absent in older checkpoints, read as 0); plain
                                      data in msgpack, tensors (RNG states) in safetensors
                                      (``async_rl.utils.checkpoint_format``: nothing is unpickled)
        latest                        text file naming the newest complete checkpoint

A checkpoint is written into ``step_NNNNNN.tmp`` (the step, zero-padded to six digits:
``step_000300``) and renamed to ``step_NNNNNN`` only once every rank has
finished, then ``latest`` is updated: a run killed mid-save leaves the previous checkpoint as
the latest, and a save that fails with an error removes its ``.tmp`` directory. A SIGKILL cannot
be caught, so its half-written ``.tmp`` stays until the run is continued (``trainer.resume``),
which removes every ``.tmp`` in its ``checkpoints/`` first, saying so in one line. ``trainer.checkpoint.keep_last`` bounds how many are kept.

``trainer.resume``: ``auto`` continues from ``<output_dir>/<run_name>/checkpoints/latest`` when
there is one (and starts fresh otherwise), a path resumes from that checkpoint directory (or a
run directory's latest). A resumed run skips the warm start and the step-0 evaluation, restores
everything above and continues at the next step: with the same config, a run of 6 steps and a
run of 3 steps resumed for 3 more train on the same data with the same weights (sync mode is
bit-exact on CPU; tests/test_checkpoint.py).

``RunDirectory`` names the run directory when a run starts (refusing one that holds another
run, unless resumed or ``trainer.overwrite=true``), makes it once the inputs have loaded, and
removes it again when the run stops before its first training step.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import shutil
import signal
import threading
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from async_rl.utils.checkpoint_format import has_state, load_state, save_state

logger = logging.getLogger(__name__)

STATE_NAME = "trainer_state"
"""Stem of the trainer state's files in a checkpoint (``trainer_state.msgpack``, ``.safetensors``)."""
OLD_STATE_FILE = "trainer_state.pt"
"""The trainer state of a format-1 checkpoint (a ``torch.save`` pickle): found, and refused."""


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


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory: this format's trainer state, or a format-1
    ``trainer_state.pt`` (found so that loading it says why it is refused)."""
    return has_state(path, STATE_NAME) or (Path(path) / OLD_STATE_FILE).exists()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or ``None`` if it has none."""
    marker = checkpoints_dir(run_dir) / "latest"
    if not marker.exists():
        return None
    path = checkpoints_dir(run_dir) / marker.read_text().strip()
    return path if is_checkpoint(path) else None


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
    if is_checkpoint(path):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"trainer.resume={resume}: neither a checkpoint directory (with "
                                f"{STATE_NAME}.msgpack) nor a run directory with a complete checkpoint")
    return found


class RunDirectory:
    """A run's directory ``<output_dir>/<run_name>``: named when the run starts, made once its
    inputs have loaded (``create``), removed again (``discard``) if the run ends before it had
    anything worth keeping.

    A fresh run never writes into a directory that holds another run's files (it would overwrite
    ``final_model/`` and ``summary.json``, append to ``metrics.jsonl`` and mix checkpoints): such
    a name is refused at once, before anything loads, unless ``trainer.resume`` continues that run
    or ``trainer.overwrite`` deletes it first. An empty directory is used as it is. Without
    ``trainer.run_name`` the name is the start time, with ``-1``, ``-2``, ... added when runs
    start in the same second.

    Args:
        t_cfg: ``TrainerConfig`` (``output_dir``, ``run_name``, ``resume``, ``overwrite``).

    Attributes:
        path: the run directory.
        created: whether this run made it (``create`` found none there, or ``overwrite`` deleted
            the old one); only then may ``discard`` remove it.

    Raises:
        ValueError: ``trainer.run_name`` names a directory holding files, and the run neither
            resumes nor overwrites; the message names the directory and the three ways on.
    """

    def __init__(self, t_cfg) -> None:
        self._named = t_cfg.run_name is not None
        self._continuing = t_cfg.resume is not None
        self._overwrite = t_cfg.overwrite
        self.created = False
        self._made_from: Path | None = None
        root = Path(t_cfg.output_dir)
        if self._named:
            self.path = root / t_cfg.run_name
            self._refuse_if_used()
        else:
            self._stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            self.path = self._unused_stamp(root)

    def _unused_stamp(self, root: Path) -> Path:
        names = itertools.chain([self._stamp], (f"{self._stamp}-{k}" for k in itertools.count(1)))
        return next(root / name for name in names if not (root / name).exists())

    def _used(self) -> bool:
        return self.path.is_dir() and any(self.path.iterdir())

    def _refuse_if_used(self) -> None:
        name = self.path.name
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"trainer.run_name={name}: {self.path} is a file, not a run directory")
        if self._continuing or self._overwrite or not self._used():
            return
        ways = "start it over with trainer.overwrite=true (deletes it)"
        if latest_checkpoint(self.path) is not None:
            ways = f"continue it with trainer.resume=auto, {ways}"
        raise ValueError(f"trainer.run_name={name}: {self.path} already holds a run; {ways}, or choose another "
                         "trainer.run_name")

    def create(self, config_yaml: str) -> Path:
        """Make the directory (deleting the old one first with ``trainer.overwrite``) and write
        ``config.yaml``; returns ``path``.

        Raises:
            ValueError: another run took the name since this one started (see the class).
        """
        if self._overwrite and self.path.exists():
            shutil.rmtree(self.path)
            logger.warning("trainer.overwrite=true: deleted the previous run in %s", self.path)
        while True:
            missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
            try:
                self.path.mkdir(parents=True)
            except FileExistsError:
                if not self._named:
                    # Another unnamed run started in the same second and took this name.
                    self.path = self._unused_stamp(self.path.parent)
                    continue
                self._refuse_if_used()
                break
            self.created = True
            # The outermost directory this run made: ``discard`` removes up to it while empty.
            self._made_from = missing[-1]
            break
        if self._continuing:
            self._remove_half_written_checkpoints()
        (self.path / "config.yaml").write_text(config_yaml)
        return self.path

    def _remove_half_written_checkpoints(self) -> None:
        # What a SIGKILLed save left (no handler runs then): never read as a checkpoint, since
        # only complete ones are renamed, but it must not outlive the run that continues this one.
        root = checkpoints_dir(self.path)
        stale = sorted(root.glob("*.tmp")) if root.is_dir() else []
        for path in stale:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if stale:
            logger.warning("removed %s in %s: left half-written by a run that was killed while saving",
                           ", ".join(p.name for p in stale), root)

    def discard(self) -> bool:
        """Remove the directory if this run made it (and the empty parents it made); returns
        whether it did."""
        if not self.created:
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.path.parents:
            if self._made_from is None or not parent.is_relative_to(self._made_from):
                break
            try:
                parent.rmdir()
            except OSError:
                break
        self.created = False
        return True


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU and CUDA) RNG states of this process.

    ``python``: ``random.getstate()``, a tuple ``(3, <625 ints>, None)``; ``numpy``:
    ``np.random.get_state()``, ``("MT19937", uint32 [624], pos, has_gauss, cached_gaussian)``;
    ``torch``: uint8 ``[5056]``; ``cuda``: one uint8 tensor per device. ``save_state`` stores
    all of them exactly (tuples stay tuples, arrays and tensors go to safetensors).
    """

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
        trainer_state: trainer-side state (see the module docstring): plain data, tuples,
            tensors and NumPy arrays (``checkpoint_format.save_state``).
        keep_last: complete checkpoints to keep, counting this one.

    Returns:
        ``<run_dir>/checkpoints/step_<step, zero-padded to 6 digits>`` (``step_000300``).

    Raises:
        TypeError: ``trainer_state`` holds another type (an object the format does not store).
    """
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        learner.save_checkpoint(str(tmp / "learner"))
        save_state(tmp, STATE_NAME, {"step": step, **trainer_state})
    except BaseException:
        # A save that failed (a learner rank died in it, a full disk) leaves no partial directory.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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

    Nothing is unpickled: a format-1 checkpoint (``trainer_state.pt``) is refused, not read.

    Raises:
        FileNotFoundError: ``path`` is not a checkpoint.
        checkpoint_format.CheckpointFormatError (a ``ValueError``): a format-1 checkpoint (the one
            line says what to do), or another ``format_version`` than ``FORMAT_VERSION``.
    """
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path}: not a checkpoint (no {STATE_NAME}.msgpack)")
    return load_state(path, STATE_NAME, old_file=OLD_STATE_FILE)


_forced_stop_signal: int | None = None
"""The signal number of a second SIGINT/SIGTERM that stopped this process at once (else None)."""


def forced_stop_signal() -> int | None:
    """The signal number of the second SIGINT/SIGTERM that stopped a training loop at once, or
    ``None``. The exception that second signal raises (``KeyboardInterrupt``) lands wherever the
    main thread was, and library code may wrap it: a DCP save in progress turns it into a
    ``CheckpointException``. The CLI asks here so that such a stop still exits 128 + signal."""
    return _forced_stop_signal


class StopRequest:
    """SIGINT/SIGTERM handling for a training loop: the first signal asks the loop to stop after
    the step in progress (and save); a second one restores the previous handlers and re-raises
    (with the default action where SIGTERM was ignored before).

    A SIGINT the process was started with ignored stays ignored, as Python itself leaves it
    (no ``KeyboardInterrupt`` then) and as POSIX asks of programs that catch it: a shell without
    job control starts background commands (``nohup async-rl train ... &`` from a script, a CI
    runner) that way so that a Ctrl-C meant for the foreground does not reach them. Such a run
    still stops cleanly, with a checkpoint, on ``kill <pid>`` (SIGTERM), which is always caught:
    a scheduler's or a user's SIGTERM asks for a clean stop wherever it comes from.

    Use as a context manager around the loop; handlers are installed only in the main thread
    (``signal`` allows no other) and restored on exit.

    Attributes:
        signal_name: ``"SIGINT"``/``"SIGTERM"`` once a signal arrived, else ``None``.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    _told_sigint_ignored = False
    """Whether this process was told that its Ctrl-C is ignored (told once)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        global _forced_stop_signal
        if self.signal_name is not None:
            _forced_stop_signal = signum
            previous = self._previous.get(signum)
            self._restore()
            if previous in (signal.SIG_IGN, None):
                # A SIGTERM ignored before must still stop the process at once the second time.
                signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: stopping after the current step (send it again to stop at once)", self.signal_name)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> "StopRequest":
        global _forced_stop_signal
        _forced_stop_signal = None  # a new loop: an earlier run's forced stop is not this one's
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                    # Started with Ctrl-C ignored: the class docstring says why it stays so. Said
                    # once, or a user's Ctrl-C looks broken.
                    if not StopRequest._told_sigint_ignored:
                        StopRequest._told_sigint_ignored = True
                        logger.warning("Ctrl-C (SIGINT) is ignored in this process (started in the background "
                                       "without job control): stop it with kill %d (SIGTERM), which saves first",
                                       os.getpid())
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
