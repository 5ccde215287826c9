"""An async run whose generator actors are killed while it trains: does it finish, lose nothing,
and learn as much as an undisturbed run?

Runs ``async-rl train`` (any config and overrides; the default job unless told otherwise) as a
child process, and each time the run reaches one of ``--kill-at`` steps (read from its
``metrics.jsonl``) sends SIGKILL to one generator actor, taking the actors in turn (their
process ids come from the run's ``placement.json``, which the run rewrites after each
replacement). At the end it prints the run's ledger (``pipeline/*``: dispatched, trained,
abandoned, re-issued, restarts, what was left in flight), whether it adds up, and the held-out
gain in points (final eval, and the mean of the last quarter's evals) to set beside undisturbed
runs of the same job.

    python bench/chaos_run.py --out /tmp/chaos [--kill-at 75,150,225] [-- dotted.key=value ...]

Exit status: the run's, or 1 if a kill found no actor or the ledger does not add up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# pipeline/* summary entries that are not destinations of a dispatched group.
# ``unstarted_or_in_engine_at_exit`` is what the others leave unexplained: a lost group, unless 0.
NOT_IN_SUM = {"pipeline/dispatched", "pipeline/trained", "pipeline/dropped_duplicate_samples",
              "pipeline/malformed_messages", "pipeline/reissued", "pipeline/generator_restarts",
              "pipeline/unstarted_or_in_engine_at_exit"}


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line being written
    return -1


def _actor_pid(run_dir: Path, index: int) -> int | None:
    try:
        placement = json.loads((run_dir / "placement.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    generators = placement.get("actors", {}).get("generators", [])
    return int(generators[index]["pid"]) if index < len(generators) and "pid" in generators[index] else None


def main() -> int:
    """Run the job, kill actors at the given steps, print the ledger and the gain (see module doc)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="trainer.output_dir of the run")
    ap.add_argument("--name", default="chaos", help="trainer.run_name")
    ap.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    ap.add_argument("--kill-at", default="75,150,225", help="steps at which to kill an actor, comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="generator.num_workers (actors killed in turn)")
    ap.add_argument("overrides", nargs="*", help="more dotted.key=value overrides (after --)")
    args = ap.parse_args()
    kill_at = sorted(int(s) for s in args.kill_at.split(",") if s)
    run_dir = Path(args.out) / args.name
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", args.config, "trainer.mode=async",
           f"generator.num_workers={args.workers}", f"trainer.output_dir={args.out}", f"trainer.run_name={args.name}",
           "weight_sync.probe_at_exit=true", *args.overrides]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    child = subprocess.Popen(cmd)
    kills, failed = [], False
    while child.poll() is None:
        time.sleep(0.2)
        if len(kills) < len(kill_at) and _last_step(run_dir) >= kill_at[len(kills)]:
            index = len(kills) % args.workers
            pid = _actor_pid(run_dir, index)
            try:
                os.kill(pid, signal.SIGKILL) if pid else None
            except ProcessLookupError:
                pid = None
            print(f"[chaos] step {_last_step(run_dir)}: SIGKILL actor {index} (pid {pid})", flush=True)
            kills.append((kill_at[len(kills)], index, pid))
            failed |= pid is None
    wall = time.monotonic() - t0
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        print(f"no summary.json: the run exited with {child.returncode}")
        return child.returncode or 1
    ledger = {k: v for k, v in summary.items() if k.startswith("pipeline/")}
    destinations = sum(v for k, v in ledger.items() if k not in NOT_IN_SUM)
    adds_up = ledger.get("pipeline/dispatched") == ledger.get("pipeline/trained", 0) + destinations
    print(f"\nkills: {len(kills)} ({', '.join(f'step {s} actor {i} pid {p}' for s, i, p in kills)})")
    print("ledger:", ", ".join(f"{k.split('/', 1)[1]} {v}" for k, v in ledger.items()))
    print(f"ledger adds up (dispatched = trained + every other counted end): {adds_up}; "
          f"unaccounted: {ledger.get('pipeline/unstarted_or_in_engine_at_exit')}")
    print(f"per actor: " + ", ".join(f"{i}: {summary.get(f'generator_{i}/trained_samples')} trained samples, "
                                     f"{summary.get(f'generator_{i}/restarts')} restarts" for i in range(args.workers)))
    print(f"engine probe after the run: {summary.get('weight_sync/probe_token_mismatches')} token mismatches, "
          f"max |logprob diff| {summary.get('weight_sync/probe_max_abs_logprob_diff')}")
    print(f"held-out gain: {summary.get('eval_gain_points', float('nan')):+.2f} points final, "
          f"{summary.get('eval_tail_gain_points', float('nan')):+.2f} last-quarter mean "
          f"(step 0 {summary.get('eval_step_0')}); run {wall:.0f} s")
    return child.returncode or (1 if failed or not adds_up else 0)


if __name__ == "__main__":
    sys.exit(main())
