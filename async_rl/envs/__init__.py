"""Environments for rollouts: the episode protocol, its registry, and the built-in environments.

- ``Environment``: ``reset(task, seed) -> messages``, ``step(action) -> EnvStep``, ``close()``,
  all coroutines; one object per episode (``async_rl.envs.base``).
- ``ENVIRONMENTS`` / ``register_env`` / ``make_env``: environments by spec (``builtin:name``,
  ``pkg.mod:attr``, ``path/to/file.py:attr``).
- Built-ins, registered here: ``guess_number`` (``GuessNumber``, a multi-turn guessing game) and
  ``gym`` (``GymTextEnv``: a gymnasium environment with text observations and actions; needs the
  ``gymnasium`` package), ``reasoning_gym`` (``ReasoningGym``: reasoning-gym's procedural tasks,
  their rows and their scorers; needs the ``reasoning-gym`` package), ``openenv``
  (``OpenEnvEnv``: sessions on OpenEnv servers, which a run may start and supervise itself,
  ``OpenEnvServers``; needs ``openenv-core``), ``mix`` (``MixedEnv``: several of these in one
  run, by weight), ``single_turn`` (``SingleTurn``: one prompt, one response, scored by the run's
  reward function, the plain rollout as an environment), ``tools`` (``ToolUse``: multi-turn tool
  calls, the tools run by the environment, the answer scored by the run's reward function),
  ``shapes_dialogue`` (``ShapesDialogue``: questions about pictures, a new picture each turn,
  for a vision-language policy).

The rollout side (turns on an engine, tokens, masks, faults) is ``async_rl.step.episodes``.
"""

from async_rl.envs.base import (ENVIRONMENTS, EnvStep, Environment, EnvironmentLost, MalformedEnvStepError, Task, check_messages,
                                check_step, make_env, register_env)
from async_rl.envs.guess import GuessNumber, guess_prompt
from async_rl.envs.gym import GymTextEnv
from async_rl.envs.mix import MixedEnv
from async_rl.envs.openenv import OpenEnvEnv, OpenEnvServers
from async_rl.envs.reasoning_gym import ReasoningGym
from async_rl.envs.shapes import ShapesDialogue
from async_rl.envs.single_turn import SingleTurn
from async_rl.envs.tools import ToolUse

register_env(GuessNumber, "guess_number")
register_env(GymTextEnv, "gym")
register_env(ReasoningGym, "reasoning_gym")
register_env(OpenEnvEnv, "openenv")
register_env(MixedEnv, "mix")
register_env(SingleTurn, "single_turn")
register_env(ToolUse, "tools")
register_env(ShapesDialogue, "shapes_dialogue")

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "EnvironmentLost", "GuessNumber", "MixedEnv", "OpenEnvEnv", "OpenEnvServers", "GymTextEnv", "MalformedEnvStepError", "ReasoningGym", "ShapesDialogue", "SingleTurn", "Task", "ToolUse",
           "check_messages", "check_step", "guess_prompt", "make_env", "register_env"]
