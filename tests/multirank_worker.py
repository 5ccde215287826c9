"""One learner rank of the multi-rank tests (run in a spawned process; see test_learner_multirank)."""

from __future__ import annotations

import random


def make_batch(seed: int = 0):
    """A fixed batch of 11 variable-length trajectories with advantages (the same on every rank)."""
    import torch

    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(seed)
    trajs = []
    for k in range(11):
        n = rng.randint(1, 9)
        resp = [rng.randint(10, 200) for _ in range(n)]
        trajs.append(Trajectory(trajectory_id=f"{k}/0", group_id=k, prompt_uid=f"p{k}",
                                prompt_ids=[rng.randint(10, 200) for _ in range(rng.randint(2, 6))],
                                response_ids=resp, behavior_logprobs=[-rng.uniform(3, 6) for _ in resp],
                                loss_mask=[1] * n, finish_reason="stop", policy_version=[0] * n, reward=0.0))
    batch = collate(trajs, pad_token_id=0)
    g = torch.Generator().manual_seed(seed)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def run(rank: int, world: int, init_file: str, model_path: str, agg_mode: str, out: str,
        max_tokens: int = 0, critic: bool = False, packing: bool = False, sft: bool = False,
        backend: str = "fsdp2", tp: int = 1, pp: int = 1, temperature: float = 1.0, reload: bool = False) -> None:
    """Train one step on ``make_batch()`` and write loss and full weights to ``out`` (rank 0);
    ``backend="megatron"`` with tensor- and pipeline-parallel sizes ``tp``, ``pp`` runs the Megatron
    learner instead; ``reload``: the weights written are those of a fresh learner that loaded the
    checkpoint saved after the step."""
    import torch
    import torch.distributed as dist

    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import LearnerConfig, MegatronConfig
    from async_rl.learners.launch import exit_rank_process, learner_class

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    algo = AlgorithmConfig(name="ppo" if critic else "grpo", loss_agg_mode=agg_mode, clip_ratio_low=0.2,
                           clip_ratio_high=0.2, loss_horizon_tokens=16).apply_preset()
    # A large Adam eps keeps the update continuous in the gradient: with the default 1e-8 the
    # first Adam step is ~lr * sign(g), so float-noise-sized gradients (summed in another order
    # on 2 ranks) could flip sign and move a weight by 2 * lr.
    cfg = LearnerConfig(lr=1e-2, eps=1e-3, warmup_steps=1, micro_batch_size=2, num_mini_batches=2,
                        max_tokens_per_micro_batch=max_tokens, packing=packing, backend=backend,
                        megatron=MegatronConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp), world_size=world)
    learner = learner_class(cfg)(cfg, algo, model_path, temperature=temperature, total_optimizer_steps=4)
    batch = make_batch()
    if critic:
        batch.extras["values"] = torch.zeros_like(batch.loss_mask)
        batch.extras["returns"] = batch.advantages.clone()
    if sft:
        # The warm start's step; each rank scores only its share of the rows.
        forwarded = []
        forward = learner._forward
        learner._forward = lambda mb, *a, **k: forwarded.append(int(mb.attention_mask.sum())) or forward(mb, *a, **k)
        metrics = {"loss/pg": learner.sft_step(batch, 1e-2)["sft/loss"]}
        metrics["critic/vf_loss"] = float(sum(forwarded))  # tokens this rank ran (rank 0's)
    else:
        learner.prepare(batch)
        metrics = learner.train_step(batch)
    if reload:
        ckpt = f"{out}.ckpt"
        learner.save_checkpoint(ckpt)
        version, scored = learner.version, learner.compute_logprobs(batch)
        learner = learner_class(cfg)(cfg, algo, model_path, temperature=temperature, total_optimizer_steps=4)
        learner.load_checkpoint(ckpt)
        assert learner.version == version
        # Every weight that scores came back (a tied head's last-stage copy too, which
        # named_weights does not show).
        torch.testing.assert_close(learner.compute_logprobs(batch), scored, rtol=0, atol=0)
    weights = {n: t.clone() for n, t in learner.named_weights()}  # collective: every rank
    if rank == 0:
        torch.save({"loss": float(metrics["loss/pg"]), "vf": float(metrics.get("critic/vf_loss", 0.0)),
                    "ratio_max": float(metrics.get("loss/ratio_max", float("nan"))), "weights": weights}, out)
    dist.destroy_process_group()
    exit_rank_process(0)
