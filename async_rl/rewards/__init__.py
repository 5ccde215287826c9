"""Rule-based rewards: built-in reward functions, user-function loading and a safe scorer.

- ``REWARD_FUNCTIONS``: name -> reward function; built-ins "arithmetic" (the default CPU task),
  "chainsum" (worked answers that are a chain of numbers: the chain-sum task and the long-tailed
  job's skip counting), "shapes" (the one-word answers of the built-in image task), "gsm8k" and
  "math" (both checked with math-verify). ``register_reward`` adds more.
- ``get_reward_fn(spec)``: a built-in name, "package.module:function" or "path/file.py:function".
- ``default_reward_for(data_source)``: the built-in for a dataset's ``data_source`` column.
- ``RewardScorer``: calls a reward function and turns exceptions, NaN/inf and bad return types
  into counted, logged errors (score 0.0 or a rejected sample) instead of a crashed run;
  ``check_rewards_work`` stops a run whose function failed on every call of its first step,
  ``failure_summary`` counts the failures of one that failed sometimes.
- ``async_rl.rewards.workers.RewardWorkers``: the reward function in worker processes, off the
  engine's decoding thread, with a per-call deadline (``reward.num_workers``,
  ``reward.timeout_s``): a hang, a crash or a huge result is a counted rejection of one sample.

The reward-function interface, shared with verl::

    fn(data_source: str, response_text: str, ground_truth: str, extra_info: dict | None)
        -> float | dict   # a dict holds "score" and may hold other numbers, e.g. "acc" (0/1)
"""

from async_rl.rewards.arithmetic import arithmetic_reward
from async_rl.rewards.chainsum import chainsum_reward
from async_rl.rewards.math_rewards import gsm8k_reward, math_reward
from async_rl.rewards.shapes import shapes_reward
from async_rl.rewards.registry import (
    DATA_SOURCE_REWARDS,
    REWARD_FUNCTIONS,
    RewardFn,
    RewardRegistry,
    default_reward_for,
    get_reward_fn,
    register_reward,
)
from async_rl.rewards.scorer import ON_ERROR_MODES, RewardResult, RewardScorer, check_rewards_work, failure_summary

__all__ = [
    "DATA_SOURCE_REWARDS",
    "ON_ERROR_MODES",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardRegistry",
    "RewardResult",
    "RewardScorer",
    "arithmetic_reward",
    "chainsum_reward",
    "check_rewards_work",
    "default_reward_for",
    "failure_summary",
    "get_reward_fn",
    "gsm8k_reward",
    "math_reward",
    "register_reward",
    "shapes_reward",
]
