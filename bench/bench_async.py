"""Async vs sync speed-up on a long-tailed response-length workload, side by side in one run.

Both modes train the same number of samples (steps x prompts x samples per prompt) with the real
pipeline (``async_rl.trainer.train``): the HF generator, the FSDP2 learner, and in async mode
the Ray generator pool, the ZMQ transport and the replay buffer. The workload: the built-in tiny
model at its random initialisation samples nearly uniformly over its 262-token vocabulary, and
``--stop-ids`` of those tokens end a response, so lengths are geometric (mean about 262 /
stop-ids tokens, capped at ``--max-tokens``): most responses are short and a few are many times
longer, the long tail that makes a sync step wait for its slowest sample.

Two measurements, each a table:

* **End to end** (``--sections e2e``): sync mode uses every core for each phase (its colocated
  engine, then its learner), async mode splits them between the actors and the learner
  (``thread_budget``). What a user of this machine gets; the bound below is not attainable by
  construction here, since sync gets twice the cores per phase.
* **Same placement** (``--sections placement``): in both modes generation runs on core A and the
  learner on core B, one torch thread each (``generator.cpu_affinity=[A]``,
  ``learner.cpu_affinity=[B]``; sync mode moves between them per phase), so sync pays G + T per
  step and async max(G, T) plus its overheads. The rows: async with in-flight weight updates
  continued (``generator.partial_rollout=keep``) and aborted and re-issued (``abort``).

Each table prints wall-clock seconds of the RL phase per mode, the speed-up sync / async, and the
ideal overlap bound (G + T) / max(G, T) from that table's sync run: its mean generation time G
and training + weight sync time T per step (the first step, which pays one-off warm-up costs,
left out). The placement table adds the efficiency speed-up / bound against the target 0.90 and,
per async run, where its steps' time went (``timing/*`` means per step: waiting for data,
training, weight sync, the rest) and how busy the generator was (``perf/generator_busy_frac``).

    python bench/bench_async.py [--steps 8] [--workers 1,2] [--max-staleness 1] [--cores 0,1]
        [--sections e2e,placement] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _overrides(args, out: str, name: str) -> list[str]:
    stops = list(range(100, 100 + args.stop_ids))
    return [
        f"trainer.output_dir={out}", f"trainer.run_name={name}", f"trainer.total_steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.samples_per_prompt={args.samples}",
        "trainer.warm_start.steps=0", "trainer.eval_every_steps=0", "data.val_files=[]",
        "trainer.export_model=false", "logging.progress=false", "logging.console_every_steps=1000",
        f"generator.max_response_tokens={args.max_tokens}", f"generator.extra_stop_token_ids={stops}",
        "learner.num_mini_batches=2", "learner.micro_batch_size=32", "learner.warmup_steps=0",
    ]


def _step_metrics(out: str, names: list[str]) -> list[dict]:
    """The per-step metrics rows of runs ``names``, each without its first step (one-off warm-up
    costs)."""
    rows = []
    for name in names:
        lines = [json.loads(l) for l in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
        rows += [l for l in lines if l.get("step", 0) >= 1 and "timing/step_s" in l][1:]
    return rows


def _mean(steps: list[dict], key: str) -> float:
    return statistics.mean(l.get(key, 0.0) for l in steps)


def _table(title: str, rows: list[tuple[str, list[float]]], samples: int, G: float, T: float) -> float:
    """Print one table (median wall per row, each run's in brackets); returns the bound
    (G + T) / max(G, T), with G and T the sync runs' mean seconds per step."""
    bound = (G + T) / max(G, T)
    base = statistics.median(rows[0][1])
    print(f"\n{title}")
    print(f"sync step breakdown: generate G = {G:.2f} s, train + weight sync T = {T:.2f} s")
    print(f"{'mode':50s} {'RL wall s':>10s} {'samples/s':>10s} {'speed-up':>9s}  runs (s)")
    for name, walls in rows:
        wall = statistics.median(walls)
        print(f"{name:50s} {wall:10.1f} {samples / wall:10.1f} {base / wall:8.2f}x  "
              + ", ".join(f"{w:.1f}" for w in walls))
    print(f"ideal overlap bound (G + T) / max(G, T) = {bound:.2f}x")
    return bound


def _breakdown(label: str, steps: list[dict], speedup: float, bound: float, G: float, T: float) -> None:
    """One async row's efficiency against the target and where its steps' time went."""
    eff = speedup / bound
    wait, train_s = _mean(steps, "timing/wait_for_data_s"), _mean(steps, "timing/train_s")
    sync_s, step_s = _mean(steps, "timing/weight_sync_s"), _mean(steps, "timing/step_s")
    print(f"{label}: efficiency speed-up / bound = {eff:.2f} (target >= 0.90: {'met' if eff >= 0.9 else 'NOT met'})")
    print(f"  per step {step_s:.2f} s (max(G, T) = {max(G, T):.2f}) = wait for data {wait:.2f} + train {train_s:.2f} "
          f"+ weight sync {sync_s:.2f} + rest {step_s - wait - train_s - sync_s:.2f}; generator busy "
          f"{_mean(steps, 'perf/generator_busy_frac'):.2f}, engine {_mean(steps, 'perf/engine_tokens_per_s'):.0f} "
          f"tokens/s busy, staleness mean "
          f"{_mean(steps, 'staleness/mean'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--stop-ids", type=int, default=10)
    parser.add_argument("--workers", default="1,2", help="comma-separated generator pool sizes to try (e2e)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--cores", default=None,
                        help="A,B: the generator's core and the learner's (placement); default the first two "
                             "this process may use")
    parser.add_argument("--sections", default="e2e,placement", help="comma-separated: e2e, placement")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each row, interleaved (a round runs every row once), so a machine whose load "
                             "changes treats the modes alike; the median wall is printed")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if not set(sections) <= {"e2e", "placement"}:
        parser.error(f"--sections: e2e and/or placement, got {args.sections}")

    from async_rl.config import load_config
    from async_rl.trainer import train

    out = tempfile.mkdtemp(prefix="bench-async-")
    samples = args.steps * args.prompts * args.samples
    async_cfg = ["trainer.mode=async", f"trainer.max_staleness={args.max_staleness}"]
    tables = []  # (section, title, [(label, run name, overrides)]); the first row is the sync baseline
    if "e2e" in sections:
        rows = [("sync", "sync", [])] + [
            (f"async, {w} worker(s), max_staleness {args.max_staleness}", f"async{w}",
             async_cfg + [f"generator.num_workers={w}"]) for w in [int(x) for x in args.workers.split(",")]]
        tables.append(("e2e", "END TO END (sync: all cores per phase; async: cores split by the thread budget)", rows))
    if "placement" in sections:
        cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))[:2]
        if len(cores) != 2:
            raise SystemExit(f"--cores: the placement section needs two cores, got {cores}")
        pinned = [f"generator.cpu_affinity=[{cores[0]}]", f"learner.cpu_affinity=[{cores[1]}]",
                  "generator.threads_per_worker=1", "learner.num_threads=1"]
        rows = [("sync, pinned", "sync_pinned", pinned)] + [
            (f"async, pinned, max_staleness {args.max_staleness}, partial_rollout={mode}", f"async_pinned_{mode}",
             pinned + async_cfg + ["generator.num_workers=1", f"generator.partial_rollout={mode}"])
            for mode in ("keep", "abort")]
        tables.append(("placement", f"SAME PLACEMENT (generator on core {cores[0]}, learner on core {cores[1]}, "
                                    "1 torch thread each, both modes)", rows))

    walls: dict[str, list[float]] = {}
    done: dict[str, list[str]] = {}  # row -> its runs that completed
    for r in range(args.repeats):
        for _, _, rows in tables:
            for _, name, extra in rows:
                try:
                    summary = train(load_config(ROOT / "configs/default.yaml",
                                                _overrides(args, out, f"{name}_{r}") + extra))
                except Exception as e:  # noqa: BLE001 - e.g. Ray's start-up timing out on a loaded machine
                    print(f"run {name}_{r} failed, left out of its row: {type(e).__name__}: {e}")
                    continue
                if "async" in name:
                    assert summary["pipeline/trained"] == args.steps * args.prompts
                walls.setdefault(name, []).append(summary["rl_wall_s"])
                done.setdefault(name, []).append(f"{name}_{r}")

    print(f"\nworkload: {samples} trained samples ({args.steps} steps x {args.prompts} prompts x {args.samples}), "
          f"{args.repeats} run(s) per row; geometric response lengths (mean about {262 // args.stop_ids} tokens), "
          f"cap {args.max_tokens}; run directories under {out}")
    for section, title, rows in tables:
        if any(name not in walls for _, name, _ in rows):
            print(f"\n{title}: a row has no completed run; see the failures above")
            continue
        sync_steps = _step_metrics(out, done[rows[0][1]])
        G = _mean(sync_steps, "timing/generate_s")
        T = _mean(sync_steps, "timing/train_s") + _mean(sync_steps, "timing/weight_sync_s")
        bound = _table(title, [(label, walls[name]) for label, name, _ in rows], samples, G, T)
        if section == "placement":
            base = statistics.median(walls[rows[0][1]])
            print(f"sync engine {_mean(sync_steps, 'perf/engine_tokens_per_s'):.0f} tokens/s while generating")
            for label, name, _ in rows[1:]:
                _breakdown(label, _step_metrics(out, done[name]), base / statistics.median(walls[name]), bound, G, T)


if __name__ == "__main__":
    main()
