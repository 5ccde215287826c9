"""``mix``: several environments in one run, each with a sampling weight.

Each episode goes to the environment its row names (``extra_info.env``, a key of ``envs``). The
rows (``data.train_files: [env:train]``, ``[env:val]``) are every environment's own task rows
(``task_rows``), tagged with its key, and drawn in proportion to the weights: ``size`` training rows
in all (``val_size`` held-out), split by weight (largest remainder, so the shares sum to the
total), each environment's share sampled from its rows
(with replacement when it has fewer). Rows keep their ``data_source``, so every environment's (or
task's) reward, accuracy and length are reported apart (``env/<source>/*``, ``eval/<source>/*``).

Config::

    data: {train_files: [env:train], val_files: [env:val]}
    env:
      name: mix
      args:
        envs:
          guess: {name: guess_number, weight: 1, args: {low: 1, high: 8}}
          sums: {name: reasoning_gym, weight: 1, args: {tasks: [chain_sum], size: 500, val_size: 50}}
        size: 1000
        val_size: 100
        seed: 0
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator

from async_rl.envs.base import ENVIRONMENTS, Environment, EnvStep, Task, make_env, weighted_shares


def _entries(envs: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any], float]]:
    """``key -> (spec, args, weight)``.

    Raises:
        ValueError: no environment, a ``mix`` inside a mix, unknown keys, or a bad weight.
    """
    if not isinstance(envs, dict) or not envs:
        raise ValueError(f"mix: envs must map names to {{name, weight, args}}, got {envs!r}")
    out = {}
    for key, entry in envs.items():
        entry = dict(entry or {})
        unknown = set(entry) - {"name", "weight", "args"}
        if unknown or "name" not in entry:
            raise ValueError(f"mix: envs.{key} needs name (and optionally weight, args); unknown keys {sorted(unknown)}")
        if str(entry["name"]).removeprefix("builtin:") == "mix":
            raise ValueError(f"mix: envs.{key} is itself a mix; list its environments here instead")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"mix: envs.{key}.weight must be a positive number, got {weight!r}")
        out[str(key)] = (str(entry["name"]), dict(entry.get("args") or {}), float(weight))
    return out


class MixedEnv(Environment):
    """One episode of whichever environment of ``envs`` its row names (see the module docstring).

    Args:
        envs: ``key -> {name, weight, args}``.
        size, val_size, seed: the rows' (``task_rows``).

    Raises:
        ValueError: bad ``envs``, or an environment that cannot be made with its args.
    """

    def __init__(self, envs: dict[str, Any], size: int = 1000, val_size: int = 100, seed: int = 0) -> None:
        self.factories = {key: make_env(spec, args) for key, (spec, args, _) in _entries(envs).items()}
        self.current: Environment | None = None

    async def reset(self, task: Task, seed: int) -> list[dict]:
        """Make the environment the row names and reset it.

        Raises:
            ValueError: the row names none of ``envs`` (``extra_info.env``).
        """
        key = task.extra_info.get("env")
        if key not in self.factories:
            raise ValueError(f"row {task.uid}: extra_info.env={key!r} names none of the mixed environments "
                             f"{sorted(self.factories)}")
        self.current = self.factories[key]()
        return await self.current.reset(task, seed)

    @property
    def reward_from_run(self) -> bool:  # type: ignore[override]
        """The row's environment's (once reset): whether the run's reward scores its episode."""
        return bool(getattr(self.current, "reward_from_run", False))

    @property
    def keep_special_tokens(self) -> bool:  # type: ignore[override]
        """The row's environment's (once reset): whether its steps read special tokens."""
        return bool(getattr(self.current, "keep_special_tokens", False))

    async def step(self, action: str) -> EnvStep:
        """The row's environment's step."""
        return await self.current.step(action)

    async def close(self) -> None:
        """The row's environment's close."""
        if self.current is not None:
            await self.current.close()

    @staticmethod
    def task_rows(split: str, envs: dict[str, Any], size: int = 1000, val_size: int = 100, seed: int = 0,
                  **_: Any) -> list[dict[str, Any]]:
        """Every environment's rows of ``split``, tagged ``extra_info.env = key``, drawn by weight
        (``size`` or ``val_size`` in all), in a seeded shuffled order.

        Raises:
            ValueError: an environment without ``task_rows``, or one that has no row.
        """
        entries = _entries(envs)
        total = size if split == "train" else val_size
        rng = random.Random(f"{seed}/{split}")
        out = []
        shares = weighted_shares([w for _, _, w in entries.values()], total)
        for (key, (spec, args, _)), share in zip(entries.items(), shares):
            rows_fn = getattr(ENVIRONMENTS.get(spec), "task_rows", None)
            if rows_fn is None:
                raise ValueError(f"mix: envs.{key} ({spec}) offers no task rows; mix environments that do")
            if not share:
                continue
            rows = rows_fn(split, **args)
            if not rows:
                raise ValueError(f"mix: envs.{key} ({spec}) has no {split} rows")
            picked = rng.sample(rows, share) if share <= len(rows) else [rng.choice(rows) for _ in range(share)]
            for row in picked:
                out.append({**row, "extra_info": {**row.get("extra_info", {}), "env": key}})
        rng.shuffle(out)
        return out

    @staticmethod
    @contextlib.contextmanager
    def services(args: dict[str, Any], host: str) -> Iterator[dict[str, Any]]:
        """Every mixed environment's services (OpenEnv servers...) for the run, binding ``host``
        by default; yields ``args`` with each one's arguments as its services gave them."""
        entries = _entries(args["envs"])
        with contextlib.ExitStack() as stack:
            envs = {}
            for key, (spec, sub_args, weight) in entries.items():
                serve = getattr(ENVIRONMENTS.get(spec), "services", None)
                if serve is not None:
                    sub_args = stack.enter_context(serve(sub_args, host))
                envs[key] = {"name": spec, "weight": weight, "args": sub_args}
            yield {**args, "envs": envs}
