"""Issue 13, fault kind 7: KL and reward edge cases against the reference implementations.

* k3 ("low_var_kl") is bounded per token as in verl ([-10, 10]), configurable, zero gradient where
  the bound binds; every place that computes a KL uses it (loss term, KL in the reward);
* verl's `abs` estimator exists, and every verl estimator has a counterpart with verl's values;
* a reward of `None` is never trained as 0: it is a counted rejection (`no_reward`) whatever
  `reward.on_error` says, in the sync rollout and in the async generator actor;
* the group-spread helpers raise the documented `ValueError` on bad input, not `TypeError`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from async_rl.algorithms import kl_loss, kl_penalty
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.dapo import fill_groups_with_spread, filter_groups_with_spread, group_has_spread, \
    rewards_have_spread
from async_rl.rewards import RewardScorer

OUTLIER = math.exp(20.0) - 21.0  # 4.85e8: the k3 value of one token with log-ratio 20


# ---------------------------------------------------------------------------- KL
def test_k3_outlier_token_is_bounded_like_verl():
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[20.0, -1.5]])
    kl = kl_penalty(logprobs, ref, "k3")
    assert kl[0, 0].item() == 10.0
    assert kl[0, 1].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    kl.sum().backward()
    # Zero gradient where the bound binds; the ordinary token keeps d/dlogp = 1 - exp(log r).
    assert logprobs.grad[0, 0].item() == 0.0
    assert logprobs.grad[0, 1].item() == pytest.approx(1 - math.exp(-0.5))


def test_k3_bound_is_configurable():
    logprobs, ref = torch.tensor([[0.0]]), torch.tensor([[20.0]])
    assert kl_penalty(logprobs, ref, "k3", k3_clamp=None).item() == pytest.approx(OUTLIER, rel=1e-6)
    assert kl_penalty(logprobs, ref, "k3", k3_clamp=3.0).item() == 3.0
    loss = kl_loss(logprobs, ref, torch.ones(1, 1), agg_mode="token-mean", num_global_tokens=1, num_global_seqs=1)
    assert loss.item() == 10.0
    with pytest.raises(ValueError, match="k3_clamp"):
        kl_penalty(logprobs, ref, "k3", k3_clamp=0.0)
    assert AlgorithmConfig().kl_k3_clamp == 10.0
    assert AlgorithmConfig(kl_k3_clamp=None).kl_k3_clamp is None
    with pytest.raises(ValueError, match="kl_k3_clamp"):
        AlgorithmConfig(kl_k3_clamp=-1.0)


def test_k3_bound_from_the_config_file():
    from pathlib import Path

    from async_rl.config import load_config

    root = Path(__file__).resolve().parents[1]
    assert load_config(root / "configs/default.yaml", ["algorithm.kl_k3_clamp=null"]).algorithm.kl_k3_clamp is None
    assert load_config(root / "configs/default.yaml", ["algorithm.kl_estimator=abs"]).algorithm.kl_estimator == "abs"


def test_abs_estimator_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([[-1.5, -1.0]]), "abs")
    assert kl.tolist() == [[0.5, 1.0]]
    kl.sum().backward()
    assert logprobs.grad.tolist() == [[1.0, -1.0]]


def _verl(kind: str, logprob: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """verl's `kl_penalty` values, written out (core_algos.py): kl/k1, abs, mse/k2, low_var_kl/k3."""
    if kind == "k1":
        return logprob - ref
    if kind == "abs":
        return (logprob - ref).abs()
    if kind == "k2":
        return 0.5 * (logprob - ref).square()
    log_r = (ref - logprob).clamp(-20, 20)
    return (torch.exp(log_r) - log_r - 1).clamp(-10, 10)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_every_verl_estimator_has_a_counterpart_with_its_values(kind):
    g = torch.Generator().manual_seed(3)
    logprob = -torch.rand(64, 8, generator=g) * 15
    ref = -torch.rand(64, 8, generator=g) * 15
    torch.testing.assert_close(kl_penalty(logprob, ref, kind), _verl(kind, logprob, ref), rtol=1e-5, atol=1e-5)


class RefLearner:
    """``prepare`` of a policy/reference pair whose log-ratio is 20 on one token and 0 elsewhere."""

    def prepare(self, batch):
        batch.extras["proximal_logprobs"] = torch.zeros_like(batch.behavior_logprobs)
        ref = torch.zeros_like(batch.behavior_logprobs)
        ref[0, 2] = 20.0
        batch.extras["ref_logprobs"] = ref
        return {}


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp"])
def test_kl_in_reward_uses_the_bound(name):
    from async_rl.step.batch import make_batch
    from async_rl.buffers.trajectory import Trajectory

    trajs = [Trajectory(trajectory_id=f"0/{j}", group_id=0, prompt_uid="p", prompt_ids=[5, 6],
                        response_ids=[9, 9, 9], behavior_logprobs=[0.0] * 3, loss_mask=[1] * 3, finish_reason="stop",
                        policy_version=[0] * 3, reward=float(j)) for j in range(2)]
    algo = AlgorithmConfig(name=name, kl_coef=0.1, use_kl_in_reward=True).apply_preset()
    _, metrics = make_batch(trajs, algo, 0, 3, RefLearner())
    # One bounded token of 10 over 6 valid tokens, times coef 0.1.
    assert metrics["actor/kl_reward_penalty"] == pytest.approx(0.1 * 10 / 6)


# ---------------------------------------------------------------------------- reward None
@pytest.mark.parametrize("value", [None, {"score": None, "acc": 1.0}])
@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_missing_reward_is_a_counted_rejection_whatever_on_error_says(value, on_error):
    scorer = RewardScorer(lambda *args: value, on_error=on_error)
    result = scorer.score("src", "response", "gt", None)
    assert result.rejected and result.reason == "no_reward" and result.error == "no reward (None)"
    assert scorer.pop_metrics() == {"reward/scored": 1.0, "reward/errors": 0.0, "reward/no_reward": 1.0,
                                    "reward/rejected": 1.0, "reward/timeouts": 0.0, "reward/crashed": 0.0,
                                    "reward/too_large": 0.0}


def test_an_error_under_on_error_zero_is_still_scored_zero():
    scorer = RewardScorer(lambda *args: math.nan, on_error="zero")
    result = scorer.score("src", "r", "g", None)
    assert not result.rejected and result.reason is None and result.score == 0.0
    assert scorer.counts()["reward/errors"] == 1.0 and scorer.counts()["reward/rejected"] == 0.0


class _Gen:
    """Scripted engine: prompt i's n samples are single tokens ``script[i]``."""

    def __init__(self, script):
        self.script = list(script)

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        from async_rl.generators.base import Sample

        out = []
        for i, _ in enumerate(prompts):
            row = [Sample([int(t)], [-0.1], "stop", [0]) for t in self.script.pop(0)[:n]]
            out.append(row)
            for j, s in enumerate(row):
                if on_sample is not None:
                    on_sample(i, j, s)
        return out


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _reward_none_for_7(data_source, text, gt, extra):
    """Token 7 means "the judge could not score this": no reward."""
    return None if text == "7" else float(text)


def test_sync_rollout_never_trains_a_missing_reward_as_zero():
    from async_rl.step.rollout import rollout

    prompts = [SimpleNamespace(prompt_ids=[1, 2], data_source="d", ground_truth="", extra_info={}, uid="u0",
                               messages=[])]
    scorer = RewardScorer(_reward_none_for_7, on_error="zero")
    result = rollout(_Gen([[1, 7, 0, 1]]), prompts, 4, None, scorer, _Tok(), first_group_id=0, seed=0)
    assert [t.reward for t in result.trajectories] == [1.0, 0.0, 1.0]
    assert [t.trajectory_id for t in result.trajectories] == ["0/0", "0/2", "0/3"]
    assert result.num_rejected_samples == 1 and scorer.pop_metrics()["reward/no_reward"] == 1.0


def test_async_generator_actor_never_sends_a_missing_reward(tiny_model_path, tmp_path):
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.loops.actors import GeneratorWorker
    from async_rl.step.rollout import GroupRequest
    from async_rl.buffers.transport import TrajectoryGroup

    reward_file = tmp_path / "judge.py"
    reward_file.write_text("def judge(ds, text, gt, extra):\n    return None if len(text) % 2 else 1.0\n")
    sent = []

    class Sender:
        def send(self, msg):
            sent.append(msg)

        def close(self):
            pass

    worker = GeneratorWorker(0, tiny_model_path, tiny_model_path, GeneratorConfig(max_response_tokens=6),
                             SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[0]),
                             f"{reward_file}:judge", "zero", lambda: Sender(), num_threads=1)
    worker._serve([GroupRequest(group_id=3, prompt_ids=[5, 6, 7], prompt_uid="u", data_source="d",
                                ground_truth="", extra_info={}, n=8, seed=11)])
    worker.scorer.drain()  # scored in the actor's reward worker process, after sampling returned
    worker.scorer.close()
    # The group travels as one message: its kept trajectories, closing it.
    assert len(sent) == 1 and isinstance(sent[0], TrajectoryGroup) and sent[0].group_id == 3
    trajs = list(sent[0].trajectories)
    stats = worker.get_stats()
    missing = stats["reward/no_reward"]
    assert missing >= 1, "some of the 8 sampled responses decode to an odd length"
    assert len(trajs) == 8 - missing and all(t.reward == 1.0 for t in trajs)
    assert all(t.group_id == 3 and t.generator_id == 0 for t in trajs)
    assert stats["rejected_samples"] == missing == stats["reward/rejected"]


# ---------------------------------------------------------------------------- spread helpers
@pytest.mark.parametrize("rewards", [[None, 1.0], [1.0, "0.5"], "11", None, [1.0, float("nan")]])
def test_rewards_have_spread_bad_input_is_value_error(rewards):
    with pytest.raises(ValueError):
        rewards_have_spread(rewards)


def test_rewards_have_spread_bad_min_spread_is_value_error():
    with pytest.raises(ValueError, match="min_spread"):
        rewards_have_spread([0.0, 1.0], min_spread=None)
    with pytest.raises(ValueError, match="min_spread"):
        rewards_have_spread([0.0, 1.0], min_spread=-1.0)


@pytest.mark.parametrize("rewards, group_ids, valid", [
    ([1.0, 0.0], [0.0, 0.5], None),  # float group ids
    ([True, False], [0, 0], None),  # bool rewards tensor
    ([1.0, 0.0], [0, 0], [1, 0]),  # non-bool valid
    ([1.0, 0.0], [0, 0], [True]),  # valid of the wrong length
])
def test_group_spread_tensor_helpers_bad_input_is_value_error(rewards, group_ids, valid):
    args = (torch.tensor(rewards), torch.tensor(group_ids), None if valid is None else torch.tensor(valid))
    with pytest.raises(ValueError):
        group_has_spread(*args)
    with pytest.raises(ValueError):
        filter_groups_with_spread(*args)
    with pytest.raises(ValueError):
        group_has_spread([1.0, 0.0], torch.tensor([0, 0]))


def test_dynamic_sampling_with_a_missing_reward_is_value_error():
    with pytest.raises(ValueError, match="None"):
        fill_groups_with_spread(lambda k: [("g", [1.0, None])], target_groups=1, max_rounds=1)


@pytest.mark.parametrize("clamp, expected", [(10.0, 10.0 / 4), (None, OUTLIER / 4)])
def test_learner_kl_loss_term_uses_the_configured_bound(tiny_model_path, clamp, expected):
    from async_rl.buffers.trajectory import Trajectory, collate
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(kl_coef=0.1, kl_k3_clamp=clamp).apply_preset()
    learner = FSDPLearner(LearnerConfig(), algo, tiny_model_path, temperature=1.0, total_optimizer_steps=1)
    traj = Trajectory(trajectory_id="0/0", group_id=0, prompt_uid="p", prompt_ids=[5, 6], response_ids=[9, 10, 11, 12],
                      behavior_logprobs=[0.0] * 4, loss_mask=[1] * 4, finish_reason="stop", policy_version=[0] * 4)
    batch = collate([traj], pad_token_id=0)
    logprobs = learner.compute_logprobs(batch)
    batch.behavior_logprobs = logprobs * batch.loss_mask
    batch.extras["proximal_logprobs"] = logprobs
    ref = logprobs.clone()
    ref[0, 2] += 20.0  # the second response token: log r = 20
    batch.extras["ref_logprobs"] = ref
    out = learner.train_step(batch)
    assert float(out["loss/kl"]) == pytest.approx(expected, rel=1e-4)
