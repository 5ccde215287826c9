"""Megatron learner against FSDP2 learner throughput, side by side in one run, on the same cores,
model and batch: one training step (``prepare``'s proximal pass plus ``train_step``) per
measurement, in tokens per second.

    python bench/bench_megatron.py            # ~4 min on 2 cores
    python bench/bench_megatron.py --quick

Layouts, each a set of spawned gloo ranks sharing the machine's cores (threads per rank = cores /
ranks, as the launcher gives them):

* one rank: FSDP2 vs Megatron (TP=1) with all cores;
* two ranks: FSDP2 (data parallel 2) vs Megatron data parallel 2, tensor parallel 2, and two
  pipeline stages.

Rounds alternate the layouts (A B C ... A B C ...) so a load that comes and goes touches each;
each layout's figure is its best step over the rounds after one warm-up step per process.
Tokens/s counts the batch's real (non-padding) tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {  # name -> (ranks, backend, tensor parallel, pipeline parallel)
    "fsdp2, 1 rank": (1, "fsdp2", 1, 1),
    "megatron TP=1, 1 rank": (1, "megatron", 1, 1),
    "fsdp2, 2 ranks (DP=2)": (2, "fsdp2", 1, 1),
    "megatron DP=2": (2, "megatron", 1, 1),
    "megatron TP=2": (2, "megatron", 2, 1),
    "megatron PP=2": (2, "megatron", 1, 2),
}


def _rank(rank: int, world: int, init: str, model: str, layout: tuple, n: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from bench_learner import make_batch

    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import LearnerConfig, MegatronConfig
    from async_rl.learners.launch import exit_rank_process, learner_class

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    _, backend, tp, pp = layout
    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=512).apply_preset()
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=8, max_tokens_per_micro_batch=1024, backend=backend,
                        world_size=world, megatron=MegatronConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    learner = learner_class(cfg)(cfg, algo, model, temperature=1.0, total_optimizer_steps=steps + 2)
    batch = make_batch(n)
    times = []
    for step in range(steps + 1):  # the first step warms up
        b = batch.select(slice(0, len(batch)))
        dist.barrier()
        t0 = time.perf_counter()
        learner.prepare(b)
        learner.train_step(b)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        torch.save({"seconds": min(times), "tokens": int(batch.attention_mask.sum())}, out)
    dist.destroy_process_group()
    exit_rank_process(0)


def run_layout(model: str, layout: tuple, n: int, steps: int, scratch: str) -> dict:
    world = layout[0]
    init = tempfile.mktemp(dir=scratch)
    out = tempfile.mktemp(dir=scratch)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, init, model, layout, n, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"layout {layout}: a rank exited with {p.exitcode}")
    return torch.load(out)


def main() -> None:
    from bench_learner import make_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per process (after one warm-up)")
    args = ap.parse_args()
    hidden, layers, n = (128, 2, 32) if args.quick else (256, 4, 64)
    with tempfile.TemporaryDirectory() as d:
        make_model(d, hidden, layers)
        best: dict[str, float] = {}
        tokens = 0
        for _ in range(args.rounds):
            for name, layout in LAYOUTS.items():
                res = run_layout(d, layout, n, args.steps, d)
                best[name] = min(best.get(name, float("inf")), res["seconds"])
                tokens = res["tokens"]
        print(f"model: Qwen2 hidden {hidden} x {layers} layers (tied embeddings); batch {n} sequences, "
              f"{tokens} real tokens; {os.cpu_count()} cores; best of {args.rounds} rounds x {args.steps} steps")
        print(f"{'layout':26s} {'step s':>8s} {'tokens/s':>10s} {'vs fsdp2':>9s}")
        for name, seconds in best.items():
            ref = best["fsdp2, 1 rank" if LAYOUTS[name][0] == 1 else "fsdp2, 2 ranks (DP=2)"]
            print(f"{name:26s} {seconds:8.3f} {tokens / seconds:10.0f} {ref / seconds:9.2f}")


if __name__ == "__main__":
    main()
