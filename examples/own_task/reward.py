"""The reward of this example: the answer must be the word in capitals.

A reward function takes four arguments, in this order (they are passed positionally, so verl's
names, e.g. ``solution_str``, work too):

- ``data_source``: the row's ``data_source`` (one function can serve several tasks);
- ``response_text``: the model's answer, decoded without special tokens;
- ``ground_truth``: the row's ``reward_model.ground_truth``, as a string;
- ``extra_info``: the row's ``extra_info`` mapping (or ``None``).

It returns a number, or a dict with a number under ``"score"`` and other numbers beside it
(``"acc"`` is what the run reports as accuracy). A wrong or unreadable answer should score 0,
not raise: a run whose reward function raises on every call stops at its first step.

Run it with ``reward.fn=examples/own_task/reward.py:score``.
"""

from __future__ import annotations


def score(data_source: str, response_text: str, ground_truth: str, extra_info: dict | None) -> dict[str, float]:
    """1.0 for exactly the ground truth; otherwise the fraction of its letters in the right place
    (a partial signal RL can climb), capped below 1.

    Example: ground truth ``"KIV"``: ``"KIV"`` -> 1.0, ``"KIX"`` -> 0.33 (2 of 3 letters, halved),
    ``"kiv"`` -> 0.0, ``"KIVV"`` -> 0.375 (3 of 4 positions, halved).

    Returns:
        ``{"score": float in [0, 1], "acc": 1.0 or 0.0}``.
    """
    answer = response_text.strip()
    if answer == ground_truth:
        return {"score": 1.0, "acc": 1.0}
    width = max(len(answer), len(ground_truth), 1)
    same = sum(a == b for a, b in zip(answer, ground_truth))
    return {"score": 0.5 * same / width, "acc": 0.0}
