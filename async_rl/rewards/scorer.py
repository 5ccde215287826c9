"""Fault-tolerant wrapper that calls a reward function and validates what it returns.

A reward function is user code run thousands of times per step; one bad sample must not stop a
run, and a NaN must never reach the advantages. ``RewardScorer.score`` turns every outcome into a
``RewardResult``: a finite float score plus numeric extras, or a recorded error. An error becomes
score 0.0 (``on_error="zero"``) or a rejected sample (``on_error="reject"``; the caller drops it
and counts it). Errors are logged with rate limiting and counted for the metrics.

Example::

    scorer = RewardScorer(get_reward_fn("gsm8k"), on_error="zero")
    result = scorer.score("openai/gsm8k", "... #### 72", "72", None)
    result.score, result.extras      # (1.0, {"acc": 1.0})
    scorer.pop_metrics()
    # {"reward/scored": 1.0, "reward/errors": 0.0, "reward/rejected": 0.0}
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ON_ERROR_MODES", "RewardResult", "RewardScorer"]

logger = logging.getLogger(__name__)

ON_ERROR_MODES = ("zero", "reject")
"""Valid ``on_error`` values: score a failed sample 0.0, or mark it rejected."""

_NUM_FULL_LOGS = 5
"""Errors logged in full (with traceback) per scorer; later ones only at 10, 100, 1000, ..."""
_MAX_REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class RewardResult:
    """Outcome of scoring one response.

    Attributes:
        score: the reward, always a finite float; 0.0 when ``error`` is set.
        extras: the other finite numeric fields of a dict return value, e.g. {"acc": 1.0};
            empty for a plain float return and when ``error`` is set.
        rejected: the function failed and ``on_error="reject"``: drop the sample, do not train on
            ``score``.
        error: short reason when the function failed ("raised ValueError: ...", "non-finite
            score nan", "bad return type str ..."), else None.
    """

    score: float
    extras: dict[str, float] = field(default_factory=dict)
    rejected: bool = False
    error: str | None = None


class RewardScorer:
    """Calls one reward function, validates its result and counts failures.

    Safe to call from several threads at once (counters are updated under a lock; the reward
    function itself must be thread-safe if called that way).

    Args:
        fn: reward function ``fn(data_source, response_text, ground_truth, extra_info)`` returning
            a number (bool counts: True -> 1.0) or a dict with a numeric "score".
        on_error: what a failure becomes: "zero" (score 0.0) or "reject" (``rejected=True``).

    Raises:
        ValueError: ``on_error`` is not one of ``ON_ERROR_MODES``.

    Attributes:
        num_scored: calls to ``score`` since construction, failures included.
        num_errors: failed calls since construction.
        num_rejected: failed calls turned into rejections since construction.
    """

    def __init__(self, fn: Callable[..., Any], on_error: str = "zero") -> None:
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
        if not callable(fn):
            raise ValueError(f"reward function must be callable, got {fn!r}")
        self.fn = fn
        self.on_error = on_error
        self.num_scored = 0
        self.num_errors = 0
        self.num_rejected = 0
        self._popped = (0, 0, 0)
        self._lock = threading.Lock()
        self._name = getattr(fn, "__qualname__", None) or repr(fn)

    def score(
        self, data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
    ) -> RewardResult:
        """Score one response; never raises for a failure of the reward function.

        Args:
            data_source: the row's ``data_source``, passed through.
            response_text: decoded model response.
            ground_truth: the row's ``reward_model.ground_truth``.
            extra_info: the row's ``extra_info`` or None, passed through.

        Returns:
            A ``RewardResult``. The function is called positionally, so verl-style functions
            whose parameters are named differently (``solution_str``) work.
        """
        exc: Exception | None = None
        try:
            value = self.fn(data_source, response_text, ground_truth, extra_info)
        except Exception as e:  # user code: any failure is one bad sample, not a crashed run
            exc = e
            reason = _truncate(f"raised {type(e).__name__}: {e}")
        else:
            outcome = _validate(value)
            if not isinstance(outcome, str):
                with self._lock:
                    self.num_scored += 1
                return RewardResult(score=outcome[0], extras=outcome[1])
            reason = outcome
        return self._fail(reason, data_source, exc)

    def pop_metrics(self) -> dict[str, float]:
        """Return counts since the previous call and start a new window.

        Returns:
            {"reward/scored", "reward/errors", "reward/rejected"}: numbers of calls, failures and
            rejections since the last ``pop_metrics`` (reduction: sum over the window).
        """
        with self._lock:
            now = (self.num_scored, self.num_errors, self.num_rejected)
            before, self._popped = self._popped, now
        scored, errors, rejected = (float(a - b) for a, b in zip(now, before))
        return {"reward/scored": scored, "reward/errors": errors, "reward/rejected": rejected}

    def _fail(self, reason: str, data_source: str, exc: Exception | None) -> RewardResult:
        rejected = self.on_error == "reject"
        with self._lock:
            self.num_scored += 1
            self.num_errors += 1
            self.num_rejected += rejected
            count = self.num_errors
        if count <= _NUM_FULL_LOGS:
            logger.warning(
                "reward function %s failed (data_source=%r, error %d, counted as %s): %s",
                self._name, data_source, count, "rejected" if rejected else "score 0.0", reason,
                exc_info=exc,
            )
        elif _is_power_of_ten(count):
            logger.warning(
                "reward function %s: %d failures so far (%d rejected); latest: %s",
                self._name, count, self.num_rejected, reason,
            )
        return RewardResult(score=0.0, rejected=rejected, error=reason)


def _validate(value: Any) -> tuple[float, dict[str, float]] | str:
    """Return (score, extras) for a valid reward return value, or the reason it is invalid."""
    if isinstance(value, Mapping):
        if "score" not in value:
            return _truncate(f"dict without 'score' (keys: {sorted(map(str, value))})")
        score = value["score"]
        if not isinstance(score, numbers.Real):
            return f"bad 'score' type {type(score).__name__} (want a number)"
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and _finite(v)
        }
    elif isinstance(value, numbers.Real):
        score, extras = value, {}
    else:
        return f"bad return type {type(value).__name__} (want a number or a dict with 'score')"
    try:
        as_float = float(score)
    except OverflowError:  # an int too large for a float
        return "score out of float range"
    if not math.isfinite(as_float):
        return f"non-finite score {as_float!r}"
    return as_float, extras


def _finite(value: numbers.Real) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_power_of_ten(n: int) -> bool:
    while n % 10 == 0:
        n //= 10
    return n == 1


def _truncate(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."
