"""Reward-function registry, user-function loading and dispatch on ``data_source``.

A reward function has the signature (verl's ``compute_score`` layout, called positionally, so a
verl function whose second parameter is named ``solution_str`` works unchanged)::

    fn(data_source: str, response_text: str, ground_truth: str, extra_info: dict | None)
        -> float | dict   # a dict holds "score" and may hold other numbers, e.g. "acc"

Pick one by name::

    get_reward_fn("gsm8k")                           # a built-in
    get_reward_fn("my_pkg.rewards:compute_score")    # an importable module
    get_reward_fn("rewards/my_reward.py:score")      # a file, loaded as a module

or let ``default_reward_for(data_source)`` choose from the dataset's ``data_source`` column.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from async_rl.rewards.arithmetic import arithmetic_reward
from async_rl.rewards.math_rewards import gsm8k_reward, math_reward

__all__ = [
    "DATA_SOURCE_REWARDS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardRegistry",
    "default_reward_for",
    "get_reward_fn",
    "register_reward",
]

RewardFn = Callable[[str, str, str, "dict | None"], "float | dict"]

_SPEC_HELP = (
    "Give a built-in name, an import path 'package.module:function', or a file path "
    "'path/to/file.py:function' naming a function "
    "fn(data_source, response_text, ground_truth, extra_info) -> float | dict."
)


class RewardRegistry(Mapping[str, RewardFn]):
    """Read-only mapping name -> reward function; new names are added with ``register``.

    Lookups of a missing name raise KeyError as any Mapping does; ``get_reward_fn`` turns that
    into an actionable ValueError.
    """

    def __init__(self) -> None:
        self._fns: dict[str, RewardFn] = {}

    def register(self, name: str, fn: RewardFn) -> RewardFn:
        """Add ``fn`` under ``name`` and return it.

        Args:
            name: registry key; must not contain ":" (reserved for import paths).
            fn: reward function with the signature in the module docstring.

        Returns:
            ``fn`` unchanged.

        Raises:
            ValueError: the name is taken, contains ":", or ``fn`` is not callable.
        """
        if name in self._fns:
            raise ValueError(f"reward function {name!r} is already registered")
        if ":" in name:
            raise ValueError(
                f"reward name {name!r} must not contain ':' (reserved for import paths)"
            )
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is not callable: {fn!r}")
        self._fns[name] = fn
        return fn

    def __getitem__(self, name: str) -> RewardFn:
        return self._fns[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fns)

    def __len__(self) -> int:
        return len(self._fns)

    def __repr__(self) -> str:
        return f"RewardRegistry({sorted(self._fns)})"


REWARD_FUNCTIONS = RewardRegistry()
"""Built-in and user-registered reward functions by name."""

REWARD_FUNCTIONS.register("arithmetic", arithmetic_reward)
REWARD_FUNCTIONS.register("gsm8k", gsm8k_reward)
REWARD_FUNCTIONS.register("math", math_reward)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator that adds a reward function to ``REWARD_FUNCTIONS`` under ``name``.

    Raises:
        ValueError: as ``RewardRegistry.register``.
    """

    def decorator(fn: RewardFn) -> RewardFn:
        return REWARD_FUNCTIONS.register(name, fn)

    return decorator


DATA_SOURCE_REWARDS: dict[str, str] = {
    "async_rl/arithmetic": "arithmetic",
    "async_rl/calc": "arithmetic",
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
}
"""Built-in reward name for each known ``data_source`` value (Hugging Face dataset ids)."""


def default_reward_for(data_source: str) -> RewardFn:
    """Return the built-in reward function for a dataset's ``data_source`` value.

    Args:
        data_source: the row's ``data_source`` column, e.g. "openai/gsm8k".

    Returns:
        The reward function registered for it (see ``DATA_SOURCE_REWARDS``).

    Raises:
        ValueError: unknown source; the message names it and says how to set a reward function.
    """
    name = DATA_SOURCE_REWARDS.get(data_source)
    if name is None:
        raise ValueError(
            f"no built-in reward for data_source {data_source!r} (known: "
            f"{sorted(DATA_SOURCE_REWARDS)}). Set the reward function explicitly in the config. "
            + _SPEC_HELP
        )
    return REWARD_FUNCTIONS[name]


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward-function spec: a registered name, "pkg.module:fn" or "file.py:fn".

    A spec whose module part ends in ".py" or contains a path separator is a file; it is loaded
    once per resolved path as a module named ``async_rl_user_reward_<stem>_<hash>`` (added to
    ``sys.modules`` so pickling and dataclasses inside it work). Anything else before the ":" is
    imported with ``importlib.import_module``.

    Args:
        spec: e.g. "gsm8k", "my_pkg.rewards:compute_score", "./rewards.py:score".

    Returns:
        The callable.

    Raises:
        ValueError: unknown name (the message lists the built-ins and the import-path forms),
            missing file or module, missing attribute, or an attribute that is not callable.
        Exception: whatever the user module raises while it is imported, unchanged.
    """
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"unknown reward function {spec!r}; built-ins: {sorted(REWARD_FUNCTIONS)}. "
            + _SPEC_HELP
        )
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        module = _load_file(module_part)
    else:
        module = _import_module(module_part)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward spec {spec!r}: {module.__name__} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {attr!r} is not callable ({type(fn).__name__})")
    return fn


def _import_module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # Only a missing module named by the spec is the user's typo; a missing dependency of
        # their module is their module's error and keeps its own message.
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise
        raise ValueError(f"reward module {name!r} not found ({e}). " + _SPEC_HELP) from e


def _load_file(path: str) -> Any:
    from async_rl.imports import load_file_module

    return load_file_module(path, "async_rl_user_reward", "reward file")
