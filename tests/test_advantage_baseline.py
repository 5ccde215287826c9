"""Issue 13, fault kind 1: "which samples are trained" (loss mask) and "which samples define the
baseline" (every sample that has a reward) are two separate things, for every estimator and every
reason a sample leaves the loss."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import ADVANTAGE_ESTIMATORS, AdvantageInputs, compute_advantages
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.step.batch import make_batch
from async_rl.buffers.trajectory import Trajectory

S3 = 0.5 / math.sqrt(1 / 3)  # 0.8660: +-0.5 around mean 0.5 over std sqrt(1/3) (Bessel, n = 4)


def _traj(gid: int, j: int, n_tokens: int, reward: float, finish: str = "stop") -> Trajectory:
    return Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid=f"p{gid}", prompt_ids=[5, 6],
                      response_ids=[9] * n_tokens, behavior_logprobs=[-0.5] * n_tokens, loss_mask=[1] * n_tokens,
                      finish_reason=finish, policy_version=[0] * n_tokens, reward=reward)


def _algo(**kw) -> AlgorithmConfig:
    return AlgorithmConfig(**kw).apply_preset()


def _assert_rows(batch, expected: list[list[float]]) -> None:
    """The advantages of each row at its response slots (prompt of 2 tokens: label slots 1..)."""
    torch.testing.assert_close(batch.advantages[:, 1:], torch.tensor(expected), rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------- the inputs
def test_truncated_sample_stays_in_the_grpo_baseline():
    # Rewards [1, 1, 0, 0], last truncated: mean 0.5 and std 0.5774 over all four.
    trajs = [_traj(0, 0, 3, 1.0), _traj(0, 1, 3, 1.0), _traj(0, 2, 3, 0.0), _traj(0, 3, 3, 0.0, "length")]
    batch, metrics = make_batch(trajs, _algo(name="grpo", overlong_filter=True), 0, 3)
    _assert_rows(batch, [[S3] * 3, [S3] * 3, [-S3] * 3, [0.0] * 3])
    assert batch.loss_mask[3].sum() == 0 and batch.loss_mask[:3].sum() == 9
    assert metrics["rollout/overlong_filtered"] == 1.0


def test_group_whose_only_different_sample_was_truncated_keeps_its_signal():
    # Rewards [1, 1, 1, 0], last truncated: mean 0.75, std 0.5 -> +0.5 for the three kept.
    trajs = [_traj(0, j, 3, 1.0) for j in range(3)] + [_traj(0, 3, 3, 0.0, "length")]
    batch, _ = make_batch(trajs, _algo(name="grpo", overlong_filter=True), 0, 3)
    _assert_rows(batch, [[0.5] * 3] * 3 + [[0.0] * 3])


# ---------------------------------------------------------------------------- every estimator
def _mixed_batch() -> list[Trajectory]:
    """Two groups of 4 with different lengths; one truncated sample in each (one of them the only
    different reward of its group)."""
    return [_traj(0, 0, 3, 1.0), _traj(0, 1, 2, 0.0), _traj(0, 2, 4, 1.0), _traj(0, 3, 5, 0.0, "length"),
            _traj(1, 0, 2, 1.0), _traj(1, 1, 3, 1.0), _traj(1, 2, 4, 1.0), _traj(1, 3, 5, 0.0, "length")]


class ValuesLearner:
    """``prepare`` of a critic whose value is 0.25 everywhere (GAE needs values)."""

    def prepare(self, batch):
        batch.extras["values"] = torch.full_like(batch.behavior_logprobs, 0.25)
        return {}


@pytest.mark.parametrize("estimator, params", [
    ("grpo", {}), ("dr_grpo", {}), ("rloo", {}), ("reinforce_pp", {}), ("reinforce_pp_baseline", {}),
    ("gae", {"whiten_advantages": True}), ("gae", {"whiten_advantages": False, "gamma": 0.9, "lam": 0.8}),
])
@pytest.mark.parametrize("reason", ["length", "max_turns"])
def test_leaving_the_loss_never_changes_the_baseline(estimator, params, reason):
    """The overlong filter (finish ``length``, and an agent's ``max_turns``, which the trajectory
    records as ``length``) only zeroes loss rows: every other advantage equals the unfiltered one."""
    trajs = _mixed_batch()
    if reason == "max_turns":
        from async_rl.step.rollout import trajectory_of
        from async_rl.step.agent import Conversation

        conv = Conversation(prompt_ids=[5, 6], messages=[], seed=0, final_text="x", response_ids=[9] * 5,
                            logprobs=[-0.5] * 5, loss_mask=[1] * 5, finish_reason="max_turns",
                            policy_version=[0] * 5, num_turns=4, num_tool_calls=3, num_tool_errors=0)
        t = trajectory_of(conv, None, 1, 3, "p1", [5, 6])
        t.reward = 0.0
        trajs[-1] = t
    learner = ValuesLearner() if estimator == "gae" else None
    kept = [i for i, t in enumerate(trajs) if t.finish_reason != "length"]
    plain, _ = make_batch(trajs, _algo(advantage_estimator=estimator, **params), 0, 5, learner)
    filtered, _ = make_batch(trajs, _algo(advantage_estimator=estimator, overlong_filter=True, **params), 0, 5,
                             learner)
    torch.testing.assert_close(filtered.advantages[kept], plain.advantages[kept], rtol=0, atol=1e-6)
    assert filtered.loss_mask[[3, 7]].sum() == 0 and filtered.advantages[[3, 7]].abs().sum() == 0
    # The filter must matter for the test to mean anything: group 1's spread is all in sample 3.
    assert plain.advantages[4:7].abs().sum() > 0


def test_dr_grpo_hand_values_with_a_truncated_outlier():
    # Rewards [1, 0, 5] (the 5 truncated): mean 2 -> [-1, -2, masked]; the 5 still sets the baseline.
    trajs = [_traj(0, 0, 2, 1.0), _traj(0, 1, 2, 0.0), _traj(0, 2, 2, 5.0, "length")]
    batch, _ = make_batch(trajs, _algo(name="dr_grpo", overlong_filter=True), 0, 2)
    _assert_rows(batch, [[-1.0, -1.0], [-2.0, -2.0], [0.0, 0.0]])


# ---------------------------------------------------------------------------- the estimators alone
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def _inputs(rewards, mask, group_ids=None, scored=None, values=None):
    return AdvantageInputs(rewards=torch.tensor(rewards, dtype=torch.float32),
                           response_mask=torch.tensor(mask, dtype=torch.bool),
                           group_ids=None if group_ids is None else torch.tensor(group_ids),
                           scored=None if scored is None else torch.tensor(scored, dtype=torch.bool),
                           values=None if values is None else torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("name, expected", [
    # group of 4: rewards [1, 1, 0, 0], the last with no trainable token (all-zero mask row).
    ("grpo", [S3, S3, -S3, 0.0]),
    ("dr_grpo", [0.5, 0.5, -0.5, 0.0]),
    # leave-one-out over all four: baselines 1/3, 1/3, 2/3 -> 2/3, 2/3, -2/3.
    ("rloo", [2 / 3, 2 / 3, -2 / 3, 0.0]),
])
def test_a_row_without_trainable_tokens_still_counts_in_its_group(name, expected):
    adv, _ = compute_advantages(name, _inputs([1.0, 1.0, 0.0, 0.0], [[1], [1], [1], [0]], [0, 0, 0, 0]))
    assert adv.squeeze(-1).tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("name, expected", [
    # Sample 2 has no reward (NaN stands in for None): the group is the other three, [1, 0, 1]:
    # mean 2/3, std sqrt(1/3).
    ("grpo", [(1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3), 0.0, (1 / 3) / math.sqrt(1 / 3)]),
    ("dr_grpo", [1 / 3, -2 / 3, 0.0, 1 / 3]),
    ("rloo", [0.5, -1.0, 0.0, 0.5]),
])
def test_a_sample_without_a_reward_leaves_the_baseline(name, expected):
    inputs = _inputs([1.0, 0.0, float("nan"), 1.0], [[1, 1]] * 4, [0, 0, 0, 0], scored=[1, 1, 0, 1])
    adv, ret = compute_advantages(name, inputs)
    assert adv[:, 0].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all() and ret[2].abs().sum() == 0


@pytest.mark.parametrize("name", [*ADVANTAGE_ESTIMATORS.names()])
def test_unscored_samples_get_zero_and_never_leak_nan(name):
    inputs = _inputs([1.0, float("nan"), 0.0], [[1, 1], [1, 1], [1, 0]], [0, 0, 0], scored=[1, 0, 1],
                     values=[[0.1, 0.2], [float("nan"), 0.3], [0.0, 0.0]])
    adv, ret = compute_advantages(name, inputs)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv[1].abs().sum() == 0 and ret[1].abs().sum() == 0


def test_scored_reward_must_be_finite():
    with pytest.raises(ValueError, match="non-finite reward"):
        compute_advantages("grpo", _inputs([1.0, float("nan")], [[1], [1]], [0, 0]))
    with pytest.raises(ValueError, match="scored"):
        _inputs([1.0, 2.0], [[1], [1]], [0, 0], scored=[1, 0, 1])


def test_an_unknown_finish_reason_is_not_scored_as_truncated():
    # The old code mapped any reason other than stop/length (an aborted sample) to "length" and
    # scored it as a finished, truncated response.
    from types import SimpleNamespace

    from async_rl.step.rollout import trajectory_of

    sample = SimpleNamespace(response_ids=[9], logprobs=[-0.1], finish_reason="abort", policy_version=[0])

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "9"

    with pytest.raises(ValueError, match="'abort'"):
        trajectory_of(sample, Tok(), 0, 0, "p", [5])
