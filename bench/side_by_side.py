"""Two or more roads timed side by side: interleaved runs and a table of their ratios.

Every road runs once as a warm-up, then ``reps`` times interleaved (the order alternating, so a
machine whose load drifts moves every road alike). A run returns ``(count, extra)``: the units it
produced (samples, tokens) and a number of its own (a mean reward, a length). The table gives
each road's median units per wall second and per CPU second (this process and its descendants),
their ratio to the first road, the mean of ``extra``, and PASS or MISS against a target ratio.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import _cpu_s  # noqa: E402 (CPU seconds of this process and its descendants)


def default_job_parser(description: str, tokens: int, reps: int):
    """The arguments both benches of the default job's batch take: ``--backend``, ``--prompts``,
    ``--n``, ``--tokens`` (default ``tokens``), ``--reps`` (default ``reps``), ``--model``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=tokens, help="max tokens per response")
    parser.add_argument("--reps", type=int, default=reps, help="timed runs per row (median reported)")
    parser.add_argument("--model", default=None,
                        help="policy: a directory or a built-in (builtin:small-qwen2); default the job's model.path, untrained")
    return parser


def interleaved(names: list[str], run: Callable[[str], tuple[float, float]], reps: int,
                note: Callable[[str], str] = lambda name: "") -> dict[str, list[tuple[float, float, float]]]:
    """``{road: [(count, extra, (wall_s, cpu_s))...]}`` of ``reps`` interleaved runs after one
    warm-up each; each run is printed as it ends (``note(road)`` appended)."""
    for name in names:
        run(name)
    out: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            c0, t0 = _cpu_s(), time.perf_counter()
            count, extra = run(name)
            dt, dc = time.perf_counter() - t0, _cpu_s() - c0
            out[name].append((count, extra, dt, dc))
            print(f"  {name:30s} {count / dt:9.1f} /s {count / dc:9.1f} /CPU-s ({count:.0f} in {dt:.2f} s{note(name)})",
                  flush=True)
    return out


def ratio_table(runs: dict[str, list[tuple[float, float, float, float]]], unit: str, extra: str, target: float,
                header: str) -> None:
    """Print ``header`` (with the load average), then per road its median ``unit`` per second and
    per CPU second, both as ratios to the first road, the mean ``extra``, and the verdict."""
    print(f"{header}; load average {os.getloadavg()[0]:.2f}")
    names = list(runs)
    wall = {n: statistics.median(c / dt for c, _, dt, _ in runs[n]) for n in names}
    cpu = {n: statistics.median(c / dc for c, _, _, dc in runs[n]) for n in names}
    print(f"{'road':30s} {unit + '/s':>12s} {'ratio':>6s} {unit + '/CPU-s':>14s} {'ratio':>6s} {extra:>14s}")
    for n in names:
        w, c = wall[n] / wall[names[0]], cpu[n] / cpu[names[0]]
        verdict = "" if n == names[0] else (f"  >= {target}: wall {'PASS' if w >= target else 'MISS'}, "
                                           f"CPU {'PASS' if c >= target else 'MISS'}")
        print(f"{n:30s} {wall[n]:12.1f} {w:6.3f} {cpu[n]:14.1f} {c:6.3f} "
              f"{statistics.fmean(e for _, e, _, _ in runs[n]):14.3f}{verdict}")
