"""What an evaluation costs the learner in async mode: on the generator pool against on the
trainer's colocated engine, side by side.

The default job (``configs/default.yaml``) in ``trainer.mode=async``, evaluating every
``--eval-every`` steps with evaluation at k (``--samples`` samples a prompt besides the greedy
pass), run twice from the same warm start and seed:

* **pool** (``trainer.eval_on_pool=true``, the default): the held-out groups are sampled by the
  generator actors in their idle time while the learner trains. The learner's cost is the
  slowdown of the steps during which an evaluation ran (from the step after it started to the
  step its last group arrived, both in ``metrics.jsonl``) against the run's other steps:
  ``mean step_s while evaluating / mean step_s otherwise`` (target <= 1.10, issue 35).
* **colocated** (``trainer.eval_on_pool=false``): the learner waits while the trainer's engine
  samples the evaluation (``timing/eval_s``); its cost per evaluation is that wait, printed as a
  fraction of the steps between two evaluations.

Steps 1-2 (start-up) and the last step (its evaluation is always colocated) are left out of both
means. Every figure comes from the runs' own ``metrics.jsonl``.

Run (about 4 minutes on 2 cores)::

    ASYNC_RL_CACHE=/tmp/arl-cache python bench/bench_pool_eval.py [--steps 120] [--eval-every 10]
        [--samples 8] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 1.10
"""Most a pool evaluation may slow the learner's steps while it runs (issue 35, acceptance 3)."""


def run(out: Path, name: str, args, on_pool: bool) -> list[dict]:
    """One async run of the default job; returns its ``metrics.jsonl`` records."""
    from async_rl.config import load_config
    from async_rl.trainer import train

    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "trainer.mode=async", f"trainer.total_steps={args.steps}", f"trainer.eval_every_steps={args.eval_every}",
        f"trainer.eval_samples={args.samples}", f"trainer.eval_on_pool={str(on_pool).lower()}",
        f"trainer.seed={args.seed}", f"trainer.output_dir={out}", f"trainer.run_name={name}",
        "trainer.export_model=false", "logging.progress=false", "logging.console_every_steps=100000",
        *args.override])
    train(cfg)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def step_times(records: list[dict], last: int) -> dict[int, float]:
    """``timing/step_s`` by step, start-up steps and the last left out."""
    return {int(r["step"]): float(r["timing/step_s"]) for r in records
            if "timing/step_s" in r and 3 <= int(r["step"]) < last}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--samples", type=int, default=8, help="evaluation at k: samples a held-out prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("override", nargs="*", help="dotlist overrides for both runs")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        pool = run(out, "pool", args, on_pool=True)
        colocated = run(out, "colocated", args, on_pool=False)

    times = step_times(pool, args.steps)
    during: set[int] = set()
    done = [r for r in pool if "eval/started_step" in r]
    for r in done:
        during.update(range(int(r["eval/started_step"]) + 1, int(r["step"]) + 1))
    busy = [t for s, t in times.items() if s in during]
    quiet = [t for s, t in times.items() if s not in during]
    waits_for_data = {int(r["step"]): float(r["timing/wait_for_data_s"]) for r in pool if "timing/wait_for_data_s" in r}
    print(f"\ndefault job, async, {args.steps} steps, evaluation every {args.eval_every} with {args.samples} "
          f"samples a prompt besides greedy, seed {args.seed}")
    if not busy or not quiet:
        raise SystemExit(f"no steps to compare: {len(busy)} during evaluations, {len(quiet)} without")
    ratio = statistics.fmean(busy) / statistics.fmean(quiet)
    print(f"pool:      {len(done)} evaluations ended on the pool, each over {statistics.fmean(len(range(int(r['eval/started_step']) + 1, int(r['step']) + 1)) for r in done):.1f} steps "
          f"({statistics.fmean(r['eval/wall_s'] for r in done):.2f} s); step_s while evaluating "
          f"{statistics.fmean(busy):.3f} s ({len(busy)} steps), otherwise {statistics.fmean(quiet):.3f} s "
          f"({len(quiet)} steps): ratio {ratio:.3f}  (target <= {TARGET}: {'PASS' if ratio <= TARGET else 'MISS'})")
    busy_wait = statistics.fmean(w for s, w in waits_for_data.items() if s in during and s in times)
    quiet_wait = statistics.fmean(w for s, w in waits_for_data.items() if s not in during and s in times)
    print(f"           of which waiting for data: {busy_wait:.3f} s while evaluating, {quiet_wait:.3f} s otherwise")
    last = [r for r in pool if "eval/policy_version_max" in r]
    spread = statistics.fmean(r["eval/policy_version_max"] - r["eval/policy_version"] for r in last)
    print(f"           policy versions within one evaluation: {spread:.1f} apart on average (min to max)")
    ctimes = step_times(colocated, args.steps)
    waits = [float(r["timing/eval_s"]) for r in colocated if "timing/eval_s" in r and 0 < int(r["step"]) < args.steps]
    per_step = statistics.fmean(ctimes.values())
    print(f"colocated: {len(waits)} evaluations, the learner waiting {statistics.fmean(waits):.2f} s each; step_s "
          f"{per_step:.3f} s: {statistics.fmean(waits) / (per_step * args.eval_every):.2f} of the "
          f"{args.eval_every} steps' time between two evaluations")
    for name, records in (("pool", pool), ("colocated", colocated)):
        final = [r for r in records if int(r["step"]) == args.steps and "eval/accuracy" in r][-1]
        print(f"{name:10s} final greedy accuracy {final['eval/accuracy']:.3f}, pass@1 {final['eval/pass@1']:.3f}, "
              f"pass@{args.samples} {final[f'eval/pass@{args.samples}']:.3f}, mean@{args.samples} "
              f"{final[f'eval/mean@{args.samples}']:.3f}, maj@{args.samples} {final[f'eval/maj@{args.samples}']:.3f}")


if __name__ == "__main__":
    main()
