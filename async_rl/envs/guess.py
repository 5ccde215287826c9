"""``guess_number``: a multi-turn guessing game with feedback between turns (a built-in environment).

The environment holds a secret integer in ``[low, high]``; each assistant turn is a guess (the
first integer in its text). A right guess ends the episode with reward 1; otherwise the feedback is
"higher" or "lower" (or a reminder of the range when the turn holds no number), reward 0, and the
episode goes on. An agent that halves the range finds the number in ``ceil(log2(high - low + 1))``
turns; guessing blindly needs about half the range.
"""

from __future__ import annotations

import random
import re
from typing import Any

from async_rl.envs.base import Environment, EnvStep, Task

_INTEGER = re.compile(r"-?\d+")


def guess_prompt(low: int, high: int) -> str:
    """The game's instruction (the first user message of its dataset rows and of ``reset``)."""
    return (f"I am thinking of a number between {low} and {high}. Guess it: answer with one number. "
            "I will say higher or lower.")


class GuessNumber(Environment):
    """The guessing game of the module docstring, one episode per object.

    Args:
        low, high: the secret's range, inclusive (``low <= high``).
        size, val_size: the rows' (``task_rows``).

    The secret is ``extra_info["secret"]`` of the task's row when set (fixed held-out episodes),
    else drawn from the environment seed, so the episodes of a group share it.

    Raises:
        ValueError: ``low > high``.
    """

    def __init__(self, low: int = 1, high: int = 16, size: int = 1000, val_size: int = 100) -> None:
        if low > high:
            raise ValueError(f"guess_number: low={low} is above high={high}")
        self.low, self.high = int(low), int(high)
        self.secret: int | None = None
        self.guesses = 0

    async def reset(self, task: Task, seed: int) -> list[dict]:
        """The secret from the row or the seed; the prompt is the row's messages, or the game's
        instruction when the row has none."""
        secret = task.extra_info.get("secret")
        self.secret = int(secret) if secret is not None else random.Random(seed).randint(self.low, self.high)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"guess_number: secret {self.secret} outside [{self.low}, {self.high}]")
        return list(task.messages) or [{"role": "user", "content": guess_prompt(self.low, self.high)}]

    @staticmethod
    def task_rows(split: str, low: int = 1, high: int = 16, size: int = 1000, val_size: int = 100,
                  **_: Any) -> list[dict[str, Any]]:
        """Rows of the game (``data.train_files: [env:train]``): its instruction, and the secret
        ``extra_info.secret`` cycling through ``[low, high]`` (``size`` training rows, ``val_size``
        held-out ones, which start the cycle elsewhere). A game has few secrets: held-out rows
        differ from training rows by their episodes (their turns' seeds), not their secrets.

        Raises:
            ValueError: an unknown split.
        """
        if split not in ("train", "val"):
            raise ValueError(f"guess_number: unknown split {split!r}; valid: train, val")
        count, offset = (size, 0) if split == "train" else (val_size, (high - low + 1) // 2)
        return [{"prompt": [{"role": "user", "content": guess_prompt(low, high)}], "data_source": "guess_number",
                 "extra_info": {"secret": low + (k + offset) % (high - low + 1)}} for k in range(count)]

    async def step(self, action: str) -> EnvStep:
        """Reward 1 and done for the secret; else feedback, reward 0."""
        match = _INTEGER.search(action)
        if match is None:
            return EnvStep([{"role": "user", "content": f"Answer with one number between {self.low} and "
                                                         f"{self.high}."}], 0.0, False, {"invalid": 1.0})
        self.guesses += 1
        guess = int(match.group())
        if guess == self.secret:
            return EnvStep([], 1.0, True, {"guesses": float(self.guesses)})
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep([{"role": "user", "content": f"{guess} is wrong: {hint}."}], 0.0, False, {})
