"""verifiers environments as rollouts: the built-in rollout function ``verifiers``.

Prime Intellect's ``verifiers`` library (0.4.0, ``verifiers.v1``) defines an environment as a
taskset module (tasks, their rewards and metrics, an optional ``Env`` with a multi-turn ``run``
loop, toolsets) that runs episodes against any OpenAI-compatible server. This rollout function
runs each episode of a run against the episode's own session of the policy endpoint, so every
model call of the episode is captured token-in token-out, and takes the reward the taskset's own
rewards give::

    endpoint:
      rollout: verifiers
      args:
        taskset: my_pkg.my_taskset        # a module verifiers.v1 resolves, as its users name it
        taskset_args: {size: 64}          # fields of the taskset's config
    data:
      train_files: [env:train]            # the taskset's rows (split "train")
      val_files: [env:val]

verifiers 0.4.0 needs ``openai<3``, which the main venv's vLLM does not allow, so it lives in a
venv of its own (``envs/verifiers/build.sh`` builds ``.venv-verifiers``; ``args.python`` or
``ASYNC_RL_VERIFIERS_PYTHON`` names another). Each process that runs episodes (the sync trainer,
each generator actor) starts one worker in that venv (``verifiers_worker.py``) and talks to it over
a pipe, one JSON line per request. The taskset module must be importable there:
``args.pythonpath`` lists folders to add.

Rows: ``env:<split>`` data files take the taskset's rows (``task_rows``): each row's prompt is
its task's prompt (a task without one is refused: the warm start and the dataset need it), its
``ground_truth`` the task's ``answer``, its ``extra_info`` the task's other fields plus
``verifiers_split`` and ``verifiers_index``, which name the task an episode runs. A taskset whose
config has a ``split`` field gets the split asked for.

An episode the library reports as failed (``episode.ok`` false: its harness, a tool or a reward
raised) is a counted rejection (``env/rejected_error``); its reward is the trace's weighted reward,
and its metrics and each reward's score are reported per episode (``env/info/<name>``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .rollouts import RolloutResult, register_rollout

__all__ = ["VerifiersWorker", "task_rows", "verifiers_python", "verifiers_rollout"]

WORKER = Path(__file__).with_name("verifiers_worker.py")
PYTHON_VARIABLE = "ASYNC_RL_VERIFIERS_PYTHON"
DEFAULT_VENV = ".venv-verifiers"
ROW_KEYS = ("verifiers_split", "verifiers_index")


def verifiers_python(python: str | None = None) -> str:
    """The Python of the verifiers venv: ``python``, else ``$ASYNC_RL_VERIFIERS_PYTHON``, else
    ``.venv-verifiers/bin/python`` in the working directory or the repository.

    Raises:
        ValueError: none of them exists (the message names the command that builds it).
    """
    candidates = [python] if python else ([os.environ[PYTHON_VARIABLE]] if os.environ.get(PYTHON_VARIABLE) else
                                          [str(Path.cwd() / DEFAULT_VENV / "bin" / "python"),
                                           str(Path(__file__).resolve().parents[2] / DEFAULT_VENV / "bin" / "python")])
    for candidate in candidates:
        if Path(candidate).exists():
            return candidate
    raise ValueError(f"no verifiers venv ({' or '.join(candidates)}): build it with envs/verifiers/build.sh, or name "
                     f"its Python in endpoint.args.python or ${PYTHON_VARIABLE}")


def _env(pythonpath: list[str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["ASYNC_RL_VERIFIERS_PATH"] = os.pathsep.join(str(Path(p).resolve()) for p in (pythonpath or []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def task_rows(split: str, taskset: str, taskset_args: dict[str, Any] | None = None, python: str | None = None,
              pythonpath: list[str] | None = None, timeout_s: float = 300.0, **_: Any) -> list[dict[str, Any]]:
    """The taskset's rows for ``split`` in the row layout of ``data.train_files``.

    Raises:
        ValueError: no verifiers venv, the taskset does not load, or a task has no prompt.
    """
    requests = [{"op": "load", "taskset": taskset, "args": taskset_args or {}}, {"op": "rows", "split": split}]
    proc = subprocess.run([verifiers_python(python), str(WORKER)], input="".join(json.dumps(r) + "\n" for r in requests),
                          capture_output=True, text=True, timeout=timeout_s, env=_env(pythonpath))
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    error = next((a["error"] for a in answers if "error" in a), None)
    if error or len(answers) < 2:
        detail = error or (proc.stderr.strip().splitlines() or ["the worker exited"])[-1]
        raise ValueError(f"verifiers taskset {taskset!r}: {detail}")
    rows = []
    for row in answers[1]["rows"]:
        if not row["prompt"]:
            raise ValueError(f"verifiers taskset {taskset!r}: task {row['index']} has no prompt (the run's rows need "
                             "one: give the taskset's tasks a prompt)")
        rows.append({"prompt": row["prompt"], "data_source": f"verifiers/{taskset}",
                     "reward_model": {"style": "rule", "ground_truth": row["answer"] or ""},
                     "extra_info": {**row["info"], "verifiers_split": split, "verifiers_index": row["index"]}})
    return rows


class VerifiersWorker:
    """One worker process in the verifiers venv, on the calling event loop.

    Args:
        python: the venv's Python.
        taskset: the taskset module's id.
        taskset_args: fields of the taskset's config.
        pythonpath: folders the worker adds to ``sys.path``.
    """

    def __init__(self, python: str, taskset: str, taskset_args: dict[str, Any], pythonpath: list[str] | None) -> None:
        self.cmd = [python, str(WORKER)]
        self.taskset, self.taskset_args, self.pythonpath = taskset, taskset_args, pythonpath
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.started: asyncio.Future | None = None
        self.reader: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the worker and load the taskset (once; concurrent callers wait for it).

        Raises:
            RuntimeError: the taskset did not load (the worker's message).
        """
        if self.started is None:
            self.started = asyncio.get_running_loop().create_future()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self.cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=subprocess.DEVNULL, env=_env(self.pythonpath), limit=1 << 24)
                await self._send({"op": "load", "taskset": self.taskset, "args": self.taskset_args})
                answer = json.loads(await self.proc.stdout.readline() or b'{"error": "the worker exited"}')
                if "error" in answer:
                    raise RuntimeError(f"verifiers taskset {self.taskset!r}: {answer['error']}")
                self.reader = asyncio.ensure_future(self._read())
                self.started.set_result(None)
            except BaseException as e:
                self.started.set_exception(e)
        await asyncio.shield(self.started)

    async def _send(self, request: dict[str, Any]) -> None:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        await self.proc.stdin.drain()

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            answer = json.loads(line)
            future = self.pending.pop(answer.get("id"), None)
            if future is not None and not future.done():
                future.set_result(answer)
        for future in self.pending.values():  # the worker died: every episode in flight fails
            if not future.done():
                future.set_exception(RuntimeError("the verifiers worker exited"))
        self.pending.clear()

    async def run(self, split: str, index: int, base_url: str, api_key: str) -> dict[str, Any]:
        """One episode of row ``index`` of ``split`` against ``base_url``; the worker's answer."""
        await self.start()
        if self.reader is None or self.reader.done():
            raise RuntimeError("the verifiers worker exited")
        k = next(self.ids)
        future = self.pending[k] = asyncio.get_running_loop().create_future()
        try:
            await self._send({"op": "run", "id": k, "split": split, "index": index, "base_url": base_url,
                              "api_key": api_key})
            return await future
        finally:
            self.pending.pop(k, None)

    def close(self) -> None:
        """Stop the worker (its stdin closes; killed if it lingers)."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()


_WORKERS: dict[tuple, VerifiersWorker] = {}


async def verifiers_rollout(client, task, taskset: str, taskset_args: dict[str, Any] | None = None,
                            python: str | None = None, pythonpath: list[str] | None = None) -> RolloutResult:
    """One episode of a verifiers taskset through this episode's session (see the module docstring).

    Raises:
        ValueError: the row does not name a task (``verifiers_index``: rows from ``env:<split>``).
        RuntimeError: the episode failed (``episode.ok`` false) or the worker exited.
    """
    if "verifiers_index" not in task.extra_info:
        raise ValueError("the row names no verifiers task (extra_info.verifiers_index): use data files env:train / env:val")
    loop = asyncio.get_running_loop()
    key = (id(loop), verifiers_python(python), taskset, json.dumps(taskset_args or {}, sort_keys=True),
           tuple(pythonpath or ()))
    worker = _WORKERS.get(key)
    if worker is None:
        worker = _WORKERS[key] = VerifiersWorker(key[1], taskset, taskset_args or {}, pythonpath)
    reply = await worker.run(task.extra_info.get("verifiers_split", "train"), int(task.extra_info["verifiers_index"]),
                             str(client.base_url), client.api_key)
    if not reply.get("ok") or reply.get("reward") is None:
        raise RuntimeError("verifiers episode failed: " + "; ".join(reply.get("errors") or ["no trace"])[:500])
    info = {**reply.get("metrics", {}), **{f"reward_{k}": v for k, v in reply.get("rewards", {}).items()}}
    return RolloutResult(reward=float(reply["reward"]), info=info)


verifiers_rollout.task_rows = task_rows  # type: ignore[attr-defined]
register_rollout(verifiers_rollout, name="verifiers")
