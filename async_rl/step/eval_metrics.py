"""Evaluation at k: pass@k, mean@k and maj@k of k sampled responses per held-out prompt, with
standard errors from a bootstrap over prompts.

Definitions (for one prompt with ``n`` sampled responses, ``c`` of them correct):

- **pass@k** (``k <= n``): the probability that at least one of ``k`` responses drawn without
  replacement from the ``n`` is correct, ``1 - C(n - c, k) / C(n, k)``: the unbiased estimator of
  Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1. With ``k = n`` it
  is 1 if any response is correct; with ``k = 1`` it is ``c / n``.
- **mean@n**: the mean correctness of the ``n`` responses (``acc`` of the reward, else
  ``reward >= 1``), so ``mean@n`` equals ``pass@1``'s expectation and differs from it only where
  correctness is fractional.
- **maj@n**: the correctness of the majority answer among the ``n`` responses (self-consistency,
  Wang et al. 2023, "Self-Consistency Improves Chain of Thought Reasoning in Language Models").
  Answers are compared by ``answer_key`` (the last ``\\boxed{}`` if any, else the response's
  final line, with whitespace and end markers removed; integers canonical, so ``007`` and ``7``
  agree). A response without an answer (empty) does not vote. **Ties**: when several answers share
  the top count, maj@n is the mean correctness over the tied answers: the expected correctness of
  picking one of them at random, rather than an order-dependent first pick. No answer at all: 0.

Each metric is averaged over prompts; its standard error is the standard deviation of that average
over ``B`` bootstrap resamples of the prompts (with replacement, seeded): a prompt's responses stay
together, as they are not independent of each other.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

import numpy as np

__all__ = ["pass_at_k", "majority_correct", "answer_key", "bootstrap_se", "k_values", "at_k_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from ``n`` samples with ``c`` correct (Chen et al. 2021, eq. 1).

    Computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)``, the same value as
    ``1 - C(n - c, k) / C(n, k)`` without its large binomials.

    Raises:
        ValueError: ``not 0 <= c <= n``, or ``not 1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


_BOXED = re.compile(r"\\boxed\s*\{")
_INT = re.compile(r"[+-]?\d+")


def _last_boxed(text: str) -> str | None:
    start = None
    for m in _BOXED.finditer(text):
        start = m.end()
    if start is None:
        return None
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start: i - 1] if depth == 0 else None


def answer_key(text: str) -> str | None:
    """The answer a response gives, normalized for voting (see the module's maj@n); ``None`` when
    it gives none (empty after stripping)."""
    boxed = _last_boxed(text)
    if boxed is None:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        boxed = lines[-1] if lines else ""
    key = " ".join(boxed.split()).strip(" .")
    if _INT.fullmatch(key):
        key = str(int(key))
    return key or None


def majority_correct(answers: Sequence[str | None], correct: Sequence[float]) -> float:
    """maj@n of one prompt: the correctness of its most frequent answer, ties averaged.

    Args:
        answers: ``answer_key`` of each response (``None``: no answer, no vote).
        correct: each response's correctness in [0, 1], same length. Responses with the same
            answer are averaged (a reward may judge the same answer differently by its wording).

    Raises:
        ValueError: ``answers`` and ``correct`` differ in length.
    """
    if len(answers) != len(correct):
        raise ValueError(f"maj@n: {len(answers)} answers but {len(correct)} correctness values")
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [a for a, v in votes.items() if v == top]

    def mean_correct(answer: str) -> float:
        got = [float(c) for a, c in zip(answers, correct) if a == answer]
        return sum(got) / len(got)

    return sum(mean_correct(a) for a in tied) / len(tied)


def bootstrap_se(values: Sequence[float], resamples: int = 1000, seed: int = 0) -> float:
    """Standard error of ``mean(values)`` (one value per prompt) by bootstrap over prompts: the
    standard deviation of the mean over ``resamples`` resamples with replacement (numpy's seeded
    generator, all resamples drawn at once: an evaluation's metrics are computed on the learner's
    thread in async mode). 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return float(np.asarray(values, dtype=np.float64)[picks].mean(axis=1).std(ddof=1))


def k_values(n: int) -> list[int]:
    """The k of pass@k reported for ``n`` samples a prompt: 1, powers of two below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def at_k_metrics(per_prompt: Sequence[tuple[Sequence[str | None], Sequence[float]]], n: int,
                 prefix: str = "eval/", resamples: int = 1000, seed: int = 0) -> dict[str, float]:
    """pass@k for ``k_values(n)``, mean@n and maj@n over prompts, each with ``_se``.

    Args:
        per_prompt: for each prompt, its responses' answers (``answer_key``) and correctness in
            [0, 1]; a prompt may hold fewer than ``n`` responses (samples rejected by the reward:
            they count as wrong, so a rejection never raises a score).
        n: samples requested per prompt.
        prefix: prepended to each key (``eval/`` or ``eval/<data source>/``).

    Returns:
        ``{prefix}pass@{k}``, ``{prefix}pass@{k}_se`` for each k, ``{prefix}mean@{n}``,
        ``{prefix}maj@{n}`` and their ``_se``, ``{prefix}num_prompts_at_k``; empty for no prompts.

    Raises:
        ValueError: a prompt with more than ``n`` responses, or correctness outside [0, 1].
    """
    if not per_prompt:
        return {}
    columns: dict[str, list[float]] = {f"pass@{k}": [] for k in k_values(n)}
    columns[f"mean@{n}"], columns[f"maj@{n}"] = [], []
    for answers, correct in per_prompt:
        if len(correct) > n:
            raise ValueError(f"eval at k: a prompt has {len(correct)} responses, more than the {n} sampled")
        if any(not 0.0 <= float(c) <= 1.0 for c in correct):
            raise ValueError(f"eval at k: correctness must be in [0, 1], got {list(correct)}")
        # A rejected sample is a wrong one: pad to n.
        full = [float(c) for c in correct] + [0.0] * (n - len(correct))
        hits = sum(1 for c in full if c >= 1.0)
        for k in k_values(n):
            columns[f"pass@{k}"].append(pass_at_k(n, hits, k))
        columns[f"mean@{n}"].append(sum(full) / n)
        columns[f"maj@{n}"].append(majority_correct(list(answers), list(correct)) if correct else 0.0)
    out: dict[str, float] = {}
    for name, values in columns.items():
        out[f"{prefix}{name}"] = sum(values) / len(values)
        out[f"{prefix}{name}_se"] = bootstrap_se(values, resamples, seed)
    out[f"{prefix}num_prompts_at_k"] = float(len(per_prompt))
    return out
