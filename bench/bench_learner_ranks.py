"""The FSDP2 learner on 1 rank vs N gloo ranks, side by side in one run, on the same batch and
the same total core count: training-step tokens/s, and per-rank memory of what FSDP2 shards
(parameters, gradients, AdamW state).

    python bench/bench_learner_ranks.py            # ~2 min on 2 cores
    python bench/bench_learner_ranks.py --quick

On a machine with C cores, 1 rank runs C torch threads and each of N ranks C/N threads, so the
ratio shows the cost of the collectives (all-gathers, reduce-scatters, all-reduces over gloo) on
top of the same compute, and the memory column the 1/N sharding that lets a model N times larger
train. Tokens/s counts real (non-padding) tokens per second of ``prepare`` + ``train_step``.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _rank(rank: int, world: int, init: str, model: str, n: int, reps: int, threads: int, out: str) -> None:
    import torch.distributed as dist

    from async_rl.algorithms.config import AlgorithmConfig
    from bench_learner import make_batch
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner
    from async_rl.learners.launch import exit_rank_process

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=512).apply_preset()
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=8, max_tokens_per_micro_batch=1024)
    learner = FSDPLearner(cfg, algo, model, temperature=1.0, total_optimizer_steps=reps + 1)
    batch = make_batch(n)
    times = []
    for rep in range(reps + 1):  # the first step warms up (and creates the AdamW state)
        b = batch.select(slice(0, len(batch)))
        dist.barrier()
        t0 = time.perf_counter()
        learner.prepare(b)
        learner.train_step(b)
        dist.barrier()
        if rep:
            times.append(time.perf_counter() - t0)

    def local_bytes(tensors) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in tensors)

    params = list(learner.model.parameters())
    state = [v for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    if rank == 0:
        torch.save({"step_s": min(times), "param_bytes": local_bytes(params), "adam_bytes": local_bytes(state),
                    "real_tokens": int(batch.attention_mask.sum())}, out)
    dist.destroy_process_group()
    exit_rank_process(0)


def run(world: int, model: str, n: int, reps: int, cores: int, tmp: str) -> dict:
    init, out = os.path.join(tmp, f"init-{world}"), os.path.join(tmp, f"out-{world}.pt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, init, model, n, reps, max(1, cores // world), out))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"rank exited with {p.exitcode}")
    return torch.load(out)


def main() -> None:
    from bench_learner import make_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    hidden, layers, n = (128, 2, 32) if args.quick else (256, 4, 64)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "model")
        make_model(model, hidden, layers)
        rows = {w: run(w, model, n, args.reps, cores, d) for w in args.ranks}
    base = rows[args.ranks[0]]
    print(f"model: Qwen2 hidden {hidden} x {layers} layers; batch {n} sequences, {base['real_tokens']} real tokens; "
          f"{cores} cores shared by the ranks; best of {args.reps} steps after a warm-up")
    print(f"{'ranks':>5s} {'threads/rank':>12s} {'step s':>8s} {'tokens/s':>9s} {'x 1 rank':>8s} "
          f"{'params MB/rank':>14s} {'AdamW MB/rank':>13s} {'memory x 1 rank':>15s}")
    for w, r in rows.items():
        mem = (r["param_bytes"] + r["adam_bytes"]) / (base["param_bytes"] + base["adam_bytes"])
        print(f"{w:5d} {max(1, cores // w):12d} {r['step_s']:8.3f} {r['real_tokens'] / r['step_s']:9.0f} "
              f"{base['step_s'] / r['step_s']:8.2f} {r['param_bytes'] / 2**20:14.2f} {r['adam_bytes'] / 2**20:13.2f} "
              f"{mem:15.2f}")


if __name__ == "__main__":
    main()
