"""Metrics: one reduction per optimizer step, one logger fanning out to every sink.

The learner reduces its per-micro-batch metric tensors with :func:`reduce_metrics`, so each
loss metric is logged once per optimizer step. The driver loop then hands one flat mapping of
namespaced keys (``rollout/reward_mean``, ``loss/pg``, ``perf/gen_tokens_per_s``, ``timing/step_s``,
``eval/accuracy``) to :class:`MetricsLogger`, which converts tensors to Python numbers (the only
host sync for metrics) and writes them to

* ``run_dir/metrics.jsonl``: one JSON object per :meth:`MetricsLogger.log` call, flushed at once
  so a crashed run keeps everything logged before the crash;
* ``run_dir/tensorboard/``: TensorBoard event files (``logging.tensorboard: true``);
* Weights & Biases (``logging.wandb.mode: online | offline``), offline runs land in
  ``run_dir/wandb/offline-run-*`` and can be uploaded later with ``wandb sync``;
* the console: a rich progress bar with ETA and a one-line summary every
  ``logging.console_every_steps`` steps; a pass before the RL steps (the warm start) gets a bar
  of its own (:meth:`MetricsLogger.phase`), and a resumed run's clock continues from its
  checkpoint's elapsed time (:meth:`MetricsLogger.resume`).

Usage in the driver loop::

    with MetricsLogger(cfg.logging, run_dir, total_steps=cfg.num_steps,
                       run_config=dataclasses.asdict(cfg)) as logger:
        for step in range(start_step + 1, cfg.num_steps + 1):
            ...                                   # one optimizer step
            logger.log(train_metrics, step)
            if step % eval_every == 0:
                logger.log(eval_metrics, step)    # same step, separate call
            logger.advance(step)                  # bar + summary line for this step

A fresh run shows its warm start on a bar of its own; a resumed one calls ``logger.resume(step,
elapsed_s)`` with what its checkpoint saved (``logger.elapsed_s`` at save time)::

    with logger.phase("warm start", total=500) as update:
        for k in range(1, 501):
            update(k, f"loss {loss:.4f}")

Read a finished run with ``pandas.read_json("runs/x/metrics.jsonl", lines=True)`` or
``tensorboard --logdir runs/x/tensorboard``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

logger = logging.getLogger(__name__)

WANDB_MODES = ("online", "offline", "disabled")

# Keys shown in the console summary line, with their short labels; absent keys are skipped.
# gen_tok/s: tokens the generators sampled per second of wall time (all engines, since the
# previous step ended); train_tok/s: tokens (prompt + response) the learner trained on per second
# of its train step. Both mean the same in sync and async mode.
SUMMARY_KEYS = (
    ("rollout/reward_mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("loss/pg", "loss_pg"),
    ("perf/gen_tokens_per_s", "gen_tok/s"),
    ("perf/train_tokens_per_s", "train_tok/s"),
    ("timing/step_s", "step_s"),
)

# Written by the logger itself on every JSONL line, so metrics may not use them as keys.
RESERVED_KEYS = ("step", "time_s")


@dataclass
class WandbConfig:
    """Weights & Biases settings (``logging.wandb``)."""

    mode: str = "disabled"
    """``online`` uploads live (needs ``wandb login`` or ``WANDB_API_KEY``; never prompts),
    ``offline`` writes ``run_dir/wandb/offline-run-*`` for a later ``wandb sync``,
    ``disabled`` does not import wandb at all."""

    project: str = "async-rl"
    """W&B project name; non-empty."""

    entity: str | None = None
    """W&B user or team; None uses the account's default entity."""

    name: str | None = None
    """Run name shown in the W&B UI; None uses the run directory's name."""

    tags: list[str] = field(default_factory=list)
    """Free-form run tags, e.g. ``[grpo, qwen-0.5b]``."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(
                f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}"
            )
        if not self.project:
            raise ValueError("logging.wandb.project must be a non-empty string")
        if self.name is not None and not self.name:
            raise ValueError("logging.wandb.name must be a non-empty string or null")
        if self.mode == "disabled" and (self.entity or self.name or self.tags):
            logger.warning(
                "logging.wandb.entity/name/tags are set but logging.wandb.mode is 'disabled'; "
                "they have no effect"
            )


@dataclass
class LoggingConfig:
    """Where and how often metrics are written (``logging``)."""

    jsonl: bool = True
    """Write one JSON line per log call to ``run_dir/metrics.jsonl`` (appended on resume)."""

    tensorboard: bool = False
    """Write TensorBoard event files under ``run_dir/tensorboard``."""

    progress: bool = True
    """Show a rich progress bar (steps done/total, elapsed, ETA). On a terminal it redraws in
    place; in CI logs and other non-terminals it is drawn once, when the run closes."""

    console_every_steps: int = 1
    """Print a one-line summary every K optimizer steps; 0 = never; >= 0."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""

    def __post_init__(self) -> None:
        if self.console_every_steps < 0:
            raise ValueError(
                f"logging.console_every_steps must be >= 0, got {self.console_every_steps}"
            )


class MetricsLogger:
    """Writes one optimizer step's metrics to JSONL, TensorBoard, W&B and the console.

    Create one per run, call :meth:`log` once per optimizer step (and again at the same step for
    eval metrics), then :meth:`advance` once the step is done, and :meth:`close` at the end (or use
    it as a context manager). Non-finite values are written as JSON ``null`` and counted in
    :attr:`num_nonfinite`; TensorBoard and W&B receive them unchanged.

    Args:
        cfg: the ``logging`` config section.
        run_dir: the run directory; created if missing. JSONL, TensorBoard and W&B files go here.
        total_steps: number of optimizer steps the run will take in total (the progress bar's
            end), >= 0.
        run_config: the resolved config as a plain dict, passed to ``wandb.init(config=...)`` and
            written nowhere else (the driver writes the resolved config itself).

    Raises:
        ValueError: ``total_steps < 0``, or ``logging.wandb.mode == 'online'`` without W&B
            credentials (instead of prompting for them).
    """

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: str | Path,
        total_steps: int,
        run_config: dict | None = None,
    ) -> None:
        if total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {total_steps}")
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.total_steps = total_steps
        self.num_nonfinite = 0
        """Non-finite values seen so far (each one written to JSONL as null)."""
        self._start = time.perf_counter()
        self._elapsed_offset_s = 0.0
        """Seconds the run had taken before ``_start`` (a resumed run's time up to its checkpoint)."""
        self._closed = False
        self._warned_unnamespaced: set[str] = set()
        self._warned_nonfinite: set[str] = set()
        # The console summary shows everything logged at its step (train and eval calls alike).
        self._step_metrics: dict[str, float | int] = {}
        self._step_metrics_step: int | None = None

        # First: it is the step that can refuse to start (missing credentials), and nothing opened
        # before it would then be left unclosed.
        self._wandb_run = _init_wandb(cfg.wandb, self.run_dir, run_config)

        self._jsonl = None
        if cfg.jsonl:
            # Line-buffered append: each record reaches the OS as soon as it is written, and a
            # resumed run continues the same file (steps after the checkpoint then appear twice).
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1, encoding="utf-8")

        self._tb = None
        if cfg.tensorboard:
            # Imported here: pulling in tensorboard costs seconds that disabled runs should not pay.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

        self._console = Console()
        self._progress = None
        self._task = None
        if cfg.progress:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                _ElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self._console,
                # Off a terminal the bar is drawn only at stop, so a refresh thread is wasted.
                auto_refresh=self._console.is_terminal,
                refresh_per_second=2,
                # RL steps can take minutes; rich's default 30 s window would hold fewer than two
                # samples and never show an ETA, so average over the last few hours instead.
                speed_estimate_period=4 * 3600.0,
            )
            self._task = self._progress.add_task("train", total=total_steps, info="", elapsed_offset_s=0.0)
            self._progress.start()

    @property
    def elapsed_s(self) -> float:
        """Seconds the run has taken: since this logger was made, plus, after :meth:`resume`, the
        time the run had taken up to its checkpoint (so a resumed run's clock continues; the time
        between the interruption and the resume is not counted). Used by the summary line, the
        bar and the ``time_s`` of each JSONL record."""
        return self._elapsed_offset_s + time.perf_counter() - self._start

    def resume(self, step: int, elapsed_s: float) -> None:
        """Continues a resumed run: ``step`` optimizer steps are already done and took
        ``elapsed_s`` seconds (what :attr:`elapsed_s` was when the checkpoint was saved).

        The bar moves to ``step`` without counting those steps toward its speed (the ETA comes
        from the steps this process trains), and :attr:`elapsed_s` continues from ``elapsed_s``.

        Raises:
            ValueError: a negative ``step`` or a negative or non-finite ``elapsed_s``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not (math.isfinite(elapsed_s) and elapsed_s >= 0):
            raise ValueError(f"elapsed_s must be a finite number of seconds >= 0, got {elapsed_s}")
        self._start = time.perf_counter()
        self._elapsed_offset_s = float(elapsed_s)
        if self._progress is not None:
            # reset, not update: update would record `step` steps done in no time, and the ETA
            # would stay far too short until hours of real steps outweighed them.
            self._progress.reset(self._task, total=self.total_steps, completed=step, info="",
                                 elapsed_offset_s=self._elapsed_offset_s)
            self._progress.refresh()

    @contextlib.contextmanager
    def phase(self, description: str, total: int) -> Iterator[Callable[[int, str], None]]:
        """A bar of its own for a pass outside the RL steps (the warm start), shown below the
        training bar, so a long pass is visibly alive beside a train bar still at ``0/N``.

        Yields ``update(done, info="")``: ``done`` units of ``total`` are finished; ``info`` is a
        short text shown after the bar (e.g. ``"loss 0.4121"``). Without a progress bar
        (``logging.progress: false``) ``update`` does nothing. The finished bar stays on screen.

        Raises:
            ValueError: ``total < 0``.
        """
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if self._progress is None:
            yield lambda done, info="": None
            return
        task = self._progress.add_task(description, total=total, info="", elapsed_offset_s=0.0)

        def update(done: int, info: str = "") -> None:
            self._progress.update(task, completed=done, info=info)

        try:
            yield update
        finally:
            self._progress.stop_task(task)
            self._progress.refresh()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Records one set of metrics at optimizer step ``step``.

        Args:
            metrics: namespaced keys (``"loss/pg"``) to values: Python int/float, one-element
                torch tensors (any device; all fetched with one host sync per device) or numpy
                scalars. Tensors and numpy values become Python floats. A key without a ``/``
                namespace is accepted with a one-time warning.
            step: optimizer step, >= 0. Calls for the same step (train, then eval) are allowed;
                W&B needs steps that do not decrease.

        Raises:
            ValueError: a negative step, a reserved key (``step``, ``time_s``) or a tensor/array
                value with more than one element.
            TypeError: a non-string key or a value of another type.
            RuntimeError: called after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        values = _to_python(metrics)
        for key, value in values.items():
            if key in RESERVED_KEYS:
                raise ValueError(f"metric key {key!r} is reserved for the logger")
            if "/" not in key and key not in self._warned_unnamespaced:
                self._warned_unnamespaced.add(key)
                logger.warning("metric key %r has no namespace (e.g. 'loss/%s')", key, key)
            if isinstance(value, float) and not math.isfinite(value):
                self.num_nonfinite += 1
                if key not in self._warned_nonfinite:
                    self._warned_nonfinite.add(key)
                    logger.warning(
                        "metric %r is %s at step %d; written to metrics.jsonl as null",
                        key, value, step,
                    )

        if self._jsonl is not None:
            record = {"step": step, "time_s": round(self.elapsed_s, 3)}
            record.update(
                (k, v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in values.items()
            )
            # allow_nan=False: a stray NaN would make the line unreadable to strict JSON parsers.
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

        if step != self._step_metrics_step:
            self._step_metrics = {}
            self._step_metrics_step = step
        self._step_metrics.update(values)

    def advance(self, step: int) -> None:
        """Marks optimizer step ``step`` (1-based count of finished steps) as done.

        Moves the progress bar to ``step`` of ``total_steps`` and, when ``step`` is a multiple of
        ``console_every_steps`` or the last step, prints a summary line (step/total, elapsed, and
        those of :data:`SUMMARY_KEYS` logged at ``step``, 4 significant digits); call it after the
        step's :meth:`log` calls.
        """
        if self._progress is not None:
            self._progress.update(self._task, completed=step)
            # Redraw now so a summary printed below sits above a bar that already shows `step`.
            self._progress.refresh()
        every = self.cfg.console_every_steps
        if every and (step % every == 0 or step == self.total_steps):
            metrics = self._step_metrics if self._step_metrics_step == step else {}
            self.print(self._summary_line(step, metrics))

    def print(self, msg: str) -> None:
        """Prints ``msg`` on the console above the progress bar, verbatim (no rich markup)."""
        # soft_wrap: keep each message on one line whatever rich thinks the width is (80 in CI).
        self._console.print(msg, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stops the progress bar, flushes and closes every sink. Safe to call more than once."""
        self._close(exit_code=0)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A non-zero exit code marks the W&B run as failed instead of finished.
        self._close(exit_code=0 if exc_type is None else 1)

    def _close(self, exit_code: int) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=exit_code)
        if self.num_nonfinite:
            logger.warning("%d non-finite metric values were logged as null", self.num_nonfinite)

    def _summary_line(self, step: int, metrics: Mapping[str, float | int]) -> str:
        s = int(self.elapsed_s)
        parts = [f"step {step}/{self.total_steps}", f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"]
        parts += [f"{label} {metrics[key]:.4g}" for key, label in SUMMARY_KEYS if key in metrics]
        return " | ".join(parts)


class _ElapsedColumn(ProgressColumn):
    """A task's elapsed time (``H:MM:SS``) plus the seconds in its ``elapsed_offset_s`` field:
    what a resumed run had taken before its checkpoint."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        if elapsed is None:
            return Text("-:--:--", style="progress.elapsed")
        seconds = max(0, int(elapsed + task.fields.get("elapsed_offset_s", 0.0)))
        return Text(str(timedelta(seconds=seconds)), style="progress.elapsed")


def reduce_metrics(
    per_micro_batch: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float | torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Reduces each metric over the micro-batches of one optimizer step, without a host sync.

    Each key is reduced over the entries that contain it; entries lacking it neither contribute
    nor dilute. An extreme (a key ending in ``_max`` / ``/max`` or ``_min`` / ``/min``, see
    :func:`metric_reduction`) is the max / min of its entries, so ``loss/ratio_max`` is the
    largest ratio of any token in the step, not a mean of per-micro-batch maxima (which would
    depend on how the batch was cut). Every other key is averaged; with ``weights`` (e.g.
    valid-token counts per micro-batch) the mean is ``sum_i w_i * v_i / sum_i w_i`` over those
    entries, so a token-level metric equals the one computed on the whole batch at once. An
    extreme ignores the weights' sizes but skips entries of weight zero (a micro-batch without a
    valid token reports a placeholder, not an extreme).

    Example: ``[{"loss/pg": 1.0, "loss/ratio_max": 4.0}, {"loss/pg": 3.0, "loss/ratio_max": 2.0}]``
    with weights ``[1, 3]`` gives ``{"loss/pg": 2.5, "loss/ratio_max": 4.0}``.

    Args:
        per_micro_batch: one mapping per micro-batch, key to tensor; tensors of one key share
            shape and device (usually 0-d scalars). They are detached and reduced in float32
            along a new leading micro-batch dimension.
        weights: one non-negative weight per micro-batch, Python numbers or 0-d tensors (tensors
            stay on device, so their sign is not checked). None weighs entries equally.

    Returns:
        key -> float32 tensor of the shared shape, in first-seen key order. A key whose weights
        sum to zero (no valid tokens anywhere) is NaN, an extreme's too.

    Raises:
        ValueError: an empty ``per_micro_batch``, a weights length that does not match it, or a
            negative Python weight.
    """
    if not per_micro_batch:
        raise ValueError("reduce_metrics needs at least one micro-batch")
    if weights is not None:
        if len(weights) != len(per_micro_batch):
            raise ValueError(
                f"got {len(weights)} weights for {len(per_micro_batch)} micro-batches"
            )
        for w in weights:
            if not isinstance(w, torch.Tensor) and w < 0:
                raise ValueError(f"weights must be >= 0, got {w}")

    keys = dict.fromkeys(k for entry in per_micro_batch for k in entry)
    reduced = {}
    for key in keys:
        idx = [i for i, entry in enumerate(per_micro_batch) if key in entry]
        values = torch.stack([per_micro_batch[i][key].detach().float() for i in idx])
        how = metric_reduction(key)
        if weights is None:
            reduced[key] = values.mean(dim=0) if how == "mean" else _extreme(values, how, None)
            continue
        w = torch.stack(
            [torch.as_tensor(weights[i], dtype=torch.float32, device=values.device) for i in idx]
        )
        w = w.reshape(-1, *([1] * (values.dim() - 1)))
        if how == "mean":
            reduced[key] = (values * w).sum(dim=0) / w.sum()
        else:
            reduced[key] = _extreme(values, how, (w > 0).expand_as(values))
    return reduced


def metric_reduction(key: str) -> str:
    """How a metric combines over micro-batches and ranks: ``"max"``, ``"min"`` or ``"mean"``.

    Keys whose last name ends in ``_max`` / ``_min`` (``loss/ratio_max``), or whose last name is
    ``max`` / ``min`` (``staleness/max``), are extremes; every other metric is a mean.
    """
    name = key.rsplit("/", 1)[-1]
    if name == "max" or name.endswith("_max"):
        return "max"
    if name == "min" or name.endswith("_min"):
        return "min"
    return "mean"


def _extreme(values: torch.Tensor, how: str, keep: torch.Tensor | None) -> torch.Tensor:
    """Max or min over dim 0 of ``values`` ``[N, ...]`` among the entries ``keep`` ``[N, ...]`` bool
    marks (None: all); NaN where it marks none."""
    if keep is None:
        return values.amax(dim=0) if how == "max" else values.amin(dim=0)
    fill = -math.inf if how == "max" else math.inf
    masked = torch.where(keep, values, torch.full_like(values, fill))
    out = masked.amax(dim=0) if how == "max" else masked.amin(dim=0)
    return torch.where(keep.any(dim=0), out, torch.full_like(out, math.nan))


def _to_python(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Converts metric values to Python numbers, fetching tensors with one sync per device."""
    values: dict[str, float | int] = {}
    on_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"metric {key!r} must have one element, got shape {tuple(value.shape)}"
                )
            on_device.setdefault(value.device, []).append((key, value))
            values[key] = 0.0  # placeholder keeps the caller's key order
        elif isinstance(value, (np.generic, np.ndarray)):
            if np.size(value) != 1:
                raise ValueError(
                    f"metric {key!r} must have one element, got shape {np.shape(value)}"
                )
            values[key] = float(np.asarray(value).reshape(()))
        elif isinstance(value, (bool, int)):
            values[key] = int(value)
        elif isinstance(value, float):
            values[key] = value
        else:
            raise TypeError(f"metric {key!r} has unsupported type {type(value).__name__}")
    for device, items in on_device.items():
        # MPS has no float64; elsewhere float64 keeps large integer counts exact.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        stacked = torch.stack([t.detach().reshape(()).to(dtype) for _, t in items])
        for (key, _), number in zip(items, stacked.tolist()):
            values[key] = number
    return values


def _init_wandb(cfg: WandbConfig, run_dir: Path, run_config: dict | None):
    """Starts the W&B run for ``cfg.mode`` online/offline; returns None when disabled."""
    if cfg.mode == "disabled":
        return None
    # Imported here: wandb takes about a second to import and disabled runs never need it.
    import wandb

    from async_rl.utils.leftovers import own_wandb_temp_dirs

    own_wandb_temp_dirs()  # its temp dirs carry our pid: a killed run's are swept at the next start
    # Without credentials wandb.init would prompt on a terminal and hang a headless job.
    if cfg.mode == "online" and not wandb.login(prompt=False, verify=False):
        raise ValueError(
            "logging.wandb.mode is 'online' but no W&B credentials were found; run `wandb login`, "
            "set WANDB_API_KEY, or use logging.wandb.mode=offline"
        )
    # One W&B run per run directory: a resumed job continues the same W&B run.
    id_file = run_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    return wandb.init(
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name or run_dir.resolve().name,
        tags=list(cfg.tags),
        config=run_config,
        mode=cfg.mode,
        # A new run per logger even if another is active in this process (tests, sweeps).
        reinit="create_new",
        settings=wandb.Settings(
            # quiet keeps only the run's URL or local path; console capture is off because rich
            # owns the terminal and wandb's copy would record every progress-bar frame.
            quiet=True,
            console="off",
        ),
    )
