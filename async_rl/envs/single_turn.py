"""``single_turn``: one prompt, one response, scored by the run's reward function.

The single-turn rollout of a prompt dataset written as an environment: ``reset`` gives the row's
messages, the one assistant turn ends the episode, and the run's reward (``reward.fn``, the
function registered for the row's ``data_source``, ``reward.model``) scores the response in its
reward workers, exactly as it scores a sample of the plain single-turn road
(``Environment.reward_from_run``). A run that names it takes the episode road
(``async_rl.step.episodes``) for what is otherwise a plain rollout; ``bench/bench_env_throughput.py``
measures the two roads side by side.

Config::

    env: {name: single_turn}
    data: {train_files: [builtin:arithmetic/train], val_files: [builtin:arithmetic/test]}
"""

from __future__ import annotations

from async_rl.envs.base import Environment, EnvStep


class SingleTurn(Environment):
    """One assistant turn per episode; the run's reward scores it (``reward_from_run``)."""

    reward_from_run = True

    async def step(self, action: str) -> EnvStep:
        """End the episode after its one turn, with no reward of its own (the run's reward scores
        ``action``, the turn's text)."""
        return EnvStep(done=True)
