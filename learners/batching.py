"""How a learner cuts a batch: across data-parallel ranks by tokens, then into micro-batches
under a hard token budget.

Both cuts keep sequences in order and contiguous, so a rank's share and a micro-batch are plain
slices of the batch (``TrainBatch.select(slice)``), and both are pure functions of the sequence
lengths, so every rank computes the same plan without communicating.
"""

from __future__ import annotations

from typing import Sequence


def split_by_tokens(lengths: Sequence[int], world_size: int) -> list[range]:
    """Contiguous, order-kept shares of ``lengths`` for ``world_size`` ranks, balanced by tokens.

    No rank is left empty while another holds two or more sequences (9 equal sequences over 4
    ranks give ``[3, 2, 2, 2]``), and the largest share has the fewest tokens possible (the
    slowest rank sets the step time); under that bound each share is cut where it first reaches
    an even split of the tokens left.

    Args:
        lengths: tokens of each sequence (>= 0), in batch order.
        world_size: ranks (>= 1).

    Returns:
        ``world_size`` ranges covering ``range(len(lengths))`` in order; with fewer sequences
        than ranks the last ranks get empty ranges.

    Raises:
        ValueError: ``world_size < 1`` or a negative length.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {list(lengths)}")
    n = len(lengths)
    if n <= world_size:
        return [range(i, i + 1) if i < n else range(n, n) for i in range(world_size)]
    # Every rank gets at least one sequence (n > world_size), which is exactly "no rank empty
    # while another has two". First the smallest feasible cap on a share's tokens (binary search
    # with a greedy check), then, under that cap, each cut where the share first reaches an even
    # split of what is left (so 9 equal sequences over 4 ranks give [3, 2, 2, 2], not [3, 3, 2, 1]).
    prefix = [0]
    for x in lengths:
        prefix.append(prefix[-1] + x)

    def feasible(start: int, ranks: int, cap: int) -> bool:
        # Greedy max-fill from ``start`` over ``ranks`` ranks, one sequence at least each.
        for r in range(ranks - 1):
            last = n - (ranks - 1 - r)
            end = start + 1
            while end < last and prefix[end + 1] - prefix[start] <= cap:
                end += 1
            if prefix[end] - prefix[start] > cap:
                return False
            start = end
        return prefix[n] - prefix[start] <= cap

    lo, hi = max(lengths), prefix[n]
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(0, world_size, mid):
            hi = mid
        else:
            lo = mid + 1
    cuts, start = [0], 0
    for r in range(world_size - 1):
        left = world_size - r
        last = n - (left - 1)
        target = (prefix[n] - prefix[start]) / left
        end = start + 1
        while end < last and prefix[end] - prefix[start] < target and prefix[end + 1] - prefix[start] <= lo:
            end += 1
        # Feasibility of the rest only grows as this share takes more (within the cap).
        while not feasible(end, left - 1, lo):
            end += 1
        cuts.append(end)
        start = end
    cuts.append(n)
    return [range(cuts[r], cuts[r + 1]) for r in range(world_size)]


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[range]:
    """Contiguous micro-batches of ``lengths`` with at most ``max_tokens`` tokens each.

    A micro-batch's cost is counted as its padded size, ``len * max(lengths in it)``, since that
    is what a padded forward pass computes (lengths ``[7] * 8`` with budget 8 give 8 micro-batches
    of one sequence; ``[3, 3, 2]`` with budget 6 give ``[0, 1]`` and ``[2]``).

    Args:
        lengths: tokens of each sequence (>= 1), in batch order.
        max_tokens: the hard budget per micro-batch (>= 1).

    Returns:
        Ranges covering ``range(len(lengths))`` in order, each within the budget.

    Raises:
        ValueError: ``max_tokens < 1``, or a sequence longer than the budget (its index and
            length are named: it cannot fit any micro-batch).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {max_tokens}")
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens, more than learner.max_tokens_per_micro_batch="
                             f"{max_tokens}: it fits no micro-batch")
        longest_with = max(longest, n)
        if i > start and (i + 1 - start) * longest_with > max_tokens:
            out.append(range(start, i))
            start, longest_with = i, n
        longest = longest_with
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out
