"""The guessing game's client side: OpenEnv sessions (``async_rl.envs.OpenEnvEnv``) plus rows whose
reference is a demonstration for the warm start (one guess, or the whole binary search).

``env.name: examples/openenv_guess/client.py:GuessClient`` in config.yaml. The rows' prompt is the
server's own instruction, so the warm start trains on the conversation a rollout will see; the
episodes themselves get the server's secret (drawn from the group's seed), not the row's.
"""

from __future__ import annotations

from typing import Any

from async_rl.envs import OpenEnvEnv

LOW, HIGH = 1, 8
INSTRUCTION = (f"I am thinking of a number between {LOW} and {HIGH}. Guess it: answer with one number. "
               "I will say higher or lower.")


def binary_search(secret: int, low: int = LOW, high: int = HIGH) -> list[dict[str, str]]:
    """The messages after the instruction of a game played by halving the range: each guess, the
    server's answer to it, up to the right guess."""
    messages = []
    while True:
        guess = (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        hint = "higher" if guess < secret else "lower"
        messages.append({"role": "user", "content": f"{guess} is wrong: {hint}."})
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)


class GuessClient(OpenEnvEnv):
    """``OpenEnvEnv`` whose rows carry a demonstration (``extra_info.demonstration``).

    Args:
        demonstration: ``guess`` or ``binary_search`` (``task_rows``).
        kwargs: ``OpenEnvEnv``'s.
    """

    def __init__(self, demonstration: str = "guess", **kwargs: Any) -> None:
        super().__init__(**kwargs)

    @staticmethod
    def task_rows(split: str, size: int = 1000, val_size: int = 64, demonstration: str = "guess",
                  **_: Any) -> list[dict[str, Any]]:
        """The rows, with a demonstration: ``guess`` (one guess: the answer's format, not how to
        use the feedback, which RL has to learn) or ``binary_search`` (the whole strategy).

        Raises:
            ValueError: another ``demonstration``.
        """
        if demonstration not in ("guess", "binary_search"):
            raise ValueError(f"demonstration must be guess or binary_search, got {demonstration!r}")
        rows = OpenEnvEnv.task_rows(split, size=size, val_size=val_size, instruction=INSTRUCTION)
        for k, row in enumerate(rows):
            number = LOW + k % (HIGH - LOW + 1)
            row["extra_info"]["demonstration"] = (binary_search(number) if demonstration == "binary_search"
                                                  else [{"role": "assistant", "content": str(number)}])
        return rows
