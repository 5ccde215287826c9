"""Megatron learner tokens/s on the built-in MoE model, per layout, side by side in one run.

Layouts: ``EP1`` (one rank), ``EP2`` (two ranks, experts split 4 + 4, data parallel 2) and ``TP2``
(two ranks, every weight split in two, experts included), each on ``builtin:tiny-qwen3-moe``
(fp32, CPU/gloo, one torch thread per rank). Each layout trains ``--steps`` GRPO steps on the same
fixed batch (``--rows`` trajectories of ``--length`` tokens, 2 mini-batches, micro-batch 4) after
one warm-up step; tokens/s = real (unpadded) tokens of the batch x steps / wall seconds of the
timed steps (the proximal pass included, as ``learner.prepare`` + ``train_step`` run in a job).

    python bench/bench_moe_learner.py --steps 3

Prints one line per layout: ``layout  ranks  tokens/s  s/step``. Ranks share the machine's cores:
on 2 cores the two-rank layouts measure communication and per-rank overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAYOUTS = {"EP1": (1, 1, 1), "EP2": (2, 1, 2), "TP2": (2, 2, 1)}  # name -> (ranks, tp, ep)


def _batch(rows: int, length: int):
    """A fixed GRPO batch of ``rows`` trajectories, ``length`` tokens each (prompt 8)."""
    import random

    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(0)
    trajs = []
    for k in range(rows):
        resp = [rng.randint(10, 250) for _ in range(length - 8)]
        trajs.append(Trajectory(trajectory_id=f"{k}/0", group_id=k, prompt_uid=f"p{k}",
                                prompt_ids=[rng.randint(10, 250) for _ in range(8)], response_ids=resp,
                                behavior_logprobs=[-5.0] * len(resp), loss_mask=[1] * len(resp), finish_reason="stop",
                                policy_version=[0] * len(resp), reward=0.0))
    batch = collate(trajs, pad_token_id=0)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.loss_mask
    return batch


def _rank(rank: int, world: int, init: str, out: str, tp: int, ep: int, steps: int, rows: int, length: int) -> None:
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.data.builtin import resolve
    from async_rl.learners.base import LearnerConfig, MegatronConfig
    from async_rl.learners.launch import exit_rank_process
    from async_rl.learners.megatron import MegatronLearner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    megatron = MegatronConfig(tensor_parallel_size=tp, expert_parallel_size=ep)
    cfg = LearnerConfig(backend="megatron", micro_batch_size=4, num_mini_batches=2, megatron=megatron,
                        world_size=world)
    algo = AlgorithmConfig(name="grpo").apply_preset()
    learner = MegatronLearner(cfg, algo, resolve("builtin:tiny-qwen3-moe"), temperature=1.0,
                              total_optimizer_steps=2 * (steps + 1))
    batch = _batch(rows, length)
    learner.prepare(batch)
    learner.train_step(batch)  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        learner.prepare(batch)
        learner.train_step(batch)
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        torch.save({"seconds": seconds, "tokens": int(batch.attention_mask.sum()) * steps}, out)
    dist.destroy_process_group()
    exit_rank_process(0)


def run_layout(name: str, steps: int, rows: int, length: int) -> dict:
    """Spawn one layout's ranks; ``{"seconds", "tokens"}`` of its timed steps.

    Raises:
        RuntimeError: a rank exited with a non-zero code.
    """
    world, tp, ep = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "init"), out, tp, ep, steps, rows, length))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"layout {name}: rank exit codes {[p.exitcode for p in procs]}")
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per layout (after 1 warm-up)")
    parser.add_argument("--rows", type=int, default=16, help="trajectories per batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per trajectory (prompt 8)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {list(LAYOUTS)}")
    args = parser.parse_args()
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {list(LAYOUTS)}")
    print(f"{'layout':8}{'ranks':>6}{'tokens/s':>12}{'s/step':>10}")
    for name in names:
        res = run_layout(name, args.steps, args.rows, args.length)
        print(f"{name:8}{LAYOUTS[name][0]:>6}{res['tokens'] / res['seconds']:>12.0f}{res['seconds'] / args.steps:>10.2f}",
              flush=True)


if __name__ == "__main__":
    main()
