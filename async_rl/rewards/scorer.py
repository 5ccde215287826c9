"""Fault-tolerant wrapper that calls a reward function and validates what it returns.

A reward function is user code run thousands of times per step; one bad sample must not stop a
run, and a NaN must never reach the advantages. ``RewardScorer.score`` turns every outcome into a
``RewardResult``: a finite float score plus numeric extras, or a recorded error. An error (the
function raised, or returned NaN/inf or a value of the wrong type) becomes score 0.0
(``on_error="zero"``) or a rejected sample (``on_error="reject"``; the caller drops it and counts
it). A reward of ``None`` (or ``{"score": None}``) says the reward could not be computed: it is
never trained as 0, whatever ``on_error`` says, but always a rejection with reason ``no_reward``
(the sample then leaves its group's baseline too). Errors and missing rewards are logged with rate
limiting (a traceback once per reward function and process, not per sample) and counted for the
metrics; the first error is kept with where it happened (``RewardScorer.first_error``).

Where the function runs: with ``workers`` (``async_rl.rewards.workers.RewardWorkers``,
``reward.num_workers`` >= 1) in worker processes under a per-call deadline (``reward.timeout_s``),
never on the engine's decoding thread; a call past its deadline (``timeout``), one whose worker
died (``crashed``) and a result over ``MAX_EXTRAS`` (``too_large``) are rejections like a missing
reward, whatever ``on_error`` says, and each has its own counter (``reward/timeouts``,
``reward/crashed``, ``reward/too_large``; all three also count in ``reward/errors``). Without
workers (``reward.num_workers=0``) the function runs on the calling thread, as under a debugger.

A reward function that fails on every call is a bug in it, not bad luck with samples:
``check_rewards_work`` stops the run with the first error at its first step, and
``failure_summary`` is the end-of-run line counting the failures of one that failed sometimes.

Example::

    scorer = RewardScorer(get_reward_fn("gsm8k"), on_error="zero")
    result = scorer.score("openai/gsm8k", "... #### 72", "72", None)
    result.score, result.extras      # (1.0, {"acc": 1.0})
    scorer.pop_metrics()
    # {"reward/scored": 1.0, "reward/errors": 0.0, "reward/no_reward": 0.0, "reward/rejected": 0.0,
    #  "reward/timeouts": 0.0, "reward/crashed": 0.0, "reward/too_large": 0.0}
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["MAX_EXTRAS", "MAX_EXTRAS_BYTES", "ON_ERROR_MODES", "Outcome", "REJECT_REASONS", "RewardResult",
           "RewardScorer", "call_reward", "check_rewards_work", "failure_summary"]

logger = logging.getLogger(__name__)

ON_ERROR_MODES = ("zero", "reject")
"""Valid ``on_error`` values: score a failed sample 0.0, or mark it rejected."""

REJECT_REASONS = ("error", "no_reward", "timeout", "crashed", "too_large")
"""Why a sample was rejected: its reward function failed under ``on_error="reject"``, returned no
reward (``None``), ran past ``reward.timeout_s``, killed its worker process, or returned more than
``MAX_EXTRAS`` extras (or ``MAX_EXTRAS_BYTES`` of them). All but ``error`` reject whatever
``on_error`` says: none of them is a reward to train on."""

MAX_EXTRAS = 64
"""Most extra numeric fields a reward dict may carry besides ``score`` (a result with more is a
``too_large`` rejection: extras become per-step metrics, and a runaway dict must not reach them)."""
MAX_EXTRAS_BYTES = 16 * 1024
"""Most bytes of extras' names (UTF-8) plus 8 per value in one result (``too_large`` past it)."""

_NUM_FULL_LOGS = 5
"""Errors logged one line each per scorer; later ones only at 10, 100, 1000, ..."""
_MAX_REASON_CHARS = 200
_MAX_TRACE_CHARS = 4000

# Reward functions whose traceback this process has logged (a function, file and line each): the
# training and evaluation scorers, or a scorer per run in one process, share one traceback.
_traceback_logged: set[tuple[str, str, int]] = set()
_traceback_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class RewardResult:
    """Outcome of scoring one response.

    Attributes:
        score: the reward, always a finite float; 0.0 when ``error`` is set.
        extras: the other finite numeric fields of a dict return value, e.g. {"acc": 1.0};
            empty for a plain float return and when ``error`` is set.
        rejected: drop the sample, do not train on ``score``: the function failed and
            ``on_error="reject"``, or it returned no reward.
        error: short reason when the function failed or gave no reward ("raised ValueError: ...",
            "non-finite score nan", "bad return type str ...", "no reward (None)"), else None.
        reason: why it was rejected, one of ``REJECT_REASONS``; None when not rejected.
    """

    score: float
    extras: dict[str, float] = field(default_factory=dict)
    rejected: bool = False
    error: str | None = None
    reason: str | None = None


class Outcome(NamedTuple):
    """What one reward-function call came to, before ``on_error`` applies (small and picklable:
    a worker process sends it back to ``RewardScorer``).

    Attributes:
        kind: ``ok``, ``no_reward`` (it returned ``None``), ``error`` (raised, NaN/inf, wrong
            type), ``too_large`` (more than ``MAX_EXTRAS`` extras or ``MAX_EXTRAS_BYTES`` of
            them), ``timeout`` (no result within ``reward.timeout_s``) or ``crashed`` (its worker
            process died).
        score: the validated score (``ok``), else 0.0.
        extras: the finite numeric extras (``ok``), else empty.
        reason: short text of what went wrong (at most 200 characters), else ``None``.
        where: ``file:line`` of the raising frame or of the function (``error``), else ``None``.
        trace: the formatted traceback (its last 4,000 characters) when it raised, else ``None``.
    """

    kind: str
    score: float = 0.0
    extras: dict[str, float] = {}
    reason: str | None = None
    where: str | None = None
    trace: str | None = None


def exception_text(e: BaseException) -> str:
    """``str(e)``, or a stand-in when the exception's own ``__str__`` raises (user code: the
    description of a failure must not become a second, uncaught failure)."""
    try:
        return str(e)
    except Exception as inner:  # any __str__ bug: the sample is still one counted error
        return f"<str() of the exception raised {type(inner).__name__}>"


def call_reward(fn: Callable[..., Any], args: tuple) -> Outcome:
    """Call ``fn(*args)`` (positionally, so verl-style functions whose parameters are named
    differently, such as ``solution_str``, work) and validate what it returns. Runs in the
    scorer's process (``reward.num_workers=0``) or in a reward worker process (``RewardWorkers``),
    which then sends back only the small ``Outcome``.

    Never raises for a failure of ``fn`` (an ``Exception``; ``KeyboardInterrupt`` and
    ``SystemExit`` pass).
    """
    try:
        value = fn(*args)
    except Exception as e:  # user code: any failure is one bad sample, not a crashed run
        trace = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        return Outcome("error", reason=_truncate(f"raised {type(e).__name__}: {exception_text(e)}"), where=_where(fn, e),
                       trace=trace[-_MAX_TRACE_CHARS:])
    if value is None or (isinstance(value, Mapping) and "score" in value and value["score"] is None):
        return Outcome("no_reward", reason="no reward (None)")
    if isinstance(value, Mapping) and len(value) > MAX_EXTRAS + 1:
        return Outcome("too_large", reason=f"returned a dict of {len(value)} keys (at most {MAX_EXTRAS} besides "
                                           "'score')")
    outcome = _validate(value)
    if isinstance(outcome, str):
        return Outcome("error", reason=outcome, where=_where(fn, None))
    score, extras = outcome
    size = sum(len(k.encode("utf-8", "replace")) + 8 for k in extras)
    if size > MAX_EXTRAS_BYTES:
        return Outcome("too_large", reason=f"extras of {size} bytes (at most {MAX_EXTRAS_BYTES})")
    return Outcome("ok", score, extras)


class RewardScorer:
    """Calls one reward function, validates its result and counts failures.

    In-process (``workers=None``): ``score`` and ``submit`` call the function on the calling
    thread; safe to call from several threads at once (counters are updated under a lock; the
    reward function itself must be thread-safe if called that way). With ``workers`` (a
    ``RewardWorkers`` pool) the function runs in worker processes under a per-call deadline:
    ``submit`` returns at once and its ``done`` runs on the pool's thread.

    Args:
        fn: reward function ``fn(data_source, response_text, ground_truth, extra_info)`` returning
            a number (bool counts: True -> 1.0) or a dict with a numeric "score"; ``None`` only
            with ``model`` (the reward is the model's alone, ``score`` is never called). With
            ``workers`` the workers resolve their own copy from ``workers.spec``; ``fn`` then names
            the function in messages.
        on_error: what a failure becomes: "zero" (score 0.0) or "reject" (``rejected=True``).
            A missing reward, a timeout, a crashed worker and a too-large result are always
            rejected.
        model: the reward model's ``ModelRewardStage`` (``async_rl.rewards.model``) or ``None``;
            ``sample_groups`` sends each sample through it after ``fn``, and its counters
            (``reward/model_*``) join ``counts`` and ``pop_metrics``.
        workers: ``async_rl.rewards.workers.RewardWorkers`` or ``None`` (score in-process).
        teacher: the teacher's ``TeacherStage`` of on-policy distillation
            (``async_rl.rewards.teacher``) or ``None``; ``sample_groups`` sends each rewarded
            training sample through it last, and its counters (``distill/teacher_*``) join
            ``counts`` and ``pop_metrics``.

    Raises:
        ValueError: ``on_error`` is not one of ``ON_ERROR_MODES``; no function and no model.

    Attributes:
        num_scored: calls since construction, failures included.
        num_errors: failed calls since construction (raised, NaN/inf, wrong type, too large,
            timed out, crashed).
        num_no_reward: calls that returned no reward (``None``) since construction.
        num_timeouts, num_crashed, num_too_large: failed calls of each of these kinds (also in
            ``num_errors``).
        num_rejected: rejections since construction: failures under ``on_error="reject"`` plus
            every missing reward, timeout, crash and too-large result.
        first_error: the first failure's reason and where it happened (the reward function and
            the line of its file that raised, e.g. ``"score (reward.py:7): raised KeyError:
            'x'"``; else the reward model's first failure), or ``None`` before any failure.
    """

    def __init__(self, fn: Callable[..., Any] | None, on_error: str = "zero", model=None, workers=None,
                 teacher=None) -> None:
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"on_error must be one of {ON_ERROR_MODES}, got {on_error!r}")
        if not callable(fn) and not (fn is None and model is not None):
            raise ValueError(f"reward function must be callable, got {fn!r}")
        self.fn = fn
        self.model = model
        self.teacher = teacher
        self.workers = workers if fn is not None else None
        self.on_error = on_error
        self.num_scored = 0
        self.num_errors = 0
        self.num_no_reward = 0
        self.num_rejected = 0
        self.num_timeouts = 0
        self.num_crashed = 0
        self.num_too_large = 0
        self._by_kind = dict.fromkeys(_FAILURE_KINDS, 0)
        self._popped = self._now()
        self._first_error: str | None = None
        self._lock = threading.Lock()
        self._name = getattr(fn, "__qualname__", None) or repr(fn)
        code = getattr(fn, "__code__", None)
        self._file = code.co_filename if code is not None else None
        self._key = (self._name, self._file or "", code.co_firstlineno if code is not None else 0)

    def score(
        self, data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
    ) -> RewardResult:
        """Score one response and wait for it; never raises for a failure of the reward function.

        Args:
            data_source: the row's ``data_source``, passed through.
            response_text: decoded model response.
            ground_truth: the row's ``reward_model.ground_truth``.
            extra_info: the row's ``extra_info`` dict, or None.

        Raises:
            RuntimeError: the worker pool stopped (``RewardWorkers.submit``).
        """
        args = (data_source, response_text, ground_truth, extra_info)
        if self.workers is None:
            return self._record(call_reward(self.fn, args), data_source)
        got: list[RewardResult] = []
        ready = threading.Event()
        self.submit(*args, done=lambda result: (got.append(result), ready.set()))
        while not ready.wait(0.5):
            self.workers.check()
        return got[0]

    def submit(self, data_source: str, response_text: str, ground_truth: str, extra_info: dict | None,
               done: Callable[[RewardResult], None]) -> None:
        """Score one response without waiting: ``done(result)`` runs once it is scored, on this
        thread before ``submit`` returns (in-process), or on the worker pool's thread (all of this
        scorer's calls on that one thread, in the order results come back).

        Raises:
            RuntimeError: the worker pool stopped (a ``done`` raised there, or a worker could not
                load the function).
        """
        args = (data_source, response_text, ground_truth, extra_info)
        if self.workers is None:
            done(self._record(call_reward(self.fn, args), data_source))
        else:
            self.workers.submit(args, lambda outcome: done(self._record(outcome, data_source)))

    def drain(self) -> None:
        """Wait until every ``submit`` of this scorer has called its ``done``, then until the
        reward model (if any) has scored what they passed on, then the teacher (if any).

        Raises:
            RuntimeError: the worker pool, the model stage or the teacher stage stopped.
        """
        if self.workers is not None:
            self.workers.drain()
        if self.model is not None:
            self.model.drain()
        if self.teacher is not None:
            self.teacher.drain()

    def close(self) -> None:
        """Stop the worker processes (nothing to do in-process). Idempotent."""
        if self.workers is not None:
            self.workers.close()

    def counts(self) -> dict[str, float]:
        """Totals since construction, as the metrics name them (reduction: sum).

        Returns:
            ``{"reward/scored", "reward/errors", "reward/no_reward", "reward/rejected",
            "reward/timeouts", "reward/crashed", "reward/too_large"}`` (plus the model's
            ``reward/model_*`` with a reward model, the teacher's ``distill/teacher_*`` with a
            teacher).
        """
        with self._lock:
            now = self._now()
        out = dict(zip(_METRIC_KEYS, map(float, now)))
        for stage in (self.model, self.teacher):
            if stage is not None:
                out.update(stage.counts())
        return out

    @property
    def first_error(self) -> str | None:
        """The reward function's first failure, else the reward model's, else the teacher's,
        else ``None``."""
        if self._first_error is None:
            for stage in (self.model, self.teacher):
                if stage is not None and stage.first_error is not None:
                    return stage.first_error
        return self._first_error

    def pop_metrics(self) -> dict[str, float]:
        """Return counts since the previous call and start a new window.

        Returns:
            The keys of ``counts``: calls, failures, missing rewards, rejections, timeouts,
            crashed workers and too-large results since the last ``pop_metrics`` (reduction: sum
            over the window).
        """
        with self._lock:
            now = self._now()
            before, self._popped = self._popped, now
        out = {k: float(a - b) for k, a, b in zip(_METRIC_KEYS, now, before)}
        for stage in (self.model, self.teacher):
            if stage is not None:
                out.update(stage.pop_metrics())
        return out

    def _now(self) -> tuple[int, ...]:
        return (self.num_scored, self.num_errors, self.num_no_reward, self.num_rejected, self.num_timeouts,
                self.num_crashed, self.num_too_large)

    def _record(self, outcome: Outcome, data_source: str) -> RewardResult:
        """Count ``outcome`` and turn it into a ``RewardResult`` under ``on_error``."""
        if outcome.kind == "ok":
            with self._lock:
                self.num_scored += 1
            return RewardResult(score=outcome.score, extras=dict(outcome.extras))
        kind = outcome.kind
        rejected = kind != "error" or self.on_error == "reject"
        with self._lock:
            self.num_scored += 1
            self.num_errors += kind != "no_reward"
            self.num_no_reward += kind == "no_reward"
            self.num_timeouts += kind == "timeout"
            self.num_crashed += kind == "crashed"
            self.num_too_large += kind == "too_large"
            self.num_rejected += rejected
            self._by_kind[kind] += 1
            count = self._by_kind[kind]
            if kind != "no_reward" and self._first_error is None:
                where = outcome.where or (f"{_short_path(self._file)}:{self._key[2]}" if self._file else "no source file")
                self._first_error = f"{self._name} ({where}): {outcome.reason}"
        what, noun, plural = _FAILURE_WORDS[kind]
        if count <= _NUM_FULL_LOGS:
            trace = outcome.trace
            if trace is not None:
                with _traceback_lock:
                    if self._key in _traceback_logged:
                        trace = None
                    _traceback_logged.add(self._key)
            logger.warning(
                "reward function %s %s (data_source=%r, %s %d, counted as %s): %s%s",
                self._name, what, data_source, noun, count, "rejected" if rejected else "score 0.0", outcome.reason,
                "\n" + trace.rstrip() if trace else "",
            )
        elif _is_power_of_ten(count):
            logger.warning(
                "reward function %s: %d %s so far (%d rejected in all); latest: %s",
                self._name, count, plural, self.num_rejected, outcome.reason,
            )
        return RewardResult(score=0.0, rejected=rejected, error=outcome.reason, reason=kind if rejected else None)


_FAILURE_KINDS = ("error", "no_reward", "timeout", "crashed", "too_large")
_FAILURE_WORDS = {
    "error": ("failed", "error", "failures"),
    "no_reward": ("returned no reward", "missing reward", "missing rewards"),
    "timeout": ("timed out", "timeout", "timeouts"),
    "crashed": ("crashed its worker", "crash", "crashes"),
    "too_large": ("returned too large a result", "too-large result", "too-large results"),
}
"""Per failure kind: the verb of its log line, and the noun of its count (one, several)."""


def _where(fn: Callable[..., Any], exc: BaseException | None) -> str:
    """``file:line`` of the reward function's own frame that raised ``exc`` (its deepest frame in
    the function's file; else the deepest frame), or of the function itself."""
    code = getattr(fn, "__code__", None)
    file = code.co_filename if code is not None else None
    frames = traceback.extract_tb(exc.__traceback__)[1:] if exc is not None else []
    own = [f for f in frames if f.filename == file]
    frame = (own or frames or [None])[-1]
    if frame is not None:
        inner = f" in {frame.name}" if frame.name != getattr(fn, "__name__", frame.name) else ""
        return f"{_short_path(frame.filename)}:{frame.lineno}{inner}"
    return f"{_short_path(file)}:{code.co_firstlineno}" if file else "no source file"


_METRIC_KEYS = ("reward/scored", "reward/errors", "reward/no_reward", "reward/rejected", "reward/timeouts",
                "reward/crashed", "reward/too_large")


def check_rewards_work(window: Mapping[str, float], first_error: str | None, where: str) -> None:
    """Stop a run whose reward function failed on every call of ``window`` (its first step).

    A function that raises (or returns NaN, or the wrong type) for every response is broken, and
    training on its rewards (all 0, or all rejected) would only hide that; a function that fails
    sometimes is counted (``reward/errors``) and summed up at the end (``failure_summary``).

    Args:
        window: counts of the calls in question, as ``RewardScorer.pop_metrics`` names them
            (``reward/scored``, ``reward/errors``).
        first_error: ``RewardScorer.first_error`` (the reason and where it happened).
        where: what the calls scored, e.g. ``"step 1"``, the start of the message.

    Raises:
        ValueError: every one of at least one call failed; the message counts them and holds the
            first error.
    """
    model_calls, model_errors = window.get("reward/model_scored", 0.0), window.get("reward/model_errors", 0.0)
    if model_calls and model_errors >= model_calls:
        raise ValueError(f"{where}: the reward model failed on every call ({model_errors:.0f} of {model_calls:.0f}); "
                         f"first error: {first_error}. Check reward.model and reward.model_kind")
    calls, errors = window.get("reward/scored", 0.0), window.get("reward/errors", 0.0)
    if calls and errors >= calls:
        raise ValueError(f"{where}: the reward function failed on every call ({errors:.0f} of {calls:.0f}); "
                         f"first error: {first_error}. Fix reward.fn: a reward should return 0.0 for a wrong or "
                         "unreadable answer, not raise")


def failure_summary(totals: Mapping[str, float], first_error: str | None, what: str = "reward calls") -> str | None:
    """One line counting a run's reward failures, or ``None`` when there were none.

    Example: ``"reward function: 12 of 512 reward calls failed; first error: score (reward.py:7):
    raised KeyError: 'x'"``.

    Args:
        totals: ``RewardScorer.counts()`` (or their sum over several scorers).
        first_error: the first failure (``RewardScorer.first_error``).
        what: names the calls counted, e.g. ``"training reward calls"``.
    """
    errors, calls = totals.get("reward/errors", 0.0), totals.get("reward/scored", 0.0)
    if not errors:
        return None
    return f"reward function: {errors:.0f} of {calls:.0f} {what} failed; first error: {first_error}"


def _short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it (shorter in messages)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


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
