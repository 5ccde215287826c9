"""Tools for agentic rollouts: the ``Tool`` type, a registry, and a fault-tolerant executor.

A tool is a Python function plus the JSON schema the model sees. The agent loop parses tool calls
out of the generated text (``async_rl.tools.parsers``), runs them with ``ToolExecutor`` and feeds
each ``ToolResult.content`` back to the model as a ``tool`` message. Every fault of the model's
making (bad JSON, an unknown tool, wrong arguments) or of the tool's (an exception, a hang) comes
back as an observation the model can read, never as an exception in the rollout::

    from async_rl.tools import ToolCall, ToolExecutor, ToolRegistry, tool

    @tool(timeout_s=2.0)
    def add(a: int, b: int = 0) -> int:
        \"\"\"Add two integers.\"\"\"
        return a + b

    registry = ToolRegistry.from_specs(["calculator", "my_pkg.tools:search"])
    registry.register(add)
    executor = ToolExecutor(registry)
    [result] = executor.execute([ToolCall(name="add", arguments={"a": 1, "b": 2}, raw="...")])
    result.content, result.ok          # -> ("3", True)
    executor.pop_counts()              # -> {"tools/calls": 1, "tools/ok": 1}

``registry.schemas()`` is what ``tokenizer.apply_chat_template(messages, tools=...)`` takes.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import re
import threading
import time
import types
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from async_rl.registry import Registry

__all__ = [
    "BUILTIN_TOOLS",
    "register_tool",
    "ERROR_KINDS",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "load_tools",
    "tool",
]

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

# OpenAI's rule for function names; chat templates and engines' tool parsers assume it.
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

_JSON_TYPES: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    tuple: "array",
    set: "array",
    frozenset: "array",
    dict: "object",
}


@dataclass
class Tool:
    """A callable the model may invoke, with the schema that describes it to the model.

    Attributes:
        name: the name the model calls it by; 1-64 characters of ``[A-Za-z0-9_-]``.
        description: what the tool does, shown to the model.
        parameters: JSON schema of the arguments, an object schema
            ``{"type": "object", "properties": {...}, "required": [...]}``.
        fn: the function; called as ``fn(**arguments)``. Its return value is turned into text by
            the executor (str as is, dict/list via ``json.dumps``, anything else via ``str``).
        timeout_s: wall-clock seconds the executor waits for one call before it reports a
            timeout and abandons the call's thread; > 0.

    Raises:
        ValueError: (on construction) a bad name, a non-object ``parameters`` schema, a
            non-callable ``fn`` or a non-positive ``timeout_s``.
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ValueError(
                f"tool name {self.name!r} is invalid: use 1-64 characters of letters, digits, '_' "
                "and '-'"
            )
        if not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise ValueError(
                f"tool {self.name!r}: parameters must be a JSON object schema "
                '{"type": "object", "properties": {...}, "required": [...]}, got '
                f"{self.parameters!r}"
            )
        if not callable(self.fn):
            raise ValueError(f"tool {self.name!r}: fn must be callable, got {type(self.fn).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s!r}")

    def schema(self) -> dict:
        """The OpenAI-style function schema, as chat templates' ``tools=[...]`` expects.

        Returns:
            ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        """
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def __call__(self, **arguments: Any) -> Any:
        """Call ``fn(**arguments)`` directly, without the executor's fault handling."""
        return self.fn(**arguments)


def tool(
    name: str | Callable[..., Any] | None = None,
    description: str | None = None,
    parameters: dict | None = None,
    timeout_s: float = 10.0,
) -> Any:
    """Decorator that turns a function into a ``Tool``; works bare (``@tool``) or called.

    When ``parameters`` is None the schema is derived from the signature: each parameter becomes
    a property typed from its annotation (int -> integer, float -> number, str -> string,
    bool -> boolean, list/tuple/set -> array (``list[int]`` adds ``items``), dict -> object,
    ``Literal[...]`` -> enum, ``X | None`` -> X; other or missing annotations -> any type), with
    the description from a Google-style ``Args:`` docstring section when present. Parameters
    without a default are required; ``*args``/``**kwargs`` are left out of the schema.

    Args:
        name: tool name; default the function's ``__name__``. (When used bare, this is the
            function itself.)
        description: default the first paragraph of the docstring (lines joined by spaces), or
            "" without a docstring.
        parameters: explicit JSON object schema; skips the derivation.
        timeout_s: see ``Tool.timeout_s`` (seconds).

    Returns:
        A decorator ``fn -> Tool`` or, used bare, the ``Tool``.

    Raises:
        ValueError: as ``Tool`` does, e.g. for a function name that is not a valid tool name.
    """
    if callable(name):
        return tool()(name)

    def decorator(fn: Callable[..., Any]) -> Tool:
        doc = inspect.getdoc(fn) or ""
        return Tool(
            name=name or getattr(fn, "__name__", ""),
            description=description if description is not None else _first_paragraph(doc),
            parameters=parameters if parameters is not None else _schema_from_signature(fn, doc),
            fn=fn,
            timeout_s=timeout_s,
        )

    return decorator


def _first_paragraph(doc: str) -> str:
    paragraph: list[str] = []
    for line in doc.strip().splitlines():
        if not line.strip():
            break
        paragraph.append(line.strip())
    return " ".join(paragraph)


def _arg_docs(doc: str) -> dict[str, str]:
    """Parameter descriptions from a Google-style ``Args:`` section."""
    docs: dict[str, str] = {}
    lines = doc.splitlines()
    in_args, current, base_indent = False, None, None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not in_args:
            in_args = stripped in ("Args:", "Arguments:", "Parameters:")
            continue
        if not stripped:
            continue
        if base_indent is None:
            base_indent = indent
        if indent < base_indent:
            break  # the next section ("Returns:", ...) starts
        match = re.match(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
        if indent == base_indent and match:
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current is not None:
            docs[current] = f"{docs[current]} {stripped}".strip()
    return docs


def _json_schema_for(annotation: Any) -> dict:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or origin is types.UnionType:
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) == 1:
            return _json_schema_for(non_null[0])
        schemas = [_json_schema_for(a) for a in non_null]
        return {"anyOf": schemas} if all(schemas) else {}
    if origin is typing.Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {_JSON_TYPES.get(type(a)) for a in args}
        if len(kinds) == 1 and None not in kinds:
            schema["type"] = kinds.pop()
        return schema
    if origin is not None and origin in _JSON_TYPES:
        schema = {"type": _JSON_TYPES[origin]}
        if schema["type"] == "array" and len(args) == 1:
            item = _json_schema_for(args[0])
            if item:
                schema["items"] = item
        return schema
    return {"type": _JSON_TYPES[annotation]} if annotation in _JSON_TYPES else {}


def _schema_from_signature(fn: Callable[..., Any], doc: str) -> dict:
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        # Unresolvable forward references: fall back to untyped properties rather than refuse.
        hints = {}
    arg_docs = _arg_docs(doc)
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            continue
        prop = _json_schema_for(hints.get(param.name, param.annotation))
        if param.name in arg_docs:
            prop["description"] = arg_docs[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required}


# --------------------------------------------------------------------------------------------
# Registry


def _as_tools(kind: str, spec: str, obj: Any) -> list[Tool]:
    """``coerce`` of ``BUILTIN_TOOLS``: a Tool, a function, a ``ToolRegistry`` or a list of Tools
    and functions -> list of Tools."""
    if isinstance(obj, Tool):
        return [obj]
    if isinstance(obj, ToolRegistry):
        return list(obj)
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    tools: list[Tool] = []
    for item in items:
        if isinstance(item, Tool):
            tools.append(item)
        elif callable(item) and not isinstance(item, type):
            try:
                tools.append(tool(item))
            except ValueError as e:
                raise ValueError(f"{kind} spec {spec!r}: cannot wrap {item!r} as a tool: {e}") from e
        else:
            raise ValueError(
                f"{kind} spec {spec!r} names a {type(item).__name__}, not a Tool, a function or a "
                "list of them"
            )
    if not tools:
        raise ValueError(f"{kind} spec {spec!r} names an empty list")
    return tools


BUILTIN_TOOLS: Registry[list[Tool]] = Registry(
    "tool", coerce=_as_tools,
    help="A tool spec's attr is a Tool, a function (wrapped with tool()) or a list of them.")
"""Tools configs may name by short name (``agent.tools: [calculator]``): the built-ins, registered
by ``async_rl.tools`` (its ``__init__``), and whatever ``register_tool`` adds."""


def register_tool(obj: "Tool | Callable[..., Any]", name: str | None = None) -> Tool:
    """Register a tool in code so configs can name it in ``agent.tools`` like a built-in.

    Args:
        obj: a ``Tool``, or a function (wrapped with ``tool()``, schema from its type hints).
        name: the name configs use; default the tool's own name.

    Returns:
        The registered ``Tool``.

    Raises:
        ValueError: the name is taken (built-ins included).

    Example::

        @register_tool
        def lookup(key: str) -> str: ...
        # agent.tools: [lookup]

    In async mode generator actors load tools in their own processes: register in a module
    the actors import too (or name the tool by import path instead).
    """
    t = obj if isinstance(obj, Tool) else tool()(obj)
    return BUILTIN_TOOLS.register(name or t.name, t)


class ToolRegistry:
    """Name -> ``Tool`` map, in registration order (the order the model sees the schemas in).

    ``get(name)`` returns None for an unknown name (as ``dict.get``); ``registry[name]`` raises
    KeyError. Iterating yields the tools.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, tool: Tool) -> Tool:
        """Add ``tool`` and return it (so ``@registry.register`` on a ``@tool`` works).

        Raises:
            ValueError: a tool of the same name is already registered, or ``tool`` is not a Tool.
        """
        if not isinstance(tool, Tool):
            raise ValueError(f"expected a Tool, got {type(tool).__name__}; wrap functions with tool()")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict]:
        """``Tool.schema()`` of every tool, in registration order, for ``apply_chat_template``."""
        return [t.schema() for t in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; registered: {self.names()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __repr__(self) -> str:
        return f"ToolRegistry({self.names()})"

    @classmethod
    def from_specs(cls, specs: Iterable[str]) -> ToolRegistry:
        """Build a registry from tool specs (see ``load_tools``), in the given order.

        Args:
            specs: e.g. ``["calculator", "python", "my_pkg.tools:search", "tools.py:TOOLS"]``.

        Returns:
            A new registry.

        Raises:
            ValueError: a spec cannot be loaded, or two specs yield the same tool name; the
                message names the spec and the reason.
        """
        if isinstance(specs, str):
            raise ValueError(f"from_specs takes a list of specs, got the string {specs!r}")
        registry = cls()
        for spec in specs:
            for t in load_tools(spec):
                if t.name in registry:
                    raise ValueError(
                        f"tool spec {spec!r}: tool {t.name!r} is already registered by an "
                        "earlier spec"
                    )
                registry.register(t)
        return registry


def load_tools(spec: str) -> list[Tool]:
    """Load the tools one spec names.

    A spec is a registered short name (``BUILTIN_TOOLS``: "calculator", "python", and what
    ``register_tool`` added), ``builtin:<name>``, an import path ``"package.module:attr"`` or a
    file path ``"path/to/file.py:attr"``, resolved by ``async_rl.registry.Registry.get``.
    ``attr`` may be dotted and may name a ``Tool``, a function (wrapped with ``tool()``), a
    ``ToolRegistry``, or a list/tuple of Tools and functions.

    Returns:
        The tools, in order.

    Raises:
        ValueError: unknown short name, empty or malformed spec, missing module or file, an
            exception while importing the module (chained), missing attribute, or an attribute
            of the wrong kind; the message names the spec.
    """
    return BUILTIN_TOOLS.get(spec)


# --------------------------------------------------------------------------------------------
# Calls and results


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

