"""Advantage estimators against hand-computed values, including the degenerate-group faults."""

import math

import pytest
import torch

from async_rl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _inputs(rewards, mask, group_ids=None, values=None, token_rewards=None):
    t = lambda x, dt=torch.float32: None if x is None else torch.tensor(x, dtype=dt)  # noqa: E731
    return AdvantageInputs(rewards=t(rewards), response_mask=t(mask, torch.bool),
                           group_ids=t(group_ids, torch.long), values=t(values),
                           token_rewards=t(token_rewards))


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_single_sample_group_gives_no_nan_fault_case_1(name):
    inputs = _inputs([5.0], [[1, 1, 1]], group_ids=[0], values=[[0.0, 0.0, 0.0]])
    adv, ret = compute_advantages(name, inputs)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == ret.shape == (1, 3)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name != "gae":  # gae has a critic baseline, the others have nothing to compare against
        assert adv.abs().max().item() == 0.0


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_sample_without_reward_is_excluded_from_group_fault_case_2(name):
    # Sample 0 has no reward (its 100 is garbage): it must not enter the group mean. Sample 1 is
    # then alone in its group -> advantage 0, not (1 - 50.5) / ... or -49.5. (Until issue 13 this
    # rule keyed on "no trainable token"; a sample filtered out of the loss keeps its reward in the
    # baseline: tests/test_advantage_baseline.py.)
    inputs = _inputs([100.0, 1.0], [[1, 1, 0], [1, 1, 0]], group_ids=[3, 3])
    inputs.scored = torch.tensor([False, True])
    adv, _ = compute_advantages(name, inputs)
    assert adv.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_grpo_hand_computed_with_unequal_groups():
    # group 7: rewards 1, 0 -> mean 0.5, std (Bessel) 0.7071; group 9 has one sample -> 0.
    inputs = _inputs([1.0, 0.0, 5.0], [[1, 1], [1, 0], [1, 1]], group_ids=[7, 7, 9])
    adv, ret = compute_advantages("grpo", inputs)
    s = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[s, s], [-s, 0.0], [0.0, 0.0]]), atol=1e-5, rtol=0)
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]]


def test_groups_come_from_group_ids_not_batch_order():
    # Interleaved groups of sizes 3 and 2; dr_grpo: r - group mean.
    inputs = _inputs([1.0, 10.0, 2.0, 20.0, 3.0], [[1]] * 5, group_ids=[0, 1, 0, 1, 0])
    adv, _ = compute_advantages("dr_grpo", inputs)
    torch.testing.assert_close(adv.squeeze(-1), torch.tensor([-1.0, -5.0, 0.0, 5.0, 1.0]))


def test_grpo_identical_rewards_give_zero():
    adv, _ = compute_advantages("grpo", _inputs([2.0, 2.0, 2.0], [[1]] * 3, group_ids=[0, 0, 0]))
    assert adv.abs().max().item() == 0.0


def test_rloo_leave_one_out_baseline():
    # baselines: (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5
    inputs = _inputs([1.0, 0.0, 2.0, 7.0], [[1, 1], [1, 1], [1, 0], [1, 1]], group_ids=[0, 0, 0, 1])
    adv, _ = compute_advantages("rloo", inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0], [-1.5, -1.5], [1.5, 0.0], [0.0, 0.0]]))


def test_reinforce_pp_whitens_over_batch_tokens():
    # returns on valid tokens: 1, 1, 0 -> mean 2/3, unbiased std sqrt(1/3)
    inputs = _inputs([1.0, 0.0], [[1, 1], [1, 0]])
    adv, ret = compute_advantages("reinforce_pp", inputs, epsilon=0.0)
    a, b = (1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [b, 0.0]]))
    assert ret.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_reinforce_pp_baseline_hand_computed():
    # centered: group 0 -> +0.5, -0.5 (2 tokens each); singleton group 1 -> 0 and not in stats.
    inputs = _inputs([1.0, 0.0, 9.0], [[1, 1], [1, 1], [1, 1]], group_ids=[0, 0, 1])
    adv, _ = compute_advantages("reinforce_pp_baseline", inputs, epsilon=0.0)
    s = 0.5 / math.sqrt(1 / 3)  # tokens 0.5, 0.5, -0.5, -0.5: mean 0, unbiased var 1/3
    torch.testing.assert_close(adv, torch.tensor([[s, s], [-s, -s], [0.0, 0.0]]))


def test_gae_hand_computed():
    inputs = _inputs([1.0], [[1, 1, 1]], values=[[0.5, 0.2, 0.1]])
    adv, ret = compute_advantages("gae", inputs)  # gamma = lam = 1: A_t = R - V_t
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    adv, _ = compute_advantages("gae", inputs, gamma=0.9, lam=0.5)
    # deltas 0.9 (t2), 0.9*0.1-0.2 = -0.11, 0.9*0.2-0.5 = -0.32; A1 = -0.11+0.45*0.9, A0 = -0.32+0.45*A1
    torch.testing.assert_close(adv, torch.tensor([[-0.18725, 0.295, 0.9]]))


def test_gae_skips_masked_tool_tokens_and_never_reads_them():
    inputs = _inputs([1.0], [[1, 0, 1]], values=[[0.5, float("nan"), 0.1]])
    adv, ret = compute_advantages("gae", inputs, gamma=0.9, lam=0.5)
    # t2: delta 0.9; t0: delta = 0.9*0.1 - 0.5 = -0.41, A0 = -0.41 + 0.45*0.9 = -0.005
    torch.testing.assert_close(adv, torch.tensor([[-0.005, 0.0, 0.9]]))
    torch.testing.assert_close(ret, torch.tensor([[0.495, 0.0, 1.0]]))


def test_gae_uses_token_rewards():
    inputs = _inputs([0.0], [[1, 1]], values=[[0.0, 0.0]], token_rewards=[[0.25, 1.0]])
    adv, _ = compute_advantages("gae", inputs)
    torch.testing.assert_close(adv, torch.tensor([[1.25, 1.0]]))


def test_missing_inputs_and_bad_shapes_raise():
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", _inputs([1.0], [[1]]))
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", _inputs([1.0], [[1]]))
    with pytest.raises(ValueError, match="rewards"):
        _inputs([1.0, 2.0], [[1]])
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        compute_advantages("gpro", _inputs([1.0], [[1]]))
