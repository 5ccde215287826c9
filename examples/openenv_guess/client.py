"""The guessing game's client side: OpenEnv sessions (``async_rl.envs.OpenEnvEnv``) plus rows whose
reference is a demonstration for the warm start (one guess, random guesses that ignore the
answers or stay inside the range they leave, the whole binary search, or a share of it).

``env.name: examples/openenv_guess/client.py:GuessClient`` in config.yaml. The rows' prompt is the
server's own instruction, so the warm start trains on the conversation a rollout will see; the
episodes themselves get the server's secret (drawn from the group's seed), not the row's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from async_rl.envs import OpenEnvEnv
from async_rl.utils.registry import load_file_module

# The server's own rules and words, so that a demonstration reads as the game answers.
_server = load_file_module(str(Path(__file__).with_name("server.py")), "async_rl_example", "guessing game server")
LOW, HIGH, answer, instruction, narrow = _server.LOW, _server.HIGH, _server.answer, _server.instruction, _server.narrow
INSTRUCTION = instruction()


def binary_search(secret: int, turns: int | None = None, low: int = LOW, high: int = HIGH, slip: float = 0.0,
                  rng: random.Random | None = None) -> list[dict[str, str]]:
    """The messages after the instruction of a game played by halving the range: each guess, the
    server's answer to it, up to the right guess (or ``turns`` guesses, if given: a game of 8
    numbers takes up to 4).

    With ``slip`` > 0 each guess is, with that probability (drawn from ``rng``), the low end of the
    range the answers leave instead of its middle: a player who reads every answer but does not
    always halve. At ``slip=1`` (counting up from the bottom) 3 turns find 3 secrets of 8, at 0
    they find 7; at 0.5, 59% of them (exact expectation over the secrets).

    Raises:
        ValueError: a ``slip`` without an ``rng`` to draw it from.
    """
    if slip and rng is None:
        raise ValueError("binary_search: slip needs an rng to draw each slip from")
    messages = []
    while turns is None or len(messages) < 2 * turns - 1:
        guess = low if slip and rng.random() < slip else (low + high) // 2
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return messages
        low, high = narrow(low, high, guess, secret)
        messages.append({"role": "user", "content": answer(guess, low, high)})
    return messages[:-1]  # the last answer of a lost game is the server's; nothing follows it to train on


def random_play(secret: int, rng: random.Random, turns: int = 4, in_range: bool = True, low: int = LOW,
                high: int = HIGH) -> list[dict[str, str]]:
    """The messages after the instruction of a game of random guesses, each the server's answer
    to the guess before it, up to the right guess or ``turns`` guesses. With ``in_range`` each
    guess is drawn uniformly from the range the answers so far leave (the answers are read, no
    strategy is used: on 8 numbers it wins 62% of games in 3 turns, where halving the range wins
    88%); without, from ``[low, high]`` every time (repeats included: the answers are ignored;
    ``1 - (1 - 1/n)**turns`` of games on ``n`` numbers)."""
    messages, left = [], (low, high)
    for _ in range(turns):
        guess = rng.randint(*left) if in_range else rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        left = narrow(*left, guess, secret)
        messages.append({"role": "user", "content": answer(guess, *left)})
    if messages[-1]["role"] == "user":
        messages.pop()  # the last answer of a lost game is the server's; nothing follows it to train on
    return messages


DEMONSTRATIONS = ("guess", "feedback_blind", "in_range", "binary_search")


class GuessClient(OpenEnvEnv):
    """``OpenEnvEnv`` whose rows carry a demonstration (``extra_info.demonstration``).

    Args:
        demonstration: ``guess``, ``feedback_blind``, ``in_range`` or ``binary_search``
            (``task_rows``).
        turns: the demonstrations' number of guesses at most (``env.max_turns``).
        binary_search_share: the share of rows demonstrating the binary search instead.
        slip: the share of the binary search's guesses at the low end of the range instead.
        kwargs: ``OpenEnvEnv``'s.
    """

    def __init__(self, demonstration: str = "guess", turns: int = 4, binary_search_share: float = 0.0,
                 slip: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    @staticmethod
    def task_rows(split: str, size: int = 1000, val_size: int = 64, demonstration: str = "guess",
                  turns: int = 4, binary_search_share: float = 0.0, slip: float = 0.0,
                  **_: Any) -> list[dict[str, Any]]:
        """The rows, with a demonstration of at most ``turns`` guesses: ``guess`` (one guess: the
        answer's format), ``feedback_blind`` (random guesses that ignore the answers: the game's
        form over several turns), ``in_range`` (random guesses inside the range the answers leave:
        reading the answers, with no strategy) or ``binary_search`` (the whole strategy, or with
        ``slip`` a share of its guesses at the low end of the range instead). With the first
        three, or a slip, a better way to play is RL's to learn. ``binary_search_share`` of the rows
        (drawn row by row) demonstrate the binary search instead: a warm-started policy
        that plays it some of the time, for RL to make it the rule. A row's demonstration is fixed
        by its split and index.

        Raises:
            ValueError: another ``demonstration``, or a share or slip outside ``[0, 1]``.
        """
        if demonstration not in DEMONSTRATIONS:
            raise ValueError(f"demonstration must be one of {', '.join(DEMONSTRATIONS)}, got {demonstration!r}")
        if not 0.0 <= binary_search_share <= 1.0:
            raise ValueError(f"binary_search_share must be in [0, 1], got {binary_search_share}")
        if not 0.0 <= slip <= 1.0:
            raise ValueError(f"slip must be in [0, 1], got {slip}")
        rows = OpenEnvEnv.task_rows(split, size=size, val_size=val_size, instruction=INSTRUCTION)
        for k, row in enumerate(rows):
            number = LOW + k % (HIGH - LOW + 1)
            rng = random.Random(f"{split}:{k}")
            if demonstration == "binary_search" or rng.random() < binary_search_share:
                demo = binary_search(number, turns, slip=slip, rng=rng)
            elif demonstration in ("feedback_blind", "in_range"):
                demo = random_play(number, rng, turns, demonstration == "in_range")
            else:
                demo = [{"role": "assistant", "content": str(number)}]
            row["extra_info"]["demonstration"] = demo
        return rows
