"""Learner throughput, side by side in one run: our FSDP2 learner's training step against a plain
Hugging Face forward/backward loop on the same data, and padded micro-batches (a fixed number of
sequences, padded to the batch's longest) against token-budget micro-batches (padding beyond each
micro-batch's longest sequence removed) and packed micro-batches (``learner.packing``: one row of
real tokens per micro-batch, no padding at all; sdpa with a block-diagonal mask on CPU) on
long-tailed response lengths.

    python bench/bench_learner.py            # ~2 min on 2 cores
    python bench/bench_learner.py --quick

Tokens/s counts real (non-padding) tokens of the batch per second of training step. The plain
loop is the floor of what any learner must do (one forward, one backward, one AdamW step per
micro-batch group, no proximal pass, no loss masking); ours also recomputes the proximal
log-probs (one extra no-grad forward) unless bypassed, which the table shows separately.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch


def make_model(path: str, hidden: int, layers: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                      max_position_embeddings=2048, tie_word_embeddings=True)
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def make_batch(n: int, seed: int = 0):
    """``n`` trajectories with long-tailed response lengths (most short, a few long)."""
    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(seed)
    trajs = []
    for k in range(n):
        length = min(480, int(rng.paretovariate(1.2) * 24))
        resp = [rng.randint(10, 1000) for _ in range(length)]
        trajs.append(Trajectory(trajectory_id=f"{k}/0", group_id=k, prompt_uid=f"p{k}", prompt_ids=[1, 2, 3, 4],
                                response_ids=resp, behavior_logprobs=[-6.9] * length, loss_mask=[1] * length,
                                finish_reason="stop", policy_version=[0] * length, reward=0.0))
    batch = collate(trajs, pad_token_id=0)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(seed)) * batch.loss_mask
    return batch


def plain_loop(path: str, batch, micro: int) -> float:
    """Seconds of one step of a plain HF loop: micro-batches of ``micro`` padded sequences,
    a token-mean NLL-like surrogate, backward, one AdamW step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    t0 = time.perf_counter()
    for s in range(0, len(batch), micro):
        mb = batch.select(slice(s, s + micro))
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids).logits[:, :-1]
        lp = torch.log_softmax(logits.float(), -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        (-(lp * mb.advantages).sum() / batch.loss_mask.sum()).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def learner_step(path: str, batch, micro: int, max_tokens: int, bypass: bool, packing: bool = False,
                 ) -> tuple[float, float]:
    """``(prepare seconds, train_step seconds)`` of our learner on ``batch``."""
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", bypass_proximal=bypass, loss_horizon_tokens=512).apply_preset()
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=micro, max_tokens_per_micro_batch=max_tokens, packing=packing)
    learner = FSDPLearner(cfg, algo, path, temperature=1.0, total_optimizer_steps=10)
    b = batch.select(slice(0, len(batch)))
    t0 = time.perf_counter()
    learner.prepare(b)
    t1 = time.perf_counter()
    learner.train_step(b)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    hidden, layers, n = (128, 2, 32) if args.quick else (256, 4, 64)
    micro = 8
    budget = 1024
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as d:
        make_model(d, hidden, layers)
        batch = make_batch(n)
        real = int(batch.attention_mask.sum())
        padded = batch.input_ids.numel()
        lengths = batch.attention_mask.sum(1)
        print(f"model: Qwen2 hidden {hidden} x {layers} layers; batch {n} sequences, {real} real tokens, "
              f"{padded} padded slots (lengths: median {int(lengths.median())}, max {int(lengths.max())})")
        rows = {}
        for rep in range(args.reps + 1):  # the first round warms up, not counted
            res = {
                "plain HF loop, padded micro-batches": (0.0, plain_loop(d, batch, micro)),
                "learner, padded micro-batches (bypass)": learner_step(d, batch, micro, 0, True),
                "learner, token budget (bypass)": learner_step(d, batch, micro, budget, True),
                "learner, token budget, packed (bypass)": learner_step(d, batch, micro, budget, True, True),
                "learner, token budget + proximal pass": learner_step(d, batch, micro, budget, False),
                "learner, packed + proximal pass": learner_step(d, batch, micro, budget, False, True),
            }
            if rep:
                for k, v in res.items():
                    rows.setdefault(k, []).append(v)
        base = min(t for _, t in rows["plain HF loop, padded micro-batches"])
        print(f"{'':42s} {'prepare s':>10s} {'train s':>9s} {'tokens/s':>10s} {'x plain':>8s}")
        for k, v in rows.items():
            prep, train = min(v, key=lambda x: x[0] + x[1])
            total = prep + train
            print(f"{k:42s} {prep:10.3f} {train:9.3f} {real / total:10.0f} {base / total:8.2f}")
        print(f"token budget {budget} tokens per micro-batch vs {micro} padded sequences per micro-batch; "
              f"best of {args.reps} after a warm-up; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
