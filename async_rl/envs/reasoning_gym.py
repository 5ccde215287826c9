"""``reasoning_gym``: the procedural tasks of the ``reasoning-gym`` package, as task rows and a
single-turn environment scored by each task's own answer scorer.

Rows (``data.train_files: [env:train]``, ``data.val_files: [env:val]``) come from
``reasoning_gym.create_dataset``: one task, or several mixed by weight, each task drawing its share
of the ``size`` training rows (from ``seed``) and of the ``val_size`` held-out rows (from another
seed) from its own generator, with every held-out question that also appears among that task's
training rows left out (small task spaces repeat questions often). Each row keeps the task's
entry (question, answer, metadata) in
``extra_info.entry``, its ``data_source`` is ``reasoning_gym/<task>`` and its
``reward_model.ground_truth`` the reference answer (a warm start's reference).

An episode is one turn: the answer (the text inside ``<answer_tag>`` tags when ``answer_tag`` is
set, else the whole turn) goes to the task's ``score_answer(answer, entry)``. Its score in [0, 1]
is the reward, partial credit included; ``info`` reports ``score`` and ``acc``, 1 only for a full
score, which ``rollout/accuracy`` and ``eval/accuracy`` count: a task whose partial credit rises
while its exact accuracy stays flat shows both.

Config::

    data: {train_files: [env:train], val_files: [env:val]}
    env:
      name: reasoning_gym
      args:
        tasks: {chain_sum: {weight: 1, config: {min_terms: 2, max_terms: 2}},
                spell_backward: {weight: 1, config: {min_word_len: 3, max_word_len: 4}}}
        size: 2000
        val_size: 100
        seed: 1
"""

from __future__ import annotations

import functools
import json
import logging
import random
from typing import Any

from async_rl.envs.base import Environment, EnvStep, Task, weighted_shares

logger = logging.getLogger(__name__)

VAL_SEED_OFFSET = 1_000_003
"""Held-out rows are drawn from ``seed + VAL_SEED_OFFSET``."""


def _import():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("env.name=reasoning_gym needs the reasoning-gym package: "
                         "pip install 'async-rl[envs]'") from None
    return reasoning_gym


def _specs(tasks: dict[str, Any] | list[str] | str) -> list[tuple[str, float, dict[str, Any]]]:
    """``(name, weight, config)`` per task, from a name, a list of names or a mapping
    ``name -> {weight, config}``.

    Raises:
        ValueError: no task, a weight that is not a positive number, or unknown keys.
    """
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, (list, tuple)):
        tasks = {name: {} for name in tasks}
    if not isinstance(tasks, dict) or not tasks:
        raise ValueError(f"reasoning_gym: tasks must name at least one task, got {tasks!r}")
    out = []
    for name, spec in tasks.items():
        spec = dict(spec or {})
        unknown = set(spec) - {"weight", "config"}
        if unknown:
            raise ValueError(f"reasoning_gym: task {name!r} has unknown keys {sorted(unknown)}; "
                             "valid: weight, config")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"reasoning_gym: task {name!r} weight must be a positive number, got {weight!r}")
        out.append((str(name), float(weight), dict(spec.get("config") or {})))
    return out


def _create(name: str, config: dict[str, Any], size: int, seed: int):
    rg = _import()
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning_gym: cannot create {name!r} (size {size}, seed {seed}): "
                         f"{type(e).__name__}: {e}") from None


def _json_safe(value: Any) -> Any:
    """The entry as JSON data (tuples become lists, other objects their ``str``)."""
    return json.loads(json.dumps(value, default=str))


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    source = entry.get("metadata", {}).get("source_dataset", "task")
    return {"prompt": [{"role": "user", "content": entry["question"]}], "data_source": f"reasoning_gym/{source}",
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"entry": _json_safe(entry)}}


def task_rows(split: str, tasks: Any = None, size: int = 1000, val_size: int = 100, seed: int = 0,
              **_: Any) -> list[dict[str, Any]]:
    """The dataset rows of ``split`` (``train`` or ``val``) for the environment's ``env.args``.

    Returns:
        ``size`` training rows, or ``val_size`` held-out rows none of whose questions is among
        the training rows'; with several tasks, each task's share of either split follows its
        weight (largest remainder), the rows in a seeded shuffled order.

    Raises:
        ValueError: an unknown split or task, bad sizes, or fewer than ``val_size`` held-out
            questions outside the training rows (the task space is too small: lower ``size`` or
            ``val_size``, or widen the task's config).
    """
    if split not in ("train", "val"):
        raise ValueError(f"reasoning_gym: unknown split {split!r}; valid: train, val")
    if size < 1 or val_size < 0:
        raise ValueError(f"reasoning_gym: size must be >= 1 and val_size >= 0, got {size} and {val_size}")
    specs = _specs(tasks)
    rows = []
    # Each task draws its own share (by weight) from its own generator, in both splits: the held-out
    # filter removes far more questions of a small task space than of a large one, so a mixed draw
    # filtered afterwards would tilt the held-out split toward the larger space.
    for (name, _, config), train_share, val_share in zip(specs, weighted_shares([w for _, w, _ in specs], size),
                                                           weighted_shares([w for _, w, _ in specs], val_size)):
        train = [_row(e) for e in _create(name, config, train_share, seed)] if train_share else []
        if split == "train":
            rows += train
        elif val_share:
            rows += _held_out(name, config, {r["prompt"][0]["content"] for r in train}, val_share, seed,
                              train_share)
    if len(specs) > 1:
        random.Random(f"{seed}/{split}").shuffle(rows)
    return rows


def _held_out(name: str, config: dict[str, Any], seen: set[str], count: int, seed: int,
              train_size: int) -> list[dict[str, Any]]:
    """``count`` rows of task ``name`` whose questions are distinct and not in ``seen``.

    Raises:
        ValueError: the task space is too small to find ``count`` such questions.
    """
    candidates = _create(name, config, max(10 * count, 100), seed + VAL_SEED_OFFSET)
    held_out, questions = [], set()
    for entry in candidates:
        if entry["question"] not in seen and entry["question"] not in questions:
            questions.add(entry["question"])
            held_out.append(_row(entry))
            if len(held_out) == count:
                return held_out
    raise ValueError(f"reasoning_gym: only {len(held_out)} distinct held-out {name} questions of {len(candidates)} "
                     f"drawn fall outside its {train_size} training rows, fewer than the {count} asked: the task "
                     "space is too small (lower size or val_size, or widen the task's config)")


@functools.lru_cache(maxsize=None)
def _scorer(source: str):
    return _import().get_score_answer_fn(source)


class ReasoningGym(Environment):
    """One episode of a reasoning-gym task (see the module docstring).

    Args:
        answer_tag: read the answer inside ``<answer_tag>...</answer_tag>`` (reasoning-gym's
            ``extract_answer``); ``None``: the whole turn, stripped.
        tasks, size, val_size, seed: the task rows' (``task_rows``); checked here, so a bad
            task stops the run at load.

    Raises:
        ValueError: reasoning-gym missing, or bad ``tasks``.
    """

    def __init__(self, tasks: Any = None, size: int = 1000, val_size: int = 100, seed: int = 0,
                 answer_tag: str | None = None) -> None:
        _import()
        for name, _, _ in _specs(tasks):
            try:
                _scorer(name)  # an unknown task name fails here, in one line
            except (KeyError, ValueError) as e:
                raise ValueError(f"reasoning_gym: task {name!r}: {e}") from None
        self.answer_tag = answer_tag
        self.entry: dict[str, Any] | None = None

    task_rows = staticmethod(task_rows)

    async def reset(self, task: Task, seed: int) -> list[dict]:
        """The row's question; its entry is kept for the scorer.

        Raises:
            ValueError: the row has no ``extra_info.entry`` (not made by ``task_rows``).
        """
        entry = task.extra_info.get("entry")
        if not isinstance(entry, dict) or "metadata" not in entry:
            raise ValueError(f"row {task.uid} has no extra_info.entry: reasoning_gym rows come from "
                             "data.train_files: [env:train]")
        self.entry = entry
        return list(task.messages)

    async def step(self, action: str) -> EnvStep:
        """The task's score of the answer: reward (partial credit) and ``acc`` (full score)."""
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(action, tag_name=self.answer_tag) if self.answer_tag else action.strip()
        source = self.entry["metadata"].get("source_dataset", "")
        score = float(_scorer(source)(answer, self.entry))
        return EnvStep([], score, True, {"score": score, "acc": float(score >= 1.0)})
