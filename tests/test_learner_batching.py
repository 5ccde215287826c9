"""Cutting a batch across ranks by tokens and into micro-batches under a token budget."""

from __future__ import annotations

import itertools
import random

import pytest

from async_rl.learners.batching import micro_batches_by_tokens, pack_rows, split_by_tokens, unpack_labels


def _sizes(ranges):
    return [len(r) for r in ranges]


def test_split_examples():
    assert _sizes(split_by_tokens([5] * 9, 4)) == [3, 2, 2, 2]
    # Token balance, not count balance: one long sequence gets a rank to itself.
    assert _sizes(split_by_tokens([100, 1, 1, 1, 1], 2)) == [1, 4]
    assert _sizes(split_by_tokens([1, 1, 1, 1, 100], 2)) == [4, 1]
    # Fewer sequences than ranks: one each, the rest empty.
    assert [list(r) for r in split_by_tokens([3, 4], 3)] == [[0], [1], []]
    assert [list(r) for r in split_by_tokens([7], 1)] == [[0]]


def _best_max(lengths, world):
    # Brute force over all cut positions with every rank non-empty.
    n = len(lengths)
    best = None
    for cuts in itertools.combinations(range(1, n), world - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(lengths[bounds[i]:bounds[i + 1]]) for i in range(world))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_split_is_contiguous_complete_and_optimal(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    lengths = [rng.randint(0, 20) for _ in range(rng.randint(world + 1, 10))]
    ranges = split_by_tokens(lengths, world)
    assert [i for r in ranges for i in r] == list(range(len(lengths)))
    assert all(len(r) >= 1 for r in ranges)  # nobody empty while another has >= 2
    assert max(sum(lengths[i] for i in r) for r in ranges) == _best_max(lengths, world)


def test_micro_batch_examples():
    assert _sizes(micro_batches_by_tokens([7] * 8, 8)) == [1] * 8
    assert [list(r) for r in micro_batches_by_tokens([3, 3, 2], 6)] == [[0, 1], [2]]
    assert _sizes(micro_batches_by_tokens([2, 2, 2, 2], 8)) == [4]
    assert micro_batches_by_tokens([], 8) == []


def test_a_sequence_over_the_budget_is_named():
    with pytest.raises(ValueError, match="sequence 2 has 9 tokens"):
        micro_batches_by_tokens([1, 2, 9, 1], 8)


@pytest.mark.parametrize("seed", range(20))
def test_micro_batches_respect_the_budget_and_cover_in_order(seed):
    rng = random.Random(seed)
    budget = rng.randint(8, 40)
    lengths = [rng.randint(1, 8) for _ in range(rng.randint(1, 30))]
    mbs = micro_batches_by_tokens(lengths, budget)
    assert [i for r in mbs for i in r] == list(range(len(lengths)))
    assert all(len(r) * max(lengths[i] for i in r) <= budget for r in mbs)
    # Greedy is maximal: each micro-batch could not take the next sequence.
    for a, b in zip(mbs, mbs[1:]):
        grown = list(a) + [b[0]]
        assert len(grown) * max(lengths[i] for i in grown) > budget


def test_packed_micro_batches_count_the_sum_of_lengths():
    assert [list(r) for r in micro_batches_by_tokens([3, 3, 2], 6, packed=True)] == [[0, 1], [2]]
    assert [list(r) for r in micro_batches_by_tokens([3, 2, 1], 6, packed=True)] == [[0, 1, 2]]
    # Padded, [1, 1, 6] costs 3 * 6 = 18 tokens; packed it is 8.
    assert _sizes(micro_batches_by_tokens([1, 1, 6], 8)) == [2, 1]
    assert _sizes(micro_batches_by_tokens([1, 1, 6], 8, packed=True)) == [3]
    assert _sizes(micro_batches_by_tokens([7] * 8, 8, packed=True)) == [1] * 8
    with pytest.raises(ValueError, match="sequence 1 has 9 tokens"):
        micro_batches_by_tokens([1, 9], 8, packed=True)


@pytest.mark.parametrize("seed", range(10))
def test_packed_micro_batches_respect_the_budget(seed):
    rng = random.Random(seed)
    budget = rng.randint(8, 40)
    lengths = [rng.randint(1, 8) for _ in range(rng.randint(1, 30))]
    mbs = micro_batches_by_tokens(lengths, budget, packed=True)
    assert [i for r in mbs for i in r] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= budget for r in mbs)
    for a, b in zip(mbs, mbs[1:]):
        assert sum(lengths[i] for i in a) + lengths[b[0]] > budget


def test_pack_and_unpack_round_trip():
    import torch

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    packed, positions = pack_rows(ids, mask, pos)
    assert packed.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # Value k at packed position k (predicting packed token k + 1); boundary positions 2 and 4
    # predict the next sequence's first token and must not appear.
    values = torch.arange(1.0, 9.0, requires_grad=True)
    out = unpack_labels(values, mask)
    assert out.tolist() == [[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [6.0, 7.0, 8.0]]
    out.sum().backward()
    assert values.grad.tolist() == [1, 1, 0, 1, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="need N - 1"):
        unpack_labels(torch.zeros(9), mask)


# ----------------------------------------------------------------------------- budgets exactly met

@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("length, ok", [(7, True), (8, True), (9, False)])
def test_one_sequence_at_the_budget_boundary(packed, length, ok):
    # A sequence of exactly the budget fits (its own micro-batch); one token more fits none.
    if ok:
        assert [list(r) for r in micro_batches_by_tokens([length], 8, packed=packed)] == [[0]]
        assert [list(r) for r in micro_batches_by_tokens([1, length, 1], 8, packed=packed)] in (
            [[0], [1], [2]], [[0, 1], [2]], [[0], [1, 2]])
    else:
        with pytest.raises(ValueError, match="sequence 0 has 9 tokens, more than learner.max_tokens_per_micro_batch=8"):
            micro_batches_by_tokens([length], 8, packed=packed)


@pytest.mark.parametrize("packed", [False, True])
def test_a_sequence_of_exactly_the_budget_gets_its_own_micro_batch(packed):
    assert [list(r) for r in micro_batches_by_tokens([1, 8, 1], 8, packed=packed)] == [[0], [1], [2]]
    assert [list(r) for r in micro_batches_by_tokens([8, 8], 8, packed=packed)] == [[0], [1]]


@pytest.mark.parametrize("budget, cuts", [(7, [[0], [1]]), (8, [[0, 1]]), (9, [[0, 1]])])
def test_padded_micro_batch_exactly_at_the_budget(budget, cuts):
    # Padded cost of [4, 4] together: 2 x 4 = 8 tokens.
    assert [list(r) for r in micro_batches_by_tokens([4, 4], budget)] == cuts


@pytest.mark.parametrize("budget, cuts", [(6, [[0], [1]]), (7, [[0, 1]]), (8, [[0, 1]])])
def test_packed_micro_batch_exactly_at_the_budget_counts_real_tokens(budget, cuts):
    # Packed cost of [4, 3] together: 4 + 3 = 7 real tokens (padded it would be 8).
    assert [list(r) for r in micro_batches_by_tokens([4, 3], budget, packed=True)] == cuts
    assert [list(r) for r in micro_batches_by_tokens([4, 3], 7)] == [[0], [1]]


@pytest.mark.parametrize("n, sizes", [(3, [1, 1, 1, 0]), (4, [1, 1, 1, 1]), (5, [2, 1, 1, 1])])
def test_rank_split_at_the_world_size_boundary(n, sizes):
    # World size - 1 sequences leave one rank empty (the config check refuses such a config);
    # exactly world size gives one each; one more goes to the first rank.
    assert _sizes(split_by_tokens([5] * n, 4)) == sizes
