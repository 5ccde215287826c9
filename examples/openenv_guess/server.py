"""A guessing game served by OpenEnv's own server code (``openenv-core``), for ``env.name=openenv``.

The server holds a secret integer in ``[LOW, HIGH]`` per session (drawn from the seed the client
passes to ``reset``); each action is a guess (the first integer of its ``message``); the
observation says "higher" or "lower", and a right guess ends the episode with reward 1.

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
        self.secret = LOW

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.secret = random.Random(seed).randint(LOW, HIGH)
        return GuessObservation(message=f"I am thinking of a number between {LOW} and {HIGH}. Guess it: answer "
                                        "with one number. I will say higher or lower.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        match = re.search(r"-?\d+", action.message)
        if match is None:
            return GuessObservation(message=f"Answer with one number between {LOW} and {HIGH}.", done=False,
                                    reward=0.0)
        guess = int(match.group())
        if guess == self.secret:
            return GuessObservation(message="Right.", done=True, reward=1.0)
        return GuessObservation(message=f"{guess} is wrong: {'higher' if guess < self.secret else 'lower'}.",
                                done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256)
