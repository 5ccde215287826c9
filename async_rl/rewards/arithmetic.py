"""Exact-match reward for the built-in arithmetic task (``data_source="async_rl/arithmetic"``).

The task asks a small model for the integer result of a short expression, and the answer is the
whole response. The reward is strict on purpose: "12abc" or "the answer is 12" score 0, so the
policy learns to answer with the number alone. It is a couple of regex matches and a string
comparison (about a microsecond), because it is called for every sampled response.

Example::

    >>> arithmetic_reward("async_rl/arithmetic", " 12<|im_end|>", "12", None)
    {'score': 1.0, 'acc': 1.0}
    >>> arithmetic_reward("async_rl/arithmetic", "12abc", "12", None)
    {'score': 0.0, 'acc': 0.0}
"""

from __future__ import annotations

import re

__all__ = ["arithmetic_reward", "canonical_integer", "strip_end_markers"]

# End-of-turn / end-of-sequence markers that detokenizers leave in the text when special tokens
# are not skipped (ChatML, Llama 3, Gemma, SentencePiece models). Several may be chained.
_TRAILING_MARKERS = re.compile(r"(?:\s*(?:<\|[A-Za-z0-9_]+\|>|</s>|<eos>|<end_of_turn>))+\s*\Z")
# ASCII digits only: str.isdigit() and \d also accept other scripts' digits and superscripts.
_INTEGER = re.compile(r"([+-]?)([0-9]+)", re.ASCII)

_CORRECT = {"score": 1.0, "acc": 1.0}
_WRONG = {"score": 0.0, "acc": 0.0}


def strip_end_markers(text: str) -> str:
    """Return ``text`` without trailing whitespace and trailing end-of-turn markers.

    Removes any chain of ChatML-style ``<|...|>`` tokens, ``</s>``, ``<eos>`` and
    ``<end_of_turn>`` at the end, with the whitespace around them ("12 <|im_end|>\\n<|endoftext|>"
    -> "12"); markers elsewhere in the text are kept. Shared by the rule-based rewards whose
    answer is the whole response (arithmetic, chainsum).

    Args:
        text: decoded model response.

    Returns:
        The response with its end stripped; leading whitespace is kept.
    """
    text = text.rstrip()
    if text.endswith(">"):  # cheap test first: most responses carry no marker
        text = _TRAILING_MARKERS.sub("", text)
    return text


def canonical_integer(text: str) -> str | None:
    """Return the canonical form of a clean integer literal, or None if ``text`` is not one.

    A clean integer literal is an optional sign followed by ASCII digits and nothing else
    (surrounding whitespace is ignored). Leading zeros are accepted and dropped ("012" -> "12"),
    "+" is dropped, and "-0" becomes "0". The comparison stays on strings, so arbitrarily long
    literals cost no big-integer parsing and never hit Python's int-from-str digit limit.

    Args:
        text: candidate literal.

    Returns:
        The canonical decimal string ("-12", "0", "7"), or None.
    """
    match = _INTEGER.fullmatch(text.strip())
    if match is None:
        return None
    sign, digits = match.groups()
    digits = digits.lstrip("0") or "0"
    return "-" + digits if sign == "-" and digits != "0" else digits


def arithmetic_reward(
    data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
) -> dict[str, float]:
    """Score one response of the arithmetic task by exact integer match.

    The response, with surrounding whitespace and any trailing end-of-turn markers such as
    "<|im_end|>" removed, must be a clean integer literal (see ``canonical_integer``; "012"
    counts as 12) equal in value to ``ground_truth``. Anything else scores 0.

    Args:
        data_source: ignored (the function serves "async_rl/arithmetic").
        response_text: decoded model response.
        ground_truth: the expected integer as a decimal string, e.g. "-3".
        extra_info: ignored.

    Returns:
        {"score": 1.0, "acc": 1.0} on a match, else {"score": 0.0, "acc": 0.0}. A fresh dict
        each call, so callers may mutate it.

    Raises:
        ValueError: ``ground_truth`` is not an integer literal (a data error, not a model error).
    """
    expected = canonical_integer(ground_truth)
    if expected is None:
        raise ValueError(
            f"arithmetic ground_truth must be an integer literal, got {ground_truth!r}"
        )
    answer = canonical_integer(strip_end_markers(response_text))
    return dict(_CORRECT if answer == expected else _WRONG)
