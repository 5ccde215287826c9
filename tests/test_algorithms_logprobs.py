"""Log-probs, entropy and masked reductions, against hand-computed values."""

import math

import pytest
import torch

from async_rl.algorithms import (entropy_bonus, entropy_from_logits, logprobs_from_logits, masked_max,
                                 masked_mean, masked_sum)


def test_temperature_logprob_and_entropy_fault_case_9():
    # logits / 0.5 = [4, 0]: log p0 = -log(1 + e^-4) = -0.018149; H = 0.0901 nats.
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.5)
    assert lp.dtype == torch.float32 and lp.shape == (1, 1)
    assert round(lp.item(), 4) == -0.0181
    assert round(entropy_from_logits(logits, temperature=0.5).item(), 4) == 0.0901


def test_logprobs_match_log_softmax_for_bf16_input():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7).bfloat16()
    labels = torch.randint(7, (2, 3))
    expected = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    got = logprobs_from_logits(logits, labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


def test_entropy_is_finite_and_nonnegative_with_masked_vocab():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    masked_vocab = logits.masked_fill(torch.tensor([True, False, False, True, False]), float("-inf"))
    h = entropy_from_logits(masked_vocab)
    assert torch.isfinite(h).all() and (h >= 0).all() and (h <= math.log(3) + 1e-6).all()
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(torch.zeros(1, 2, 2), torch.zeros(1, 3, dtype=torch.long))


def test_entropy_over_valid_tokens_fault_case_6():
    # Two valid sampled tokens of log-prob -0.5; the padded slots hold garbage that would make a
    # naive mean negative or NaN. -logprob is the one-sample entropy estimate.
    logprobs = torch.tensor([[-0.5, -0.5, 3.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0, 0]])
    entropy = -logprobs
    per_token = entropy_bonus(entropy, mask, agg_mode="token-mean", num_global_tokens=2, num_global_seqs=1)
    per_seq = entropy_bonus(entropy, mask, agg_mode="seq-mean-token-sum", num_global_tokens=2,
                            num_global_seqs=1)
    assert per_token.item() == pytest.approx(0.5)  # nats per valid token
    assert per_seq.item() == pytest.approx(1.0)  # nats per sequence (sum over its 2 valid tokens)
    assert masked_mean(entropy, mask).item() == pytest.approx(0.5)
    assert per_token.item() >= 0 and per_seq.item() >= 0


def test_masked_reductions_ignore_nan_in_masked_slots():
    x = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    s, m = masked_sum(x, mask), masked_mean(x, mask)
    assert s.item() == 4.0 and m.item() == 2.0
    (s + m).backward()
    assert x.grad.tolist() == [[1.5, 0.0], [1.5, 0.0]]
    assert masked_max(x, mask).item() == 3.0
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.0, 3.0]))


def test_masked_mean_of_empty_mask_is_zero_and_nan_in_valid_slot_surfaces():
    x = torch.tensor([[float("nan"), 2.0]])
    assert masked_mean(x, torch.zeros(1, 2)).item() == 0.0
    assert masked_max(x, torch.zeros(1, 2)).item() == 0.0
    assert torch.isnan(masked_mean(x, torch.ones(1, 2)))
