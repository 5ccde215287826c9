"""Running tool calls: ``ToolCall`` (parsed from the model's text), ``ToolResult`` (what goes back
to the model) and ``ToolExecutor``, which runs calls concurrently under per-tool timeouts and
turns every fault into an ``Error: ...`` observation and a counter, never an exception.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from async_rl.tools.definition import Tool
from async_rl.tools.registry import ToolRegistry

__all__ = ["ERROR_KINDS", "ToolCall", "ToolExecutor", "ToolResult"]

# The fault classes a ToolResult can report; counters are named "tools/error_<kind>".
ERROR_KINDS = (
    "malformed_json",
    "truncated",
    "not_an_object",
    "unknown_tool",
    "bad_arguments",
    "tool_error",
    "timeout",
    "no_name",
)


@dataclass
class ToolCall:
    """One tool call as parsed from the model's text.

    Attributes:
        name: the tool name, or None when the call has none (or could not be parsed).
        arguments: the decoded arguments object; None when the call is faulty.
        raw: the text inside the call markers, as generated.
        error: None for a well-formed call, else the fault kind from the parser
            ("malformed_json", "truncated", "not_an_object", "no_name").
        detail: a short human-readable explanation of ``error`` (e.g. the JSON decoder's
            message); shown to the model.
    """

    name: str | None
    arguments: dict | None
    raw: str = ""
    error: str | None = None
    detail: str = ""


@dataclass
class ToolResult:
    """The outcome of one call, in the order of the calls.

    Attributes:
        name: the called tool's name (None when the call had none).
        content: the text that goes back to the model: the tool's output, or "Error: ..." text.
        ok: True when the tool ran and returned.
        error_kind: None when ``ok``, else one of ``ERROR_KINDS``.
        elapsed_s: wall-clock seconds the tool ran (0.0 for calls rejected before running; the
            time waited for a timed-out call).
    """

    name: str | None
    content: str
    ok: bool
    error_kind: str | None = None
    elapsed_s: float = 0.0


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    if value is None:
        return ""
    return str(value)


def _describe_parameters(t: Tool) -> str:
    props = t.parameters.get("properties", {}) or {}
    required = set(t.parameters.get("required", []) or [])
    if not props:
        return "it takes no arguments"
    parts = []
    for pname, pschema in props.items():
        kind = pschema.get("type", "any") if isinstance(pschema, dict) else "any"
        parts.append(f"{pname} ({kind}, {'required' if pname in required else 'optional'})")
    return "expected: " + ", ".join(parts)


def _binding_problems(signature: inspect.Signature, arguments: dict, error: TypeError) -> str:
    """All unexpected and missing arguments at once (``bind`` reports only the first)."""
    params = signature.parameters.values()
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unexpected = [] if takes_any else [k for k in arguments if k not in named]
    missing = [
        p.name for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and p.default is p.empty and p.name not in arguments
    ]
    problems = []
    if unexpected:
        problems.append("unexpected argument(s) " + ", ".join(repr(k) for k in unexpected))
    if missing:
        problems.append("missing required argument(s) " + ", ".join(repr(k) for k in missing))
    return "; ".join(problems) or str(error)


class _Job:
    """One call running on its own daemon thread."""

    def __init__(self, index: int, t: Tool, arguments: dict) -> None:
        self.index = index
        self.tool = t
        self.arguments = arguments
        self.done = False
        self.value: str | None = None
        self.exc: BaseException | None = None
        self.start_s = 0.0
        self.end_s = 0.0

    def start(self, cond: threading.Condition) -> None:
        self.start_s = time.monotonic()
        thread = threading.Thread(
            target=self._run, args=(cond,), name=f"tool-{self.tool.name}", daemon=True
        )
        thread.start()

    @property
    def deadline_s(self) -> float:
        return self.start_s + self.tool.timeout_s

    def _run(self, cond: threading.Condition) -> None:
        try:
            value = _to_text(self.tool.fn(**self.arguments))
        except BaseException as e:  # noqa: BLE001 - a tool's SystemExit must not hang the call
            value, exc = None, e
        else:
            exc = None
        with cond:
            self.value, self.exc = value, exc
            self.end_s = time.monotonic()
            self.done = True
            cond.notify_all()


class ToolExecutor:
    """Runs parsed tool calls against a registry; turns every fault into an observation.

    Each well-formed call runs on its own daemon thread, at most ``max_workers`` of one
    ``execute`` call at a time. A call past its tool's ``timeout_s`` is reported as a timeout
    at that moment and its thread is abandoned (Python cannot kill threads; being a daemon it
    never blocks interpreter exit, and its late result is dropped). ``abandoned_threads``
    counts them so a leak shows up. Daemon threads rather than ``ThreadPoolExecutor``: a pool
    worker stuck in a hung tool would stay occupied, so later calls would queue behind it and
    time out without having run, and the interpreter would wait for it at exit.

    Args:
        registry: the tools; read at each ``execute`` so later registrations are seen.
        max_workers: most calls of one ``execute`` running at once; >= 1.

    Raises:
        ValueError: ``max_workers`` < 1.
    """

    def __init__(self, registry: ToolRegistry, max_workers: int = 4) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.registry = registry
        self.max_workers = max_workers
        self.abandoned_threads = 0
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._signatures: dict[int, tuple[Callable[..., Any], inspect.Signature | None]] = {}

    def execute(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently; return one result per call, in call order.

        Never raises for a fault in a call or a tool: malformed/truncated JSON, non-object
        arguments, a missing name, an unknown tool, arguments the function's signature does not
        accept (checked with ``inspect.signature(fn).bind`` before calling), an exception in the
        tool (type and message, no traceback) and a timeout each give
        ``ToolResult(ok=False, content="Error: ...", error_kind=...)``.

        Args:
            calls: parsed calls, e.g. from ``HermesParser.parse``.

        Returns:
            ``len(calls)`` results; the wall time of the whole call is about the longest single
            call (bounded by its ``timeout_s``) when no more than ``max_workers`` run.
        """
        results: list[ToolResult | None] = [None] * len(calls)
        jobs: list[_Job] = []
        for index, call in enumerate(calls):
            prepared = self._prepare(call)
            if isinstance(prepared, ToolResult):
                results[index] = prepared
            else:
                jobs.append(_Job(index, *prepared))
        if jobs:
            self._run(jobs, results)
        done = [r for r in results if r is not None]
        assert len(done) == len(calls)
        self._count(done)
        return done

    async def execute_async(self, calls: list[ToolCall]) -> list[ToolResult]:
        """``execute`` on a worker thread, for asyncio agent loops (same return, never raises)."""
        return await asyncio.to_thread(self.execute, calls)

    def counts(self) -> dict[str, int]:
        """Counters since the last ``pop_counts``: ``tools/calls``, ``tools/ok`` and
        ``tools/error_<kind>`` for each kind seen (a copy; thread-safe)."""
        with self._lock:
            return dict(self._counts)

    def pop_counts(self) -> dict[str, int]:
        """Return the counters and reset them to zero, atomically."""
        with self._lock:
            counts = dict(self._counts)
            self._counts.clear()
            return counts

    def restore_counts(self, counts: dict[str, int]) -> None:
        """Add counters taken by ``pop_counts`` back (after a block counted apart)."""
        with self._lock:
            self._counts.update({k: int(v) for k, v in counts.items()})

    # ----------------------------------------------------------------------------------------

    def _count(self, results: list[ToolResult]) -> None:
        with self._lock:
            for r in results:
                self._counts["tools/calls"] += 1
                self._counts["tools/ok" if r.ok else f"tools/error_{r.error_kind}"] += 1

    def _available(self) -> str:
        return ", ".join(self.registry.names()) or "(none)"

    def _prepare(self, call: ToolCall) -> tuple[Tool, dict] | ToolResult:
        """The (tool, arguments) to run, or the error result for a call that cannot run."""
        name = call.name

        def fail(kind: str, message: str) -> ToolResult:
            return ToolResult(name=name, content=f"Error: {message}", ok=False, error_kind=kind)

        detail = f": {call.detail}" if call.detail else ""
        if call.error == "truncated":
            return fail(
                "truncated",
                f"the tool call is incomplete{detail}. It was not run; write the whole call again.",
            )
        if call.error == "malformed_json":
            return fail(
                "malformed_json",
                f"the tool call is not valid JSON{detail}. Write it as "
                '{"name": "<tool name>", "arguments": {<argument>: <value>, ...}}.',
            )
        if call.error == "no_name" or (call.error is None and not isinstance(name, str)):
            return fail(
                "no_name",
                f"the tool call has no tool name{detail}. Available tools: {self._available()}.",
            )
        if call.error == "not_an_object" or (
            call.error is None and call.arguments is not None and not isinstance(call.arguments, dict)
        ):
            return fail(
                "not_an_object",
                f"the arguments of tool {name!r} must be a JSON object mapping parameter names to "
                f"values{detail or f', got {type(call.arguments).__name__}'}.",
            )
        if call.error is not None:
            return fail(call.error, f"bad tool call ({call.error}){detail}.")
        t = self.registry.get(name)  # type: ignore[arg-type]
        if t is None:
            return fail("unknown_tool", f"unknown tool {name!r}. Available tools: {self._available()}.")
        arguments = dict(call.arguments or {})
        signature = self._signature(t)
        if signature is not None:
            try:
                signature.bind(**arguments)
            except TypeError as e:
                return fail(
                    "bad_arguments",
                    f"invalid arguments for tool {name!r}: "
                    f"{_binding_problems(signature, arguments, e)}; {_describe_parameters(t)}.",
                )
        return t, arguments

    def _signature(self, t: Tool) -> inspect.Signature | None:
        # Keyed by id (a callable object may be unhashable), checked by identity (ids get reused).
        cached = self._signatures.get(id(t.fn))
        if cached is not None and cached[0] is t.fn:
            return cached[1]
        try:
            signature: inspect.Signature | None = inspect.signature(t.fn)
        except (TypeError, ValueError):
            # Some C callables have no introspectable signature: let the call itself decide.
            signature = None
        self._signatures[id(t.fn)] = (t.fn, signature)
        return signature

    def _run(self, jobs: list[_Job], results: list[ToolResult | None]) -> None:
        cond = threading.Condition()
        waiting = collections.deque(jobs)
        running: list[_Job] = []
        with cond:
            while waiting or running:
                while waiting and len(running) < self.max_workers:
                    job = waiting.popleft()
                    job.start(cond)
                    running.append(job)
                now = time.monotonic()
                still_running = []
                for job in running:
                    if job.done:
                        results[job.index] = self._finished(job)
                    elif now >= job.deadline_s:
                        results[job.index] = self._timed_out(job, now)
                    else:
                        still_running.append(job)
                running = still_running
                if running and not (waiting and len(running) < self.max_workers):
                    cond.wait(timeout=max(0.0, min(j.deadline_s for j in running) - now))

    def _finished(self, job: _Job) -> ToolResult:
        name, elapsed = job.tool.name, job.end_s - job.start_s
        if job.exc is not None:
            message = str(job.exc).strip()
            text = type(job.exc).__name__ + (f": {message}" if message else "")
            content = f"Error: tool {name!r} failed: {text}"
            return ToolResult(name, content, False, "tool_error", elapsed)
        return ToolResult(name, job.value or "", True, None, elapsed)

    def _timed_out(self, job: _Job, now: float) -> ToolResult:
        with self._lock:
            self.abandoned_threads += 1
        name = job.tool.name
        return ToolResult(
            name,
            f"Error: tool {name!r} did not finish within its time limit of {job.tool.timeout_s:g} s "
            "and was stopped.",
            False,
            "timeout",
            now - job.start_s,
        )
