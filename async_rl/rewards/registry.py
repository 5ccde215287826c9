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

from collections.abc import Callable

from async_rl.utils.registry import Registry
from async_rl.rewards.arithmetic import arithmetic_reward
from async_rl.rewards.chainsum import chainsum_reward
from async_rl.rewards.math_rewards import gsm8k_reward, math_reward
from async_rl.rewards.shapes import shapes_reward

__all__ = [
    "DATA_SOURCE_REWARDS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardRegistry",
    "default_reward_for",
    "dispatch_by_source",
    "get_reward_fn",
    "register_reward",
    "resolve_reward_spec",
]

RewardFn = Callable[[str, str, str, "dict | None"], "float | dict"]

_SIGNATURE = "A reward function is fn(data_source, response_text, ground_truth, extra_info) -> float | dict."

RewardRegistry = Registry
"""The registry type of ``REWARD_FUNCTIONS`` (the shared ``async_rl.utils.registry.Registry``)."""

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", help=_SIGNATURE)
"""Built-in and user-registered reward functions by name; ``REWARD_FUNCTIONS[name]`` or, for any
spec form, ``get_reward_fn(spec)``."""

REWARD_FUNCTIONS.register("arithmetic", arithmetic_reward)
REWARD_FUNCTIONS.register("chainsum", chainsum_reward)
REWARD_FUNCTIONS.register("gsm8k", gsm8k_reward)
REWARD_FUNCTIONS.register("math", math_reward)
REWARD_FUNCTIONS.register("shapes", shapes_reward)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator that adds a reward function to ``REWARD_FUNCTIONS`` under ``name``.

    Raises:
        ValueError: the name is taken, empty, or holds ":" or "." (reserved for import paths).
    """

    def decorator(fn: RewardFn) -> RewardFn:
        return REWARD_FUNCTIONS.register(name, fn)

    return decorator


DATA_SOURCE_REWARDS: dict[str, str] = {
    "async_rl/arithmetic": "arithmetic",
    "async_rl/calc": "arithmetic",
    "async_rl/chainsum": "chainsum",
    "async_rl/skipcount": "chainsum",  # a worked chain of numbers, scored whole, as chain sums are
    "async_rl/shapes": "shapes",
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
            f"no built-in reward for data_source {data_source!r} (known: {sorted(DATA_SOURCE_REWARDS)}). "
            "Set reward.fn in the config: a built-in name, an import path 'package.module:function' or a "
            "file path 'path/to/file.py:function'. " + _SIGNATURE
        )
    return REWARD_FUNCTIONS[name]


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward-function spec: a registered name, "builtin:name", "pkg.module:fn" or
    "file.py:fn" (``async_rl.utils.registry`` reads every spec form the same way for every kind).

    Args:
        spec: e.g. "gsm8k", "my_pkg.rewards:compute_score", "./rewards.py:score".

    Returns:
        The callable.

    Raises:
        ValueError: unknown name (the message lists the built-ins and the import-path forms),
            missing file or module, an exception while importing it (chained), missing
            attribute, or an attribute that is not callable.
    """
    return REWARD_FUNCTIONS.get(spec)


def dispatch_by_source(data_source: str, response_text: str, ground_truth, extra_info):
    """The reward of ``data_source``'s built-in reward function (``reward.fn`` unset).

    Raises:
        ValueError: no built-in reward for ``data_source`` (``default_reward_for``).
    """
    return default_reward_for(data_source)(data_source, response_text, ground_truth, extra_info)


def resolve_reward_spec(spec: str | None) -> RewardFn:
    """The reward function of ``reward.fn``: a spec (``get_reward_fn``), or ``None`` for one per
    ``data_source`` (``dispatch_by_source``). What a reward worker process calls to load its
    function (``async_rl.rewards.workers``).

    Raises:
        ValueError: as ``get_reward_fn``.
    """
    return get_reward_fn(spec) if spec else dispatch_by_source
