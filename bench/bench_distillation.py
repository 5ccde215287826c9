"""On-policy distillation against RL alone, in steps to the teacher's held-out accuracy (issue 35).

A teacher is the default job trained longer (or any run given with ``--teacher``); each contender
starts from the job's own warm start (a fresh student) and trains ``--steps`` steps:

- ``distill_sync`` / ``distill_async``: ``algorithm.distill.teacher=<teacher>`` in sync / async
  mode, with ``--distill-overrides`` (default: pure distillation, ``task_reward=false``);
- ``rl_sync`` / ``rl_async``: the job as it is (GRPO on the task reward), with ``--rl-overrides``.

Every run is a fresh ``async-rl train`` process evaluating every ``--eval-every`` steps with
``trainer.eval_samples`` samples per held-out prompt; the teacher is evaluated once with
``async-rl eval`` (``--teacher-samples`` samples). The target is the teacher's mean@k minus
``--points`` (2) points; a contender reaches it at the first evaluation where the trailing mean of
3 evaluations (the step-0 one counts) is at or above it. Printed: per contender the steps to the
target (trailing mean, and the first single evaluation), the best and final mean@k, greedy
accuracy beside them, and the last step's reverse KL to the teacher; saved: ``<out>/distillation.json``
(every curve) and ``<out>/distillation.png`` (mean@k and greedy against steps, the teacher's level
and the target drawn across).

    python bench/bench_distillation.py --out /tmp/distill                 # teacher 600 steps, 150-step contenders
    python bench/bench_distillation.py --teacher runs/teacher --steps 150 --contenders distill_sync,rl_sync
    python bench/bench_distillation.py --out /tmp/distill --report        # the table again, from the runs
    python bench/bench_distillation.py --short --out /tmp/d               # CI's form: checks the machinery
    python bench/bench_distillation.py --config configs/chainsum.yaml --teacher runs/lt_teacher \
        --overrides model.path=runs/lt_student/final_model trainer.warm_start.steps=0

Steps, not seconds, are compared: the figures do not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_time_to_accuracy import first_reach  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONTENDERS = ("distill_sync", "distill_async", "rl_sync", "rl_async")
SHORT = ["trainer.warm_start.steps=3", "trainer.warm_start.batch_size=8", "trainer.prompts_per_step=4",
         "trainer.samples_per_prompt=4", "data.val_max_prompts=8"]
"""Overrides of the short form (CI): a few steps of everything, on small batches."""


def train(out: Path, name: str, config: str, overrides: list[str], log: Path) -> Path:
    """Run ``async-rl train`` as a fresh process into ``out/name``; returns the run directory.

    Raises:
        RuntimeError: the run failed (its log's last lines in the message).
    """
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", config, f"trainer.output_dir={out}",
           f"trainer.run_name={name}", "trainer.overwrite=true", "logging.progress=false", *overrides]
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"{name}: async-rl train exited {rc}; the end of {log}:\n{tail}")
    return out / name


def evaluate_teacher(teacher: Path, config: str, samples: int, out: Path, extra: list[str]) -> dict:
    """``async-rl eval`` of the teacher with ``samples`` samples per held-out prompt; its JSON."""
    result = out / "teacher_eval.json"
    cmd = [sys.executable, "-m", "async_rl.cli", "eval", "--config", config, "--model", str(teacher),
           "--out", str(result), f"trainer.eval_samples={samples}", *extra]
    log = out / "teacher_eval.log"
    with open(log, "w") as f:
        if subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT) != 0:
            raise RuntimeError(f"teacher evaluation failed; see {log}")
    return json.loads(result.read_text())


def curve_of(run_dir: Path, samples: int) -> list[dict]:
    """The run's evaluations in step order: ``step`` (the step whose policy it measured: an
    evaluation on the async pool's ``eval/started_step``), ``sampled`` (mean@k), ``greedy``,
    ``policy_version`` and that step's ``reverse_kl`` to the teacher where logged."""
    kl: dict[int, float] = {}
    points = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "distill/reverse_kl" in rec:
            kl[rec["step"]] = rec["distill/reverse_kl"]
        if f"eval/mean@{samples}" in rec:
            # An evaluation on the async pool is logged when it ends; it measured the policy of
            # the step it started after (eval/started_step).
            step = int(rec.get("eval/started_step", rec["step"]))
            points.append({"step": step, "rl_s": rec.get("time_s", 0.0), "sampled": rec[f"eval/mean@{samples}"],
                           "greedy": rec["eval/accuracy"], "policy_version": rec.get("eval/policy_version")})
    for p in points:
        p["reverse_kl"] = kl.get(p["step"])
    return sorted(points, key=lambda p: p["step"])


def summarize(curve: list[dict], target: float) -> dict:
    """Steps to ``target`` (trailing mean of ``TRAILING_EVALS`` evaluations, and the first single
    evaluation at or above it), best and final mean@k and greedy accuracy of one curve."""
    reached = first_reach(curve, target, "sampled")
    single = next((p for p in curve if p["sampled"] >= target - 1e-12), None)
    kls = [p["reverse_kl"] for p in curve if p.get("reverse_kl") is not None]
    return {"steps_to_target": reached["step"] if reached else None,
            "steps_to_target_single": single["step"] if single else None,
            "best": max(p["sampled"] for p in curve), "final": curve[-1]["sampled"],
            "best_greedy": max(p["greedy"] for p in curve), "final_greedy": curve[-1]["greedy"],
            "last_step": curve[-1]["step"], "last_reverse_kl": kls[-1] if kls else None}


def report(result: dict) -> str:
    """The table of ``result`` (``distillation.json``'s content)."""
    t = result["teacher"]
    lines = [f"teacher {t['path']}: mean@{t['samples']} {t['sampled']:.3f} ± {t['sampled_se']:.3f}, greedy "
             f"{t['greedy']:.3f}; target (mean@{t['samples']} - {result['points']:.0f} points) {result['target']:.3f}; "
             f"contenders evaluated with {result['samples']} samples a prompt",
             "| contender | steps to target (trailing mean of 3) | first evaluation at target | best mean@k | "
             "final mean@k | best greedy | final greedy | last reverse KL (nats/token) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in result["summary"].items():
        never = f"never in {s['last_step']}"
        kl = "-" if s["last_reverse_kl"] is None else f"{s['last_reverse_kl']:.3f}"
        lines.append(f"| {name} | {s['steps_to_target'] if s['steps_to_target'] is not None else never} | "
                     f"{s['steps_to_target_single'] if s['steps_to_target_single'] is not None else never} | "
                     f"{s['best']:.3f} | {s['final']:.3f} | {s['best_greedy']:.3f} | {s['final_greedy']:.3f} | {kl} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """mean@k and greedy accuracy against steps, one line per contender, the teacher and the target across."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5))
    for ax, key, title in zip(fig.subplots(1, 2), ("sampled", "greedy"),
                              (f"held-out mean@{result['samples']} (temperature 1)", "held-out greedy accuracy")):
        for name, curve in result["curves"].items():
            ax.plot([p["step"] for p in curve], [p[key] for p in curve], marker=".", label=name)
        teacher = result["teacher"][key]
        ax.axhline(teacher, color="black", linestyle="--", linewidth=1, label="teacher")
        if key == "sampled":
            ax.axhline(result["target"], color="gray", linestyle=":", linewidth=1, label="teacher - 2 points")
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--out", default="runs/bench_distillation")
    p.add_argument("--teacher", help="a trained run (or model directory) to distill from; default: train one")
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--teacher-samples", type=int, default=16)
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-samples", type=int, default=8)
    p.add_argument("--points", type=float, default=2.0, help="the target: the teacher's mean@k minus this many points")
    p.add_argument("--distill-overrides", nargs="*", default=["algorithm.distill.task_reward=false"])
    p.add_argument("--rl-overrides", nargs="*", default=[])
    p.add_argument("--overrides", nargs="*", default=[],
                   help="overrides of every contender (e.g. model.path=<a student> trainer.warm_start.steps=0)")
    p.add_argument("--report", action="store_true", help="print the table of an earlier --out and exit")
    p.add_argument("--short", action="store_true", help="CI's form: a few steps of everything")
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    if a.report:
        print(report(json.loads((out / "distillation.json").read_text())))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    short = SHORT if a.short else []
    if a.short:
        a.teacher_steps, a.steps, a.eval_every, a.eval_samples, a.teacher_samples = 4, 3, 2, 2, 2
    names = [c for c in a.contenders.split(",") if c]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        p.error(f"--contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    teacher = Path(a.teacher).resolve() if a.teacher else train(
        out, "teacher", a.config, [f"trainer.total_steps={a.teacher_steps}", "trainer.eval_every_steps=0", *short],
        out / "teacher.log")
    # The teacher is evaluated on the contenders' held-out prompts (their data.* overrides).
    t_eval = evaluate_teacher(teacher, a.config, a.teacher_samples, out,
                              [o for o in [*short, *a.overrides] if o.startswith("data.")])
    k = a.teacher_samples
    result = {"teacher": {"path": str(teacher), "samples": k, "sampled": t_eval[f"eval/mean@{k}"],
                          "sampled_se": t_eval[f"eval/mean@{k}_se"], "greedy": t_eval["eval/accuracy"]},
              "points": a.points, "samples": a.eval_samples, "curves": {}, "summary": {}}
    result["target"] = result["teacher"]["sampled"] - a.points / 100
    common = [f"trainer.total_steps={a.steps}", f"trainer.eval_every_steps={a.eval_every}",
              f"trainer.eval_samples={a.eval_samples}", *short, *a.overrides]
    for name in names:
        mode = "trainer.mode=" + name.split("_")[1]
        extra = ([f"algorithm.distill.teacher={teacher}", *a.distill_overrides] if name.startswith("distill")
                 else list(a.rl_overrides))
        print(f"{name}: {a.steps} steps ...", flush=True)
        run_dir = train(out, name, a.config, [*common, mode, *extra], out / f"{name}.log")
        curve = curve_of(run_dir, a.eval_samples)
        result["curves"][name] = curve
        result["summary"][name] = summarize(curve, result["target"])
        (out / "distillation.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "distillation.png")
    print(report(result))
    print(f"curves: {out / 'distillation.json'}, {out / 'distillation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
