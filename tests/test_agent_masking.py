"""Tool tokens get no gradient: a completion [a1, a2, t1, t2, a3] whose tool tokens t1, t2 have
loss mask 0 gets exactly zero gradient at t1 and t2 on every loss path (every policy loss x
aggregation mode x behavior correction, the KL loss, the entropy bonus, the value loss), and the
learner's update does not depend on anything stored at the tool tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from async_rl.algorithms.aggregation import LOSS_AGG_MODES, count_normalizers
from async_rl.algorithms.critic import value_loss
from async_rl.algorithms.kl import entropy_bonus, kl_loss
from async_rl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from async_rl.algorithms.losses import BEHAVIOR_CORRECTIONS, POLICY_LOSSES, OffPolicyCorrection, PolicyLossInputs
from async_rl.buffers.trajectory import Trajectory, collate

TOOL_SLOTS = (2, 3)  # response positions of t1, t2 in [a1, a2, t1, t2, a3]


def _batch():
    """Two trajectories; the first is [a1, a2, t1, t2, a3] with mask [1, 1, 0, 0, 1]."""
    trajs = [
        Trajectory(trajectory_id="0/0", group_id=0, prompt_uid="p", prompt_ids=[5, 6, 7],
                   response_ids=[11, 12, 90, 91, 13], behavior_logprobs=[-1.0, -2.0, 0.0, 0.0, -0.5],
                   loss_mask=[1, 1, 0, 0, 1], finish_reason="stop", policy_version=[0] * 5, reward=1.0),
        Trajectory(trajectory_id="0/1", group_id=0, prompt_uid="p", prompt_ids=[5, 6, 7],
                   response_ids=[14, 15, 16], behavior_logprobs=[-1.5, -0.7, -0.2],
                   loss_mask=[1, 1, 1], finish_reason="stop", policy_version=[0] * 3, reward=0.0),
    ]
    return collate(trajs, pad_token_id=0)


def _tool_label_slots(batch) -> list[int]:
    """Label slots (``[B, L-1]`` columns) of t1 and t2 in row 0: prompt length - 1 + position."""
    return [3 - 1 + p for p in TOOL_SLOTS]


def test_collate_masks_exactly_the_tool_tokens():
    batch = _batch()
    slots = _tool_label_slots(batch)
    assert batch.input_ids[0, 1:][slots].tolist() == [90, 91]
    assert batch.loss_mask[0].tolist()[2:7] == [1.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("loss_name,agg_mode,correction",
                         list(itertools.product(sorted(POLICY_LOSSES.names()), LOSS_AGG_MODES, BEHAVIOR_CORRECTIONS)))
def test_policy_loss_has_zero_gradient_at_tool_tokens(loss_name, agg_mode, correction):
    batch = _batch()
    torch.manual_seed(0)
    logits = torch.randn(2, batch.input_ids.shape[1] - 1, 100, requires_grad=True)
    logprobs = logprobs_from_logits(logits, batch.input_ids[:, 1:])
    adv = torch.randn(batch.loss_mask.shape) * batch.loss_mask
    # Garbage at the tool slots must not matter: the loss is masked there, not multiplied by 0.
    behavior = batch.behavior_logprobs.clone()
    prox = logprobs.detach() + 0.1 * torch.randn(logprobs.shape)
    for s in _tool_label_slots(batch):
        behavior[0, s], prox[0, s], adv[0, s] = 50.0, -50.0, 1e6
    tokens, seqs = count_normalizers(batch.loss_mask)
    inputs = PolicyLossInputs(logprobs, prox, behavior, adv, batch.loss_mask, agg_mode=agg_mode,
                              num_global_tokens=tokens, num_global_seqs=seqs, horizon=16)
    loss, _ = POLICY_LOSSES.get(loss_name)(inputs, OffPolicyCorrection(correction))
    entropy = entropy_from_logits(logits)
    ref = logprobs.detach() - 0.3
    total = loss + kl_loss(logprobs, ref, batch.loss_mask, agg_mode=agg_mode, num_global_tokens=tokens,
                           num_global_seqs=seqs, horizon=16) \
        - 0.01 * entropy_bonus(entropy, batch.loss_mask, agg_mode=agg_mode, num_global_tokens=tokens,
                               num_global_seqs=seqs, horizon=16)
    total.backward()
    grad = logits.grad
    assert torch.isfinite(grad).all()
    for s in _tool_label_slots(batch):
        assert torch.count_nonzero(grad[0, s]) == 0, f"gradient at tool slot {s}"
    assert grad[0, 2].abs().sum() > 0  # a1 is trained


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_value_loss_has_zero_gradient_at_tool_tokens(agg_mode):
    batch = _batch()
    values = torch.randn(batch.loss_mask.shape, requires_grad=True)
    returns = torch.randn(batch.loss_mask.shape)
    for s in _tool_label_slots(batch):
        returns[0, s] = float("nan")
    tokens, seqs = count_normalizers(batch.loss_mask)
    loss, _ = value_loss(values, values.detach() + 0.1, returns, batch.loss_mask, clip_range_value=0.2,
                         agg_mode=agg_mode, num_global_tokens=tokens, num_global_seqs=seqs, horizon=16)
    loss.backward()
    for s in _tool_label_slots(batch):
        assert values.grad[0, s] == 0


@pytest.mark.slow
def test_learner_update_ignores_what_is_stored_at_tool_tokens(tiny_model_path):
    """End to end through FSDPLearner (PPO with a critic and a KL term): changing behavior
    log-probs, advantages, returns and reference log-probs at the tool tokens leaves the update
    bit-identical."""
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner

    def run(poison: bool) -> dict[str, torch.Tensor]:
        algo = AlgorithmConfig(name="ppo", kl_coef=0.1, entropy_coef=0.01, loss_horizon_tokens=16).apply_preset()
        learner = FSDPLearner(LearnerConfig(lr=1e-2, micro_batch_size=2), algo, tiny_model_path, temperature=1.0,
                              total_optimizer_steps=1)
        learner.begin_rl()
        batch = _batch()
        learner.prepare(batch)
        batch.advantages = torch.linspace(-1, 1, batch.loss_mask.numel()).view_as(batch.loss_mask) * batch.loss_mask
        batch.extras["returns"] = batch.advantages.clone()
        if poison:
            for s in _tool_label_slots(batch):
                batch.behavior_logprobs[0, s] = 30.0
                batch.advantages[0, s] = 1e4
                batch.extras["returns"][0, s] = -1e4
                batch.extras["ref_logprobs"][0, s] = -40.0
                batch.extras["proximal_logprobs"][0, s] = 20.0
        learner.train_step(batch)
        weights = {n: t.clone() for n, t in learner.named_weights()}
        # DTensors under FSDP2, plain tensors on one fp32 rank (FSDPLearner._wraps_with_fsdp).
        weights.update({f"critic.{n}": (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
                        for n, p in learner.critic.model.named_parameters()})
        return weights

    clean, poisoned = run(False), run(True)
    for name, w in clean.items():
        assert torch.equal(poisoned[name], w), name
