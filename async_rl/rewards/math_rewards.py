"""Math answer rewards checked with math-verify: "gsm8k" and "math".

Both rewards first cut a short final-answer string out of the response with plain string
handling, then let math-verify (https://github.com/huggingface/Math-Verify) decide whether it
equals the ground truth (so "0.5" matches "\\frac{1}{2}" and "72.0" matches "72"):

- ``gsm8k_reward``: the number after the last "####" (the GSM8K solution format), else the
  content of the last ``\\boxed{...}``, else the last number in the text.
- ``math_reward``: the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``); a response
  without one scores 0, as in the MATH benchmark convention.

Threads: math-verify guards parsing and comparison with ``signal.alarm``, which Python allows only
in the main thread; from any other thread its default arguments raise ValueError. These rewards
keep the alarm in the main thread and pass ``parsing_timeout=None`` / ``timeout_seconds=None``
elsewhere. Without the alarm the guard against a pathological expression is the length cap
``MAX_ANSWER_CHARS`` on the extracted answer: sympy only ever sees a short string.

math-verify (and sympy) is imported on the first call, so importing ``async_rl.rewards`` stays
cheap for tasks that never use these rewards.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

__all__ = [
    "MAX_ANSWER_CHARS",
    "extract_gsm8k_prediction",
    "gsm8k_reward",
    "last_boxed",
    "math_reward",
    "normalize_number",
]

MAX_ANSWER_CHARS = 1000
"""Longest extracted answer (characters) handed to math-verify; longer ones score 0."""

_MAIN_THREAD_TIMEOUT_S = 5
"""Seconds math-verify may spend on one parse or comparison, enforced in the main thread only."""

# A number with optional sign, optional "," thousands groups and an optional decimal part.
# Groups must be exactly three digits, so the pair "(1,2)" reads as two numbers, not 12.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+", re.ASCII)
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")


def normalize_number(text: str) -> str:
    """Drop thousands separators and a leading "+" from a number string ("+1,234" -> "1234").

    Args:
        text: a string matched as a number, e.g. by ``extract_gsm8k_prediction``.

    Returns:
        The number without "," and without a leading "+".
    """
    return text.replace(",", "").removeprefix("+")


def last_boxed(text: str) -> str | None:
    """Return the content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``.

    Braces are matched with nesting, so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. The
    brace-less form ``\\boxed 5`` gives the token after the space. An unclosed box is ignored
    and the search moves to an earlier one.

    Args:
        text: model response (LaTeX mixed with prose).

    Returns:
        The box content (stripped), or None if there is no complete box.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if text.startswith("{", start):
            depth = 0
            for i in range(start, len(text)):
                if text[i] == "{":
                    depth += 1
                elif text[i] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : i].strip()
        elif text.startswith(" ", start):
            token = text[start:].split(maxsplit=1)
            if token:
                return token[0].rstrip("$.")
    return None


def extract_gsm8k_prediction(text: str) -> str | None:
    """Cut the final answer out of a GSM8K-style response.

    Order of preference: the first number after the last "####"; else the content of the last
    ``\\boxed{...}``; else the last number anywhere in the text. Thousands separators are removed
    from numbers found by the "####" and last-number rules ("1,234" -> "1234").

    Args:
        text: model response.

    Returns:
        The answer string (a plain number, or LaTeX box content), or None if nothing was found.
    """
    marker = text.rfind("####")
    if marker != -1:
        number = _NUMBER.search(text, marker + 4)
        if number is not None:
            return normalize_number(number.group())
    boxed = last_boxed(text)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_reward(
    data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
) -> dict[str, float]:
    """Score a GSM8K response: extracted final answer vs. ground truth, checked by math-verify.

    Args:
        data_source: ignored (the function serves "openai/gsm8k").
        response_text: decoded model response, e.g. "... so she has 72 apples.\\n#### 72".
        ground_truth: the final number of the reference solution, e.g. "72" ("1,234" is also
            accepted).
        extra_info: ignored.

    Returns:
        {"score": 1.0, "acc": 1.0} if the answer is mathematically equal to the ground truth,
        else {"score": 0.0, "acc": 0.0} (also for an empty response or no answer found).
    """
    prediction = extract_gsm8k_prediction(response_text)
    correct = prediction is not None and _equal(normalize_number(ground_truth.strip()), prediction)
    return _result(correct)


def math_reward(
    data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
) -> dict[str, float]:
    """Score a competition-math response by its last ``\\boxed{}`` answer, checked by math-verify.

    Args:
        data_source: ignored (the function serves MATH-style datasets).
        response_text: decoded model response; the answer must be in ``\\boxed{...}``.
        ground_truth: the reference answer as LaTeX, boxed or not, e.g. "\\frac{1}{2}".
        extra_info: ignored.

    Returns:
        {"score": 1.0, "acc": 1.0} if the boxed answer equals the ground truth, else
        {"score": 0.0, "acc": 0.0} (also when the response has no box).
    """
    prediction = last_boxed(response_text)
    gold = last_boxed(ground_truth) or ground_truth.strip()
    return _result(prediction is not None and _equal(gold, prediction))


def _result(correct: bool) -> dict[str, float]:
    value = 1.0 if correct else 0.0
    return {"score": value, "acc": value}


def _equal(gold: str, prediction: str) -> bool:
    """True if math-verify finds the two LaTeX answers (box contents, no delimiters) equal."""
    if not gold or not prediction or len(prediction) > MAX_ANSWER_CHARS:
        return False
    math_verify = _math_verify()
    in_main_thread = threading.current_thread() is threading.main_thread()
    timeout_s = _MAIN_THREAD_TIMEOUT_S if in_main_thread else None
    gold_parsed = _parse(gold, timeout_s)
    prediction_parsed = _parse(prediction, timeout_s)
    if not gold_parsed or not prediction_parsed:
        return False
    return math_verify.verify(gold_parsed, prediction_parsed, timeout_seconds=timeout_s)


# Answers repeat a lot (n samples per prompt share one ground truth; short numbers recur), and
# parsing dominates the cost. Parsed values are immutable sympy objects, safe to share.
@functools.lru_cache(maxsize=8192)
def _parse(answer: str, timeout_s: int | None) -> list[Any]:
    # Re-boxing gives math-verify an anchor, so it reads the whole string as one answer.
    return _math_verify().parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)


class _DropTimeoutDisabledWarning(logging.Filter):
    """Hides math-verify's "Timeout is disabled" warning: the length cap is our guard instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@functools.cache
def _math_verify() -> Any:
    # Lazy: math-verify pulls in sympy and latex2sympy (seconds of import), which the default
    # arithmetic task never needs.
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return math_verify
