"""Exact-match reward for the built-in image task (``data_source="async_rl/shapes"``).

The task's answers are single words ("3", "red", "triangle") and the whole response is the
answer, as in the arithmetic task: the response, with surrounding whitespace and trailing
end-of-turn markers removed, must equal the ground truth, letters compared case-insensitively
("Red" is right, "red." and "it is red" are not), so the policy learns to answer with the word
alone. The arithmetic reward does not fit: it accepts integers only.

Example::

    >>> shapes_reward("async_rl/shapes", " Red<|im_end|>", "red", None)
    {'score': 1.0, 'acc': 1.0}
    >>> shapes_reward("async_rl/shapes", "red.", "red", None)
    {'score': 0.0, 'acc': 0.0}
"""

from __future__ import annotations

from async_rl.rewards.arithmetic import strip_end_markers

__all__ = ["shapes_reward"]


def shapes_reward(data_source: str, response_text: str, ground_truth: str, extra_info: dict | None) -> dict[str, float]:
    """Score one response of the shapes task by exact, case-insensitive match.

    Args:
        data_source: ignored (the function serves "async_rl/shapes").
        response_text: decoded model response.
        ground_truth: the expected word, e.g. "3", "red", "circle".
        extra_info: ignored.

    Returns:
        ``{"score": 1.0, "acc": 1.0}`` on a match, else ``{"score": 0.0, "acc": 0.0}`` (a fresh dict).

    Raises:
        ValueError: an empty or non-string ``ground_truth`` (a data error, not a model error).
    """
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"shapes ground_truth must be a non-empty string, got {ground_truth!r}")
    hit = strip_end_markers(response_text).strip().casefold() == ground_truth.strip().casefold()
    return {"score": 1.0, "acc": 1.0} if hit else {"score": 0.0, "acc": 0.0}
