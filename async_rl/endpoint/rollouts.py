"""Rollout functions: a user's own agent loop, written against the ``openai`` client, as the run's
rollouts.

A rollout function is a coroutine function::

    async def rollout(client: openai.AsyncOpenAI, task: async_rl.envs.Task) -> float | RolloutResult

registered by spec in ``endpoint.rollout`` (``my_pkg.agent:rollout``, ``path/to/agent.py:rollout``
or a built-in name); ``endpoint.args`` are passed to it as keyword arguments. ``client`` talks to
the engine of the process the function runs in (the generator actor in async mode, the trainer
in sync mode) through a session of its own: its base URL is ``http://127.0.0.1:<port>/s/<session>/v1``
and its API key the endpoint's. A function may hand ``client.base_url`` and ``client.api_key``
to any other OpenAI-compatible library.

A group is the function called ``n`` times for one task (``trainer.samples_per_prompt``), each
call its own session, under the same admission control and staleness bound as every group. The
function returns the episode's reward (a finite number), or a ``RolloutResult`` with the reward
and numbers to report (``info``: ``env/info/<key>`` per episode; ``acc`` is the episode's
accuracy). The session's calls become one trajectory (``async_rl.endpoint.capture``): the
assistant tokens sampled on its final chain are trained, everything else is masked.

Limits and faults. At most ``endpoint.max_concurrency`` sessions run at once in a process (0:
every session of the batch the process was given). A
session's calls that sample are at most ``endpoint.max_turns``, its response-side tokens at most
``endpoint.max_response_tokens``: a call past either is answered at once with no tokens and finish
reason ``length``, and the episode ends ``max_turns`` or ``length`` (the function still returns
its reward). A session runs at most ``endpoint.timeout_s`` seconds. Each of these ends the episode
as a counted rejection (``env/rejected_<reason>``), never a reward of 0, and nothing of a rejected
episode is trained: ``error`` (the function raised), ``timeout``, ``malformed`` (it returned
something that is not a finite number or a ``RolloutResult``), ``no_calls`` (it never sampled),
``prompt_too_long`` (a first prompt over ``data.max_prompt_tokens``), ``disconnected`` (its
client went away before an answer was delivered whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from async_rl.envs.base import Task
from async_rl.generators.base import mix_seed
from async_rl.runtime.cluster import LOOPBACK
from async_rl.step.agent import Episode, EpisodeCounters
from async_rl.utils.registry import Registry

from .capture import Session
from .server import Endpoint, new_event_loop

logger = logging.getLogger(__name__)

__all__ = ["ENDPOINT_ENV", "EndpointConfig", "EndpointLoop", "ROLLOUT_FUNCTIONS", "RolloutResult", "register_rollout"]

ENDPOINT_ENV = "openai_endpoint"
"""The ``EnvConfig.name`` under which a run's rollout function travels to the generator actors."""

REJECT_REASONS = ("error", "timeout", "malformed", "no_calls", "prompt_too_long", "disconnected")
"""Why an episode of a rollout function is rejected (``env/rejected_<reason>``)."""


@dataclass
class EndpointConfig:
    """Rollout functions against an OpenAI-compatible endpoint (``endpoint.*``); off while
    ``rollout`` is unset."""

    rollout: str | None = None
    """The rollout function's spec: ``my_pkg.agent:rollout``, ``path/to/agent.py:rollout`` or a
    built-in name (``async_rl.endpoint.rollouts.ROLLOUT_FUNCTIONS``). ``None``: off."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function besides ``client`` and ``task``."""
    tools: list[str] = field(default_factory=list)
    """Tools the function offers the model (specs as ``agent.tools`` takes them): their schemas
    render the dataset's prompts and warm-start demonstrations, as the function's calls render
    them (``tools=``), so the warm start teaches the prompts RL samples from. Empty: none."""
    host: str = LOOPBACK
    """Address the endpoint binds (loopback by default: the rollout functions run in the process
    that serves it; anything else is said at start)."""
    port: int = 0
    """Port of the endpoint (0: a free one per process)."""
    api_key: str | None = None
    """The key callers must send (``Authorization: Bearer``); ``None``: a random one per process."""
    parser: str | None = "hermes"
    """Tool-call format the model writes (``async_rl.tools.parsers``), parsed into ``tool_calls``;
    ``None``: answers are plain text."""
    max_concurrency: int = 0
    """Most sessions running at once in one process (>= 0); 0: every session of a batch at once
    (as the built-in episode loop runs them: a cap below the batch halves the engine's batches)."""
    max_turns: int = 8
    """Most calls that sample per session (>= 1)."""
    max_response_tokens: int = 1024
    """Most response-side tokens of a session's chain, sampled and sent tokens together (>= 1)."""
    timeout_s: float = 300.0
    """Wall time one session may take (> 0 seconds); past it the episode is rejected (``timeout``)."""
    batch_wait_s: float = 0.5
    """How long the engine's next batch waits for a running session's next call after the session
    got its last answer (four times this after it started; a batch waits at most four times this;
    >= 0 seconds): the calls of a turn then share one batch. A session busy longer (a slow tool)
    joins a later batch."""

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_response_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"endpoint.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_concurrency < 0:
            raise ValueError(f"endpoint.max_concurrency must be >= 0 (0: no cap), got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError(f"endpoint.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.batch_wait_s < 0:
            raise ValueError(f"endpoint.batch_wait_s must be >= 0 seconds, got {self.batch_wait_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"endpoint.port must be in [0, 65535], got {self.port}")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are a rollout function's episodes."""
        return bool(self.rollout)


@dataclass
class RolloutResult:
    """What a rollout function may return instead of a bare reward.

    Attributes:
        reward: the episode's reward (finite).
        info: numbers reported per episode (``env/info/<key>``); ``acc`` is the episode's accuracy.
    """

    reward: float
    info: dict[str, float] = field(default_factory=dict)


def _as_rollout(kind: str, spec: str, obj: Any) -> Callable:
    if not inspect.iscoroutinefunction(obj) and not inspect.iscoroutinefunction(getattr(obj, "__call__", None)):
        raise ValueError(f"{kind} {spec!r} must name an async function (async def rollout(client, task)), got "
                         f"{type(obj).__name__}")
    return obj


ROLLOUT_FUNCTIONS: Registry[Callable] = Registry(
    "rollout function", coerce=_as_rollout,
    help="A rollout function spec names an async function rollout(client, task) -> reward.")
"""Rollout functions configs may name by short name (``endpoint.rollout``)."""


def register_rollout(obj: Any = None, name: str | None = None) -> Any:
    """Register a rollout function under ``name`` (default: its ``__name__``); usable as a decorator.

    Raises:
        ValueError: as ``Registry.register``, or ``obj`` is not an async function.
    """
    def add(value: Any) -> Any:
        _as_rollout("rollout function", name or value.__name__, value)
        return ROLLOUT_FUNCTIONS.register(name or value.__name__, value)

    return add if obj is None else add(obj)


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_result(result: Any) -> RolloutResult:
    """A rollout function's return as a ``RolloutResult``.

    Raises:
        ValueError: not a finite number or a ``RolloutResult`` with a finite reward and numeric info.
    """
    if isinstance(result, RolloutResult):
        reward, info = result.reward, result.info
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        reward, info = result, {}
    else:
        raise ValueError(f"a rollout function must return a number or a RolloutResult, got {type(result).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the reward must be a finite number, got {reward!r}")
    if not isinstance(info, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                         for v in info.values()):
        raise ValueError(f"RolloutResult.info must map names to finite numbers, got {str(info)[:120]}")
    return RolloutResult(float(reward), {str(k): float(v) for k, v in info.items()})


class EndpointLoop(EpisodeCounters):
    """Runs a rollout function's episodes on any engine: the ``agent`` of a run whose
    ``endpoint.rollout`` is set (the same surface as ``async_rl.step.episodes.EpisodeLoop``).

    The endpoint starts on first use (one per process). The functions run on an event loop of
    this object's own thread; the thread that calls ``run_groups`` drives the engine meanwhile
    (``EngineDriver.pump``). A function that blocks its event loop (synchronous work in a
    coroutine) stalls every session of the process: past ``endpoint.timeout_s`` plus 5 s of a
    stalled loop, every session still running is rejected (``timeout``) and a new loop serves
    the next ones.

    Counters (``pop_metrics``): ``env/episodes``, ``env/rejected_<reason>``, ``endpoint/calls``,
    ``endpoint/engine_batches``, ``endpoint/rewritten_calls``, ``endpoint/untrained_choices``,
    ``endpoint/sampling_overridden``.

    Args:
        cfg: ``endpoint`` settings.
        tokenizer: the policy's tokenizer (with a chat template).
        stop_token_ids: ids that end an assistant turn.
        max_prompt_tokens: most tokens of a chain's first prompt (``data.max_prompt_tokens``).
        params: the run's ``SamplingParams`` (the endpoint's default ``max_tokens`` and stop ids).

    Raises:
        ValueError: the spec names no async function.
    """

    def __init__(self, cfg: EndpointConfig, tokenizer, stop_token_ids: Sequence[int], max_prompt_tokens: int,
                 params=None) -> None:
        from async_rl.generators.base import SamplingParams

        super().__init__()
        self.cfg = cfg
        self.fn = ROLLOUT_FUNCTIONS.get(cfg.rollout)
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_prompt_tokens = max_prompt_tokens
        self.params = params or SamplingParams(stop_token_ids=self.stop_token_ids)
        self.schemas = None
        """Tool schemas of ``endpoint.tools`` (the dataset's prompts are rendered with them)."""
        if cfg.tools:
            from async_rl.tools import ToolRegistry

            self.schemas = ToolRegistry.from_specs(list(cfg.tools)).schemas()
        self.endpoint: Endpoint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat = time.monotonic()
        self._lock = threading.Lock()
        self._http = None  # the current event loop's HTTP client (``_client``)
        self._batches_seen = 0

    # ------------------------------------------------------------------ set-up
    def _endpoint(self) -> Endpoint:
        if self.endpoint is None:
            self.endpoint = Endpoint(self.tokenizer, self.stop_token_ids, self.params, parser=self.cfg.parser,
                                     host=self.cfg.host, port=self.cfg.port, api_key=self.cfg.api_key,
                                     batch_wait_s=self.cfg.batch_wait_s).start()
            where = "loopback" if _is_loopback(self.cfg.host) else "NOT loopback"
            logger.info("OpenAI-compatible endpoint at %s (%s)", self.endpoint.base_url, where)
            if where != "loopback":
                logger.warning("endpoint.host=%s: the policy endpoint is reachable from other hosts (API key %s)",
                               self.cfg.host, "configured" if self.cfg.api_key else "random, per process")
        return self.endpoint

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = new_event_loop()
                threading.Thread(target=loop.run_forever, name="rollout-functions", daemon=True).start()
                self._loop, self._http = loop, None
            return self._loop

    def _client(self, session: Session, k: int):
        """Session ``k``'s ``openai.AsyncOpenAI`` (its base URL names the session), on the HTTP client
        that every session of the current event loop shares: the ``openai`` package's own aiohttp
        transport (``openai.DefaultAioHttpClient``, the ``aiohttp`` extra), kept across sessions and
        steps so its connections are reused. Not httpx's pool: httpcore scans every connection of a
        pool (a readability syscall each) on every request, and with hundreds of sessions a call
        cost about 2 ms of the rollout functions' CPU against about 1 ms through aiohttp
        (``bench/bench_endpoint.py``). No connection limit (aiohttp's default is 100): a session's
        call holds its connection until the engine answers, and a batch waits for the calls of
        every running session. Idle connections are kept for ten seconds less than the endpoint keeps
        them (``Endpoint.KEEP_ALIVE_S``): long enough to outlive a step's training (a new connection
        per call and step cost a third of the client's time), and never long enough to send a call
        on a connection the server is closing (calls are not retried). Proxy variables are not
        read: the endpoint is the run's own."""
        import httpx2
        import openai

        if self._http is None:
            self._http = openai.DefaultAioHttpClient(
                timeout=httpx2.Timeout(self.cfg.timeout_s), trust_env=False,
                limits=httpx2.Limits(max_connections=0, max_keepalive_connections=None,  # 0: aiohttp's "no limit"
                                     keepalive_expiry=Endpoint.KEEP_ALIVE_S - 10))
        return openai.AsyncOpenAI(base_url=self.endpoint.session_url(session.sid), api_key=self.endpoint.api_key,
                                  max_retries=0, http_client=self._http)

    # ------------------------------------------------------------------ episodes
    def run_groups(self, generator, requests: Sequence[Any], n: int, params, seeds: Sequence[int] | None,
                   on_sample: Callable[[int, int, Any], None] | None = None) -> list[list[Any]]:
        """``n`` episodes of the rollout function per request (``GroupRequest``); returns one list
        of ``n`` finished ``Episode`` per request, each handed to ``on_sample(i, j, episode)`` as it
        ends (a rejected one with ``rejected`` set).

        Args:
            generator: a ``Generator`` (HF, vLLM, SGLang), driven from this thread meanwhile.
            params: ``SamplingParams`` of one call (the run's temperature, or greedy in evaluation).
            seeds: one per request (unseeded, as in evaluation: a hash of the prompt's uid);
                session j of request i has seed ``mix_seed(seeds[i], j)``.
        """
        endpoint = self._endpoint()
        rows: list[list[Any]] = [[None] * n for _ in requests]
        sessions = []
        for i, r in enumerate(requests):
            base = seeds[i] if seeds is not None else zlib.crc32(r.prompt_uid.encode())
            task = Task(r.prompt_uid, [dict(m) for m in r.messages], r.data_source, r.ground_truth, dict(r.extra_info))
            for j in range(n):
                session = endpoint.open_session(mix_seed(base, j), self.cfg.max_turns, self.cfg.max_response_tokens,
                                                self.max_prompt_tokens, params)
                sessions.append((i, j, task, session))
        self._count("env/episodes", len(sessions))
        loop = self._event_loop()
        done: set[int] = set()

        def finished(k: int, episode: Any) -> None:
            i, j, _, session = sessions[k]
            if k in done:
                return
            done.add(k)
            rows[i][j] = episode
            if on_sample is not None:
                on_sample(i, j, episode)

        self._beat = time.monotonic()  # the stall clock starts now, not at an earlier loop's last beat
        future = asyncio.run_coroutine_threadsafe(self._run_sessions(sessions, finished), loop)
        stall = self.cfg.timeout_s + 5
        while not future.done():
            endpoint.driver.pump(generator, lambda: future.done() or time.monotonic() - self._beat > stall,
                                 lambda: endpoint.expected_calls() or 0)
            if not future.done() and time.monotonic() - self._beat > stall:
                logger.error("a rollout function blocked its event loop past %.0f s (synchronous work in a "
                             "coroutine?); its sessions are rejected and a new loop serves the next ones", stall)
                future.cancel()
                self._retire()  # closed once the function lets its loop run again
                break
        self._count("endpoint/engine_batches", endpoint.driver.batches - self._batches_seen)
        self._batches_seen = endpoint.driver.batches
        for k, (i, j, _, session) in enumerate(sessions):
            if k not in done:
                finished(k, self._episode(session, None, "timeout"))
            endpoint.end_session(session)
        return rows

    async def _run_sessions(self, sessions: list, finished: Callable[[int, Any], None]) -> None:
        limit = asyncio.Semaphore(self.cfg.max_concurrency or max(1, len(sessions)))
        self._beat = time.monotonic()

        async def beat() -> None:
            while True:
                self._beat = time.monotonic()
                await asyncio.sleep(0.5)

        async def one(k: int) -> None:
            i, j, task, session = sessions[k]
            async with limit:
                session.last_event = time.monotonic()
                session.started = True
                client = self._client(session, k)
                result, reason = None, None
                try:
                    async with asyncio.timeout(self.cfg.timeout_s):
                        result = await self.fn(client, task, **self.cfg.args)
                except TimeoutError:
                    reason = "timeout"
                except Exception as e:  # noqa: BLE001 - the function's fault, counted per episode
                    reason = "error"
                    self._warn(reason, e)
                if reason is None:
                    try:
                        result = check_result(result)
                    except ValueError as e:
                        reason = "malformed"
                        self._warn(reason, e)
                session.close()
                finished(k, self._episode(session, result, reason))

        beating = asyncio.ensure_future(beat())
        try:
            await asyncio.gather(*(one(k) for k in range(len(sessions))))
        finally:
            beating.cancel()

    def _warn(self, reason: str, error: BaseException) -> None:
        key = f"env/rejected_{reason}"
        if self._counts[key] == 0:
            logger.warning("rollout function %s: episode rejected (%s): %s: %s", self.cfg.rollout, reason,
                           type(error).__name__, error)

    def _episode(self, session: Session, result: "RolloutResult | None", reason: str | None):
        """The ``Episode`` of a finished session: its trained chain, its reward, or its rejection."""
        session.close()
        node = session.trained_chain()
        # A stream still open when the function ended was not delivered whole: its client went away.
        reason = (reason or session.fault or ("disconnected" if session.open_streams else None)
                  or (None if node is not None else "no_calls"))
        for key, value in session.counts.items():
            self._count(f"endpoint/{key}", value)
        self._count("endpoint/calls", len(session.nodes))
        if reason is not None:
            self._count(f"env/rejected_{reason}", 1)
            return Episode(list(node.ids[: node.prompt_len]) if node else [], [], session.seed, finish_reason="stop",
                           rejected=reason)
        self._count("endpoint/untrained_choices", session.untrained_calls())
        finish = session.refused or ("stop" if node.ended_turn else "length")
        return Episode(
            prompt_ids=list(node.ids[: node.prompt_len]), messages=list(node.messages or []), seed=session.seed,
            response_ids=list(node.ids[node.prompt_len:]), logprobs=list(node.logprobs), loss_mask=list(node.mask),
            policy_version=list(node.versions), num_turns=node.calls, finish_reason=finish, final_text=node.text,
            env_return=result.reward, turn_rewards=[result.reward], info=dict(result.info), multi_turn=True)

    def _retire(self, wait_s: float = 0.0) -> None:
        """Leave the current event loop: close its HTTP client, then stop it, on the loop itself
        (a blocked loop does both once it runs again); wait up to ``wait_s`` seconds for that."""
        with self._lock:
            loop, http, self._loop, self._http = self._loop, self._http, None, None
        if loop is None or loop.is_closed():
            return

        async def close() -> None:
            if http is not None:
                with contextlib.suppress(Exception):  # closing is courtesy: the connections are local
                    await http.aclose()
            loop.call_soon(loop.stop)

        done = asyncio.run_coroutine_threadsafe(close(), loop)
        if wait_s:
            with contextlib.suppress(Exception):
                done.result(timeout=wait_s)

    def close(self) -> None:
        """Stop the endpoint and the rollout functions' event loop (idempotent)."""
        self._retire(wait_s=5.0)
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
