"""How a learner cuts a batch: across data-parallel ranks by tokens, then into micro-batches
under a hard token budget, and (``learner.packing``) how a micro-batch's sequences are packed
into one padding-free row and its per-label outputs unpacked again.

Both cuts keep sequences in order and contiguous, so a rank's share and a micro-batch are plain
slices of the batch (``TrainBatch.select(slice)``), and both are pure functions of the sequence
lengths, so every rank computes the same plan without communicating.
"""

from __future__ import annotations

from typing import Sequence

import torch


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


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int, packed: bool = False) -> list[range]:
    """Contiguous micro-batches of ``lengths`` with at most ``max_tokens`` tokens each.

    A micro-batch's cost is counted as what its forward pass computes: its padded size,
    ``len * max(lengths in it)`` (lengths ``[7] * 8`` with budget 8 give 8 micro-batches of one
    sequence; ``[3, 3, 2]`` with budget 6 give ``[0, 1]`` and ``[2]``), or with ``packed`` the
    sum of its lengths (``[3, 3, 2]`` with budget 6 give ``[0, 1]`` and ``[2]``; ``[3, 2, 1]``
    give ``[0, 1, 2]``).

    Args:
        lengths: tokens of each sequence (>= 1), in batch order.
        max_tokens: the hard budget per micro-batch (>= 1).
        packed: the micro-batch runs as one packed row (``pack_rows``), without padding.

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
        longest_with = longest + n if packed else max(longest, n)
        if i > start and (longest_with if packed else (i + 1 - start) * longest_with) > max_tokens:
            out.append(range(start, i))
            start, longest_with = i, n
        longest = longest_with  # packed: the tokens so far; padded: the longest so far
    if start < len(lengths):
        out.append(range(start, len(lengths)))
    return out


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the real tokens of right-padded rows into one row without padding.

    The position ids restart at 0 for every sequence, which is how Hugging Face models tell the
    sequences of a packed row apart when no attention mask is passed: flash-attention builds
    varlen ``cu_seqlens`` from them and sdpa/eager a block-diagonal causal mask
    (``transformers.masking_utils.find_packed_sequence_indices``), so no token attends across a
    boundary and each sequence's log-probs equal its padded ones.

    Args:
        input_ids: ``[B, L]`` int64, right-padded.
        attention_mask: ``[B, L]`` int64/bool, each row ``n_b`` ones then zeros.
        position_ids: ``[B, L]`` int64, 0 at each row's first token.

    Returns:
        ``(ids, positions)``, each ``[1, N]`` int64 with ``N = sum(n_b)``, rows in batch order.
    """
    keep = attention_mask.bool()
    return input_ids[keep].unsqueeze(0), position_ids[keep].unsqueeze(0)


def unpack_labels(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-label values of a packed row back in the padded label layout (the inverse of
    ``pack_labels`` at the slots that predict a real token).

    Label slot ``t`` of row ``b`` (predicting token ``t + 1``) is packed position
    ``offset_b + t``; the last position of each sequence would predict the next sequence's first
    token and is dropped. Differentiable (``masked_scatter``), so gradients reach the packed
    forward pass.

    Args:
        values: ``[1, N-1, *trailing]`` or ``[N-1, *trailing]``, one entry per packed position but
            the last (as computed from logits ``[:, :-1]`` against labels ``ids[:, 1:]``);
            ``trailing`` may be empty (one float per position) or e.g. ``K`` values per position.
            ``[1, N-1, ...]`` is read as the packed row when both readings fit.
        attention_mask: ``[B, L]`` the padded rows' mask (``N = attention_mask.sum()``).

    Returns:
        ``[B, L-1, *trailing]``, the dtype of ``values``, 0 at every slot that does not predict a
        real token of its own row.

    Raises:
        ValueError: ``values`` does not hold ``attention_mask.sum() - 1`` positions.
    """
    keep = attention_mask.bool()
    n = int(keep.sum()) - 1
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == n:
        body = values[0]
    elif values.dim() >= 1 and values.shape[0] == n:
        body = values
    else:
        raise ValueError(f"unpack_labels: values {tuple(values.shape)} for {n + 1} packed tokens (need N - 1 "
                         "positions)")
    trailing = body.shape[1:]
    # One entry per packed token (the last one predicts nothing), scattered to its padded slot.
    per_token = torch.cat([body, body.new_zeros(1, *trailing)])
    where = keep.reshape(*keep.shape, *(1,) * len(trailing))
    full = torch.zeros((*keep.shape, *trailing), dtype=body.dtype, device=body.device)
    full = full.masked_scatter(where.expand_as(full), per_token)
    # Slot t is valid when token t + 1 is real: this drops each sequence's boundary position.
    return torch.where(where[:, 1:], full[:, :-1], torch.zeros((), dtype=body.dtype, device=body.device))


def pack_labels(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-label values of right-padded rows in the layout of their packed row (``pack_rows``):
    the inverse of ``unpack_labels``.

    Label slot ``t`` of row ``b`` (predicting token ``t + 1``) goes to packed position
    ``offset_b + t``; the position of each sequence's last token (it would predict the next
    sequence's first token) gets 0, and the packed row's last position, which predicts nothing,
    is dropped. Slots that predict no real token of their own row are not read. Differentiable
    (indexing), so gradients reach ``values`` at the slots that are read.

    Example: rows of 3, 2 and 4 real tokens (``N = 9``), ``values[b, t] = 10 * b + t`` give
    ``[[0, 1, 0, 10, 0, 20, 21, 22]]``.

    Args:
        values: ``[B, L-1, *trailing]`` (any dtype), one entry per label slot (``trailing``
            e.g. ``K`` token ids per slot).
        attention_mask: ``[B, L]`` int64/bool, each row ``n_b`` ones then zeros (``N = sum(n_b)``).

    Returns:
        ``[1, N-1, *trailing]``, the dtype and device of ``values``.

    Raises:
        ValueError: ``values`` does not start with ``[B, L-1]``.
    """
    keep = attention_mask.bool()
    if tuple(values.shape[:2]) != (keep.shape[0], keep.shape[1] - 1):
        raise ValueError(f"pack_labels: values {tuple(values.shape)} for an attention mask {tuple(keep.shape)} "
                         "(need [B, L-1, ...])")
    trailing = values.shape[2:]
    # Slot t is read when token t + 1 is real; each sequence's last token gets 0 (a pad column
    # past L-1 gives the full-length rows theirs).
    valid = keep[:, 1:].reshape(*keep[:, 1:].shape, *(1,) * len(trailing))
    per_token = torch.cat([torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device)),
                           values.new_zeros(keep.shape[0], 1, *trailing)], 1)
    return per_token[keep][:-1].unsqueeze(0)
