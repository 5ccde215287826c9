"""``gym``: a gymnasium environment whose observations and actions are text, run unchanged.

``GymTextEnv`` wraps one ``gymnasium.Env`` per episode: ``reset(seed=...)`` gives the first
observation, rendered as a user message (after ``system_prompt`` when set); each assistant turn is
the action passed to ``env.step``, whose observation becomes the next user message, its reward the
turn's reward, and ``terminated or truncated`` the end of the episode. Numeric entries of the
step's ``info`` are summed per episode (``env/info/<key>``).

Observations and actions that are not plain strings go through two functions named by spec:
``observation`` (observation -> text; default ``str``) and ``action`` (text -> action; default
the text itself). An ``action`` function that raises ``ValueError`` marks the turn invalid: the
model is told why (the error's message), the turn's reward is ``invalid_action_reward`` and the
episode goes on. The environment's calls run in a worker thread (``asyncio.to_thread``), so a slow
game never holds up the other episodes.

Config::

    env:
      name: gym
      args: {id: my_pkg.games:WordLadder, kwargs: {length: 4}, system_prompt: "You play ..."}
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from async_rl.envs.base import Environment, EnvStep, Task
from async_rl.utils.registry import Registry

_GAMES: Registry[Callable[..., Any]] = Registry("gymnasium environment")
_CONVERTERS: Registry[Callable[[Any], Any]] = Registry("gym text converter")


def _make_gym_env(env_id: str, kwargs: dict[str, Any]) -> Any:
    """``gymnasium.make(env_id, **kwargs)`` for a registered id, else the class or function the
    spec ``pkg.mod:attr`` / ``file.py:attr`` names, called with ``kwargs``.

    Raises:
        ValueError: gymnasium is not installed, the id is unknown, or the object made is not a
            ``gymnasium.Env``.
    """
    try:
        import gymnasium
    except ImportError:
        raise ValueError("env.name=gym needs the gymnasium package: pip install 'async-rl[envs]'") from None
    if ":" in env_id or env_id.endswith(".py"):
        env = _GAMES.get(env_id)(**kwargs)
    else:
        try:
            env = gymnasium.make(env_id, **kwargs)
        except gymnasium.error.Error as e:
            raise ValueError(f"gymnasium environment {env_id!r}: {e}") from None
    if not isinstance(env, gymnasium.Env):
        raise ValueError(f"gymnasium environment {env_id!r} made a {type(env).__name__}, not a gymnasium.Env")
    return env


class GymTextEnv(Environment):
    """One episode of a text ``gymnasium.Env`` (see the module docstring).

    Args:
        id: a registered gymnasium id, or the spec (``pkg.mod:attr``, ``path/file.py:attr``) of an
            ``Env`` subclass or a function returning one.
        kwargs: keyword arguments of ``gymnasium.make`` or of the class.
        observation: spec of ``observation -> str``; ``None``: ``str``.
        action: spec of ``str -> action`` (raises ``ValueError`` for an invalid one); ``None``:
            the text itself.
        system_prompt: a system message before the first observation; ``None``: none.
        invalid_action_reward: the reward of a turn whose action ``action`` refused.

    Raises:
        ValueError: as ``_make_gym_env``; a converter spec that names nothing callable.
    """

    def __init__(self, id: str, kwargs: dict[str, Any] | None = None, observation: str | None = None,
                 action: str | None = None, system_prompt: str | None = None,
                 invalid_action_reward: float = 0.0) -> None:
        self.game = _make_gym_env(id, dict(kwargs or {}))
        self.render = _CONVERTERS.get(observation) if observation else str
        self.parse = _CONVERTERS.get(action) if action else None
        self.system_prompt = system_prompt
        self.invalid_action_reward = float(invalid_action_reward)

    def _text(self, observation: Any) -> str:
        text = self.render(observation)
        if not isinstance(text, str):
            raise TypeError(f"the observation renderer returned a {type(text).__name__}, not a str")
        return text

    async def reset(self, task: Task, seed: int) -> list[dict]:
        """``env.reset(seed=seed)``'s observation as the first user message (the row's own
        messages are not used: the game states the task)."""
        observation, _ = await asyncio.to_thread(self.game.reset, seed=seed)
        first = [{"role": "user", "content": self._text(observation)}]
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + first

    async def step(self, action: str) -> EnvStep:
        """One ``env.step`` of the parsed action; an invalid action is a reward and a message."""
        try:
            parsed = self.parse(action) if self.parse is not None else action
        except ValueError as e:
            return EnvStep([{"role": "user", "content": f"Invalid action: {e}"}], self.invalid_action_reward,
                           False, {"invalid_actions": 1.0})
        observation, reward, terminated, truncated, info = await asyncio.to_thread(self.game.step, parsed)
        numbers = {k: float(v) for k, v in (info or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        done = bool(terminated or truncated)
        text = self._text(observation)
        return EnvStep([] if done and not text else [{"role": "user", "content": text}], float(reward), done, numbers)

    async def close(self) -> None:
        """``env.close()``."""
        await asyncio.to_thread(self.game.close)
