"""The learner never takes an optimizer or LR-scheduler step on a mini-batch without a token in
the loss: a step's batch with fewer sequences than ``learner.num_mini_batches`` (reward
rejections can shrink it at run time) is cut into fewer mini-batches, and a mini-batch whose
every token is masked (DAPO's overlong filter) is skipped; both are counted in the metrics."""

from __future__ import annotations

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.learners.base import LearnerConfig
from async_rl.learners.launch import exit_rank_process


def _learner(model_path: str, **kw):
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()
    # A large Adam eps keeps the update continuous in the gradient (see multirank_worker).
    cfg = LearnerConfig(**{"lr": 1e-2, "eps": 1e-3, "micro_batch_size": 4, **kw})
    return FSDPLearner(cfg, algo, model_path, temperature=1.0, total_optimizer_steps=100)


def _batch(n: int):
    from multirank_worker import make_batch

    return make_batch().select(slice(0, n))


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in learner.named_weights()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, w in a.items():
        torch.testing.assert_close(b[name], w, rtol=1e-6, atol=1e-7, msg=name)


def test_fewer_sequences_than_mini_batches_takes_one_step_per_sequence(tiny_model_path):
    # 2 sequences with num_mini_batches=4: the same two one-sequence mini-batches, in the same
    # order, as num_mini_batches=2 (the split is one seeded permutation cut into parts); the LR
    # schedule advances twice, not four times, and loss/pg averages over the 2 steps taken.
    two = _learner(tiny_model_path, num_mini_batches=2, warmup_steps=10)
    m2 = two.train_step(_batch(2))
    four = _learner(tiny_model_path, num_mini_batches=4, warmup_steps=10)
    m4 = four.train_step(_batch(2))
    assert two.scheduler.last_epoch == 2
    assert four.scheduler.last_epoch == 2
    assert float(m4["loss/pg"]) == pytest.approx(float(m2["loss/pg"]), rel=1e-6, abs=1e-9)
    assert float(m4["actor/lr"]) == pytest.approx(float(m2["actor/lr"]))
    assert (float(m4["actor/optimizer_steps"]), float(m4["actor/skipped_mini_batches"])) == (2.0, 2.0)
    assert (float(m2["actor/optimizer_steps"]), float(m2["actor/skipped_mini_batches"])) == (2.0, 0.0)
    _assert_same(_weights(two), _weights(four))
    assert four.version == two.version == 1  # one policy version per training step, as ever


def test_a_mini_batch_with_every_token_masked_is_skipped(tiny_model_path):
    # 4 sequences in 2 mini-batches; the second mini-batch's sequences carry no loss (as when
    # the overlong filter masks truncated samples). AdamW on a zero gradient is no no-op
    # (momentum and weight decay move the weights), so the step must not be taken: the result is
    # the one-step update on the first mini-batch alone.
    learner = _learner(tiny_model_path, num_mini_batches=2, weight_decay=0.1)
    first, second = learner._split(torch.arange(4), 2, epoch=0)
    batch = _batch(4)
    batch.loss_mask[second] = 0.0
    batch.advantages[second] = 0.0
    metrics = learner.train_step(batch)
    assert learner.scheduler.last_epoch == 1
    assert (float(metrics["actor/optimizer_steps"]), float(metrics["actor/skipped_mini_batches"])) == (1.0, 1.0)
    alone = _learner(tiny_model_path, num_mini_batches=1, weight_decay=0.1)
    expected = alone.train_step(_batch(4).select(first))
    _assert_same(_weights(alone), _weights(learner))
    assert float(metrics["loss/pg"]) == pytest.approx(float(expected["loss/pg"]), rel=1e-6, abs=1e-9)


def test_a_batch_without_any_loss_token_changes_nothing(tiny_model_path):
    learner = _learner(tiny_model_path, num_mini_batches=2, weight_decay=0.1)
    before = _weights(learner)
    batch = _batch(4)
    batch.loss_mask.zero_()
    batch.advantages.zero_()
    metrics = learner.train_step(batch)
    assert learner.scheduler.last_epoch == 0
    assert (float(metrics["actor/optimizer_steps"]), float(metrics["actor/skipped_mini_batches"])) == (0.0, 2.0)
    assert float(metrics["loss/pg"]) == 0.0
    _assert_same(before, _weights(learner))
    assert learner.version == 1


def test_the_critic_skips_the_same_mini_batch(tiny_model_path):
    # PPO: the critic steps on the policy's mini-batches, so it skips the masked one too.
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="ppo", loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(lr=1e-2, eps=1e-3, micro_batch_size=4, num_mini_batches=2), algo,
                          tiny_model_path, temperature=1.0, total_optimizer_steps=100)
    _, second = learner._split(torch.arange(4), 2, epoch=0)
    batch = _batch(4)
    batch.loss_mask[second] = 0.0
    batch.advantages[second] = 0.0
    learner.prepare(batch)
    batch.extras["returns"] = batch.advantages.clone()
    metrics = learner.train_step(batch)
    assert (learner.scheduler.last_epoch, learner.critic.scheduler.last_epoch) == (1, 1)
    assert torch.isfinite(torch.as_tensor(metrics["critic/vf_loss"]))


def _rank(rank: int, world: int, init_file: str, model_path: str, out: str, n: int, mask_second: bool) -> None:
    """One learner rank of ``test_two_ranks_skip_what_one_rank_skips`` (a spawned process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    learner = _learner(model_path, num_mini_batches=4 if n < 4 else 2, micro_batch_size=1, weight_decay=0.1)
    batch = _batch(n)
    if mask_second:
        second = learner._split(torch.arange(n), 2, epoch=0)[1]
        batch.loss_mask[second] = 0.0
        batch.advantages[second] = 0.0
    metrics = learner.train_step(batch)
    weights = _weights(learner)  # collective: every rank
    if rank == 0:
        steps = float(metrics.get("actor/optimizer_steps", float("nan")))
        torch.save({"loss": float(metrics["loss/pg"]), "steps": steps, "sched": learner.scheduler.last_epoch,
                    "weights": weights}, out)
    dist.destroy_process_group()
    exit_rank_process(0)


@pytest.mark.slow
@pytest.mark.parametrize("n, mask_second, steps", [(3, False, 3), (4, True, 1)])
def test_two_ranks_skip_what_one_rank_skips(tmp_path, tiny_model_path, n, mask_second, steps):
    # 3 sequences in 4 mini-batches (one empty, and on 2 ranks one rank without a sequence in
    # each of the others), or a masked mini-batch: every rank skips the same mini-batches (the
    # token count is global), so the collectives stay matched and 2 ranks give the 1-rank step.
    import torch.multiprocessing as mp

    results = {}
    for world in (1, 2):
        init, out = tmp_path / f"init-{world}", tmp_path / f"out-{world}.pt"
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, world, str(init), tiny_model_path, str(out),
                                                                       n, mask_second)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
            assert p.exitcode == 0, f"rank exited with {p.exitcode}"
        results[world] = torch.load(out)
    one, two = results[1], results[2]
    assert one["sched"] == two["sched"] == steps
    assert one["steps"] == two["steps"] == steps
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
