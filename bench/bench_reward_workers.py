"""Per-sample cost of scoring in reward worker processes vs in-process, built-in arithmetic reward.

Scores ``--samples`` responses of the arithmetic task the way ``sample_groups`` does (``submit``
each, then ``drain``) with ``reward.num_workers=0`` (in-process, on the calling thread) and with
``--workers`` processes, and prints samples per second and microseconds per sample of each, plus
the first call's latency with workers (their start). The function itself takes about a
microsecond, so the figure is the pool's own overhead: two pickles, a pipe round trip, a thread
hand-off.

    python bench/bench_reward_workers.py [--samples 20000] [--workers 1]
"""

from __future__ import annotations

import argparse
import time

from async_rl.rewards.config import RewardConfig
from async_rl.step.rollout import make_scorer


def _rate(scorer, samples: list[tuple]) -> float:
    """Samples scored per second, submitting all and then draining."""
    t0 = time.perf_counter()
    for args in samples:
        scorer.submit(*args, done=lambda result: None)
    scorer.drain()
    return len(samples) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    samples = [("async_rl/arithmetic", f" {i % 97}<|im_end|>", str(i % 89), None) for i in range(args.samples)]

    in_process = make_scorer(RewardConfig(fn="arithmetic", num_workers=0), "zero")
    pooled = make_scorer(RewardConfig(fn="arithmetic", num_workers=args.workers), "zero")
    try:
        t0 = time.perf_counter()
        pooled.score(*samples[0])
        first_s = time.perf_counter() - t0
        local, pool = _rate(in_process, samples), _rate(pooled, samples)
    finally:
        pooled.close()
    print(f"in-process:            {local:12,.0f} samples/s  ({1e6 / local:8.1f} us/sample)")
    print(f"{args.workers} worker process(es): {pool:12,.0f} samples/s  ({1e6 / pool:8.1f} us/sample)")
    print(f"overhead per sample: {1e6 / pool - 1e6 / local:.1f} us; first call (worker start): {first_s:.2f} s")


if __name__ == "__main__":
    main()
