"""DAPO overlong shaping/filtering and dynamic sampling."""

import pytest
import torch

from async_rl.algorithms import (fill_groups_with_spread, filter_groups_with_spread, group_has_spread,
                                 overlong_filter_mask, overlong_reward_shaping)


def test_overlong_shaping_fault_case_10():
    shaped = overlong_reward_shaping(torch.ones(4), torch.tensor([70, 90, 100, 130]), max_response_tokens=100,
                                     buffer_tokens=20, penalty_factor=1.0)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.5, 0.0, 0.0]))
    with pytest.raises(ValueError):
        overlong_reward_shaping(torch.ones(1), torch.ones(1), max_response_tokens=10, buffer_tokens=20,
                                penalty_factor=1.0)


def test_overlong_filter_mask():
    assert overlong_filter_mask(["stop", "length", "abort"]).tolist() == [True, False, True]


def test_single_sample_group_has_no_spread_fault_case_1():
    assert group_has_spread(torch.tensor([5.0]), torch.tensor([0])).tolist() == [False]


def test_group_spread_and_filter():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0, 9.0])
    group_ids = torch.tensor([5, 5, 2, 2, 8, 8])
    valid = torch.tensor([True, True, True, True, True, False])
    assert group_has_spread(rewards, group_ids, valid).tolist() == [True, False, False]  # ids 2, 5, 8
    assert filter_groups_with_spread(rewards, group_ids).tolist() == [False, False, True, True, True, True]
    with pytest.raises(ValueError, match="non-finite"):
        group_has_spread(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 0]))


def test_fill_loop_gives_up_after_max_rounds_fault_case_1():
    calls = []

    def only_singletons(num_missing):
        calls.append(num_missing)
        return [("g", [5.0])]

    with pytest.raises(ValueError, match="only 0 of 2 groups"):
        fill_groups_with_spread(only_singletons, target_groups=2, max_rounds=3)
    assert calls == [2, 2, 2]


def test_fill_loop_collects_target_and_keeps_surplus():
    rounds = iter([
        [("a", [1.0, 1.0]), ("b", [0.0, 1.0])],
        [("c", [0.0, 0.0]), ("d", [1.0, 0.0]), ("e", [0.0, 0.5])],
    ])
    requested = []

    def generate(num_missing):
        requested.append(num_missing)
        return next(rounds)

    result = fill_groups_with_spread(generate, target_groups=2, max_rounds=5)
    assert [g[0] for g in result.groups] == ["b", "d"] and [g[0] for g in result.surplus] == ["e"]
    assert (result.num_rounds, result.num_rejected, requested) == (2, 2, [2, 1])
