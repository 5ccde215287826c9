"""Async vs sync speed-up on a long-tailed response-length workload, side by side in one run.

Both modes train the same number of samples (steps x prompts x samples per prompt) with the real
pipeline (``async_rl.trainer.train``): the HF generator, the FSDP2 learner, and in async mode
the Ray generator pool, the ZMQ transport and the replay buffer. The workload: the built-in tiny
model at its random initialisation samples nearly uniformly over its 262-token vocabulary, and
``--stop-ids`` of those tokens end a response, so lengths are geometric (mean about 262 /
stop-ids tokens, capped at ``--max-tokens``): most responses are short and a few are many times
longer, the long tail that makes a sync step wait for its slowest sample.

Printed: wall-clock seconds of the RL phase in each mode, the speed-up sync / async, and the
ideal overlap bound (G + T) / max(G, T) from the sync run's mean generation time G and training
time T per step: what perfect overlap on separate hardware would give. On a 2-core machine
generation and training share the cores, so the measured figure is expected below the bound.

    python bench/bench_async.py [--steps 8] [--workers 1,2] [--max-staleness 1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--stop-ids", type=int, default=10)
    parser.add_argument("--workers", default="1,2", help="comma-separated generator pool sizes to try")
    parser.add_argument("--max-staleness", type=int, default=1)
    args = parser.parse_args()

    from async_rl.config import load_config
    from async_rl.trainer import train

    out = tempfile.mkdtemp(prefix="bench-async-")
    rows = []
    sync = train(load_config(ROOT / "configs/default.yaml", _overrides(args, out, "sync")))
    lines = [json.loads(l) for l in (Path(out) / "sync" / "metrics.jsonl").read_text().splitlines()]
    steps = [l for l in lines if l["step"] >= 1][1:]  # the first step pays one-off warm-up costs
    G = statistics.mean(l["timing/generate_s"] for l in steps)
    T = statistics.mean(l["timing/train_s"] + l["timing/weight_sync_s"] for l in steps)
    lengths = [l["rollout/response_length_mean"] for l in steps]
    rows.append(("sync", sync["rl_wall_s"]))
    for w in [int(x) for x in args.workers.split(",")]:
        summary = train(load_config(ROOT / "configs/default.yaml", _overrides(args, out, f"async{w}") + [
            "trainer.mode=async", f"trainer.max_staleness={args.max_staleness}", f"generator.num_workers={w}"]))
        assert summary["pipeline/trained"] == args.steps * args.prompts
        rows.append((f"async, {w} worker(s), max_staleness {args.max_staleness}", summary["rl_wall_s"]))
    samples = args.steps * args.prompts * args.samples
    print(f"\nworkload: {samples} trained samples ({args.steps} steps x {args.prompts} prompts x {args.samples}); "
          f"response length mean {statistics.mean(lengths):.1f} tokens per step-mean, cap {args.max_tokens}")
    print(f"sync step breakdown: generate G = {G:.2f} s, train + weight sync T = {T:.2f} s")
    print(f"{'mode':45s} {'RL wall s':>10s} {'samples/s':>10s} {'speed-up':>9s}")
    for name, wall in rows:
        print(f"{name:45s} {wall:10.1f} {samples / wall:10.1f} {rows[0][1] / wall:8.2f}x")
    print(f"ideal overlap bound (G + T) / max(G, T) = {(G + T) / max(G, T):.2f}x")


if __name__ == "__main__":
    main()
