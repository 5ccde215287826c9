"""How a learner cuts a batch: across data-parallel ranks by tokens, then into micro-batches
under a hard token budget, and (``learner.packing``) how a micro-batch's sequences are packed
into one padding-free row and its per-label outputs unpacked again; with
``learner.shared_prefix``, how the rows of a group that begin alike share one copy of that
prefix in the packed row.

Both cuts keep sequences in order and contiguous, so a rank's share and a micro-batch are plain
slices of the batch (``TrainBatch.select(slice)``), and both are pure functions of the sequence
lengths, so every rank computes the same plan without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class SharedPrefixPack:
    """A micro-batch packed with each group's common prefix once (``share_prefix_rows``).

    A group's *segment* is its prefix followed by each of its rows' own tokens; segments are
    laid side by side in ``R`` packed rows of width ``W`` (right-padded).

    Attributes:
        input_ids: ``[R, W]`` int64, the packed tokens (0 at padding).
        position_ids: ``[R, W]`` int64, each token's position in its own row (a row's own
            tokens continue from the prefix's length); 0 at padding.
        attend: ``[R, 1, W, W]`` bool, True where query token ``i`` may attend key ``j`` of the
            same packed row: same segment, ``j`` not after ``i``, and ``j`` in the group's prefix
            or in ``i``'s own row. A padding position attends to itself only (no query is left
            without a key), and no real token attends to padding.
        slot_positions: ``[S]`` int64, for each valid label slot (``slot_mask`` true, row-major)
            the flat position (``row * W + column``) whose output predicts that slot's label.
        slot_mask: ``[B, L-1]`` bool, label slot ``t`` of row ``b`` is valid when token ``t + 1``
            is real (``S = slot_mask.sum()``).
        prefix_tokens: tokens not run because a prefix was shared (the micro-batch's real
            tokens minus the packed real tokens).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attend: torch.Tensor
    slot_positions: torch.Tensor
    slot_mask: torch.Tensor
    prefix_tokens: int


SHARED_PREFIX_ROW_TOKENS = 128
"""``share_prefix_rows``'s packed-row capacity in tokens (a segment longer than this gets a row of
its own length). Attention over a packed row costs its width squared, whether or not the mask
lets a token see the others, so one row holding a whole micro-batch spends most of its
attention on pairs the mask throws away. Forward and backward of a 64-row micro-batch of the
default job (13-token prompts, 3-8 answer tokens; one CPU thread, sdpa), padded / one packed
row / rows of 256 / rows of 128 tokens: 8 groups of 8 samples 90 / 42 / 39 / 36 ms; 16 of 4
86 / 59 / 59 / 46 ms; 32 of 2 86 / 87 / 65 / 68 ms; 64 samples dealt from 32 groups of 8 (sync
mode's mini-batch) 86 / 81 / 61 / 53 ms."""


def _common_prefix(rows: torch.Tensor, positions: torch.Tensor, limit: int) -> int:
    """Length (<= ``limit``) of the prefix on which every row of ``rows`` ``[k, L]`` agrees with
    the first in tokens and positions."""
    same = ((rows[:, :limit] == rows[:1, :limit]) & (positions[:, :limit] == positions[:1, :limit])).all(0)
    differ = torch.nonzero(~same)
    return int(differ[0]) if len(differ) else limit


def share_prefix_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      group_ids: torch.Tensor, row_tokens: int = SHARED_PREFIX_ROW_TOKENS) -> SharedPrefixPack:
    """Pack right-padded rows so that each group's common prefix appears once.

    The rows of a group (same ``group_ids``; GRPO's samples of one prompt) begin with the same
    prompt. Packed plainly, that prompt is run once per row; here it is run once per group and
    every row's own tokens attend to it through a custom mask (the shared-prefix forward of
    Prefix Grouper, Liu et al. 2025, arXiv:2506.05433). Self-attention makes this exact: a
    prefix token sees only earlier prefix tokens, so its keys and values are the same in every
    row, and the gradient that reaches the one copy is the sum of what each row's copy would
    get. A group's prefix is the longest run of leading tokens (and positions) on which all its
    rows in this micro-batch agree, at most each row's length minus one, so every row keeps a
    token of its own. A group with one row here shares nothing and is packed as is.

    A group's segment (its prefix, then its rows' own tokens) is never split; segments are
    placed into packed rows of at most ``max(row_tokens, longest segment)`` tokens, longest
    first, each into the first row with room (first-fit decreasing), so attention, which costs
    each packed row its width squared, stays near linear in the tokens
    (``SHARED_PREFIX_ROW_TOKENS``).

    Args:
        input_ids: ``[B, L]`` int64, right-padded.
        attention_mask: ``[B, L]`` int64/bool, each row ``n_b >= 1`` ones then zeros.
        position_ids: ``[B, L]`` int64, each row's positions (0 at its first token).
        group_ids: ``[B]`` int64, the group of each row (rows of a group need not be adjacent).
        row_tokens: packed-row capacity in tokens (>= 1).

    Returns:
        ``SharedPrefixPack``; within a segment the prefix, then the group's rows in batch order.

    Raises:
        ValueError: a row is not right-padded or has no token, the shapes disagree, or
            ``row_tokens`` < 1.
    """
    keep = attention_mask.bool()
    batch, width = keep.shape
    if input_ids.shape != keep.shape or position_ids.shape != keep.shape or group_ids.shape != (batch,):
        raise ValueError(f"share_prefix_rows: input_ids {tuple(input_ids.shape)}, attention_mask {tuple(keep.shape)}, "
                         f"position_ids {tuple(position_ids.shape)} and group_ids {tuple(group_ids.shape)} disagree")
    if row_tokens < 1:
        raise ValueError(f"share_prefix_rows: row_tokens must be >= 1, got {row_tokens}")
    lengths = keep.sum(1)
    if not torch.equal(keep, torch.arange(width, device=keep.device) < lengths[:, None]) or int(lengths.min()) < 1:
        raise ValueError("share_prefix_rows: every row must hold at least one token, right-padded")
    ids_cpu, pos_cpu, lengths_list, gids = input_ids.cpu(), position_ids.cpu(), lengths.tolist(), group_ids.cpu()
    # Each segment: its spans (source row, first token, end, owner row; owner -1 = the prefix).
    segments: list[list[tuple[int, int, int, int]]] = []
    for gid in dict.fromkeys(gids.tolist()):
        rows = torch.nonzero(gids == gid).flatten().tolist()
        shared = 0 if len(rows) == 1 else _common_prefix(ids_cpu[rows], pos_cpu[rows],
                                                         min(lengths_list[r] for r in rows) - 1)
        spans = [(rows[0], 0, shared, -1)] + [(r, shared, lengths_list[r], r) for r in rows]
        segments.append([span for span in spans if span[2] > span[1]])
    sizes = [sum(stop - start for _, start, stop, _ in seg) for seg in segments]
    capacity = max(row_tokens, max(sizes))
    fill: list[int] = []  # tokens placed in each packed row
    place = [0] * len(segments)  # (packed row of each segment)
    for k in sorted(range(len(segments)), key=lambda k: -sizes[k]):  # stable: ties keep group order
        row = next((r for r, used in enumerate(fill) if used + sizes[k] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        place[k] = row
        fill[row] += sizes[k]
    n_rows, packed_width = len(fill), max(fill)
    packed_ids = torch.zeros(n_rows, packed_width, dtype=torch.long)
    packed_pos = torch.zeros(n_rows, packed_width, dtype=torch.long)
    segment_of = torch.full((n_rows, packed_width), -1, dtype=torch.long)  # -1 = padding
    owner_of = torch.full((n_rows, packed_width), -2, dtype=torch.long)
    token_at = torch.zeros(batch, width, dtype=torch.long)  # flat packed position of token t of row b
    column = [0] * n_rows
    for k, seg in enumerate(segments):
        r = place[k]
        for src, start, stop, owner in seg:
            n = stop - start
            cols = slice(column[r], column[r] + n)
            packed_ids[r, cols] = ids_cpu[src, start:stop]
            packed_pos[r, cols] = pos_cpu[src, start:stop]
            segment_of[r, cols] = k
            owner_of[r, cols] = owner
            where = r * packed_width + column[r] + torch.arange(n)
            for b in (_segment_rows(seg) if owner == -1 else [src]):
                token_at[b, start:stop] = where
            column[r] += n
    causal = torch.ones(packed_width, packed_width, dtype=torch.bool).tril()
    same = (segment_of[:, :, None] == segment_of[:, None, :]) & (segment_of[:, :, None] >= 0)
    visible = (owner_of[:, None, :] == -1) | (owner_of[:, None, :] == owner_of[:, :, None])
    pad_self = (segment_of < 0)[:, :, None] & torch.eye(packed_width, dtype=torch.bool)
    attend = (same & causal & visible) | pad_self
    slot_mask = keep[:, 1:]
    device = input_ids.device
    return SharedPrefixPack(
        input_ids=packed_ids.to(device),
        position_ids=packed_pos.to(device),
        attend=attend.unsqueeze(1).to(device),
        slot_positions=token_at[:, :-1][slot_mask.cpu()].to(device),
        slot_mask=slot_mask,
        prefix_tokens=int(lengths.sum()) - sum(sizes),
    )


def _segment_rows(segment: list[tuple[int, int, int, int]]) -> list[int]:
    """The batch rows of a segment's group (its owners), in batch order."""
    return [owner for _, _, _, owner in segment if owner >= 0] or [segment[0][0]]


def scatter_slots(values: torch.Tensor, slot_mask: torch.Tensor) -> torch.Tensor:
    """Per-slot values ``[S, *trailing]`` back in the label layout ``[B, L-1, *trailing]``, 0 at
    invalid slots (``slot_mask`` ``[B, L-1]`` bool, ``S = slot_mask.sum()``, row-major).
    Differentiable (``masked_scatter``).

    Raises:
        ValueError: ``values`` does not hold ``slot_mask.sum()`` entries.
    """
    if values.shape[0] != int(slot_mask.sum()):
        raise ValueError(f"scatter_slots: {values.shape[0]} values for {int(slot_mask.sum())} valid slots")
    trailing = values.shape[1:]
    where = slot_mask.reshape(*slot_mask.shape, *(1,) * len(trailing)).expand(*slot_mask.shape, *trailing)
    full = torch.zeros((*slot_mask.shape, *trailing), dtype=values.dtype, device=values.device)
    return full.masked_scatter(where.to(values.device), values)
