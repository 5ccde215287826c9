"""Exact-match reward for the built-in chain-sum task (``data_source="async_rl/chainsum"``), and
for any worked answer that is a chain of numbers: the long-tailed job's skip counting
(``"async_rl/skipcount"``, ``53-5>30`` answered ``48 43 38 33``) is scored by it too.

A problem is a sum of single-digit terms such as ``3+8+5+1=``; the expected response is the
worked answer, the running sums after each added term separated by single spaces (``11 16 17``),
and the ground truth holds that same chain. The reward is strict, like the arithmetic one: the
whole response (trailing end-of-turn markers and surrounding whitespace removed, runs of
whitespace counted as one space) must be exactly that chain, so a right total reached through a
wrong intermediate sum scores 0. ``final_correct`` reports the total alone, as a diagnostic of how
often the policy gets the end right without the steps. Two string splits, a comparison and one
regex search: a few microseconds per call, as it runs for every sampled response.

Example::

    >>> chainsum_reward("async_rl/chainsum", "11 16 17<|im_end|>", "11 16 17", None)
    {'score': 1.0, 'acc': 1.0, 'final_correct': 1.0}
    >>> chainsum_reward("async_rl/chainsum", "11 15 17", "11 16 17", None)
    {'score': 0.0, 'acc': 0.0, 'final_correct': 1.0}
    >>> chainsum_reward("async_rl/chainsum", "11 16 17 done", "11 16 17", None)
    {'score': 0.0, 'acc': 0.0, 'final_correct': 1.0}
"""

from __future__ import annotations

import re

from async_rl.rewards.arithmetic import canonical_integer, strip_end_markers

__all__ = ["chainsum_reward"]

# The ground truth: one or more runs of ASCII digits separated by whitespace, nothing else.
_CHAIN = re.compile(r"[0-9]+(?:\s+[0-9]+)*", re.ASCII)
# Integer literals of a response, the last one read as its final answer (the sign kept, so "-17"
# is not read as 17). One linear scan; a lookahead for "the last one" would rescan the tail.
_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)


def chainsum_reward(
    data_source: str, response_text: str, ground_truth: str, extra_info: dict | None
) -> dict[str, float]:
    """Score one response of the chain-sum task: the whole worked chain must match.

    The response, with trailing end-of-turn markers such as "<|im_end|>" and surrounding
    whitespace removed (``strip_end_markers``, shared with the arithmetic reward), is split on
    whitespace and must equal the ground truth's running sums item for item, as written ("011"
    is not "11": the task writes numbers plainly). ``final_correct`` compares the value of the
    response's last integer literal with the chain's last sum, the total.

    Args:
        data_source: ignored (the function serves "async_rl/chainsum").
        response_text: decoded model response, e.g. "11 16 17<|im_end|>".
        ground_truth: the worked answer, the running sums separated by spaces, e.g. "11 16 17".
        extra_info: ignored (the total is the chain's last sum).

    Returns:
        A fresh dict ``{"score", "acc", "final_correct"}``: ``score`` = ``acc`` = 1.0 when the
        chain matches exactly, else 0.0; ``final_correct`` = 1.0 when the response's last integer
        equals the total, else 0.0.

    Raises:
        TypeError: ``response_text`` is not a str (e.g. None).
        ValueError: ``ground_truth`` is not a chain of running sums (a data error, not a model error).

    Examples (ground truth "11 16 17", the worked answer of 3+8+5+1):
        "11 16 17" and " 11  16\\n17 <|im_end|>" score 1.0; "11 15 17" scores 0.0 with
        ``final_correct`` 1.0, as do "17" and "11 16 17 done" (not the chain alone); "" scores 0.0
        with ``final_correct`` 0.0.
    """
    if not isinstance(ground_truth, str) or _CHAIN.fullmatch(ground_truth.strip()) is None:
        raise ValueError(f"chainsum ground_truth must be running sums separated by spaces, got {ground_truth!r}")
    if not isinstance(response_text, str):
        raise TypeError(f"chainsum response_text must be a str, got {type(response_text).__name__}")
    expected = ground_truth.split()
    text = strip_end_markers(response_text)
    exact = 1.0 if text.split() == expected else 0.0
    if exact:
        final = 1.0
    else:
        numbers = _INTEGER.findall(text)
        final = 1.0 if numbers and canonical_integer(numbers[-1]) == canonical_integer(expected[-1]) else 0.0
    return {"score": exact, "acc": exact, "final_correct": final}
