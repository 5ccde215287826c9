"""On-policy distillation: a teacher scores the student's own samples, token by token.

The student samples a response; a frozen teacher computes the log-prob of each sampled token
(``async_rl.rewards.teacher``: a teacher worker beside the generators, as samples finish); the
per-token reverse KL to the teacher is the learning signal. With ``x_t`` sampled from the
student ``pi`` (the behavior policy ``mu`` that sampled it) and the teacher ``q``::

    k1_t = log pi(x_t | x_<t) - log q(x_t | x_<t)           per-token reverse-KL estimate, nats
    A_t  = [A_task_t] - coef * k1_t                          the advantage the loss trains on

``E_pi[k1_t]`` is ``KL(pi(. | x_<t) || q(. | x_<t))``, and the policy gradient with the per-token
reward ``-k1_t`` and no credit to later tokens (discount 0) is the gradient of the summed
per-position reverse KL, ``E[(log pi - log q) grad log pi]`` (Gu et al. 2024, MiniLLM,
arXiv 2306.08543, eq. 3 without its future-token term; Agarwal et al. 2024, GKD, arXiv
2306.13649, Sec. 3 with on-policy data and the reverse KL; Thinking Machines, "On-Policy
Distillation", 2025: the negative per-token reverse KL as the per-token advantage, discount 0).
It enters the same clipped, importance-weighted policy loss as the task advantage, so the
off-policy corrections of async mode (TIS, the clip against the behavior or proximal policy)
cover it too. ``log pi`` is the behavior log-prob the generator sampled with, at the sampling
temperature; the teacher scores at the same temperature.

``algorithm.distill.task_reward=false`` is pure distillation: the task's advantage is dropped
and only the teacher's signal trains (rewards are still scored, for accuracy metrics). With it
true (the default) the two add: the task advantage as the estimator computes it (GRPO's group
baseline and scale), plus ``coef`` times the teacher term, per token.

Teachers: ``algorithm.distill.teacher`` for every data source and ``algorithm.distill.teachers``
(``{data_source: teacher}``) for some or all of them (multi-teacher on-policy distillation:
each sample is scored by its source's teacher). A teacher is a Hugging Face model directory, a
run directory (its ``final_model/``) or a ``builtin:`` model, with the student's tokenizer.

**The teacher's top-k distribution** (``signal: topk_reverse_kl`` or ``topk_forward_kl``): the
sampled-token signal above is one draw per position; its gradient is exact only in expectation.
With these signals the teacher also returns, at every response position, its ``top_k`` most
likely next tokens and their log-probs (``[R, K]`` ids and floats a sample, carried in the
trajectory), and the learner adds a loss term: the divergence between the student's and the
teacher's next-token distributions at each trained position, both **coarse-grained to the
teacher's top-k tokens plus one bucket for every other token** (``topk_kl``)::

    p_v, q_v   for v in S_t (the teacher's top-k at position t); p_rest = 1 - sum_S p, q_rest = 1 - sum_S q
    reverse:   D_t = sum_{v in S_t} p_v log(p_v / q_v) + p_rest log(p_rest / q_rest)
    forward:   D_t = sum_{v in S_t} q_v log(q_v / p_v) + q_rest log(q_rest / p_rest)
    loss      += coef * agg_t(D_t)            (the run's loss aggregation over the trained tokens)

This is GKD's full-distribution objective on the student's own samples (Agarwal et al. 2024,
arXiv 2306.13649, eq. 2-3 and Algorithm 1 with on-policy data, beta = 1 for the reverse KL and
beta = 0 for the forward KL), and the same as MiniLLM's single-step term without sampling
(Gu et al. 2024, eq. 3-4). Coarse-graining is exact when ``top_k`` covers the vocabulary (the
rest bucket is then empty) and otherwise a lower bound of the full divergence (the data-processing
inequality: merging outcomes never increases a KL), with no bias towards tokens inside or outside
the top-k: a student that puts mass outside the teacher's top-k is charged for it through the
rest bucket, where a renormalised top-k divergence would not see it. Its gradient has no sampling
noise at a position, so a batch can be trained on for several epochs (``learner.num_epochs``)
without the clipped policy gradient's limits: the term is a divergence at states the student
visited, valid for any state distribution (GKD section 3), so it needs no importance weight in
async mode either. The task advantage, when kept (``task_reward``), goes through the policy loss
as usual; the sampled-token term is not added then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from async_rl.algorithms.kl import LOG_RATIO_CLAMP

__all__ = ["DISTILL_SIGNALS", "DEFAULT_TEACHER", "TOPK_SIGNALS", "DistillConfig", "distill_advantages",
           "reverse_kl_metrics", "teacher_key", "topk_kl"]

TOPK_SIGNALS = ("topk_reverse_kl", "topk_forward_kl")
"""Signals computed by the learner from the teacher's top-k next-token distribution (``topk_kl``)."""

DISTILL_SIGNALS = ("reverse_kl", *TOPK_SIGNALS)
"""Valid ``algorithm.distill.signal`` values: the sampled-token reverse KL in the advantage, or a
top-k divergence in the loss (the module docstring)."""

DEFAULT_TEACHER = "*"
"""The key of ``DistillConfig.routes`` for sources without a teacher of their own."""


def teacher_key(source: str) -> str:
    """The config key a route's teacher was given under, for messages:
    ``algorithm.distill.teacher`` for ``DEFAULT_TEACHER``, else ``algorithm.distill.teachers[<source>]``."""
    return "algorithm.distill." + ("teacher" if source == DEFAULT_TEACHER else f"teachers[{source}]")


@dataclass
class DistillConfig:
    """On-policy distillation (``algorithm.distill``); off unless a teacher is named."""

    teacher: str = ""
    """The teacher of every data source without one in ``teachers``: a Hugging Face model
    directory, a run directory (its ``final_model/``) or a ``builtin:`` model, with the student's
    tokenizer. Empty: none."""
    teachers: dict[str, str] = field(default_factory=dict)
    """One teacher per data source (``{data_source: teacher}``, multi-teacher distillation);
    a source not listed takes ``teacher``. Every source of the train set needs one."""
    coef: float = 1.0
    """Weight of the teacher's per-token signal in the advantage (> 0)."""
    signal: str = "reverse_kl"
    """The per-token signal: ``reverse_kl`` (``-coef * (log pi - log q)`` per sampled token, in
    the advantage); ``topk_reverse_kl`` or ``topk_forward_kl`` (the divergence between the
    student's and the teacher's next-token distributions over the teacher's ``top_k`` tokens and
    one bucket for the rest, a loss term; ``topk_kl``)."""
    top_k: int = 64
    """Teacher tokens a position of the ``topk_*`` signals (>= 1; at least the vocabulary: the
    whole distribution, exact). Each costs 8 bytes a response token on the wire."""
    task_reward: bool = True
    """Keep the task's advantage and add the teacher's signal to it; false: pure distillation
    (the teacher's signal alone trains, rewards are scored for metrics only)."""
    batch_size: int = 16
    """Samples per teacher forward pass (>= 1); the teacher takes whatever has finished, up to this."""
    num_threads: int = 0
    """torch threads of the teacher's actor in async mode (0: one generator worker's share)."""
    num_gpus: float = 0.0
    """GPUs of the teacher's actor in async mode (>= 0; 0: it runs on the CPU). In sync mode the
    teacher runs in the trainer's process, on its GPU when it has one."""

    def __post_init__(self) -> None:
        if self.signal not in DISTILL_SIGNALS:
            raise ValueError(f"algorithm.distill.signal must be one of {DISTILL_SIGNALS}, got {self.signal!r}")
        if not self.coef > 0:
            raise ValueError(f"algorithm.distill.coef must be > 0, got {self.coef}")
        if self.top_k < 1:
            raise ValueError(f"algorithm.distill.top_k must be >= 1, got {self.top_k}")
        if self.batch_size < 1:
            raise ValueError(f"algorithm.distill.batch_size must be >= 1, got {self.batch_size}")
        if self.num_threads < 0 or self.num_gpus < 0:
            raise ValueError(f"algorithm.distill.num_threads and num_gpus must be >= 0, got "
                             f"{self.num_threads}/{self.num_gpus}")
        empty = sorted(k for k, v in self.teachers.items() if not v)
        if empty:
            raise ValueError(f"algorithm.distill.teachers: no teacher given for data source(s) {empty}")

    @property
    def enabled(self) -> bool:
        """Whether a teacher is named (distillation on)."""
        return bool(self.teacher or self.teachers)

    @property
    def uses_topk(self) -> bool:
        """Whether the signal is a top-k divergence (the teacher sends ``[R, top_k]`` a sample)."""
        return self.signal in TOPK_SIGNALS

    @property
    def routes(self) -> dict[str, str]:
        """``{data_source: teacher spec}``, with ``DEFAULT_TEACHER`` for ``teacher`` when set."""
        return {**({DEFAULT_TEACHER: self.teacher} if self.teacher else {}), **self.teachers}

    def teacher_of(self, data_source: str) -> str | None:
        """The teacher spec that scores ``data_source``'s samples, or ``None``."""
        return self.teachers.get(data_source) or self.teacher or None

    def uncovered(self, sources: Sequence[str]) -> list[str]:
        """The data sources among ``sources`` that no teacher scores (sorted)."""
        return sorted({s for s in sources if self.teacher_of(s) is None})


def distill_advantages(advantages: Tensor, behavior_logprobs: Tensor, teacher_logprobs: Tensor,
                       loss_mask: Tensor, coef: float, task_reward: bool = True) -> Tensor:
    """The advantage with the teacher's per-token signal: ``[A_task] - coef * (log mu - log q)``.

    Source: the module docstring (MiniLLM eq. 3 at discount 0; GKD Sec. 3; Thinking Machines 2025).

    Args:
        advantages: ``[B, T]`` float32 task advantages (the estimator's).
        behavior_logprobs: ``[B, T]`` float32 log mu of the sampled tokens (the generator's).
        teacher_logprobs: ``[B, T]`` float32 log q of the same tokens under the teacher.
        loss_mask: ``[B, T]`` float32 0/1, 1 on trained response tokens.
        coef: weight of the teacher term (> 0).
        task_reward: keep the task advantage; false drops it (pure distillation).

    Returns:
        ``[B, T]`` float32, 0 outside ``loss_mask``; ``log mu - log q`` is clamped to
        ``+-LOG_RATIO_CLAMP`` (20 nats) per token, as the losses clamp log-ratios.

    Raises:
        ValueError: tensors of different shapes.

    Example: log mu = -0.1, log q = -2.3, A_task = 0.5, coef 1: 0.5 - (-0.1 + 2.3) = -1.7 (the
    teacher finds the token far less likely than the student: pushed down).
    """
    shapes = {tuple(t.shape) for t in (advantages, behavior_logprobs, teacher_logprobs, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"distill_advantages: tensors of shapes {sorted(shapes)} (all must be [B, T])")
    mask = loss_mask.bool()
    # Clamped as the losses clamp their log-ratios: a -inf behavior log-prob (the wire keeps
    # them) must cost a bounded advantage, not an infinite one.
    k1 = torch.where(mask, behavior_logprobs.float() - teacher_logprobs.float(), torch.zeros(()))
    k1 = k1.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    base = advantages.float() if task_reward else torch.zeros_like(advantages, dtype=torch.float32)
    return (base - coef * k1) * loss_mask


def reverse_kl_metrics(trajectories: Sequence, source_of: Callable[[str], str] | None = None) -> dict[str, float]:
    """``distill/reverse_kl``: the token-mean of ``log mu - log q`` over the trained tokens of
    trajectories carrying teacher log-probs, the sampled estimate of the per-token reverse KL from
    student to teacher (nats per token); ``distill/teacher_logprob_mean`` and
    ``distill/behavior_logprob_mean`` beside it (each token's difference clamped to +-20 nats, as
    in ``distill_advantages``). With ``source_of`` (``prompt_uid -> data
    source``) the same per source as ``distill/<source>/reverse_kl``. Empty without teacher
    log-probs."""
    per_source: dict[str, list[float]] = {}
    totals = [0.0, 0.0, 0.0, 0]
    for t in trajectories:
        if not len(t.teacher_logprobs):
            continue
        mask = t.loss_mask.astype(bool)
        behavior, teacher = t.behavior_logprobs[mask], t.teacher_logprobs[mask]
        k1 = float(np.sum(np.clip(behavior - teacher, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)))
        totals[0] += k1
        totals[1] += float(np.sum(teacher))
        totals[2] += float(np.sum(behavior))
        totals[3] += int(mask.sum())
        if source_of is not None:
            acc = per_source.setdefault(source_of(t.prompt_uid), [0.0, 0])
            acc[0] += k1
            acc[1] += int(mask.sum())
    if not totals[3]:
        return {}
    n = totals[3]
    out = {"distill/reverse_kl": totals[0] / n, "distill/teacher_logprob_mean": totals[1] / n,
           "distill/behavior_logprob_mean": totals[2] / n}
    out.update({f"distill/{source}/reverse_kl": kl / max(count, 1) for source, (kl, count) in sorted(per_source.items())})
    return out


_REST_FLOOR = 1e-12
"""Smallest probability of the rest bucket inside a log: with ``top_k`` covering the vocabulary
the bucket is float round-off (about 1e-7 either side of 0), whose share of the divergence must
stay that small rather than become ``0 * log 0``."""


def topk_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, kind: str = "reverse") -> Tensor:
    """Per-position divergence between student and teacher next-token distributions, coarse-grained
    to the teacher's top-k tokens plus one bucket for the rest (the module docstring).

    Source: GKD (Agarwal et al. 2024, arXiv 2306.13649) eq. 2-3 with on-policy data; the rest
    bucket makes it exact when the k tokens cover the vocabulary and a lower bound otherwise
    (data-processing inequality, Cover and Thomas, Elements of Information Theory, 2.8).

    Args:
        student_logprobs: ``[..., K]`` float log-probs (nats) of the student at the teacher's
            top-k ids (differentiable; ``log_softmax`` over the whole vocabulary, gathered).
        teacher_logprobs: ``[..., K]`` float log-probs of the teacher at the same ids.
        kind: ``"reverse"`` (``KL(student || teacher)``, mode-seeking) or ``"forward"``
            (``KL(teacher || student)``, mass-covering).

    Returns:
        ``[...]`` float32 divergence a position, nats, >= 0 up to round-off; differentiable in
        ``student_logprobs``.

    Raises:
        ValueError: shapes differ, or ``kind`` is neither.

    Example: the whole vocabulary ``{a, b}`` (K = 2), student ``(0.5, 0.5)``, teacher ``(0.9,
    0.1)``: reverse ``0.5 log(0.5/0.9) + 0.5 log(0.5/0.1) = 0.511``; with only ``a`` in the top-1
    the rest bucket holds ``b`` and the value is the same (the bucket is ``b`` alone).
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"topk_kl: student {tuple(student_logprobs.shape)} and teacher "
                         f"{tuple(teacher_logprobs.shape)} log-probs differ in shape")
    if kind not in ("reverse", "forward"):
        raise ValueError(f"topk_kl: kind must be 'reverse' or 'forward', got {kind!r}")
    log_p, log_q = student_logprobs.float(), teacher_logprobs.float()
    p, q = log_p.exp(), log_q.exp()
    # The rest bucket: 1 minus the top-k's mass, at least 0 (round-off can push it below).
    p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)
    q_rest = (1.0 - q.sum(-1)).clamp(min=0.0)
    log_p_rest, log_q_rest = p_rest.clamp(min=_REST_FLOOR).log(), q_rest.clamp(min=_REST_FLOOR).log()
    if kind == "reverse":
        return (p * (log_p - log_q)).sum(-1) + p_rest * (log_p_rest - log_q_rest)
    return (q * (log_q - log_p)).sum(-1) + q_rest * (log_q_rest - log_p_rest)
