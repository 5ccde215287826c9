"""Training curves of one or more runs from their ``metrics.jsonl`` (``async-rl plot``).

::

    async-rl plot runs/sync runs/async --out curves.png

One panel per quantity (``QUANTITIES``), x = training step, one line per run labelled with its
directory name; a panel none of the runs logged is left out, and a run that lacks a quantity
others have is reported (``plot_runs``' second return value). Drawn on a bare matplotlib
``Figure`` (Agg), so it needs no display.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from async_rl.data.dataset import read_jsonl


@dataclass(frozen=True)
class Quantity:
    """One panel: a metric key of ``metrics.jsonl`` and how the panel names it."""

    key: str
    title: str
    ylabel: str


QUANTITIES = (
    Quantity("rollout/reward_mean", "training reward (mean of the step's samples)", "reward"),
    Quantity("eval/accuracy", "held-out accuracy", "accuracy"),
    Quantity("loss/kl", "KL to the reference policy", "KL (nats/token)"),
    Quantity("distill/reverse_kl", "reverse KL to the teacher (on-policy distillation)", "KL (nats/token)"),
    Quantity("loss/distill_kl", "top-k divergence to the teacher (learner)", "KL (nats/token)"),
    Quantity("loss/approx_kl", "update size: KL(proximal || current), k3", "KL (nats/token)"),
    Quantity("actor/entropy", "policy entropy", "nats/token"),
    Quantity("staleness/mean", "staleness of trained samples (mean)", "policy versions"),
    Quantity("perf/gen_tokens_per_s", "generated tokens/s (wall time)", "tokens/s"),
    Quantity("perf/train_tokens_per_s", "learner tokens/s (train time)", "tokens/s"),
)
"""The panels, in order. ``loss/kl`` exists only with a KL term in the loss (``algorithm.kl_coef``),
``distill/reverse_kl`` only with a teacher (``algorithm.distill``), ``loss/distill_kl`` only with a
top-k signal (``algorithm.distill.signal=topk_*``).
Runs with evaluation at k (``trainer.eval_samples``) get one more panel, ``AT_K_TITLE``."""

AT_K_TITLE = "held-out at k: pass@1 (solid), pass@k (dashed), maj@k (dotted); band ± 1 s.e."


def at_k_keys(records: list[dict]) -> list[str]:
    """The run's overall at-k metrics to draw: ``eval/pass@1``, its largest ``eval/pass@k`` and
    ``eval/maj@k`` (whichever it logged), in that order."""
    logged = {k for r in records for k in r if re.fullmatch(r"eval/(pass|maj)@\d+", k)}
    passes = sorted((k for k in logged if k.startswith("eval/pass@")), key=lambda k: int(k.split("@")[1]))
    keys = [k for k in ("eval/pass@1",) if k in logged]
    if passes and passes[-1] not in keys:
        keys.append(passes[-1])
    return keys + sorted(k for k in logged if k.startswith("eval/maj@"))


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` in file order (a resumed run's repeated steps
    are kept; ``series`` keeps the last value of a step).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: a line that is not a JSON object (names the file and the line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a run directory, or logging.jsonl=false)")
    records = read_jsonl(path)
    for number, record in records:
        if "step" not in record:
            raise ValueError(f"{path}: line {number} is not a metrics record (no 'step')")
    return [record for _, record in records]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key``, sorted by step, one value per step (the last logged; a
    resumed run logs the steps after its checkpoint again); ``null`` values (non-finite) are NaN."""
    by_step: dict[int, float] = {}
    for r in records:
        if key in r:
            by_step[int(r["step"])] = math.nan if r[key] is None else float(r[key])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_runs(run_dirs: list[str | Path]):
    """A figure of the runs' curves, and what each run did not log.

    Args:
        run_dirs: run directories, each with a ``metrics.jsonl``; legend labels are their names
            (the parent's name too where two names repeat).

    Returns:
        ``(figure, missing)``: a matplotlib ``Figure`` with one axes per quantity that some run
        logged (title ``Quantity.title``; one line per run that logged it, labelled with the
        run's name) and one figure legend naming the runs in order; ``missing`` maps the label of
        each run that lacks quantities to them, as ``"title (key)"``, all of ``QUANTITIES``
        counted.

    Raises:
        FileNotFoundError, ValueError: see ``read_metrics``; no run directory given.
    """
    if not run_dirs:
        raise ValueError("plot: give at least one run directory")
    labels = _labels([Path(d) for d in run_dirs])
    runs = {label: read_metrics(d) for label, d in zip(labels, run_dirs)}
    shown = [q for q in QUANTITIES if any(series(r, q.key)[0] for r in runs.values())]
    if not shown:
        raise ValueError(f"plot: none of {', '.join(q.key for q in QUANTITIES)} is in the runs' metrics.jsonl")
    with_at_k = any(at_k_keys(r) for r in runs.values())
    panels = len(shown) + int(with_at_k)
    cols = 2 if panels > 1 else 1
    rows = math.ceil(panels / cols)
    # A bare Figure, not pyplot: no global figure registry to leak into, and savefig renders
    # with Agg whatever backend the process has (no display needed).
    fig = Figure(figsize=(6.4 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, q in zip(axes.flat, shown):
        for i, (label, records) in enumerate(runs.items()):
            steps, values = series(records, q.key)
            if not steps:
                continue
            # Sparse series (evaluations every K steps) get markers, so single points show.
            marker = "o" if len(steps) <= 30 else None
            ax.plot(steps, values, label=label, color=colors[i % len(colors)], marker=marker, markersize=3,
                    linewidth=1.4)
        ax.set_title(q.title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(q.ylabel)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if with_at_k:
        _draw_at_k(list(axes.flat)[len(shown)], runs, colors)
    for ax in list(axes.flat)[panels:]:
        ax.set_visible(False)
    # One legend for the figure (every panel uses the same colour per run), above the panels.
    handles = [Line2D([], [], color=colors[i % len(colors)], linewidth=2) for i in range(len(runs))]
    fig.legend(handles, list(runs), loc="outside upper center", ncols=min(len(runs), 4), fontsize=10,
               frameon=False)
    missing = {label: [f"{q.title} ({q.key})" for q in QUANTITIES if not series(records, q.key)[0]]
               for label, records in runs.items()}
    return fig, {label: lacks for label, lacks in missing.items() if lacks}


def _draw_at_k(ax, runs: dict[str, list[dict]], colors: list[str]) -> None:
    styles = {"pass@1": "-", "pass": "--", "maj": ":"}
    for i, (label, records) in enumerate(runs.items()):
        for key in at_k_keys(records):
            steps, values = series(records, key)
            name = key.split("/")[1]
            style = styles.get(name, styles[name.split("@")[0]])
            ax.plot(steps, values, color=colors[i % len(colors)], linestyle=style, marker="o", markersize=3,
                    linewidth=1.4)
            _, se = series(records, f"{key}_se")
            if len(se) == len(values):
                ax.fill_between(steps, [v - e for v, e in zip(values, se)], [v + e for v, e in zip(values, se)],
                                color=colors[i % len(colors)], alpha=0.12, linewidth=0)
    ax.set_title(AT_K_TITLE, fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def _labels(paths: list[Path]) -> list[str]:
    """Each run's directory name, or ``parent/name`` where names repeat (``a/run`` vs ``b/run``)."""
    names = [p.resolve().name for p in paths]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names)]
