"""The OpenAI-compatible endpoint: a FastAPI app on its own thread, and the driver that batches its
calls onto the engine.

Routes (``POST`` unless noted; every route needs ``Authorization: Bearer <api key>``):

- ``/v1/chat/completions``, ``/v1/completions``, ``GET /v1/models``: plain calls, served with
  the request's own sampling settings, not recorded.
- ``/s/<session>/v1/...``: the same routes inside a rollout session: every call is recorded
  (``async_rl.endpoint.capture``) and sampled with the run's settings (temperature, top-p,
  top-k; greedy in evaluation): the learner scores tokens at the run's temperature, so a call
  that asks for other values is served with the run's and counted
  (``endpoint/sampling_overridden``). ``max_tokens`` is honoured within the session's budget.

**Why the endpoint serves each engine itself (one per generator actor, and one in the sync
trainer), not a router in front of the pool.** The rollout functions run in the process that owns
the engine, so a session's calls never cross a process or a host, the engine's batches are
formed from exactly the calls waiting in that process (no second queue in front of the pool's own
admission control), and an actor that dies takes its sessions with it, re-issued as every group
of a lost actor is. One render and one tokenization path (the tokenizer's chat template, the
run's tool-call parser) serves all three engines, so what is recorded is what the engine was
given on each of them; vLLM's and SGLang's own OpenAI servers would each need their token-id
options mapped back to a trajectory, and would sit outside the engine's weight updates.

**Batching.** The HTTP handlers put each call on a queue; the driver, on the thread that owns the
engine (``EngineDriver.pump``), takes every call waiting and runs them as one batch once no
running session is expected to call soon: a session is expected for ``batch_wait_s`` after its
last answer (an agent usually calls again at once, or after a quick tool) and for four times that
after it started (hundreds of clients starting together take a while to get their first requests
out), and a batch waits at most four times ``batch_wait_s``. An engine that decodes a static batch (the HF engine)
then samples a turn of every session in one batch, as the built-in episode loop does, rather than
one batch per straggler. Plain calls (no session) wait for more calls 20 ms after the last. Calls that share
sampling settings are one ``generate`` batch (each choice a row with its own seed; the batch runs
to the largest ``max_tokens`` and each row is cut to its own). A call's answer goes back the
moment its choices finish, while the engine decodes the rest.

Streaming (``stream: true``) is served as server-sent events in the OpenAI chunk format. The
response starts at once (choice 0's role, or an empty text); the engines return a choice
when it finishes, so its chunks (one per token) follow each other then, rather than as the
tokens are sampled. A client that goes away before ``[DONE]`` faults its session
(``disconnected``), so nothing it was half sent is trained.
"""

# No "from __future__ import annotations": FastAPI reads the route handlers' annotations at run time.

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from async_rl.generators.base import SamplingParams, mix_seed
from async_rl.runtime.cluster import LOOPBACK
from async_rl.tools.parsers import get_parser

from . import protocol
from .capture import Plan, Session
from .protocol import ChoiceOut, ProtocolError

logger = logging.getLogger(__name__)

__all__ = ["Endpoint", "EngineCall", "EngineDriver"]


@dataclass
class EngineCall:
    """One call waiting for the engine.

    Attributes:
        prompt_ids: the engine's prompt.
        n: choices to sample.
        params: sampling settings (``max_tokens`` the call's own).
        seed: the call's seed; choice j samples with ``mix_seed(seed, j)``.
        sid: the session it belongs to (``None``: a plain call).
    """

    prompt_ids: list[int]
    n: int
    params: SamplingParams
    seed: int
    sid: str | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    samples: dict[int, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        """Calls with equal keys share one engine batch (everything but ``max_tokens``)."""
        return dataclasses.replace(self.params, max_tokens=0),

    def _settle(self, value: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)
        with contextlib.suppress(RuntimeError):  # the server's loop has stopped: nobody waits
            self.loop.call_soon_threadsafe(settle)

    def add(self, j: int, sample: Any) -> None:
        """Choice ``j`` finished; the call is answered once all ``n`` have."""
        if j in self.samples:
            return
        self.samples[j] = sample
        if len(self.samples) == self.n:
            self._settle([self.samples[k] for k in range(self.n)], None)

    def fail(self, error: BaseException) -> None:
        """The engine failed on this call's batch."""
        self._settle(None, error)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (``uvicorn[standard]`` brings it): its sockets
    cost a fraction of asyncio's own per request, which the endpoint and the rollout functions'
    clients pay hundreds of times a step; asyncio's loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EngineDriver:
    """Batches waiting calls onto a ``Generator`` on the thread that owns it.

    Args:
        batch_wait_s: how long a batch may wait for a call that a running session is expected to
            make (seconds, >= 0; see ``pump``).
    """

    PLAIN_WINDOW_S = 0.02
    """Without sessions: a batch goes once no call arrived for this long (at most ten times it)."""

    def __init__(self, batch_wait_s: float = 0.5) -> None:
        self.batch_wait_s = batch_wait_s
        self.queue: queue.Queue[EngineCall] = queue.Queue()
        self.batches = 0

    def submit(self, call: EngineCall) -> None:
        """Queue a call (any thread)."""
        self.queue.put(call)

    def pump(self, generator, until: Callable[[], bool], expected: Callable[[], int] | None = None,
             poll_s: float = 0.02) -> None:
        """Serve calls on ``generator`` until ``until()`` is true (checked at least every ``poll_s``).

        Args:
            expected: how many running sessions are expected to call soon (they have no call
                waiting, and started or got their last answer less than ``batch_wait_s`` ago);
                a batch runs once it is 0, or ``4 * batch_wait_s`` after its first call.
                ``None`` (plain calls only): a batch runs once no call arrived for
                ``PLAIN_WINDOW_S``.
        """
        while not until():
            try:
                first = self.queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            batch = [first]
            start = last = time.monotonic()
            while True:
                with contextlib.suppress(queue.Empty):
                    while True:
                        batch.append(self.queue.get_nowait())
                        last = time.monotonic()
                now = time.monotonic()
                if expected is not None:
                    if expected() == 0 or now - start >= 4 * self.batch_wait_s:
                        break
                    remaining = 0.005  # re-check who is expected
                else:
                    remaining = min(last + self.PLAIN_WINDOW_S, start + 10 * self.PLAIN_WINDOW_S) - now
                    if remaining <= 0:
                        break
                with contextlib.suppress(queue.Empty):
                    batch.append(self.queue.get(timeout=remaining))
                    last = time.monotonic()
            self.dispatch(generator, batch)

    def dispatch(self, generator, batch: list[EngineCall]) -> None:
        """Run ``batch`` on the engine: one ``generate`` per group of equal sampling settings."""
        groups: dict[tuple, list[EngineCall]] = defaultdict(list)
        for call in batch:
            if not call.future.cancelled():
                groups[call.key()].append(call)
        for calls in groups.values():
            rows = [(c, j) for c in calls for j in range(c.n)]
            params = dataclasses.replace(calls[0].params, max_tokens=max(c.params.max_tokens for c in calls))
            seeds = [mix_seed(c.seed, j) for c, j in rows]

            def on_sample(k: int, _index: int, sample: Any, rows=rows) -> None:
                call, j = rows[k]
                call.add(j, sample)

            self.batches += 1
            try:
                out = generator.generate([c.prompt_ids for c, _ in rows], 1, params, seeds=seeds, on_sample=on_sample)
            except Exception as e:  # noqa: BLE001 - the callers get it as a server error
                logger.error("endpoint: the engine failed on a batch of %d calls: %s: %s", len(calls),
                             type(e).__name__, e)
                for c in calls:
                    c.fail(e)
                continue
            for k, (sample,) in enumerate(out):
                on_sample(k, 0, sample)


class Endpoint:
    """The OpenAI-compatible HTTP endpoint of one engine.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders chat calls); copied, so the
            endpoint's thread never shares it.
        stop_token_ids: ids that end an assistant turn.
        params: the run's ``SamplingParams`` (stop ids, default ``max_tokens``; a session's
            sampling settings unless the session gives its own).
        parser: the tool-call parser's name (``async_rl.tools.parsers``) or ``None`` (no parsing).
        host: the address to bind (loopback by default).
        port: the port (0: a free one).
        api_key: the key callers must send; ``None``: a random one per endpoint.
        model_name: the name ``/v1/models`` lists (any name is accepted in requests).
        batch_wait_s: ``EngineDriver``'s wait for an expected call.

    Raises:
        ValueError: an unknown parser.
    """

    KEEP_ALIVE_S = 60
    """How long an idle client connection is kept open (seconds)."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int], params: SamplingParams, parser: str | None = "hermes",
                 host: str = LOOPBACK, port: int = 0, api_key: str | None = None, model_name: str = "policy",
                 batch_wait_s: float = 0.5) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.stop_token_ids = tuple(stop_token_ids)
        self.params = params
        self.parser = get_parser(parser) if parser else None
        self.host, self.port = host, port
        self.api_key = api_key or f"sk-arl-{secrets.token_hex(16)}"
        self.model_name = model_name
        self.driver = EngineDriver(batch_wait_s)
        self.sessions: dict[str, Session] = {}
        self.session_params: dict[str, SamplingParams] = {}
        self.counts: Counter[str] = Counter()
        self._plain_calls = 0
        self._server = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._special: list[str] | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> "Endpoint":
        """Start serving on a thread of its own; returns once the port accepts connections.

        Raises:
            OSError: the address cannot be bound.
        """
        if self._thread is not None:
            return self
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=self.KEEP_ALIVE_S)
        self._server = uvicorn.Server(config)
        started = threading.Event()

        def run() -> None:
            loop = new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            loop.call_soon(started.set)
            loop.run_until_complete(self._server.serve(sockets=[sock]))

        self._thread = threading.Thread(target=run, name="openai-endpoint", daemon=True)
        self._thread.start()
        started.wait(30)
        deadline = time.monotonic() + 30
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise OSError(f"the endpoint did not start on {self.host}:{self.port}")
        return self

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._server = self._thread = None

    @property
    def base_url(self) -> str:
        """The plain calls' base URL (``http://host:port/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def session_url(self, sid: str) -> str:
        """A session's base URL (``http://host:port/s/<sid>/v1``)."""
        return self.base_url[: -len("/v1")] + f"/s/{sid}/v1"

    @contextlib.contextmanager
    def serving(self, generator):
        """Serve plain calls on ``generator`` from a background thread for the block (tests,
        trying the endpoint by hand); the engine must not be used by anyone else meanwhile."""
        self.start()
        stop = threading.Event()
        thread = threading.Thread(target=self.driver.pump, args=(generator, stop.is_set, self.expected_calls),
                                  name="endpoint-driver", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join(timeout=60)

    # ------------------------------------------------------------------ sessions
    def open_session(self, seed: int, max_turns: int, max_response_tokens: int, max_prompt_tokens: int,
                     params: SamplingParams | None = None) -> Session:
        """A new recorded session (its id unguessable); ``params``: its sampling settings
        (default: the endpoint's)."""
        sid = secrets.token_hex(12)
        session = Session(sid, seed, max_turns, max_response_tokens, max_prompt_tokens)
        self.sessions[sid] = session
        self.session_params[sid] = params or self.params
        return session

    def end_session(self, session: Session) -> None:
        """Close a session and forget it."""
        session.close()
        self.sessions.pop(session.sid, None)
        self.session_params.pop(session.sid, None)

    def expected_calls(self) -> int | None:
        """Running sessions expected to call soon: no call waiting, and started or answered less
        than ``batch_wait_s`` ago (``EngineDriver.pump``); ``None`` when no session runs."""
        now, wait = time.monotonic(), self.driver.batch_wait_s
        running = [s for s in list(self.sessions.values()) if s.started and not s.closed]
        if not running:
            return None
        # A session that has not called yet is expected for four waits after its start: agents
        # call at once, but hundreds of clients starting together take a while (about 1 s for 256
        # on 2 cores) to get their first requests out.
        return sum(1 for s in running if not s.waiting and now - s.last_event < (4 * wait if s.issued == 0 else wait))

    def _session(self, sid: str | None) -> Session | None:
        if sid is None:
            return None
        session = self.sessions.get(sid)
        if session is None:
            raise ProtocolError(f"no session {sid!r} (it ended, or never existed)", status=404)
        session.check_open()
        return session

    # ------------------------------------------------------------------ the app
    def app(self):
        """The FastAPI application."""
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, StreamingResponse

        app = FastAPI(title="async-rl policy endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def fail(e: ProtocolError) -> JSONResponse:
            return JSONResponse(protocol.error_body(e), status_code=e.status)

        def authorized(request: Request) -> None:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {self.api_key}".encode()):
                raise ProtocolError("invalid API key (send Authorization: Bearer <key>)", status=401)

        async def body_of(request: Request) -> Any:
            try:
                return await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ProtocolError(f"the request body is not JSON: {e}") from e

        async def handle(request: Request, sid: str | None, kind: str):
            session = None
            try:
                authorized(request)
                session = self._session(sid)
                body = await body_of(request)
                if kind == "chat":
                    req = protocol.parse_chat_request(body)
                    work = self._chat(req, session)
                    build, stream = protocol.chat_completion, protocol.chat_chunks
                else:
                    req = protocol.parse_completion_request(body)
                    work = self._completion(req, session)
                    build, stream = protocol.completion, protocol.completion_chunks
                if not req.stream:
                    prompt_ids, choices = await work
            except ProtocolError as e:
                if session is not None and e.status >= 500:
                    session.set_fault("error")
                return fail(e)
            if not req.stream:
                if session is not None and await request.is_disconnected():
                    session.set_fault("disconnected")
                return JSONResponse(build(req, choices, prompt_ids, self.model_name, self.tokenizer))
            opening, ident = protocol.stream_opening(kind, self.model_name)
            if session is not None:
                with session.lock:
                    session.open_streams += 1
            return StreamingResponse(
                self._events(work, opening, lambda p, c: stream(req, c, p, self.model_name, self.tokenizer, ident),
                             session), media_type="text/event-stream")

        @app.get("/v1/models")
        async def models(request: Request):
            try:
                authorized(request)
            except ProtocolError as e:
                return fail(e)
            return JSONResponse(protocol.model_list(self.model_name))

        @app.get("/s/{sid}/v1/models")
        async def session_models(request: Request, sid: str):
            try:
                authorized(request)
                self._session(sid)
            except ProtocolError as e:
                return fail(e)
            return JSONResponse(protocol.model_list(self.model_name))

        def handlers(kind: str):
            async def plain(request: Request):
                return await handle(request, None, kind)

            async def in_session(request: Request, sid: str):
                return await handle(request, sid, kind)

            return plain, in_session

        for route, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
            plain, in_session = handlers(kind)
            app.add_api_route(route, plain, methods=["POST"])
            app.add_api_route("/s/{sid}" + route, in_session, methods=["POST"])

        return app

    async def _events(self, work, opening: dict[str, Any], chunks_of, session: Session | None):
        """Server-sent events of a streamed call: its opening chunk at once, then, once ``work``
        (the call's sampling) is done, its other chunks and ``[DONE]``. A client
        gone before ``[DONE]`` (the server learns it while the call samples, or as it writes)
        faults its session: nothing it was half sent is trained."""
        delivered = False

        def whole() -> None:
            nonlocal delivered
            delivered = True
            if session is not None:
                with session.lock:
                    session.open_streams -= 1

        try:
            yield f"data: {json.dumps(opening)}\n\n"
            try:
                prompt_ids, choices = await work
            except ProtocolError as e:
                if session is not None:
                    session.set_fault("error")
                whole()
                yield f"data: {json.dumps(protocol.error_body(e))}\n\n"
                return
            for chunk in chunks_of(prompt_ids, choices):
                yield f"data: {json.dumps(chunk)}\n\n"
            # Every chunk is with the transport: the client ends its stream only after [DONE], so a
            # session closing after that never sees this stream as open.
            whole()
            yield "data: [DONE]\n\n"
        finally:
            if not delivered:
                whole()
                if session is not None:
                    session.set_fault("disconnected")

    # ------------------------------------------------------------------ calls
    def _params(self, req, session: Session | None) -> SamplingParams:
        """The call's sampling settings: a session's own (counted when the request asked for
        others), else the request's (temperature 0: greedy)."""
        if session is not None:
            params = self.session_params.get(session.sid, self.params)
            asked_t = req.temperature if req.temperature is not None else None
            if ((asked_t is not None and not (params.greedy and asked_t == 0) and asked_t != params.temperature)
                    or (req.top_p is not None and req.top_p != params.top_p)):
                session.count("sampling_overridden")
            return params
        temperature = 1.0 if req.temperature is None else req.temperature
        return dataclasses.replace(self.params, temperature=temperature if temperature > 0 else 1.0,
                                   greedy=temperature == 0, top_p=req.top_p if req.top_p is not None else 1.0,
                                   top_k=0)

    def _seed(self, req, session: Session | None) -> int:
        if session is not None:
            session.issued += 1
            return (mix_seed(session.seed, 1 << 40, req.seed) if req.seed is not None
                    else mix_seed(session.seed, session.issued))
        if req.seed is not None:
            return mix_seed(req.seed)
        self._plain_calls += 1
        return mix_seed(secrets.randbits(62), self._plain_calls)

    async def _sample(self, prompt_ids: list[int], n: int, params: SamplingParams, max_tokens: int, seed: int,
                      top_logprobs: int, session: Session | None) -> list[Any]:
        loop = asyncio.get_running_loop()
        call_params = dataclasses.replace(params, max_tokens=max(1, max_tokens))
        if top_logprobs and hasattr(call_params, "top_logprobs"):
            call_params = dataclasses.replace(call_params, top_logprobs=top_logprobs)
        call = EngineCall(list(prompt_ids), n, call_params, seed, session.sid if session else None, loop,
                          loop.create_future())
        if session is not None:
            session.waiting += 1
        self.driver.submit(call)
        try:
            return await call.future
        except ProtocolError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's failure, answered as a server error
            raise ProtocolError(f"the engine failed: {type(e).__name__}: {e}", status=500) from e
        finally:
            if session is not None:
                session.waiting -= 1
                session.last_event = time.monotonic()

    def _cut(self, sample: Any, max_tokens: int, stop: list[str], chat_parse: bool) -> tuple[ChoiceOut, bool]:
        """A sample as a choice: cut to ``max_tokens`` and at the first ``stop`` string (the ids
        through the token that completed it are kept: they were sampled; the text ends before it).
        Returns the choice and whether its last id is a stop token."""
        ids = list(sample.response_ids)[:max_tokens]
        logprobs = list(sample.logprobs)[: len(ids)]
        tops = list(getattr(sample, "top_logprobs", None) or [])[: len(ids)]
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        finish = "stop" if ended else ("length" if len(ids) >= max_tokens or sample.finish_reason == "length" else "stop")
        body = ids[:-1] if ended else ids
        text = self._text(body, keep_tags=chat_parse)
        if stop:
            hits = [(text.find(s), s) for s in stop if s in text]
            if hits:
                at, s = min(hits)
                end = at + len(s)
                keep = next(k for k in range(1, len(body) + 1) if len(self._text(body[:k], chat_parse)) >= end)
                ids, logprobs, tops = body[:keep], logprobs[:keep], tops[:keep]
                text, finish, ended = text[:at], "stop", False
        return ChoiceOut(text=text, token_ids=ids, logprobs=logprobs, top_logprobs=tops, finish_reason=finish,
                         content=text), ended

    def _text(self, ids: list[int], keep_tags: bool) -> str:
        """Decoded text without special tokens, the tool-call parser's tags kept (they are special
        tokens in some tokenizers)."""
        if not keep_tags or self.parser is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        text = self.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
        if self._special is None:
            tok = self.tokenizer
            special = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special}
            self._special = sorted(({*special, *tok.all_special_tokens} - {""}) - set(self.parser.tags),
                                   key=len, reverse=True)
        for token in self._special:
            text = text.replace(token, "")
        return text

    def _versions(self, sample: Any, n: int) -> list[int]:
        versions = list(getattr(sample, "policy_version", None) or [])[:n]
        return versions + [versions[-1] if versions else 0] * (n - len(versions))

    def _chat(self, req: protocol.ChatRequest, session: Session | None):
        """Plan a chat call now (a bad call raises ``ProtocolError`` before any response starts);
        returns the coroutine that samples and records it: ``(prompt ids, choices)``."""
        tools_key = json.dumps(req.tools, sort_keys=True) if req.tools else None
        requested = req.max_tokens or self.params.max_tokens
        if session is not None:
            plan = session.plan_chat(self.tokenizer, req.messages, req.tools, tools_key or "", self.stop_token_ids,
                                     requested)
        else:
            from async_rl.step.agent import render_ids

            ids = render_ids(self.tokenizer, protocol.template_messages(req.messages), req.tools, True)
            plan = Plan(ids, None, 0, requested)
        return self._sample_chat(req, session, plan)

    async def _sample_chat(self, req: protocol.ChatRequest, session: Session | None,
                           plan: Plan) -> tuple[list[int], list[ChoiceOut]]:
        if plan.refused:
            session.refuse(plan.refused)
            return plan.prompt_ids, [ChoiceOut("", [], [], [], "length", content="")] * req.n
        samples = await self._sample(plan.prompt_ids, req.n, self._params(req, session), plan.max_tokens,
                                     self._seed(req, session), req.top_logprobs, session)
        choices, records = [], []
        for sample in samples:
            choice, ended = self._cut(sample, plan.max_tokens, req.stop, req.parse_tools)
            content, calls = protocol.parse_tool_calls(choice.text, self.parser if req.parse_tools else None)
            choice.content, choice.tool_calls = content, calls
            if calls:
                choice.finish_reason = "tool_calls"
            choices.append(choice)
            assistant = protocol.normalize_messages([{"role": "assistant", "content": content, "tool_calls": calls}])[0]
            records.append((choice.token_ids, choice.logprobs, self._versions(sample, len(choice.token_ids)), ended,
                            choice.content or "", assistant))
        if session is not None:
            session.record(plan, records)
        return plan.prompt_ids, choices

    def _completion(self, req: protocol.CompletionRequest, session: Session | None):
        """Plan a completions call now; returns the coroutine that samples and records it."""
        prompt_ids = (list(req.prompt) if isinstance(req.prompt, list)
                      else list(self.tokenizer(req.prompt, verbose=False)["input_ids"]))
        requested = req.max_tokens or 16  # the completions API's own default
        plan = session.plan_completion(prompt_ids, requested) if session is not None else Plan(prompt_ids, None, 0, requested)
        return self._sample_completion(req, session, plan)

    async def _sample_completion(self, req: protocol.CompletionRequest, session: Session | None,
                                 plan: Plan) -> tuple[list[int], list[ChoiceOut]]:
        prompt_ids = plan.prompt_ids
        if plan.refused:
            session.refuse(plan.refused)
            return prompt_ids, [ChoiceOut("", [], [], [], "length")] * req.n
        samples = await self._sample(prompt_ids, req.n, self._params(req, session), plan.max_tokens,
                                     self._seed(req, session), req.logprobs or 0, session)
        choices, records = [], []
        for sample in samples:
            choice, ended = self._cut(sample, plan.max_tokens, req.stop, False)
            choices.append(choice)
            records.append((choice.token_ids, choice.logprobs, self._versions(sample, len(choice.token_ids)), ended,
                            choice.text, None))
        if session is not None:
            session.record(plan, records)
        return prompt_ids, choices
