"""Issue 13, fault kind 4: a spread that is zero up to float rounding is zero. Every estimator or
whitening step that divides by a standard deviation gives exactly-zero advantages (|a| < 1e-6) for
groups (or batches) whose values are all equal, for any constant and group size; dynamic sampling
and the critic's explained variance use the same rule; verl parity on ordinary inputs holds."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import compute_advantages, group_has_spread
from async_rl.algorithms.advantages import AdvantageInputs
from async_rl.algorithms.dapo import rewards_have_spread

CONSTANTS = (0.1, 1 / 3, -7.3, 0.7, 1e6, 1e-8, 123.456)
SIZES = (2, 3, 7, 8, 64, 100)


def _inputs(rewards, lengths, group_ids=None, values=None, T=None):
    T = T or max(lengths)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths], dtype=torch.bool)
    return AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float32), response_mask=mask,
                           group_ids=None if group_ids is None else torch.tensor(group_ids),
                           values=values)


def test_the_issue_input_grpo_eight_times_point_one():
    adv, _ = compute_advantages("grpo", _inputs([0.1] * 8, [3] * 8, [0] * 8))
    assert adv.abs().max().item() < 1e-6


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("c", CONSTANTS)
def test_group_estimators_give_zero_for_equal_rewards(name, size, c):
    lengths = [1 + (k * 5) % 7 for k in range(size)]
    adv, _ = compute_advantages(name, _inputs([c] * size, lengths, [4] * size))
    assert adv.abs().max().item() < 1e-6


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("c", CONSTANTS)
def test_reinforce_pp_batch_whitening_gives_zero_for_equal_returns(size, c):
    # gamma = 1: every valid token's return-to-go is the sequence reward c.
    lengths = [1 + (k * 3) % 5 for k in range(size)]
    adv, ret = compute_advantages("reinforce_pp", _inputs([c] * size, lengths))
    assert adv.abs().max().item() < 1e-6


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("c", CONSTANTS)
def test_gae_whitening_gives_zero_for_equal_advantages(size, c):
    # Values 0, gamma = lam = 1: A_t = c on every valid token of every sequence.
    lengths = [1 + (k * 3) % 5 for k in range(size)]
    inputs = _inputs([c] * size, lengths, values=torch.zeros(size, max(lengths)))
    adv, _ = compute_advantages("gae", inputs, whiten=True)
    assert adv.abs().max().item() < 1e-6


@pytest.mark.parametrize("c", CONSTANTS)
def test_equal_group_next_to_a_group_with_spread(c):
    # Group 0 (equal rewards) gets 0; group 1 keeps its usual values, unchanged by group 0.
    rewards, gids = [c] * 5 + [1.0, 0.0, 1.0], [0] * 5 + [1] * 3
    adv, _ = compute_advantages("grpo", _inputs(rewards, [2] * 8, gids))
    assert adv[:5].abs().max().item() < 1e-6
    s = (1 / 3) / math.sqrt(1 / 3)
    torch.testing.assert_close(adv[5:, 0], torch.tensor([s, -2 * s, s]), rtol=0, atol=1e-5)
    adv, _ = compute_advantages("reinforce_pp_baseline", _inputs(rewards, [2] * 8, gids))
    assert adv[:5].abs().max().item() < 1e-6 and adv[5:].abs().min().item() > 0.1


def test_rounding_level_spread_is_no_spread():
    # 0.1 + 0.2 and 0.3 differ in float64 but are one float32 value: no group-relative signal,
    # so dynamic sampling drops the group and the estimator gives 0 (they used to disagree).
    r = [0.1 + 0.2, 0.3, 0.3]
    assert not rewards_have_spread(r)
    assert not bool(group_has_spread(torch.tensor(r, dtype=torch.float64), torch.tensor([0, 0, 0]))[0])
    adv, _ = compute_advantages("grpo", _inputs(r, [1] * 3, [0] * 3))
    assert adv.abs().max().item() == 0.0
    # A spread of 32 float32 steps at 1.0 (four times the rounding allowance) is real signal.
    assert rewards_have_spread([1.0, 1.0 + 2 ** -18])
    assert not rewards_have_spread([1.0, 1.0 + 2 ** -21])


# ---------------------------------------------------------------------------- verl parity
def _verl_grpo(rewards: torch.Tensor, group_ids: list[int], eps: float = 1e-6) -> torch.Tensor:
    """verl's outcome GRPO advantage, written out: per group torch.mean / torch.std (Bessel) in
    float32, (r - mean) / (std + eps); single-sample groups get mean 0, std 1."""
    out = torch.empty_like(rewards)
    for g in set(group_ids):
        idx = torch.tensor([i for i, x in enumerate(group_ids) if x == g])
        r = rewards[idx]
        mean, std = (r.mean(), r.std()) if len(idx) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        out[idx] = (r - mean) / (std + eps)
    return out


def _verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's masked_whiten: mean and unbiased variance over the mask, (x - mean) * rsqrt(var + 1e-8)."""
    m = mask.float()
    mean = (values * m).sum() / m.sum()
    var = (((values - mean) ** 2) * m).sum() / m.sum() * (m.sum() / (m.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


@pytest.mark.parametrize("seed", range(5))
def test_verl_parity_on_ordinary_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    num_groups, n = 6, 5
    rewards = torch.rand(num_groups * n, generator=g) * 3 - 1
    gids = [k // n for k in range(num_groups * n)]
    lengths = torch.randint(1, 9, (num_groups * n,), generator=g).tolist()
    inputs = _inputs(rewards.tolist(), lengths, gids)
    adv, _ = compute_advantages("grpo", inputs)
    torch.testing.assert_close(adv[:, 0], _verl_grpo(rewards, gids), rtol=1e-5, atol=1e-5)
    # REINFORCE++ with baseline: r - group mean on the tokens, whitened over the batch's tokens.
    adv, _ = compute_advantages("reinforce_pp_baseline", inputs)
    centered = (rewards - torch.tensor([rewards[[i for i in range(len(gids)) if gids[i] == gids[k]]].mean()
                                        for k in range(len(gids))])).unsqueeze(-1).expand_as(inputs.response_mask)
    expected = _verl_masked_whiten(centered, inputs.response_mask) * inputs.response_mask
    torch.testing.assert_close(adv, expected, rtol=1e-4, atol=1e-4)
    # REINFORCE++: return-to-go (gamma = 1: the reward) whitened over the batch's tokens.
    adv, _ = compute_advantages("reinforce_pp", inputs)
    returns = rewards.unsqueeze(-1).expand_as(inputs.response_mask)
    torch.testing.assert_close(adv, _verl_masked_whiten(returns, inputs.response_mask) * inputs.response_mask,
                               rtol=1e-4, atol=1e-4)
