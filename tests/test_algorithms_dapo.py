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


def test_fill_loop_group_budget_counts_groups_examined():
    # Async mode takes exactly the missing groups per round: the budget is groups examined.
    script = iter([[("a", [1.0, 1.0]), ("b", [0.0, 1.0])], [("c", [2.0, 2.0])], [("d", [3.0, 3.0])]])
    requested = []

    def take(num_missing):
        requested.append(num_missing)
        return next(script)

    with pytest.raises(ValueError, match=r"only 1 of 2 groups .* after 3 rounds \(3 groups rejected"):
        fill_groups_with_spread(take, target_groups=2, max_groups=4)
    assert requested == [2, 1, 1]  # 2 + 1 = 3 examined < 4: a third round; 4 examined: stop


@pytest.mark.parametrize("limits", [{}, {"max_rounds": 2, "max_groups": 4}, {"max_groups": 0}])
def test_fill_loop_needs_exactly_one_positive_budget(limits):
    with pytest.raises(ValueError):
        fill_groups_with_spread(lambda k: [], target_groups=1, **limits)


def test_both_modes_share_dynamic_sampling_and_its_metrics():
    from types import SimpleNamespace

    from async_rl.buffers.trajectory import Trajectory
    from async_rl.loops.common import dynamic_sampling

    def group(gid, rewards):
        return [Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid="p", prompt_ids=[1], response_ids=[2],
                           behavior_logprobs=[0.0], loss_mask=[1], finish_reason="stop", policy_version=[0], reward=r)
                for j, r in enumerate(rewards)]

    algo = SimpleNamespace(dynamic_sampling=True, max_generation_rounds=2)
    rounds = iter([[group(0, [1, 1]), group(1, [0, 1])], [group(2, [0, 1]), group(3, [1, 0])]])
    groups, metrics = dynamic_sampling(lambda k: next(rounds), algo, 2)
    assert [g[0].group_id for g in groups] == [1, 2, 3]  # target first, then the surplus, none lost
    assert metrics == {"rollout/dynamic_sampling_rounds": 2.0, "rollout/dynamic_sampling_surplus_groups": 1.0,
                       "rollout/dynamic_sampling_rejected_groups": 1.0}
    # Async budget: 2 x 2 = 4 groups examined, whatever the number of rounds.
    flat = iter([[group(g, [1, 1])] for g in range(10)])
    with pytest.raises(ValueError, match=r"only 0 of 2 .* after 4 rounds.*max_generation_rounds=2"):
        dynamic_sampling(lambda k: next(flat), algo, 2, budget="groups")
    plain = SimpleNamespace(dynamic_sampling=False, max_generation_rounds=2)
    assert dynamic_sampling(lambda k: [group(7, [1, 1])] * k, plain, 2) == ([group(7, [1, 1])] * 2, {})
