"""Step time of the default job alone and beside one busy process on the same cores.

Runs ``async-rl train --config configs/default.yaml`` for a few steps (no warm start, no
evaluation) through the real CLI, once with the cores to itself and once beside one busy
process that this script starts and kills: ``spin`` (``python3 -c 'while True: pass'``, one
busy thread) or ``torch`` (a torch process doing 256x256 matmuls with its default threads).
Trials alternate alone / busy, per variant, ``--reps`` times, so a machine whose other load
drifts affects both sides alike. Each trial's step time is the median of ``timing/step_s`` over
its steps after the first (the first pays for lazy initialisation); the figure printed is the
median over trials, with the slowdown ``busy / alone`` and the target (``<= 2.5x``: one busy
process on 2 cores leaves the job half the CPU, so about 2x, plus some room).

Variants (``--variants``, comma-separated):

* ``new``: the defaults as shipped: the CLI sets a short OpenMP spin (``GOMP_SPINCOUNT``) and
  the sync loop's ``SharedCoreGovernor`` picks the thread count from the cores' load
  (``async_rl.utils.cpu_threads``).
* ``old``: the behaviour before issue 20: ``GOMP_SPINCOUNT=300000``, libgomp's own spin count when
  ``OMP_WAIT_POLICY`` is unset; the CLI leaves the wait to a user who set that variable, so this
  is exactly OpenMP's default wait. (The default job's thread counts did not change: one process,
  affinity = all cores.)
* ``KEY=VAL+KEY=VAL``: ``new`` with these environment variables set in the job, e.g.
  ``OMP_WAIT_POLICY=ACTIVE`` or ``OMP_NUM_THREADS=1``; a dotted key is a config override, e.g.
  ``OMP_WAIT_POLICY=PASSIVE+learner.num_threads=2`` (the defaults before the shared-core
  governor: passive wait, two threads whatever the load; a thread count the user chose turns
  the governor off).

``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``, ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` are removed
from the job's environment (thread defaults are what is measured) unless a variant sets them.

    ASYNC_RL_CACHE=... python bench/bench_shared_cores.py [--steps 5] [--reps 3] [--busy spin,torch]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 2.5
"""Largest acceptable slowdown beside one busy process (about 2x expected on 2 cores)."""
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
BUSY = {
    "spin": "while True: pass",
    "torch": "import torch\na = torch.randn(256, 256)\nwhile True: a @ a",
}


def variant_setup(name: str) -> tuple[list[str], dict[str, str]]:
    """The config overrides and environment variables of a variant name (see the module docstring):
    in ``KEY=VAL+KEY=VAL`` a dotted key (``learner.num_threads``) is a config override, any other
    an environment variable.

    Raises:
        ValueError: a name that is neither ``new``, ``old`` nor ``KEY=VAL+...``.
    """
    if name == "new":
        return [], {}
    if name == "old":
        return [], {"GOMP_SPINCOUNT": "300000"}
    pairs = [p.split("=", 1) for p in name.split("+")]
    if not all(len(p) == 2 and p[0] for p in pairs):
        raise ValueError(f"--variants: {name!r} is not new, old or KEY=VAL+KEY=VAL")
    return [f"{k}={v}" for k, v in pairs if "." in k], {k: v for k, v in pairs if "." not in k}


def run_job(steps: int, overrides: list[str], env_extra: dict[str, str], out: Path) -> tuple[list[float], float, str]:
    """One run of the default job; returns ``timing/step_s`` of steps 2..steps (s) and the CPU
    time (user + system, s) the job's process used per second of its wall time: about 2 on 2
    cores for a job whose waiting threads spin, lower when they sleep.

    Raises:
        RuntimeError: the job exited non-zero (its last output lines are in the message).
    """
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", str(ROOT / "configs/default.yaml"),
           f"trainer.total_steps={steps}", "trainer.eval_every_steps=0", "trainer.warm_start.steps=0",
           f"trainer.output_dir={out}", "trainer.run_name=bench", "trainer.checkpoint.save_at_exit=false",
           "trainer.export_model=false", *overrides]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode:
        raise RuntimeError(f"job failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if "timing/step_s" in r and r["step"] >= 2]
    # The sync loop's SharedCoreGovernor logs the threads it chose per step (absent: none chosen).
    threads = " ".join(str(int(r["perf/torch_threads"])) for r in timed if "perf/torch_threads" in r)
    return [r["timing/step_s"] for r in timed], cpu / wall, threads


def trial(steps: int, variant: str, busy: str | None) -> tuple[float, float, str]:
    """Median step time (s) of one job run, beside a fresh ``busy`` process when given, the
    job's CPU time per wall second and the governor's thread counts per step (``run_job``)."""
    overrides, env_extra = variant_setup(variant)
    proc = None
    if busy is not None:
        busy_env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
        proc = subprocess.Popen([sys.executable, "-c", BUSY[busy]], env=busy_env)
        time.sleep(2.0 if busy == "torch" else 0.2)  # torch's import, so the job starts beside a busy process
    try:
        with tempfile.TemporaryDirectory(prefix="bench_shared_cores_") as tmp:
            step_s, cpu_per_s, threads = run_job(steps, overrides, env_extra, Path(tmp))
            return statistics.median(step_s), cpu_per_s, threads
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A SIGTERM ends the bench through its finally blocks, which kill the busy process it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser.add_argument("--steps", type=int, default=5, help="training steps per job (>= 2; step 1 is not timed)")
    parser.add_argument("--reps", type=int, default=3, help="alone/busy pairs per variant and busy kind")
    parser.add_argument("--busy", default="spin,torch", help="busy processes to try: spin, torch")
    parser.add_argument("--variants", default="old,new", help="old, new or KEY=VAL+KEY=VAL, comma-separated")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is not timed)")
    busies, variants = args.busy.split(","), args.variants.split(",")
    for b in busies:
        if b not in BUSY:
            parser.error(f"--busy: {b!r} is not one of {sorted(BUSY)}")
    for v in variants:
        variant_setup(v)
    print(f"cores (affinity): {len(os.sched_getaffinity(0))}; steps per job: {args.steps}; reps: {args.reps}")
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.reps):
        for busy in busies:
            for variant in variants:
                for kind in ("alone", busy):
                    t, cpu_per_s, threads = trial(args.steps, variant, None if kind == "alone" else busy)
                    times.setdefault((variant, f"{busy}:{kind}"), []).append(t)
                    print(f"  rep {rep + 1} {variant:>12} {busy:>5} {kind:>5}: {t:7.2f} s/step  "
                          f"(job CPU {cpu_per_s:4.2f} s per wall s{'; threads ' + threads if threads else ''})",
                          flush=True)
    print(f"\n{'variant':>24} {'busy':>6} {'alone s':>8} {'busy s':>8} {'ratio':>6}  target <= {TARGET}x")
    for variant in variants:
        for busy in busies:
            alone = statistics.median(times[(variant, f'{busy}:alone')])
            loaded = statistics.median(times[(variant, f'{busy}:{busy}')])
            ratio = loaded / alone
            print(f"{variant:>24} {busy:>6} {alone:8.2f} {loaded:8.2f} {ratio:5.1f}x  "
                  f"{'ok' if ratio <= TARGET else 'OVER'}")


if __name__ == "__main__":
    main()
