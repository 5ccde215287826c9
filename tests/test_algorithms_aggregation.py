"""Loss aggregation modes and global normalisers, against hand-computed values."""

import pytest
import torch

from async_rl.algorithms import LOSS_AGG_MODES, aggregate_loss, count_normalizers

NAN, INF = float("nan"), float("inf")


def test_token_mean_masked_positions_fault_case_3():
    loss = torch.tensor([[1.0, 100.0], [1.0, -50.0]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    out = aggregate_loss(loss, mask, "token-mean", num_global_tokens=2, num_global_seqs=2)
    assert out.item() == 1.0
    out.backward()
    assert loss.grad.tolist() == [[0.5, 0.0], [0.5, 0.0]]


def test_fully_masked_response_does_not_count_fault_case_4():
    loss = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    num_tokens, num_seqs = count_normalizers(mask)
    assert (num_tokens.item(), num_seqs.item()) == (4, 1)
    for mode in LOSS_AGG_MODES:
        kwargs = {"horizon": 4} if mode == "seq-mean-token-sum-norm" else {}
        out = aggregate_loss(loss, mask, mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs, **kwargs)
        expected = 4.0 if mode == "seq-mean-token-sum" else 1.0  # never 0.8 or 0.5
        assert out.item() == pytest.approx(expected), mode


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
    ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2 seqs
    ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2
    ("seq-mean-token-sum-norm", 0.875),  # (3/4 + 4/4) / 2, horizon 4
])
def test_modes_hand_computed_with_nan_and_inf_in_masked_slots(mode, expected):
    loss = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, -INF]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = aggregate_loss(loss, mask, mode, num_global_tokens=3, num_global_seqs=2, horizon=4)
    assert out.item() == pytest.approx(expected)
    out.backward()
    assert torch.isfinite(loss.grad).all()
    assert loss.grad[~mask].abs().sum().item() == 0.0


def test_nan_in_valid_slot_surfaces():
    loss = torch.tensor([[NAN, 1.0]])
    assert torch.isnan(aggregate_loss(loss, torch.ones(1, 2), "token-mean", num_global_tokens=2,
                                      num_global_seqs=1))


def test_empty_step_gives_zero_not_nan():
    out = aggregate_loss(torch.ones(1, 2), torch.zeros(1, 2), "token-mean", num_global_tokens=0,
                         num_global_seqs=0)
    assert out.item() == 0.0


def test_errors():
    loss, mask = torch.ones(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="valid modes"):
        aggregate_loss(loss, mask, "mean", num_global_tokens=2, num_global_seqs=1)
    with pytest.raises(ValueError, match="horizon"):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm", num_global_tokens=2, num_global_seqs=1)
    with pytest.raises(ValueError, match="must both be"):
        aggregate_loss(loss, torch.ones(2, 1), "token-mean", num_global_tokens=2, num_global_seqs=1)
