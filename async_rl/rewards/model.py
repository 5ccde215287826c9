"""Model-based reward: a local Hugging Face model scores (prompt, response) pairs in batches.

``reward.model=<dir>`` names the judge; ``reward.model_kind`` says how it scores:

- ``classifier``: ``AutoModelForSequenceClassification`` with one label (an RLHF reward model,
  as OpenRLHF and TRL train them). The score is its scalar output on the prompt's chat messages
  plus the response as the assistant turn, rendered with the reward model's own chat template
  (plain ``prompt + response`` text when its tokenizer has none).
- ``judge``: a causal LM asked ``reward.judge_template`` (``{prompt}`` and ``{response}`` filled
  in); the score is the probability in [0, 1] of ``reward.judge_token`` as the next token.

Inputs longer than ``reward.model_max_tokens`` keep their last tokens (the start of the prompt is
cut; the response too only when it alone is longer) and are counted (``reward/model_truncated``).

The reward of a sample is ``fn + reward.model_weight * model score``, or the model score alone
when ``reward.fn`` is unset. Scoring never blocks decoding: ``ModelRewardStage`` takes each
finished sample from the engine's callback into a queue, and one thread of its own scores what
has queued, up to ``reward.model_batch_size`` at a time, and hands the trajectories on::

    engine ──on_sample──> fn reward (worker processes) ──queue──> stage thread: batch ──> score_batch
                                                                                │ (RewardModel here, or
                            on_trajectory / on_group_closed  <── reward set ────┘  the reward actor)

Where the model runs: in sync mode in the trainer's process (``RewardModel``; generation and
training take turns there, and the stage's thread overlaps scoring with the rest of the
rollout); in async mode in one Ray actor (``RewardModel`` wrapped with ``ray.remote``) shared by
every generator worker, with its own share of the cores (``torch.set_num_threads``), so workers
keep sampling while it scores. Evaluation scores in the trainer's process in both modes.

Failures of the model (it raised, or gave a non-finite score) follow ``reward.on_error``: score
0.0 for the model term, or a rejected sample; either way counted (``reward/model_errors``).

Accuracy (``rollout/accuracy``, ``eval/accuracy``) comes from a verifiable reward function only:
with ``reward.fn`` set it is that function's ``acc`` (else its own score >= 1, never the sum);
with the model alone it is NaN (no check of correctness exists).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from async_rl.rewards.stage import BatchingStage

__all__ = ["MODEL_KINDS", "ModelInput", "ModelRewardStage", "RewardModel", "validate_model_dir"]

logger = logging.getLogger(__name__)

MODEL_KINDS = ("classifier", "judge")
"""Valid ``reward.model_kind`` values."""

_NUM_FULL_LOGS = 5


def validate_model_dir(path: str, key: str = "reward.model") -> None:
    """Check that ``path`` is a Hugging Face model directory.

    Raises:
        ValueError: one line naming ``key``: the directory is missing or holds no config.json.
    """
    if not os.path.isdir(path):
        raise ValueError(f"{key}={path!r}: no such directory (a local Hugging Face model directory is needed)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{key}={path!r}: the directory holds no config.json (not a Hugging Face model directory)")


@dataclass(frozen=True, slots=True)
class ModelInput:
    """What the reward model sees of one sample.

    Attributes:
        messages: the prompt's chat messages (``[{"role", "content"}, ...]``); may be empty.
        prompt_text: the prompt as plain text (used without messages or without a chat template).
        response: the decoded response (a conversation's final answer).
    """

    messages: list[dict[str, Any]]
    prompt_text: str
    response: str


class RewardModel:
    """A reward model that scores batches of ``ModelInput`` (fp32, CPU, no gradients).

    Args:
        path: local Hugging Face model directory (resolved: no ``builtin:`` URI).
        kind: ``classifier`` or ``judge`` (``MODEL_KINDS``).
        batch_size: inputs per forward pass (>= 1).
        max_tokens: longest input in tokens; longer ones keep their last ``max_tokens``.
        judge_template: ``str.format`` template with ``{prompt}`` and ``{response}`` (judge only).
        judge_token: text whose first token's probability is the judge's score (judge only).
        num_threads: torch intra-op threads for this process (0: leave them as they are); a Ray
            actor passes its share of the cores.

    Raises:
        ValueError: a bad directory or kind; a classifier with other than one label; a judge
            token that is empty as tokens.
    """

    def __init__(self, path: str, kind: str = "classifier", batch_size: int = 8, max_tokens: int = 1024,
                 judge_template: str = "", judge_token: str = " yes", num_threads: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        validate_model_dir(path)
        if kind not in MODEL_KINDS:
            raise ValueError(f"reward.model_kind must be one of {MODEL_KINDS}, got {kind!r}")
        self.kind, self.batch_size, self.max_tokens = kind, batch_size, max_tokens
        self.judge_template = judge_template
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
        self.model = auto.from_pretrained(path, dtype=torch.float32).eval()
        if kind == "classifier" and self.model.config.num_labels != 1:
            raise ValueError(f"reward.model={path!r}: a classifier reward model needs num_labels=1 (one scalar "
                             f"score), this one has {self.model.config.num_labels}")
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else self.tokenizer.eos_token_id
        # Sequence classifiers pool at the last token that is not padding (HF), so they need the id.
        self.model.config.pad_token_id = self.pad_id = pad if pad is not None else 0
        self.judge_token_id = None
        if kind == "judge":
            ids = self.tokenizer(judge_token, add_special_tokens=False)["input_ids"]
            if not ids:
                raise ValueError(f"reward.judge_token={judge_token!r} is no token of {path!r}'s tokenizer")
            self.judge_token_id = ids[0]
        self.num_truncated = 0

    def render(self, item: ModelInput) -> str:
        """The text the model reads for ``item`` (before tokenization and truncation)."""
        if self.kind == "judge":
            return self.judge_template.format(prompt=item.prompt_text, response=item.response)
        if item.messages and getattr(self.tokenizer, "chat_template", None):
            messages = [*item.messages, {"role": "assistant", "content": item.response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return item.prompt_text + item.response

    def encode(self, item: ModelInput) -> tuple[list[int], bool]:
        """Token ids of ``item`` (at most ``max_tokens``, the first ones cut) and whether it was cut."""
        ids = self.tokenizer(self.render(item), add_special_tokens=True)["input_ids"]
        if len(ids) > self.max_tokens:
            return ids[-self.max_tokens:], True
        return ids, False

    @torch.no_grad()
    def score(self, items: Sequence[ModelInput]) -> tuple[list[float], int]:
        """Score ``items`` in forward passes of ``batch_size``.

        Returns:
            ``(scores, num_truncated)``: one float per item (classifier: the scalar output;
            judge: probability of the judge token, in [0, 1]; may be non-finite, the caller
            checks), and how many of these inputs were cut to ``max_tokens``.

        Raises:
            Exception: whatever the model raises (the caller counts it under ``reward.on_error``).
        """
        encoded = [self.encode(item) for item in items]
        truncated = sum(cut for _, cut in encoded)
        self.num_truncated += truncated
        scores: list[float] = []
        for start in range(0, len(encoded), self.batch_size):
            scores += self._forward([ids for ids, _ in encoded[start:start + self.batch_size]])
        return scores, truncated

    def _forward(self, batch: list[list[int]]) -> list[float]:
        # Right padding: causal attention keeps every real position's output what it is alone, and
        # the classifier pools at the last non-pad token, so a batch scores as its rows one by one.
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        out = self.model(input_ids=input_ids, attention_mask=mask)
        if self.kind == "classifier":
            return out.logits[:, 0].float().tolist()
        last = mask.sum(1) - 1
        logits = out.logits[torch.arange(len(batch)), last].float()  # [B, V]
        return torch.softmax(logits, dim=-1)[:, self.judge_token_id].tolist()


_MODEL_METRIC_KEYS = ("reward/model_scored", "reward/model_errors", "reward/model_rejected", "reward/model_truncated")


class ModelRewardStage(BatchingStage):
    """Adds the reward model's score to finished samples, in batches on a thread of its own
    (``BatchingStage``: ``submit`` with a ``ModelInput``, ``drain``).

    Args:
        score_batch: ``score_batch(list[ModelInput]) -> (scores, num_truncated)``:
            ``RewardModel.score``, or a call into the reward actor.
        batch_size: most samples per ``score_batch`` call (``reward.model_batch_size``).
        weight: coefficient of the model score (``reward.model_weight``).
        with_fn: a reward function scores too (reward = fn + weight * model); without, the reward
            is ``weight * model`` and accuracy is NaN.
        on_error: ``zero`` or ``reject`` (``reward.on_error``).

    Its ``counts`` (reduction: sum): ``reward/model_scored`` (samples sent to the model),
    ``reward/model_errors``, ``reward/model_rejected``, ``reward/model_truncated``.
    """

    def __init__(self, score_batch: Callable[[list[ModelInput]], tuple[list[float], int]], batch_size: int,
                 weight: float, with_fn: bool, on_error: str) -> None:
        # counts(): reward/model_scored (samples sent to the model), reward/model_errors,
        # reward/model_rejected, reward/model_truncated.
        super().__init__(batch_size, "reward model", _MODEL_METRIC_KEYS)
        self.score_batch, self.weight = score_batch, weight
        self.with_fn, self.on_error = with_fn, on_error

    def _finish(self, batch: list[tuple[ModelInput, Any, Callable]]) -> None:
        live = [(item, traj, done) for item, traj, done in batch if traj is not None]
        scores: list[float] | None = None
        error = None
        if live:
            try:
                scores, truncated = self.score_batch([item for item, _, _ in live])
                if len(scores) != len(live):
                    raise ValueError(f"returned {len(scores)} scores for {len(live)} inputs")
            except Exception as e:  # the model failed: each of its samples is one error
                error, truncated = f"raised {type(e).__name__}: {e}", 0
            with self._lock:
                self._counts["reward/model_scored"] += len(live)
                self._counts["reward/model_truncated"] += truncated
        results = iter(scores or [])
        for item, traj, done in batch:
            if traj is None:
                done(None)
                continue
            score = next(results) if scores is not None else None
            reason = error or (None if math.isfinite(score) else f"non-finite score {score!r}")
            if reason is not None:
                if self._fail(reason):
                    done(None)
                    continue
                score = 0.0
            self._apply(traj, score)
            done(traj)

    def _apply(self, traj, score: float) -> None:
        extras = dict(traj.reward_extras)
        if self.with_fn:
            # Accuracy stays the verifiable function's, never a threshold on the sum.
            extras.setdefault("acc", float(traj.reward >= 1.0))
            traj.reward = traj.reward + self.weight * score
        else:
            extras["acc"] = float("nan")
            traj.reward = self.weight * score
        extras["model_score"] = score
        traj.reward_extras = extras

    def _fail(self, reason: str) -> bool:
        """Count one failed sample; returns whether it is rejected."""
        rejected = self.on_error == "reject"
        with self._lock:
            self._counts["reward/model_errors"] += 1
            self._counts["reward/model_rejected"] += rejected
            count = self._counts["reward/model_errors"]
            if self.first_error is None:
                self.first_error = f"reward model: {reason}"
        if count <= _NUM_FULL_LOGS or str(count).rstrip("0") == "1":
            logger.warning("reward model failed (error %d, counted as %s): %s", count,
                           "rejected" if rejected else "model score 0.0", reason)
        return rejected


def model_kwargs(reward_cfg) -> dict[str, Any]:
    """``RewardModel``'s keyword arguments of a ``RewardConfig`` (all but path and threads)."""
    return {"kind": reward_cfg.model_kind, "batch_size": reward_cfg.model_batch_size,
            "max_tokens": reward_cfg.model_max_tokens, "judge_template": reward_cfg.judge_template,
            "judge_token": reward_cfg.judge_token}
