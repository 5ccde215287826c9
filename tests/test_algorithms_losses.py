"""Policy losses: clip metrics, NaN hygiene, behaviour correction, GSPO/CISPO edge cases."""

import math

import pytest
import torch

from async_rl.algorithms import POLICY_LOSSES, OffPolicyCorrection, PolicyLossInputs
from async_rl.algorithms import policy_loss as resolve_and_call

NAN = float("nan")
AGG = {"agg_mode": "token-mean"}


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def policy_loss(name, logprobs, proximal, behavior, advantages, mask, *, agg_mode, num_global_tokens,
                num_global_seqs, horizon=None, behavior_correction="none", bypass=False, **params):
    """The loss call with the tensors spelled out: one inputs object, one correction config, the
    loss's own options type built from ``params``."""
    inputs = PolicyLossInputs(logprobs, proximal, behavior, advantages, mask, agg_mode=agg_mode,
                              num_global_tokens=num_global_tokens, num_global_seqs=num_global_seqs, horizon=horizon)
    options = POLICY_LOSSES.get(name).options_type(**params)
    return resolve_and_call(name, inputs, OffPolicyCorrection(behavior_correction, bypass_proximal=bypass), options)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_tis", "seq_icepop"])
def test_nan_in_masked_slot_is_ignored_fault_case_5(name, correction):
    logprobs = torch.zeros(1, 2, requires_grad=True)
    loss, metrics = policy_loss(name, logprobs, _t([[0.0, NAN]]), _t([[0.0, NAN]]), _t([[1.0, 1.0]]),
                                _t([[1, 0]]), num_global_tokens=1, num_global_seqs=1,
                                behavior_correction=correction, **AGG)
    single = torch.zeros(1, 1, requires_grad=True)
    expected, _ = policy_loss(name, single, _t([[0.0]]), _t([[0.0]]), _t([[1.0]]), _t([[1]]),
                              num_global_tokens=1, num_global_seqs=1, **AGG)
    assert torch.isfinite(loss) and loss.item() == expected.item()
    assert metrics["approx_kl"].item() == 0.0 and metrics["mismatch_kl"].item() == 0.0
    loss.backward()
    expected.backward()
    assert logprobs.grad[0, 1].item() == 0.0 and logprobs.grad[0, 0].item() == single.grad[0, 0].item()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_nan_in_valid_slot_surfaces_fault_case_5(name):
    loss, _ = policy_loss(name, torch.zeros(1, 2), _t([[0.0, NAN]]), _t([[0.0, NAN]]), _t([[1.0, 1.0]]),
                          _t([[1, 1]]), num_global_tokens=2, num_global_seqs=1, **AGG)
    assert torch.isnan(loss)


def test_ppo_clip_metrics_fault_case_7():
    ratio = _t([[1.5, 1.5, 0.5]])
    proximal = torch.zeros(1, 3)
    loss, m = policy_loss("ppo_clip", ratio.log(), proximal, proximal, _t([[1.0, -1.0, -1.0]]),
                          torch.ones(1, 3), num_global_tokens=3, num_global_seqs=1, **AGG)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    # per token: -1.2 (clipped), +1.5 (unclipped, pessimistic), +0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 1.5 + 0.8) / 3)
    assert m["ratio_mean"].item() == pytest.approx(7 / 6) and m["ratio_max"].item() == pytest.approx(1.5)
    assert not any(v.requires_grad for v in m.values())


def test_dual_clip_counts_as_low_fault_case_7():
    logprobs = torch.full((1, 1), math.log(5.0), requires_grad=True)
    loss, m = policy_loss("ppo_clip", logprobs, torch.zeros(1, 1), torch.zeros(1, 1), _t([[-1.0]]),
                          torch.ones(1, 1), num_global_tokens=1, num_global_seqs=1, clip_ratio_c=3.0, **AGG)
    assert loss.item() == pytest.approx(3.0)  # min(max(5, 1.2), 3)
    assert m["clip_frac_low"].item() == 1.0 and m["clip_frac_high"].item() == 0.0
    loss.backward()
    assert logprobs.grad.item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("ppo_clip", logprobs, torch.zeros(1, 1), torch.zeros(1, 1), _t([[-1.0]]),
                    torch.ones(1, 1), num_global_tokens=1, num_global_seqs=1, clip_ratio_c=0.5, **AGG)


@pytest.mark.parametrize("c", [None, math.inf])
def test_dual_clip_off_leaves_the_pessimistic_term_unbounded(c):
    # c = inf is how a config turns off async mode's default dual clip: the same loss as None.
    logprobs = torch.full((1, 2), math.log(5.0), requires_grad=True)
    loss, m = policy_loss("ppo_clip", logprobs, torch.zeros(1, 2), torch.zeros(1, 2), _t([[-1.0, 0.0]]),
                          torch.ones(1, 2), num_global_tokens=2, num_global_seqs=1, clip_ratio_c=c, **AGG)
    assert loss.item() == pytest.approx(5.0 / 2)  # -A r = 5 on the negative token, 0 on the other
    assert m["clip_frac_low"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[2.5, 0.0]]))  # d(r/2)/dlogp = r/2


def test_clip_higher_is_asymmetric():
    logprobs = _t([[math.log(1.25), math.log(0.75)]])
    _, m = policy_loss("ppo_clip", logprobs, torch.zeros(1, 2), torch.zeros(1, 2), _t([[1.0, -1.0]]),
                       torch.ones(1, 2), num_global_tokens=2, num_global_seqs=1, clip_ratio_low=0.2,
                       clip_ratio_high=0.28, **AGG)
    assert m["clip_frac_high"].item() == 0.0 and m["clip_frac_low"].item() == 0.5


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gspo_extreme_log_ratio_stays_finite_fault_case_8(advantage):
    logprobs = torch.full((1, 10), -1.0, requires_grad=True)
    proximal = torch.full((1, 10), -101.0)  # per-token log-ratio 100
    loss, m = policy_loss("gspo", logprobs, proximal, proximal, torch.full((1, 10), advantage),
                          torch.ones(1, 10), num_global_tokens=10, num_global_seqs=1,
                          agg_mode="seq-mean-token-mean")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(m["ratio_max"]) and torch.isfinite(logprobs.grad).all()
    assert m["clip_frac"].item() == (1.0 if advantage > 0 else 0.0)


def test_gspo_uses_geometric_mean_sequence_ratio():
    # token log-ratios 0.2 and 0 -> s = exp(0.1) for both tokens; A = -1 -> loss s (unclipped side)
    logprobs = _t([[0.2, 0.0]]).requires_grad_()
    loss, m = policy_loss("gspo", logprobs, torch.zeros(1, 2), torch.zeros(1, 2), _t([[-1.0, -1.0]]),
                          torch.ones(1, 2), num_global_tokens=2, num_global_seqs=1,
                          agg_mode="seq-mean-token-mean")
    s = math.exp(0.1)
    assert loss.item() == pytest.approx(s) and m["ratio_mean"].item() == pytest.approx(s)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.full((1, 2), s / 2))


def test_cispo_keeps_gradient_of_clipped_tokens():
    # ratio 1.5 > 1 + 0.2: PPO would zero this token's gradient; CISPO weights it by 1.2.
    logprobs = torch.full((1, 1), math.log(1.5), requires_grad=True)
    loss, m = policy_loss("cispo", logprobs, torch.zeros(1, 1), torch.zeros(1, 1), _t([[1.0]]),
                          torch.ones(1, 1), num_global_tokens=1, num_global_seqs=1, **AGG)
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-1.2)
    assert m["clip_frac_high"].item() == 1.0


@pytest.mark.parametrize("correction, weights, trunc", [
    ("tis", [2.0, 0.25, 1.0], 1 / 3),
    ("icepop", [0.0, 0.0, 1.0], 2 / 3),
    ("seq_tis", [0.75, 0.75, 0.75], 0.0),  # product 3 * 0.25 * 1
    ("seq_icepop", [0.75, 0.75, 0.75], 0.0),
    ("none", [1.0, 1.0, 1.0], 0.0),
])
def test_behavior_correction_weights(correction, weights, trunc):
    proximal = torch.zeros(1, 3)
    behavior = -_t([[math.log(3.0), math.log(0.25), 0.0]])  # pi_prox / mu = 3, 0.25, 1
    loss, m = policy_loss("ppo_clip", proximal.clone(), proximal, behavior, torch.ones(1, 3),
                          torch.ones(1, 3), num_global_tokens=3, num_global_seqs=1,
                          behavior_correction=correction, **AGG)
    assert loss.item() == pytest.approx(-sum(weights) / 3)  # ratio 1, A = 1: l = -w
    assert m["behavior_weight_trunc_frac"].item() == pytest.approx(trunc)
    assert m["mismatch_logprob_abs_diff"].item() == pytest.approx((math.log(3) + math.log(4)) / 3)
    expected_kl = ((3 - 1 - math.log(3)) + (0.25 - 1 - math.log(0.25))) / 3
    assert m["mismatch_kl"].item() == pytest.approx(expected_kl, rel=1e-5)


def test_bypass_uses_behavior_as_proximal():
    logprobs = _t([[math.log(1.5)]])
    behavior = torch.zeros(1, 1)
    loss, m = policy_loss("ppo_clip", logprobs, None, behavior, _t([[1.0]]), torch.ones(1, 1),
                          num_global_tokens=1, num_global_seqs=1, bypass=True, **AGG)
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac_high"].item() == 1.0
    assert m["mismatch_logprob_abs_diff"].item() == pytest.approx(math.log(1.5))
    with pytest.raises(ValueError, match="bypass"):
        policy_loss("ppo_clip", logprobs, None, behavior, _t([[1.0]]), torch.ones(1, 1),
                    num_global_tokens=1, num_global_seqs=1, **AGG)


def test_bad_arguments_raise():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="behavior_correction"):
        policy_loss("ppo_clip", z, z, z, z, z, num_global_tokens=1, num_global_seqs=1,
                    behavior_correction="is", **AGG)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss("ppo_clip", z, z, z, torch.zeros(1, 3), z, num_global_tokens=1, num_global_seqs=1, **AGG)
