"""A guessing game served by OpenEnv's own server code (``openenv-core``), for ``env.name=openenv``.

The server holds a secret integer in ``[LOW, HIGH]`` per session (drawn from the seed the client
passes to ``reset``); each action is a guess (the first integer of its ``message``); the
observation says where the secret is ("4 is wrong: it is between 5 and 8.": the range that every
answer so far leaves), and a right guess ends the episode with reward 1. The answers carry the
game's whole state, so a policy reads its next move from the last answer rather than from the
whole conversation.

Serve it yourself::

    uvicorn examples.openenv_guess.server:app --host 127.0.0.1 --port 8001

or let a run start and supervise its replicas (``env.args.serve``, see config.yaml).
"""

from __future__ import annotations

import os
import random
import re
from uuid import uuid4

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LOW, HIGH = 1, int(os.environ.get("GUESS_HIGH", "8"))


def instruction(low: int = LOW, high: int = HIGH) -> str:
    """The game's first message."""
    return (f"I am thinking of a number between {low} and {high}. Guess it: answer with one number. "
            "I will tell you where it is.")


def narrow(low: int, high: int, guess: int, secret: int) -> tuple[int, int]:
    """The range ``[low, high]`` still holding ``secret`` once ``guess`` (a wrong one) is answered:
    a guess outside the range leaves it as it is."""
    return (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))


def answer(guess: int, low: int, high: int) -> str:
    """The answer to a wrong ``guess``, with the range ``[low, high]`` that holds the secret."""
    return f"{guess} is wrong: it is between {low} and {high}."


class GuessAction(Action):
    """One guess, as the assistant turn's text."""

    message: str = Field(..., description="The assistant's turn; its first integer is the guess")


class GuessObservation(Observation):
    """The game's answer to a guess (or its instruction, after reset)."""

    message: str = Field(default="", description="What the game says")


class GuessEnvironment(Environment):
    """One session of the game (each WebSocket session gets its own object)."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.secret, self.low, self.high = LOW, LOW, HIGH

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = random.Random(seed).randint(LOW, HIGH)
        self.low, self.high = LOW, HIGH
        return GuessObservation(message=instruction(), done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        match = re.search(r"-?\d+", action.message)
        if match is None:
            return GuessObservation(message=f"Answer with one number between {LOW} and {HIGH}.", done=False,
                                    reward=0.0)
        guess = int(match.group())
        if guess == self.secret:
            return GuessObservation(message="Right.", done=True, reward=1.0)
        self.low, self.high = narrow(self.low, self.high, guess, self.secret)
        return GuessObservation(message=answer(guess, self.low, self.high), done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256)
