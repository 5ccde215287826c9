"""The teacher of on-policy distillation: log-probs of the student's sampled tokens.

``TeacherModel`` holds one frozen causal LM per distinct teacher directory (``algorithm.distill``:
one for every data source, or one per source) and scores batches of samples in forward passes of
prompt plus response; ``TeacherStage`` (a ``BatchingStage``) takes each finished, rewarded sample
off the rollout road, scores what has finished meanwhile in one call, and sets the trajectory's
``teacher_logprobs`` before it is handed on, so the teacher never delays decoding and the
learner never waits for it::

    engine ──on_sample──> reward (fn, reward model) ──queue──> teacher stage thread: batch
        ──> TeacherModel.scores (here, or in the teacher actor) ──> traj.teacher_logprobs (+ top-k)
        ──> on_trajectory / on_group_closed (the group goes to the replay buffer)

Where the model runs, as the reward model's: in sync mode in the trainer's process (the stage's
thread scores while the engine still samples the rest of the step); in async mode in one Ray actor
(``TeacherModel`` under ``ray.remote``) that every generator worker calls, with its own share of
the cores (``algorithm.distill.num_threads``) or GPUs (``num_gpus``), so the workers keep sampling
while it scores and each group reaches the buffer with its teacher log-probs. Evaluation never
goes through the teacher.

A teacher must share the student's tokenizer (the same vocabulary, token for token): it scores the
student's token ids. A different one is refused when the teacher loads. The teacher's log-probs
are taken at the sampling temperature (logits divided by it), the distribution the behavior
log-probs come from, so ``log mu - log q`` compares like with like.

With a top-k signal (``algorithm.distill.signal=topk_*``) the teacher also gives, at every
response position, its ``top_k`` most likely next tokens and their log-probs (``TeacherScores``),
from the same forward pass; the stage sets them as ``teacher_topk_ids`` and
``teacher_topk_logprobs`` beside ``teacher_logprobs``.

A failed teacher call (the model raised, or gave a non-finite log-prob) rejects each sample of
the batch, counted (``distill/teacher_errors``, ``distill/teacher_rejected``) and logged: a sample
without the teacher's signal would train on the task reward alone, silently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from async_rl.algorithms.distill import DEFAULT_TEACHER, teacher_key
from async_rl.rewards.stage import BatchingStage

__all__ = ["SAME_TOKENIZER", "TeacherInput", "TeacherModel", "TeacherScores", "TeacherStage", "same_vocabulary"]

logger = logging.getLogger(__name__)

_NUM_FULL_LOGS = 5

SAME_TOKENIZER = "on-policy distillation scores the student's token ids, so the teacher needs the student's tokenizer"
"""The end of the one-line refusal of a teacher whose tokenizer is not the student's."""


@dataclass(frozen=True, slots=True)
class TeacherInput:
    """What the teacher reads of one sample.

    Attributes:
        data_source: the sample's data source (picks its teacher).
        prompt_ids: ``[P]`` int token ids of the prompt (as the student saw it).
        response_ids: ``[R]`` int token ids the student sampled (tool output of a conversation
            included; the loss mask decides what trains).
    """

    data_source: str
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]


@dataclass(frozen=True, slots=True)
class TeacherScores:
    """What the teacher gives back for one sample.

    Attributes:
        logprobs: ``[R]`` float64 log q of each sampled response token, nats, at the sampling
            temperature.
        topk_ids: ``[R, K]`` int32 the teacher's K most likely next tokens at the position
            predicting each response token (most likely first), or ``[0, 0]`` without a top-k.
        topk_logprobs: ``[R, K]`` float32 their log-probs, or ``[0, 0]``.
    """

    logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray


_NO_TOPK_IDS = np.zeros((0, 0), dtype=np.int32)
_NO_TOPK_LOGPROBS = np.zeros((0, 0), dtype=np.float32)


def same_vocabulary(student, teacher) -> str | None:
    """Why tokenizer ``teacher`` cannot score ``student``'s token ids, or ``None`` if it can:
    the same token for every id (``get_vocab``) and the same end-of-sequence token."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        differ = len(set(s_vocab.items()) ^ set(t_vocab.items())) // 2 or abs(len(s_vocab) - len(t_vocab))
        return (f"its tokenizer differs from the student's ({len(t_vocab)} against {len(s_vocab)} tokens, "
                f"about {differ} ids mapped differently)")
    if student.eos_token != teacher.eos_token:
        return f"its end-of-sequence token is {teacher.eos_token!r}, the student's {student.eos_token!r}"
    return None


class TeacherModel:
    """Frozen teachers that score sampled tokens (fp32, no gradients), one per route.

    Args:
        routes: ``{data_source: local model directory}``, with ``"*"`` for every other source
            (``DistillConfig.routes`` resolved to directories); directories shared by several
            sources load once.
        student_tokenizer: the student's tokenizer directory (each teacher's must match it).
        temperature: the sampling temperature (> 0); logits are divided by it.
        batch_size: samples per forward pass (>= 1).
        top_k: the next tokens ``scores`` gives a position (``algorithm.distill.top_k`` of a
            ``topk_*`` signal, capped at the vocabulary); 0: none (the sampled tokens' log-probs only).
        num_threads: torch intra-op threads for this process (0: leave them as they are); a Ray
            actor passes its share of the cores.
        device: ``"cpu"``, ``"cuda"``, ...; ``None``: the GPU when torch sees one, else the CPU.

    Raises:
        ValueError: one line naming the route: a tokenizer other than the student's, a model
            whose vocabulary (embedding rows) is smaller than the tokenizer's, no route at all.
    """

    def __init__(self, routes: Mapping[str, str], student_tokenizer: str, temperature: float = 1.0,
                 batch_size: int = 16, num_threads: int = 0, device: str | None = None, top_k: int = 0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if num_threads:
            torch.set_num_threads(num_threads)
        if not routes:
            raise ValueError("TeacherModel: no teacher given (algorithm.distill.teacher or teachers)")
        if not temperature > 0:
            raise ValueError(f"TeacherModel: temperature must be > 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"TeacherModel: top_k must be >= 0, got {top_k}")
        self.temperature, self.batch_size, self.top_k = float(temperature), max(1, int(batch_size)), int(top_k)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        student = AutoTokenizer.from_pretrained(student_tokenizer)
        self.routes = dict(routes)
        self.models: dict[str, Any] = {}
        for source, path in self.routes.items():
            if path in self.models:
                continue
            key = teacher_key(source)
            problem = same_vocabulary(student, AutoTokenizer.from_pretrained(path))
            if problem:
                raise ValueError(f"{key}={path!r}: {problem}; {SAME_TOKENIZER}")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
            rows = model.get_input_embeddings().weight.shape[0]
            if rows < len(student):
                raise ValueError(f"{key}={path!r}: the model has {rows} token embeddings, fewer than the "
                                 f"tokenizer's {len(student)} tokens")
            self.models[path] = model
        self.pad_id = student.pad_token_id if student.pad_token_id is not None else (student.eos_token_id or 0)

    def path_of(self, data_source: str) -> str:
        """The teacher directory scoring ``data_source``.

        Raises:
            ValueError: no teacher for that source (the run's check of its train set's sources
                makes this a bug, not bad input).
        """
        path = self.routes.get(data_source) or self.routes.get(DEFAULT_TEACHER)
        if path is None:
            raise ValueError(f"no teacher for data source {data_source!r} (algorithm.distill.teachers has "
                             f"{sorted(self.routes)})")
        return path

    def logprobs(self, items: Sequence[TeacherInput]) -> list[np.ndarray]:
        """The teacher's log-prob of every response token of each item: one ``[R_i]`` float64
        array per item (``TeacherScores.logprobs`` of ``scores``). Raises as ``scores``."""
        return [s.logprobs for s in self.scores(items)]

    @torch.no_grad()
    def scores(self, items: Sequence[TeacherInput]) -> list[TeacherScores]:
        """The teacher's log-prob of every response token of each item and, with ``top_k``, its
        top-k next tokens at each response position.

        Returns:
            One ``TeacherScores`` per item, in order: ``log q(response_ids[t] | prompt,
            response_ids[:t])`` at the sampling temperature, in nats (``[R_i]`` float64), and the
            ``[R_i, min(top_k, V)]`` ids and log-probs (empty without ``top_k``).

        Raises:
            ValueError: an item's source has no teacher; an empty prompt.
            Exception: whatever the model raises (the stage counts it).
        """
        out: list[TeacherScores | None] = [None] * len(items)
        by_path: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            if not len(item.prompt_ids):
                raise ValueError("a teacher input with no prompt token")
            by_path.setdefault(self.path_of(item.data_source), []).append(i)
        for path, indices in by_path.items():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                for i, lp in zip(chunk, self._forward(self.models[path], [items[i] for i in chunk])):
                    out[i] = lp
        return out  # type: ignore[return-value]

    def _forward(self, model, batch: list[TeacherInput]) -> list[TeacherScores]:
        # Right padding with explicit position ids: causal attention keeps every real position's
        # output what it is alone, so a batch scores as its rows one by one.
        lengths = [len(b.prompt_ids) + len(b.response_ids) for b in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, :lengths[i]] = torch.as_tensor(np.concatenate([np.asarray(b.prompt_ids, dtype=np.int64),
                                                                  np.asarray(b.response_ids, dtype=np.int64)]))
            mask[i, :lengths[i]] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                       position_ids=positions.to(self.device)).logits
        out = []
        for i, b in enumerate(batch):
            p, r = len(b.prompt_ids), len(b.response_ids)
            # Slot p-1 predicts the first response token.
            rows = logits[i, p - 1:p - 1 + r].float() / self.temperature
            targets = ids[i, p:p + r].to(self.device)
            log_q = torch.log_softmax(rows, dim=-1)
            lp = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            topk_ids, topk_lp = _NO_TOPK_IDS, _NO_TOPK_LOGPROBS
            if self.top_k and r:
                values, indices = log_q.topk(min(self.top_k, log_q.shape[-1]), dim=-1)
                topk_ids = indices.to(torch.int32).cpu().numpy()
                topk_lp = values.cpu().numpy().astype(np.float32)
            out.append(TeacherScores(lp.double().cpu().numpy(), topk_ids, topk_lp))
        return out


_TEACHER_METRIC_KEYS = ("distill/teacher_scored", "distill/teacher_errors", "distill/teacher_rejected",
                        "distill/teacher_tokens", "distill/teacher_s")


class TeacherStage(BatchingStage):
    """Sets ``teacher_logprobs`` on finished samples, in batches on a thread of its own
    (``BatchingStage``: ``submit(TeacherInput, traj, done)``, ``drain``).

    Args:
        score_batch: ``score_batch(list[TeacherInput]) -> list of TeacherScores`` (or of
            ``[R_i]`` float64 arrays: log-probs only): ``TeacherModel.scores``, or a call into the
            teacher actor.
        batch_size: most samples per call (``algorithm.distill.batch_size``).

    Its ``counts`` (reduction: sum): ``distill/teacher_scored`` (samples sent),
    ``distill/teacher_errors`` and ``distill/teacher_rejected`` (samples whose call failed, all
    rejected), ``distill/teacher_tokens`` (response tokens scored) and ``distill/teacher_s``
    (seconds in teacher calls, off the decoding and learner threads).
    """

    def __init__(self, score_batch: Callable[[list[TeacherInput]], list], batch_size: int) -> None:
        super().__init__(batch_size, "teacher", _TEACHER_METRIC_KEYS)
        self.score_batch = score_batch

    def _finish(self, batch: list[tuple[TeacherInput, Any, Callable]]) -> None:
        live = [(item, traj, done) for item, traj, done in batch if traj is not None]
        results: list[np.ndarray] | None = None
        error = None
        if live:
            t0 = time.perf_counter()
            try:
                results = self.score_batch([item for item, _, _ in live])
                if len(results) != len(live):
                    raise ValueError(f"returned {len(results)} rows for {len(live)} samples")
            except Exception as e:  # the teacher failed: each of its samples is one error
                error, results = f"raised {type(e).__name__}: {e}", None
            with self._lock:
                self._counts["distill/teacher_scored"] += len(live)
                self._counts["distill/teacher_s"] += time.perf_counter() - t0
        rows = iter(results or [])
        for item, traj, done in batch:
            if traj is None:
                done(None)
                continue
            scored = next(rows) if results is not None else None
            if scored is not None and not isinstance(scored, TeacherScores):
                scored = TeacherScores(scored, _NO_TOPK_IDS, _NO_TOPK_LOGPROBS)
            row = np.asarray(scored.logprobs, dtype=np.float64) if scored is not None else None
            reason = error or _row_problem(row, len(traj.response_ids)) or _topk_problem(scored, len(traj.response_ids))
            if reason is not None:
                self._fail(f"trajectory {traj.trajectory_id}: {reason}")
                done(None)
                continue
            traj.teacher_logprobs = row
            if scored.topk_ids.size:
                traj.teacher_topk_ids = np.ascontiguousarray(scored.topk_ids, dtype=np.int32)
                traj.teacher_topk_logprobs = np.ascontiguousarray(scored.topk_logprobs, dtype=np.float32)
            with self._lock:
                self._counts["distill/teacher_tokens"] += len(row)
            done(traj)

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._counts["distill/teacher_errors"] += 1
            self._counts["distill/teacher_rejected"] += 1
            count = self._counts["distill/teacher_errors"]
            if self.first_error is None:
                self.first_error = f"teacher: {reason}"
        if count <= _NUM_FULL_LOGS or str(int(count)).rstrip("0") == "1":
            logger.warning("teacher failed (error %d, the sample is rejected): %s", count, reason)


def _row_problem(row: np.ndarray, num_tokens: int) -> str | None:
    """Why a teacher row cannot be the log-probs of ``num_tokens`` response tokens, or ``None``."""
    if row.ndim != 1 or len(row) != num_tokens:
        return f"the teacher gave {row.shape} log-probs for {num_tokens} response tokens"
    if num_tokens and not (np.isfinite(row).all() and row.max() <= 1e-6):
        bad = int((~np.isfinite(row)).sum())
        return (f"the teacher gave {bad} non-finite log-probs" if bad
                else f"the teacher gave a positive log-prob ({row.max():.3g})")
    return None



def _topk_problem(scored: TeacherScores, num_tokens: int) -> str | None:
    """Why a teacher's top-k cannot be that of ``num_tokens`` response tokens, or ``None``
    (none at all is fine: a signal without a top-k)."""
    ids, lps = np.asarray(scored.topk_ids), np.asarray(scored.topk_logprobs)
    if not ids.size and not lps.size:
        return None
    if ids.shape != lps.shape or ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] < 1:
        return f"the teacher gave top-k ids {ids.shape} and log-probs {lps.shape} for {num_tokens} response tokens"
    if not (np.isfinite(lps).all() and lps.max() <= 1e-6) or ids.min() < 0:
        return "the teacher gave a non-finite or positive top-k log-prob, or a negative token id"
    return None
