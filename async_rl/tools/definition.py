"""The ``Tool`` type and the ``@tool`` decorator, which derives a tool's JSON schema from the
function's type hints and Google-style docstring.

A tool is a Python function plus the JSON schema the model sees; ``Tool.schema()`` is one entry
of what ``tokenizer.apply_chat_template(messages, tools=...)`` takes.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Tool", "tool"]

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
