"""The episode protocol: what an environment is to a rollout, and where environments come from.

An episode starts from a ``Task`` (one dataset row) and an environment seed. The environment gives
the first observation (chat messages), then takes each assistant turn as text and answers with an
``EnvStep``: the next observation (messages appended to the conversation), a reward for the turn
and whether the episode is over. Its methods are coroutines, so one generator actor advances many
episodes at once (an environment served over HTTP waits on the network, not on the actor).

A fresh environment object serves each episode (``make_env``); it may keep the episode's state
on itself. The episode's return (the sum of its turns' rewards) is the sample's reward, as the
outcome estimators (GRPO, RLOO, Dr. GRPO, REINFORCE++) use it; per-turn rewards are kept in the
trajectory's extras (``env/turn_rewards``).

Environments are named by spec, as every pluggable part is (``async_rl.utils.registry``):
``builtin:guess_number``, ``my_pkg.envs:MyEnv`` or ``path/to/envs.py:MyEnv``. The spec names an
``Environment`` subclass or a function returning an ``Environment``; ``env.args`` from the config
are passed to it as keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from async_rl.utils.registry import Registry

__all__ = ["ENVIRONMENTS", "EnvStep", "Environment", "EnvironmentLost", "MalformedEnvStepError", "Task", "check_messages",
           "check_step", "has_images", "make_env", "register_env"]

OBSERVATION_ROLES = ("user", "tool", "system")
"""Roles an observation message may have: the environment speaks as the user, a tool or the system."""


@dataclass(frozen=True)
class Task:
    """What an episode starts from: one dataset row.

    Attributes:
        uid: the row's identity (``Prompt.uid``).
        messages: the row's chat messages (the default first observation).
        data_source: the row's ``data_source``.
        ground_truth: the row's ``reward_model.ground_truth`` (``None`` when absent).
        extra_info: the row's ``extra_info``.
    """

    uid: str
    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: str | None
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvStep:
    """An environment's answer to one assistant turn.

    Attributes:
        observation: messages appended after the assistant turn (roles ``user``, ``tool`` or
            ``system``, string content); may be empty when ``done``. For a vision-language
            policy a message's content may also be a list of parts, ``{"type": "text", "text":
            str}`` and ``{"type": "image", "image": picture}`` with the picture a ``PIL.Image``,
            encoded bytes (PNG, JPEG, ...) or a file path: the episode loop processes it as the
            dataset processes a row's images and the learner trains on it with the turn.
        reward: this turn's reward (finite float).
        done: the episode is over (the environment's ``terminated or truncated``).
        info: numbers reported per episode, summed over its turns (``env/info/<key>``).
    """

    observation: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = field(default_factory=dict)


class EnvironmentLost(ConnectionError):
    """The environment's server (or whatever hosts it) went away mid-episode: not a fault of the
    episode. The episode loop starts such an episode over, once (``env/reissued_episodes``)."""


class MalformedEnvStepError(ValueError):
    """An environment returned something that is not a valid first observation or ``EnvStep``."""


class Environment:
    """One episode of an environment. Subclass it and implement ``step`` (and usually ``reset``).

    Attributes:
        tools: JSON schemas of the tools the model may call, passed to the chat template (the
            environment parses and answers the calls itself); ``None``: no tools.
        reward_from_run: the environment gives no reward of its own: the run's reward
            (``reward.fn``, or the function registered for the row's ``data_source``, and
            ``reward.model``) scores the episode's answer, the text of its last assistant turn,
            as it scores a single-turn response, in the reward workers under
            ``reward.timeout_s`` (``async_rl.envs.single_turn``, ``async_rl.envs.tools``).
            ``False``: the episode's return is the reward (``reward.model`` may add to it).
        keep_special_tokens: ``step`` receives each turn as generated, special tokens kept (its
            end-of-turn token left out), e.g. to parse tool-call tags that a tokenizer makes
            special tokens; ``False``: special tokens removed.
    """

    tools: list[dict[str, Any]] | None = None
    reward_from_run: bool = False
    keep_special_tokens: bool = False

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        """Start the episode; return the first observation: the chat messages the model answers.

        Args:
            task: the dataset row the episode comes from.
            seed: the environment seed (int, >= 0): the same for the n episodes of a group, so
                the group's baseline compares episodes that started alike.

        Returns:
            The messages of the prompt (default: ``task.messages``).
        """
        return list(task.messages)

    async def step(self, action: str) -> EnvStep:
        """Take one assistant turn (its text, special tokens removed unless
        ``keep_special_tokens``); return the next step."""
        raise NotImplementedError(f"{type(self).__name__}.step is not implemented")

    def answer(self, action: str) -> str | None:
        """The answer a turn gives, as the run's reward should score it (``reward_from_run``), from
        the turn as ``step`` receives it; the episode loop removes the tokenizer's special tokens
        from it. ``None`` (default): the turn's text, special tokens removed. A tool environment
        answers with the text outside its calls (``async_rl.envs.tools``)."""
        return None

    async def close(self) -> None:
        """Release what the episode holds (called once per episode, however it ended)."""


def _is_parts(content: Any, image_data: bool) -> bool:
    """Whether ``content`` is multimodal message content: a list of ``{"type": "text", "text":
    str}`` and image parts; with ``image_data`` each image part holds its picture
    (``{"type": "image", "image": ...}``: an observation's), without it none does
    (``{"type": "image"}``: a prompt's, whose images travel with the request)."""
    return isinstance(content, list) and all(
        isinstance(p, dict) and (
            (p.get("type") == "image" and (p.get("image") is not None) == image_data)
            or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content)


def has_images(messages: list[dict[str, Any]]) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def check_messages(messages: Any, what: str, roles: tuple[str, ...] = OBSERVATION_ROLES,
                   parts: bool = False, image_data: bool = False) -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with allowed roles and string content
    (with ``parts``, content may also be a list of text and image parts: a vision-language
    prompt's first messages, whose images the request carries, or with ``image_data`` an
    observation's, whose image parts hold their pictures).

    Raises:
        MalformedEnvStepError: not a list of such dicts; the message names ``what`` and the fault.
    """
    if not isinstance(messages, (list, tuple)):
        raise MalformedEnvStepError(f"{what} must be a list of messages, got {type(messages).__name__}")
    out = []
    for k, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or m.get("role") not in roles or not (
                isinstance(content, str) or (parts and _is_parts(content, image_data))):
            kind = (("string or text/image parts (an image part {'type': 'image', 'image': picture})" if image_data
                     else "string or text/image parts (an image part {'type': 'image'}: the row's next image)")
                    if parts else "string")
            if not parts and isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                               for p in content):
                kind += "; images need a vision-language policy"
            raise MalformedEnvStepError(f"{what}[{k}] must be a dict with role in {list(roles)} and {kind} "
                                        f"content, got {str(m)[:120]}")
        out.append(dict(m))
    return out


def check_step(step: Any, images: bool = False) -> EnvStep:
    """``step`` if it is a well-formed ``EnvStep``; with ``images`` (a vision-language policy) its
    observation may hold image parts with their pictures (``EnvStep.observation``).

    Raises:
        MalformedEnvStepError: not an ``EnvStep``, a reward that is not a finite number, a
            ``done`` that is not a bool, bad observation messages (an image part without
            ``images``), an empty observation on an episode that goes on, or non-numeric
            ``info`` values.
    """
    if not isinstance(step, EnvStep):
        raise MalformedEnvStepError(f"step must return an EnvStep, got {type(step).__name__}")
    if isinstance(step.reward, bool) or not isinstance(step.reward, (int, float)) or not math.isfinite(step.reward):
        raise MalformedEnvStepError(f"EnvStep.reward must be a finite number, got {step.reward!r}")
    if not isinstance(step.done, bool):
        raise MalformedEnvStepError(f"EnvStep.done must be a bool, got {step.done!r}")
    step.observation = check_messages(step.observation, "EnvStep.observation", parts=images, image_data=True)
    if not step.done and not step.observation:
        raise MalformedEnvStepError("EnvStep.observation is empty but the episode is not done: the model "
                                    "would have nothing to answer")
    if not isinstance(step.info, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                              for v in step.info.values()):
        raise MalformedEnvStepError(f"EnvStep.info must map names to numbers, got {str(step.info)[:120]}")
    return step


def _as_factory(kind: str, spec: str, obj: Any) -> Callable[..., Environment]:
    """``coerce`` of ``ENVIRONMENTS``: an ``Environment`` subclass or a function returning one."""
    if isinstance(obj, type) and not issubclass(obj, Environment):
        raise ValueError(f"{kind} {spec!r} names the class {obj.__name__}, which is not an Environment subclass")
    if not callable(obj) or isinstance(obj, Environment):
        raise ValueError(f"{kind} {spec!r} must name an Environment subclass or a function returning an "
                         f"Environment, got {type(obj).__name__}")
    return obj


ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry(
    "environment", coerce=_as_factory,
    help="An environment spec names an Environment subclass or a function returning one.")
"""Environments configs may name by short name (``env.name: guess_number``)."""


def register_env(obj: Any = None, name: str | None = None) -> Any:
    """Register an ``Environment`` subclass (or factory) under ``name`` (default: its ``__name__``);
    usable as a decorator. Returns ``obj``.

    Raises:
        ValueError: as ``Registry.register``, or ``obj`` is neither a subclass nor a function.
    """
    def add(value: Any) -> Any:
        _as_factory("environment", name or value.__name__, value)
        return ENVIRONMENTS.register(name or value.__name__, value)

    return add if obj is None else add(obj)


def make_env(spec: str, args: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A function that makes a fresh ``Environment`` for each episode: the spec's class or
    factory called with ``args`` as keyword arguments. One episode is made here at once, so a
    bad spec or bad arguments stop the run at build time in one line.

    Raises:
        ValueError: the spec names no environment; calling it with ``args`` fails or returns
            something that is not an ``Environment``.
    """
    factory = ENVIRONMENTS.get(spec)
    kwargs = dict(args or {})

    def new() -> Environment:
        env = factory(**kwargs)
        if not isinstance(env, Environment):
            raise ValueError(f"environment {spec!r} returned a {type(env).__name__}, not an Environment")
        return env

    try:
        new()
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"environment {spec!r} with env.args={kwargs}: {type(e).__name__}: {e}") from e
    return new


def weighted_shares(weights: list[float], total: int) -> list[int]:
    """``total`` rows split in proportion to ``weights`` by largest remainder (Hamilton's method),
    so the shares sum to exactly ``total``; a small weight may get 0 of a small total.

    Raises:
        ValueError: no weight, or a weight that is not positive.
    """
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"weights must be positive numbers, got {weights!r}")
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))[:total - sum(shares)]:
        shares[i] += 1
    return shares
