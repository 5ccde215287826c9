"""``openenv``: environments served by OpenEnv servers (``openenv-core``), and the local replicas a
run can start and supervise itself.

An episode is one session of OpenEnv's own client (``openenv.core.GenericEnvClient``, a WebSocket
per session): ``reset(seed=...)`` gives the first observation, each assistant turn is sent as the
action ``{action_field: text}``, and each ``StepResult`` gives the next observation, the turn's
reward (``None`` counts 0) and ``done``. Observations are dicts; the text the model reads is their
``observation_field`` (default ``message``), or the whole dict as JSON when the field is absent.
Episodes go round-robin over the server URLs given (``url``).

A server that goes away mid-episode (the connection closes or cannot open) raises
``EnvironmentLost``: the episode loop starts that episode over, once, on the next replica
(``env/reissued_episodes``); a replica the run started is restarted by its supervisor. Any other
error is the environment's own fault and rejects the episode.

With ``serve`` the run starts the servers itself (``OpenEnvServers``): ``replicas`` uvicorn
processes of the ASGI app ``app`` (``pkg.mod:app`` or ``path/to/server.py:app``), on loopback ports
unless ``serve.host`` says otherwise (a warning says so), with the ``python`` of the environment's own
venv when it needs one; each is health-checked (``GET /health``) before the run starts and
restarted when it dies.

Config::

    env:
      name: openenv
      args:
        serve: {app: examples.openenv_guess.server:app, replicas: 2}   # or url: [ws://host:8001]
        action_field: message
        observation_field: message
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from async_rl.envs.base import Environment, EnvironmentLost, EnvStep, Task

logger = logging.getLogger(__name__)

_NEXT = itertools.count()
"""Round-robin over the servers, per process."""


def _client_class():
    try:
        from openenv.core import GenericEnvClient
    except ImportError:
        raise ValueError("env.name=openenv needs the openenv-core package: pip install 'async-rl[envs]'") from None
    return GenericEnvClient


def _is_lost(error: BaseException) -> bool:
    """Whether ``error`` means the server went away (not a fault of the environment's logic)."""
    try:
        from websockets.exceptions import ConnectionClosed, InvalidHandshake
    except ImportError:  # pragma: no cover - openenv-core depends on websockets
        ConnectionClosed = InvalidHandshake = OSError  # noqa: N806
    return isinstance(error, (ConnectionClosed, InvalidHandshake, ConnectionError, OSError))


class OpenEnvEnv(Environment):
    """One session on an OpenEnv server (see the module docstring).

    Args:
        url: the servers' base URLs (``http://``, ``ws://``); one or a list. Set by the run from
            ``serve`` when the run starts the servers.
        serve: start the servers locally (``OpenEnvServers`` arguments); ``None``: use ``url``.
        action_field: the action's field the assistant turn's text goes to.
        observation_field: the observation's field the model reads; absent: the observation as JSON.
        system_prompt: a system message before the first observation.
        reset_kwargs: extra keyword arguments of the server's ``reset``.
        message_timeout_s: seconds the client waits for one answer of the server.
        reconnect_s: seconds ``reset`` keeps retrying a server that refuses connections (a
            replica being restarted), within ``env.step_timeout_s``.
        size, val_size, instruction: the rows' (``task_rows``), read there.

    Raises:
        ValueError: neither ``url`` nor ``serve``, or openenv-core missing.
    """

    def __init__(self, url: str | list[str] | None = None, serve: dict[str, Any] | None = None,
                 action_field: str = "message", observation_field: str = "message",
                 system_prompt: str | None = None, reset_kwargs: dict[str, Any] | None = None,
                 message_timeout_s: float = 60.0, reconnect_s: float = 60.0, size: int = 1000, val_size: int = 64,
                 instruction: str = "Play the game.") -> None:
        self.client_class = _client_class()
        self.urls = [url] if isinstance(url, str) else list(url or [])
        if not self.urls and not serve:
            raise ValueError("openenv: set url (the servers' base URLs) or serve (servers the run starts)")
        self.action_field, self.observation_field = action_field, observation_field
        self.system_prompt = system_prompt
        self.reset_kwargs = dict(reset_kwargs or {})
        self.message_timeout_s, self.reconnect_s = message_timeout_s, reconnect_s
        self.client = None

    def _text(self, observation: Any) -> str:
        if isinstance(observation, dict) and isinstance(observation.get(self.observation_field), str):
            return observation[self.observation_field]
        return json.dumps(observation, default=str)

    async def _call(self, what: str, coro):
        try:
            return await coro
        except Exception as e:
            if _is_lost(e):
                raise EnvironmentLost(f"OpenEnv server {self.url} lost during {what}: {type(e).__name__}: {e}") from e
            raise

    async def reset(self, task: Task, seed: int) -> list[dict]:
        """Open a session on the next server and reset it with ``seed``."""
        if not self.urls:
            raise ValueError("openenv: no server URL (env.args.url, or env.args.serve in a run)")
        self.url = self.urls[next(_NEXT) % len(self.urls)]
        # A replica being restarted refuses connections for a few seconds: retry until it answers
        # (within the episode loop's env.step_timeout_s, which bounds this whole reset).
        deadline = time.monotonic() + self.reconnect_s
        while True:
            self.client = self.client_class(base_url=self.url, message_timeout_s=self.message_timeout_s)
            try:
                await self._call("connect", self.client.connect())
                break
            except EnvironmentLost:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
        result = await self._call("reset", self.client.reset(seed=seed, **self.reset_kwargs))
        first = [{"role": "user", "content": self._text(result.observation)}]
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + first

    async def step(self, action: str) -> EnvStep:
        """Send the turn as ``{action_field: action}``; the server's observation, reward and done."""
        result = await self._call("step", self.client.step({self.action_field: action}))
        text = self._text(result.observation)
        observation = [] if result.done else [{"role": "user", "content": text}]
        return EnvStep(observation, float(result.reward or 0.0), bool(result.done))

    async def close(self) -> None:
        """Close the session (a lost server's connection is already gone)."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
            self.client = None

    @staticmethod
    def task_rows(split: str, size: int = 1000, val_size: int = 64, instruction: str = "Play the game.",
                  **_: Any) -> list[dict[str, Any]]:
        """Rows that only name episodes (``data.train_files: [env:train]``): the server states the
        task at ``reset``. A held-out episode is seeded by its row's uid (file and index), so the
        ``env:val`` rows are other episodes than the training rows (seeded by their groups).

        Raises:
            ValueError: an unknown split, or ``size`` < 1.
        """
        if split not in ("train", "val") or size < 1:
            raise ValueError(f"openenv rows: split must be train or val and size >= 1, got {split!r} and {size}")
        count = size if split == "train" else val_size
        return [{"prompt": [{"role": "user", "content": instruction}], "data_source": "openenv",
                 "extra_info": {"episode": f"{split}:{k}"}} for k in range(count)]

    @staticmethod
    @contextlib.contextmanager
    def services(args: dict[str, Any], host: str) -> Iterator[dict[str, Any]]:
        """With ``serve`` in ``args``: start the servers (``OpenEnvServers``, binding ``host``
        unless ``serve.host`` is set) for the run, yield ``args`` with their URLs as ``url``, stop
        them at the end. Without it: ``args`` as they are."""
        if not args.get("serve"):
            yield args
            return
        with OpenEnvServers(**{"host": host, **args["serve"]}) as servers:
            try:
                yield {**{k: v for k, v in args.items() if k != "serve"}, "url": servers.urls}
            finally:
                logger.info("openenv: replica restarts %s", servers.restarts)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OpenEnvServers:
    """Local replicas of an OpenEnv server (uvicorn processes), health-checked and restarted.

    Args:
        app: the ASGI app, ``pkg.mod:app`` (imported from the working directory) or
            ``path/to/server.py:app``.
        replicas: servers to run (>= 1).
        host: the address they bind (``services`` gives the run's loopback default unless
            ``serve.host`` says otherwise; an address that is not loopback is logged: the servers
            run no authentication).
        python: the interpreter of the environment's own venv (it needs ``uvicorn`` and the
            app's packages); default this one.
        startup_timeout_s: seconds a server may take to answer ``/health``.
        env: extra environment variables of the server processes.

    Attributes:
        urls: ``http://host:port`` of each replica, in order.
        restarts: how many times each replica was restarted.

    Raises:
        ValueError: bad arguments, or a server that does not answer ``/health`` in time (its
            last output lines in the message).
    """

    def __init__(self, app: str, host: str, replicas: int = 1, python: str | None = None,
                 startup_timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        if replicas < 1:
            raise ValueError(f"openenv serve: replicas must be >= 1, got {replicas}")
        if ":" not in app:
            raise ValueError(f"openenv serve: app must be 'pkg.mod:attr' or 'path/to/file.py:attr', got {app!r}")
        module, _, attr = app.rpartition(":")
        self.app_dir = str(Path.cwd())
        if module.endswith(".py") or os.sep in module:
            self.app_dir, module = str(Path(module).resolve().parent), Path(module).stem
        self.target = f"{module}:{attr}"
        self.host, self.python = host, python or sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        if not _is_loopback(host):
            logger.warning("openenv servers bind %s, not loopback: anyone who can reach it can drive them "
                           "(OpenEnv servers run no authentication)", host)
        self.ports = [_free_port(host) for _ in range(replicas)]
        self.urls = [f"http://{host}:{port}" for port in self.ports]
        self.restarts = [0] * replicas
        self.procs: list[subprocess.Popen | None] = [None] * replicas
        self._logs = [Path(os.environ.get("TMPDIR", "/tmp")) / f"async-rl-openenv-{os.getpid()}-{p}.log"
                      for p in self.ports]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def _spawn(self, i: int) -> None:
        cmd = [self.python, "-m", "uvicorn", self.target, "--app-dir", self.app_dir, "--host", self.host,
               "--port", str(self.ports[i]), "--log-level", "warning"]
        env = {**os.environ, **self.extra_env, "OMP_NUM_THREADS": "1"}
        with open(self._logs[i], "ab") as log:
            self.procs[i] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)

    def _wait_healthy(self, i: int, close_on_failure: bool = True) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[i]
            if proc is not None and proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.urls[i]}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        tail = self._logs[i].read_text(errors="replace").strip().splitlines()[-3:] if self._logs[i].exists() else []
        if close_on_failure:
            self.close()
        raise ValueError(f"openenv server {self.target} on {self.urls[i]} did not answer /health within "
                         f"{self.startup_timeout_s:.0f} s: {' | '.join(tail) or 'no output'}")

    def start(self) -> "OpenEnvServers":
        """Start every replica, wait until each is healthy, then watch them (restart the dead)."""
        for i in range(len(self.ports)):
            self._spawn(i)
        for i in range(len(self.ports)):
            self._wait_healthy(i)
        self._monitor = threading.Thread(target=self._watch, name="openenv-servers", daemon=True)
        self._monitor.start()
        logger.info("openenv: %d replica(s) of %s at %s", len(self.urls), self.target, ", ".join(self.urls))
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None:
                    continue
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.restarts[i] += 1
                    logger.warning("openenv server %s exited (code %s): restart %d", self.urls[i], proc.returncode,
                                   self.restarts[i])
                    self._spawn(i)
                try:
                    self._wait_healthy(i, close_on_failure=False)
                except ValueError as e:  # its episodes fail (rejected); the others go on
                    logger.error("%s", e)

    def close(self) -> None:
        """Stop the watcher and every replica (SIGTERM, then SIGKILL after 5 s); remove their logs."""
        self._stop.set()
        with self._lock:
            for proc in self.procs:
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in self.procs:
                if proc is not None:
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
        for log in self._logs:
            log.unlink(missing_ok=True)

    def __enter__(self) -> "OpenEnvServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
