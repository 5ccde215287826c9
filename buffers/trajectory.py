"""Trajectories, groups, and their collation into padded learner batches.

Layout of a collated batch (worked example). Prompt ``[p0, p1, p2]``, response ``[r0, r1, eos]``,
batch padded to ``L = 8`` tokens with pad id ``_``::

    input_ids       p0 p1 p2 r0 r1 eos _  _        [B, L]
    attention_mask  1  1  1  1  1  1   0  0        [B, L]
    position_ids    0  1  2  3  4  5   5  5        [B, L]   (cumsum of the mask - 1, clamped)
    labels             p1 p2 r0 r1 eos _  _        [B, L-1] = input_ids[:, 1:]
    loss_mask          0  0  1  1  1   0  0        [B, L-1] (1 where the label is a response token)

Every per-token tensor of the learner (``behavior_logprobs``, ``advantages``, learner log-probs)
is aligned with ``labels``: slot ``t`` scores token ``input_ids[:, t + 1]`` given the tokens up
to ``t``. Position ids come from the attention mask, so the same sequence gets the same
log-probs whether it is left- or right-padded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class Trajectory:
    """One sampled response to one prompt, with everything the learner needs.

    Attributes:
        trajectory_id: unique id (``"<group_id>/<index in group>"``); the buffer drops duplicates.
        group_id: id of the group (the ``n`` samples of one prompt draw); advantages use it.
        prompt_uid: the dataset identity of the prompt (``Prompt.uid``).
        prompt_ids: prompt token ids, length P.
        response_ids: sampled token ids, length R (EOS included when the response stopped).
        behavior_logprobs: log-probs of ``response_ids`` under the generator's sampling
            distribution (temperature-scaled), length R, float.
        loss_mask: 1 for tokens the policy generated and is trained on, 0 for tool output or
            template glue, length R.
        finish_reason: ``"stop"`` (a stop token ended it), ``"length"`` (hit the token limit),
            ``"abort"`` or ``"tool_error"``.
        policy_version: the generator's policy version per response token, length R (all equal
            unless weights changed mid-generation).
        reward: scalar reward after shaping (set by the scorer).
        reward_extras: other numeric reward fields, for example ``{"acc": 1.0}``.
        response_text: decoded response (for reward and logs); for a multi-turn conversation its
            final answer (its turn and tool counts are in ``reward_extras`` under ``agent/``).
        generator_id: the generator actor that sampled it (its index in the async pool; which
            node that is: ``placement.json``), or -1 for the trainer's own engine (sync mode).
    """

    trajectory_id: str
    group_id: int
    prompt_uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    loss_mask: list[int]
    finish_reason: str
    policy_version: list[int]
    reward: float = 0.0
    reward_extras: dict[str, float] = field(default_factory=dict)
    response_text: str = ""
    generator_id: int = -1

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not (len(self.behavior_logprobs) == len(self.loss_mask) == len(self.policy_version) == n):
            raise ValueError(
                f"trajectory {self.trajectory_id}: per-token fields disagree in length "
                f"(response_ids {n}, behavior_logprobs {len(self.behavior_logprobs)}, "
                f"loss_mask {len(self.loss_mask)}, policy_version {len(self.policy_version)})")

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced any token (the staleness reference)."""
        return min(self.policy_version) if self.policy_version else 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length, in tokens."""
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class TrainBatch:
    """A padded batch for the learner; see the module docstring for the alignment.

    Attributes:
        input_ids: ``[B, L]`` int64, right-padded.
        attention_mask: ``[B, L]`` int64.
        position_ids: ``[B, L]`` int64, from the attention mask.
        loss_mask: ``[B, L-1]`` float32, 1 on trainable response tokens.
        behavior_logprobs: ``[B, L-1]`` float32, 0 outside the response.
        advantages: ``[B, L-1]`` float32, 0 outside the loss mask.
        rewards: ``[B]`` float32 sequence rewards.
        group_ids: ``[B]`` int64.
        extras: other per-sample tensors keyed by name (for example ``ref_logprobs``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn, per_sequence=None) -> "TrainBatch":
        """A batch with ``fn`` applied to every tensor (``per_sequence`` to the ``[B]`` ones if given)."""
        seq = per_sequence or fn
        return TrainBatch(
            input_ids=fn(self.input_ids), attention_mask=fn(self.attention_mask),
            position_ids=fn(self.position_ids), loss_mask=fn(self.loss_mask),
            behavior_logprobs=fn(self.behavior_logprobs), advantages=fn(self.advantages),
            rewards=seq(self.rewards), group_ids=seq(self.group_ids),
            extras={k: fn(v) for k, v in self.extras.items()},
        )

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> "TrainBatch":
        """Rows ``index`` of every tensor (a micro-batch or a rank's share)."""
        if not isinstance(index, (slice, torch.Tensor)):
            index = torch.as_tensor(list(index), dtype=torch.long)
        return self._map(lambda t: t[index])

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The batch with every tensor on ``device`` (itself when they already are there)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return self._map(lambda t: t.to(device, non_blocking=True))

    def trimmed(self) -> "TrainBatch":
        """The batch cut to its longest row (right padding beyond it removed): ``[B, L']`` and
        ``[B, L'-1]`` tensors with ``L' = max(attention_mask.sum(1))`` (at least 2 columns).
        Per-sequence ``[B]`` extras are kept whole."""
        width = max(2, int(self.attention_mask.sum(1).max())) if len(self) else self.input_ids.shape[1]
        if width >= self.input_ids.shape[1]:
            return self
        full = self.input_ids.shape[1]
        cut = lambda t: t[:, :width] if t.dim() >= 2 and t.shape[1] == full else (  # noqa: E731
            t[:, : width - 1] if t.dim() >= 2 and t.shape[1] == full - 1 else t)
        return self._map(cut, per_sequence=lambda t: t)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, L]`` int64 that count only real tokens: ``cumsum(mask) - 1``, clamped at 0.

    Left pads get position 0 and right pads repeat the last position; neither is attended to, so
    a sequence's log-probs do not depend on where its padding sits.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def collate(trajectories: Sequence[Trajectory], pad_token_id: int,
            advantages: Sequence[Sequence[float]] | None = None) -> TrainBatch:
    """Right-pad trajectories into a ``TrainBatch``.

    Args:
        trajectories: B trajectories.
        pad_token_id: id written into padded ``input_ids`` slots (never attended, never trained).
        advantages: optional per-response-token advantages, one sequence of length R_i per
            trajectory; zeros when ``None``.

    Returns:
        The batch with L = max over trajectories of (P_i + R_i).

    Raises:
        ValueError: for an empty list, or an advantage row whose length is not R_i.
    """
    if not trajectories:
        raise ValueError("collate() needs at least one trajectory")
    B = len(trajectories)
    L = max(t.num_tokens for t in trajectories)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    behavior = torch.zeros((B, L - 1), dtype=torch.float32)
    adv = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        P, R = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : P + R] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention_mask[i, : P + R] = 1
        # Label slot P-1 predicts the first response token.
        sl = slice(P - 1, P - 1 + R)
        loss_mask[i, sl] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behavior[i, sl] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
        if advantages is not None:
            if len(advantages[i]) != R:
                raise ValueError(f"advantages for {t.trajectory_id}: {len(advantages[i])} values for {R} tokens")
            adv[i, sl] = torch.as_tensor(advantages[i], dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids, attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask), loss_mask=loss_mask,
        behavior_logprobs=behavior, advantages=adv * loss_mask,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
    )

