"""KL estimators, KL reward penalty and the clipped value loss."""

import math

import pytest
import torch

from async_rl.algorithms import apply_kl_reward_penalty, kl_loss, kl_penalty, value_loss

NAN = float("nan")


@pytest.mark.parametrize("kind, expected", [("k1", 1.0), ("k2", 0.5), ("k3", math.exp(-1.0))])
def test_kl_estimators_hand_computed(kind, expected):
    # log(ref / pi) = -1: k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1
    kl = kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), kind)
    assert kl.item() == pytest.approx(expected)


def test_kl_masked_nan_and_clamp():
    logprobs = torch.tensor([[-1.0, 0.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, NAN, 1000.0]])
    mask = torch.tensor([[1, 0, 1]])
    kl = kl_penalty(logprobs, ref, "k3", mask=mask)
    assert kl[0, 0].item() == 0.0 and kl[0, 1].item() == 0.0 and math.isfinite(kl[0, 2].item())
    loss = kl_loss(logprobs, ref, mask, kind="k3", agg_mode="token-mean", num_global_tokens=2,
                   num_global_seqs=1)
    loss.backward()
    assert torch.isfinite(loss) and logprobs.grad[0, 1].item() == 0.0
    with pytest.raises(ValueError, match="valid kinds"):
        kl_penalty(logprobs, ref, "k4")


def test_kl_reward_penalty_is_detached():
    kl = torch.tensor([[0.5, 2.0]], requires_grad=True)
    shaped = apply_kl_reward_penalty(torch.tensor([[0.0, 1.0]]), kl, 0.1, mask=torch.tensor([[1, 0]]))
    torch.testing.assert_close(shaped, torch.tensor([[-0.05, 0.0]]))
    assert not shaped.requires_grad


def test_value_loss_clipping_hand_computed():
    values = torch.tensor([[1.0, 3.0, NAN]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, NAN]])
    returns = torch.tensor([[2.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: err 1, clipped v 0.5 -> err 2.25 (binds); token 1: err 9 vs 0.25
    loss, m = value_loss(values, old, returns, mask, clip_range_value=0.5, agg_mode="token-mean",
                         num_global_tokens=2, num_global_seqs=1)
    assert loss.item() == pytest.approx((1.125 + 4.5) / 2)
    assert m["vf_clip_frac"].item() == 0.5
    loss.backward()
    # token 0 is clipped (no gradient through v), token 1: d/dv 0.5 (v - R)^2 / 2 = 1.5
    assert values.grad.tolist() == [[0.0, 1.5, 0.0]]
    unclipped, _ = value_loss(values, old, returns, mask, clip_range_value=None, agg_mode="token-mean",
                              num_global_tokens=2, num_global_seqs=1)
    assert unclipped.item() == pytest.approx((0.5 + 4.5) / 2)
