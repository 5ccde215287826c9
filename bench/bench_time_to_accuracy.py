"""Held-out accuracy against RL time and against steps: sync, async and TRL, over seeds.

What users look at when they choose asynchronous RL: how soon a run reaches a given held-out
accuracy on the same hardware, and how much it learns per sample. Every contender starts from one
warm-started policy (the job's supervised warm start, run once and exported; see
``bench_vs_trl.warm_started_model``) and trains the same job (``--config``, the default job unless
given) with the same batch, learning rate and loss, once per seed:

* ``sync``: ``trainer.mode=sync`` (the hybrid engine);
* ``async``: ``trainer.mode=async`` with its defaults (or the ``--async-overrides`` given);
* ``trl``: TRL's ``GRPOTrainer`` (``bench_vs_trl.trl_trainer``; optional ``bench`` extra), in
  float32 as ours (``--trl-defaults``: with TRL's default bf16 autocast and gradient checkpointing).

Each run is a fresh child process (its own OpenMP runtime, Ray session and memory), started with
the thread defaults the ``async-rl`` CLI sets (``async_rl.utils.cpu_threads``) for our contenders and
an untouched environment for TRL. Runs are interleaved (seed 0 of every contender, then seed 1,
...), so a machine whose load drifts moves every contender alike.

**Evaluation is the bench's measurement, not part of the run.** Every ``--eval-every`` steps the
child copies the policy's weights (a few ms for the tiny model, taken off the clock) and goes on
training; nothing pauses, and async generators are neither idle nor given free time while an
evaluation runs. After the run the child evaluates every snapshot on the held-out split through
our evaluation path (``async_rl.step.evaluation``, the HF engine): greedy accuracy, and the mean
accuracy of ``--eval-samples`` samples per prompt at the training temperature (each snapshot
with the same per-prompt seeds, so two snapshots differ only by their weights). Greedy accuracy
on a small held-out set flips with a few borderline prompts between evaluations; the sampled
mean is the steadier estimate of the policy's accuracy and is the one the targets use
(``--metric greedy`` picks the other).

RL time is the wall time of the training steps (``async_rl.trainer.run_steps``, from its first
step to the end of the last), snapshot copies excluded; TRL's is the wall time of
``trainer.train()`` with its callback's copies excluded.

Printed: per contender the mean over seeds, with its standard error, of RL time, last-quarter
accuracy (mean of the evaluations after 75% of the steps), final accuracy, and time and steps to
the target (by default sync's mean last-quarter accuracy minus 3 points, reached when the
trailing mean of 3 consecutive evaluations first is at or above it); then the ratios of the
issue's acceptance list. The per-run figures and curves go to ``<out>/time_to_accuracy.json`` and
a plot of the mean curves against RL time and against steps to ``<out>/time_to_accuracy.png``.

    python bench/bench_time_to_accuracy.py                       # default job, 5 seeds, sync + async (+ trl if installed)
    python bench/bench_time_to_accuracy.py --config configs/longtail.yaml --seeds 5
    python bench/bench_time_to_accuracy.py --short               # CI's form: 2 seeds, 4 steps (checks the machinery)
    python bench/bench_time_to_accuracy.py --async-overrides algorithm.bypass_proximal=true
    python bench/bench_time_to_accuracy.py --out DIR --first-seed 5 --seeds 3   # 3 more seeds into DIR
    python bench/bench_time_to_accuracy.py --out DIR --report                    # summarize every run in DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONTENDERS = ("sync", "async", "trl")
TRAILING_EVALS = 3
"""Time to target: the first evaluation at which the mean of the last this many is at or above it."""
TARGET_MARGIN = 0.03
"""The default target: sync's mean last-quarter accuracy minus this (3 points)."""


# --------------------------------------------------------------------------------------- analysis
def trailing_mean(values: list[float], k: int = TRAILING_EVALS) -> list[float | None]:
    """Mean of each value with the ``k - 1`` before it; ``None`` where fewer than ``k`` exist.

    Example: ``trailing_mean([0.1, 0.2, 0.6, 0.4], 3)`` is ``[None, None, 0.3, 0.4]``.
    """
    return [None if i + 1 < k else sum(values[i + 1 - k:i + 1]) / k for i in range(len(values))]


def first_reach(curve: list[dict], target: float, key: str, k: int = TRAILING_EVALS) -> dict | None:
    """The first point of ``curve`` (dicts with ``step``, ``rl_s`` and ``key``, in step order)
    where the trailing mean of ``k`` evaluations of ``key`` is at or above ``target``; ``None``
    if it never is. The step-0 evaluation counts as one of the ``k``."""
    means = trailing_mean([p[key] for p in curve], k)
    for point, mean in zip(curve, means):
        if mean is not None and mean >= target - 1e-12:
            return point
    return None


def tail_mean(curve: list[dict], key: str, total_steps: int) -> float:
    """Mean of ``key`` over the evaluations after 75% of ``total_steps`` (the last quarter), as
    the trainer's ``eval_tail_mean``; the last evaluation alone if none is that late."""
    tail = [p[key] for p in curve if p["step"] > 0.75 * total_steps] or [curve[-1][key]]
    return sum(tail) / len(tail)


def mean_se(values: list[float]) -> tuple[float, float]:
    """``(mean, standard error of the mean)``; the error is NaN for fewer than two values."""
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def summarize(runs: dict[str, list[dict]], total_steps: int, key: str, target: float | None) -> dict:
    """Per contender: mean and standard error over its seeds of RL time (s), last-quarter and
    final accuracy, and time (s) and steps to ``target`` (by default sync's mean last-quarter
    accuracy minus ``TARGET_MARGIN``); a run that never reaches it counts as its whole RL time,
    and ``reached`` says how many did.

    Args:
        runs: contender -> the child results (``curve``, ``rl_s``, ``seed``) of its seeds.
        total_steps: steps of every run.
        key: ``"sampled"`` or ``"greedy"``, the accuracy that counts.
        target: the target accuracy, or ``None`` for the default.

    Returns:
        ``{"target": float, "contenders": {name: {figure: (mean, se), ...}}}``.
    """
    if target is None:
        base = runs.get("sync") or next(iter(runs.values()))
        target = statistics.fmean(tail_mean(r["curve"], key, total_steps) for r in base) - TARGET_MARGIN
    out: dict = {"target": target, "metric": key, "contenders": {}}
    for name, results in runs.items():
        reach = [first_reach(r["curve"], target, key) for r in results]
        out["contenders"][name] = {
            "seeds": [r["seed"] for r in results],
            "rl_s": mean_se([r["rl_s"] for r in results]),
            "tail": mean_se([tail_mean(r["curve"], key, total_steps) for r in results]),
            "final": mean_se([r["curve"][-1][key] for r in results]),
            "time_to_target": mean_se([p["rl_s"] if p else r["rl_s"] for p, r in zip(reach, results)]),
            "steps_to_target": mean_se([p["step"] if p else total_steps for p, r in zip(reach, results)]),
            "reached": sum(p is not None for p in reach),
        }
    return out


def fmt(pair: tuple[float, float], digits: int = 3, scale: float = 1.0) -> str:
    """``mean ± se`` of a ``mean_se`` pair, scaled."""
    m, se = pair
    return f"{m * scale:.{digits}f} ± {se * scale:.{digits}f}" if not math.isnan(se) else f"{m * scale:.{digits}f}"


def print_report(summary: dict, args) -> None:
    """The table of ``summarize``'s figures and the acceptance ratios of the contenders present."""
    c = summary["contenders"]
    samples = "samples per prompt not recorded" if args.eval_samples is None else f"{args.eval_samples} samples per prompt"
    print(f"\n{args.config.name}: {args.steps} steps, evaluation every {args.eval_every}, seeds {args.seeds}, "
          f"accuracy = {summary['metric']} ({samples})" if summary["metric"] == "sampled"
          else f"\n{args.config.name}: {args.steps} steps, evaluation every {args.eval_every}, greedy accuracy")
    for name, extra in getattr(args, "contender_overrides", {}).items():
        if extra:
            print(f"{name} runs with {' '.join(extra)}")
    print(f"target: {summary['target']:.4f} (trailing mean of {TRAILING_EVALS} evaluations)")
    print(f"{'contender':9s} {'RL s':>15s} {'last quarter':>15s} {'final':>15s} {'s to target':>15s} "
          f"{'steps to target':>17s} {'reached':>8s}")
    for name, f in c.items():
        print(f"{name:9s} {fmt(f['rl_s'], 1):>15s} {fmt(f['tail']):>15s} {fmt(f['final']):>15s} "
              f"{fmt(f['time_to_target'], 1):>15s} {fmt(f['steps_to_target'], 1):>17s} "
              f"{f['reached']:>4d}/{len(f['seeds'])}")

    def ratio(a: str, b: str, bound: float) -> None:
        if a in c and b in c:
            got = c[a]["time_to_target"][0] / c[b]["time_to_target"][0]
            print(f"time to target {a}/{b}: {got:.2f}x (target <= {bound}x): {'met' if got <= bound else 'not met'}")

    if "sync" in c and "async" in c:
        gap = 100 * (c["sync"]["tail"][0] - c["async"]["tail"][0])
        print(f"last-quarter accuracy sync - async: {gap:+.1f} points (target <= 2): {'met' if gap <= 2 else 'not met'}")
    ratio("async", "sync", 0.8)
    ratio("async", "trl", 0.7)
    ratio("sync", "trl", 0.9)


def plot(runs: dict[str, list[dict]], key: str, path: Path) -> None:
    """Accuracy against RL time and against steps: each seed a thin line, each contender's mean
    over seeds (at each evaluation step; time = the seeds' mean time there) a thick one."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    axes = fig.subplots(1, 2)
    for (name, results), color in zip(runs.items(), ("C0", "C1", "C2", "C3")):
        for r in results:
            axes[0].plot([p["rl_s"] for p in r["curve"]], [p[key] for p in r["curve"]], color=color, alpha=0.25, lw=0.8)
            axes[1].plot([p["step"] for p in r["curve"]], [p[key] for p in r["curve"]], color=color, alpha=0.25, lw=0.8)
        steps = sorted({p["step"] for r in results for p in r["curve"]})
        at = {s: [p for r in results for p in r["curve"] if p["step"] == s] for s in steps}
        mean_t = [statistics.fmean(p["rl_s"] for p in at[s]) for s in steps]
        mean_a = [statistics.fmean(p[key] for p in at[s]) for s in steps]
        axes[0].plot(mean_t, mean_a, color=color, lw=2.2, label=f"{name} (mean of {len(results)})")
        axes[1].plot(steps, mean_a, color=color, lw=2.2, label=name)
    axes[0].set_xlabel("RL time (s, evaluation excluded)")
    axes[1].set_xlabel("training step")
    for ax in axes:
        ax.set_ylabel(f"held-out accuracy ({key})")
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------ child
class Snapshots:
    """Weights of the policy at evaluation steps, with the RL clock at each (seconds of training,
    the copies' own time taken off)."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float, dict]] = []
        self.t0: float | None = None
        self.paused_s = 0.0
        self.rl_s = float("nan")

    def start(self) -> None:
        """Start the RL clock (the first training step begins)."""
        self.t0 = time.perf_counter()

    def take(self, step: int, named_tensors) -> None:
        """Copy ``named_tensors`` (name, tensor) as the policy after ``step``."""
        t = time.perf_counter()
        self.points.append((step, t - self.t0 - self.paused_s, {n: w.detach().clone() for n, w in named_tensors}))
        self.paused_s += time.perf_counter() - t

    def elapsed(self) -> float:
        """RL seconds so far."""
        return time.perf_counter() - self.t0 - self.paused_s


def run_ours(mode: str, warm: Path, args, run_dir: Path, snaps: Snapshots) -> None:
    """One run of our ``mode`` from ``warm``: the trainer's evaluation is replaced by a snapshot
    (``Snapshots.take``) and its RL phase timed by ``Snapshots``."""
    import async_rl.trainer as trainer
    from bench_vs_trl import default_config

    run_steps = trainer.run_steps

    def timed_run_steps(ctx, loop, progress):
        snaps.start()
        run_steps(ctx, loop, progress)
        snaps.rl_s = snaps.elapsed()

    def snapshot(ctx, loop, progress, step):
        snaps.take(step, ctx.learner.named_weights())
        return {}

    trainer.run_steps, trainer.evaluate_now = timed_run_steps, snapshot
    overrides = [*args.override, f"model.path={warm}", "trainer.warm_start.steps=0", f"trainer.mode={mode}",
                 f"trainer.total_steps={args.steps}", f"trainer.eval_every_steps={args.eval_every}",
                 f"trainer.seed={args.seed}", f"trainer.output_dir={run_dir.parent}", f"trainer.run_name={run_dir.name}",
                 "trainer.export_model=false", "trainer.overwrite=true", "logging.progress=false",
                 "logging.console_every_steps=100000",
                 # Every evaluation is this bench's snapshot (evaluate_now above), taken between
                 # steps in both modes, never sampled by the async pool.
                 "trainer.eval_on_pool=false"]
    if mode == "async":
        overrides += list(args.async_override)
    trainer.train(default_config(overrides, args.config))


def run_trl_child(warm: Path, args, run_dir: Path, snaps: Snapshots) -> None:
    """One TRL run from ``warm``, its policy copied every ``eval_every`` of our steps."""
    from transformers import TrainerCallback

    from bench_vs_trl import default_config, trl_trainer

    cfg = default_config([*args.override, f"trainer.seed={args.seed}"], args.config)
    per_step = cfg.learner.num_mini_batches

    class Snapshot(TrainerCallback):
        def on_step_end(self, _args, state, _control, model=None, **_):
            step = state.global_step // per_step
            if state.global_step % per_step == 0 and (step % args.eval_every == 0 or step == args.steps):
                snaps.take(step, model.named_parameters())

    # --trl-defaults: TRL's own precision defaults (bf16 autocast, gradient checkpointing).
    extra = {"bf16": True, "gradient_checkpointing": True} if args.trl_defaults else None
    trainer = trl_trainer(warm, cfg, args.steps, run_dir, [Snapshot()], extra)
    snaps.start()
    trainer.train()
    snaps.rl_s = snaps.elapsed()


def evaluate_snapshots(warm: Path, args, snaps: Snapshots) -> list[dict]:
    """Greedy and sampled held-out accuracy of the warm policy (step 0) and of every snapshot."""
    from bench_vs_trl import HeldOut

    from async_rl.step.evaluation import EVAL_FIRST_GROUP_ID, accuracy_of
    from async_rl.step.rollout import rollout

    held_out = HeldOut(warm, args.config, args.override)
    sampled = dataclasses.replace(held_out.params, greedy=False)
    prompts = list(held_out.val_ds)
    curve = []
    try:
        for version, (step, rl_s, weights) in enumerate([(0, 0.0, None)] + snaps.points):
            if weights is not None:
                held_out.generator.update_weights(list(weights.items()), version)
            greedy = held_out.accuracy()
            # The same seed for every snapshot: two snapshots differ only by their weights.
            with (held_out.agent.counted_apart() if held_out.agent is not None else contextlib.nullcontext()):
                ro = rollout(held_out.generator, prompts, args.eval_samples, sampled, held_out.scorer,
                             held_out.tokenizer, EVAL_FIRST_GROUP_ID, seed=12345, agent=held_out.agent)
            curve.append({"step": step, "rl_s": rl_s, "greedy": greedy, "sampled": accuracy_of(ro.trajectories)})
    finally:
        held_out.close()
    return curve


def child(args) -> None:
    """Run one contender and seed, then write its result JSON to ``args.result``."""
    snaps = Snapshots()
    run_dir = Path(args.result).with_suffix("")
    if args.child == "trl":
        run_trl_child(args.warm, args, run_dir, snaps)
    else:
        run_ours(args.child, args.warm, args, run_dir, snaps)
    curve = evaluate_snapshots(args.warm, args, snaps)
    Path(args.result).write_text(json.dumps({"contender": args.child, "seed": args.seed, "rl_s": snaps.rl_s,
                                             "curve": curve, "settings": run_settings(args.child, args)}))


def run_settings(contender: str, args) -> dict:
    """What a run's figures depend on besides its contender and seed, saved with its result so
    that ``--report`` prints the runs' own settings and refuses to average runs that differ."""
    return {"config": args.config.name, "eval_every": args.eval_every, "eval_samples": args.eval_samples,
            "overrides": list(args.override),
            "contender_overrides": list(args.async_override) if contender == "async" else [],
            "trl_defaults": bool(args.trl_defaults) if contender == "trl" else False}


# ----------------------------------------------------------------------------------------- parent
def child_env(contender: str) -> dict[str, str]:
    """The environment of a child: ours with the ``async-rl`` CLI's thread defaults (set before
    the child imports torch), TRL's as the caller's."""
    env = dict(os.environ)
    if contender != "trl":
        from async_rl.utils.cpu_threads import openmp_wait_defaults

        openmp_wait_defaults(env)
    return env


def run_child(contender: str, seed: int, args, out: Path) -> dict:
    """Start one child run and return its result.

    Raises:
        RuntimeError: the child failed (its last output lines are in the message).
    """
    result = out / "runs" / f"{contender}-seed{seed}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", contender, "--seed", str(seed), "--warm", str(args.warm),
           "--result", str(result), "--config", str(args.config), "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples),
           *[f"--async-overrides={o}" for o in args.async_override], *(["--trl-defaults"] if args.trl_defaults else []),
           *args.override]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=child_env(contender), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{contender} seed {seed} failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    r = json.loads(result.read_text())
    r["child_wall_s"] = time.perf_counter() - t0
    return r


def parse_args(argv=None):
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs/default.yaml", help="the job (YAML)")
    p.add_argument("--contenders", default=None, help="comma-separated: sync, async, trl (default: all installed)")
    p.add_argument("--seeds", type=int, default=5, help="seeds per contender: first-seed .. first-seed + N - 1")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (to add seeds to earlier runs)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the job's trainer.total_steps)")
    p.add_argument("--eval-every", type=int, default=10, help="snapshot every N steps")
    p.add_argument("--eval-samples", type=int, default=16, help="sampled responses per held-out prompt")
    p.add_argument("--metric", choices=("sampled", "greedy"), default="sampled", help="the accuracy the targets use")
    p.add_argument("--target", type=float, default=None, help="target accuracy (default: sync's last quarter - 3 points)")
    p.add_argument("--async-overrides", dest="async_override", action="append", default=[],
                   help="a dotlist override for the async runs only (repeatable)")
    p.add_argument("--trl-defaults", action="store_true",
                   help="TRL with its own bf16 autocast and gradient checkpointing (default: float32 like ours)")
    p.add_argument("--short", action="store_true", help="CI's form: 2 seeds, 4 steps, a 20-step warm start")
    p.add_argument("--out", type=Path, default=None, help="output directory (the warm-started model is reused)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: summarize every run already in --out (all its invocations' seeds)")
    p.add_argument("--child", choices=CONTENDERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--warm", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("override", nargs="*", help="dotlist overrides for every run (and the warm start)")
    args = p.parse_args(argv)
    if args.short:
        args.seeds, args.steps, args.eval_every, args.eval_samples = 2, 4, 2, 2
        args.override = ["trainer.warm_start.steps=20", *args.override]
    return args


def saved_runs(out: Path) -> dict[str, list[dict]]:
    """Every run result in ``out/runs`` (``<contender>-seed<N>.json``, from any number of
    invocations), per contender in ``CONTENDERS`` order and by seed.

    Raises:
        SystemExit: ``out/runs`` holds no result.
    """
    runs: dict[str, list[dict]] = {}
    for path in sorted((out / "runs").glob("*-seed*.json")):
        r = json.loads(path.read_text())
        runs.setdefault(r["contender"], []).append(r)
    if not runs:
        raise SystemExit(f"--report: no run results (<contender>-seed<N>.json) in {out / 'runs'}")
    return {c: sorted(runs[c], key=lambda r: r["seed"]) for c in CONTENDERS if c in runs}


def finish(runs: dict[str, list[dict]], args, out: Path) -> dict:
    """Summarize ``runs``, print the report, write the JSON and the plot; returns the summary."""
    summary = summarize(runs, args.steps, args.metric, args.target)
    print_report(summary, args)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}; out: {out}")
    (out / "time_to_accuracy.json").write_text(json.dumps({"summary": summary, "runs": runs, "argv": sys.argv[1:]},
                                                          indent=1))
    plot(runs, args.metric, out / "time_to_accuracy.png")
    return summary


def report(args) -> dict:
    """``--report``: the summary of every run saved in ``args.out``; the steps and seeds are the
    runs' own (every run must have the same number of steps).

    Raises:
        SystemExit: no saved run, or runs of different lengths.
    """
    runs = saved_runs(args.out)
    lengths = {r["curve"][-1]["step"] for results in runs.values() for r in results}
    if len(lengths) != 1:
        raise SystemExit(f"--report: the runs in {args.out} have different lengths {sorted(lengths)}; "
                         f"summarize runs of one length")
    args.steps = lengths.pop()
    args.seeds = max(len(results) for results in runs.values())
    shared, args.contender_overrides = saved_settings(runs, args.out)
    args.eval_every = shared.get("eval_every", runs_eval_every(runs))
    args.eval_samples = shared.get("eval_samples")
    if "config" in shared:
        args.config = Path(shared["config"])
    return finish(runs, args, args.out)


def runs_eval_every(runs: dict[str, list[dict]]) -> int:
    """The evaluation interval (steps) of runs saved without their settings: their curves' spacing."""
    curve = next(iter(runs.values()))[0]["curve"]
    return curve[1]["step"] - curve[0]["step"] if len(curve) > 1 else curve[0]["step"]


def contender_extra(settings: dict) -> list[str]:
    """A run's settings of its contender alone (``run_settings``), as the command line gives them."""
    return settings.get("contender_overrides", []) + (["--trl-defaults"] if settings.get("trl_defaults") else [])


def saved_settings(runs: dict[str, list[dict]], out: Path) -> tuple[dict, dict[str, list[str]]]:
    """The settings every run in ``runs`` shares (``run_settings``; runs saved before settings were
    recorded count as agreeing), and each contender's own overrides.

    Raises:
        SystemExit: two runs differ in a setting their figures depend on.
    """
    shared: dict = {}
    own: dict[str, list[str]] = {}
    for name, results in runs.items():
        for r in results:
            settings = r.get("settings")
            if settings is None:
                continue
            extra = contender_extra(settings)
            if own.setdefault(name, extra) != extra:
                raise SystemExit(f"--report: the {name} runs in {out} differ in their own settings "
                                 f"({own[name]} against {extra} at seed {r['seed']}); summarize runs of one setting")
            for key in ("config", "eval_every", "eval_samples", "overrides"):
                if shared.setdefault(key, settings[key]) != settings[key]:
                    raise SystemExit(f"--report: the runs in {out} differ in {key} ({shared[key]!r} against "
                                     f"{settings[key]!r}: {name} seed {r['seed']}); summarize runs of one setting")
    return shared, own


def main(argv=None) -> dict:
    """Run the bench; returns the summary (also written to ``<out>/time_to_accuracy.json``)."""
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return {}
    if args.report:
        if args.out is None:
            raise SystemExit("--report needs --out: the directory of the runs to summarize")
        return report(args)
    from bench_vs_trl import default_config, warm_started_model

    if args.steps is None:
        args.steps = default_config(args.override, args.config).trainer.total_steps
    try:
        import trl  # noqa: F401
        installed = list(CONTENDERS)
    except ImportError:
        installed = ["sync", "async"]
    contenders = [c.strip() for c in (args.contenders or ",".join(installed)).split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-tta-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    args.warm = warm_started_model(out, args.config, args.override)
    print(f"warm start ready in {time.perf_counter() - t0:.0f} s: {args.warm}", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name in contenders:
            r = run_child(name, seed, args, out)
            runs[name].append(r)
            last = r["curve"][-1]
            print(f"  {name:5s} seed {seed}: RL {r['rl_s']:6.1f} s, final greedy {last['greedy']:.3f} sampled "
                  f"{last['sampled']:.3f} (child {r['child_wall_s']:.0f} s)", flush=True)
    args.contender_overrides = {c: contender_extra(run_settings(c, args)) for c in contenders}
    return finish(runs, args, out)


if __name__ == "__main__":
    main()
