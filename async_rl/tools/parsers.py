"""Tool-call parsers: find the tool calls in an assistant message's text.

A parser turns the generated text into ``(content, calls)``: the text outside the calls, and one
``ToolCall`` per call found. Faulty calls are returned too, with ``ToolCall.error`` set, so the
executor can tell the model what was wrong instead of silently dropping the call.

Formats:

- ``"hermes"`` (Qwen2.5, Qwen3, Hermes; what Qwen's chat template teaches)::

      Let me compute that.
      <tool_call>
      {"name": "calculator", "arguments": {"expression": "12*34+28"}}
      </tool_call>
      <tool_call>
      {"name": "python", "arguments": {"code": "print(2**10)"}}
      </tool_call>

  -> content ``"Let me compute that."``, two calls.

- ``"llama3_json"`` (Llama 3.1-3.3 JSON tool calling): the whole message is one or more JSON
  objects ``{"name": ..., "parameters": {...}}`` separated by whitespace or ";", optionally after
  ``<|python_tag|>``; a message that does not start like that is plain content.

Pick one by name with ``get_parser("hermes")``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from async_rl.tools.base import ToolCall

__all__ = [
    "PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "ToolCallParser",
    "call_from_object",
    "decode_arguments",
    "get_parser",
]


@runtime_checkable
class ToolCallParser(Protocol):
    """What the agent loop needs from a tool-call format.

    Attributes:
        stop_strings: strings at which generation of a tool-calling turn should stop (pass them to
            the engine, keeping them in the output: vLLM ``include_stop_str_in_output=True``);
            empty when the turn ends with the model's own end-of-turn token.
    """

    stop_strings: tuple[str, ...]

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split an assistant message into (content outside the calls, calls in order)."""
        ...


def _json_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def decode_arguments(value: Any) -> tuple[dict | None, str | None, str]:
    """Normalise a call's ``arguments`` value.

    Models emit arguments as an object, as a JSON string holding an object (the OpenAI wire
    format), or leave them out for tools without parameters.

    Args:
        value: the decoded ``"arguments"`` value (None when the key is missing).

    Returns:
        ``(arguments, error, detail)``: ``arguments`` is a dict when ``error`` is None.
        None / missing / "" (or whitespace) -> ``{}``; an object -> itself; a string -> decoded,
        ``"malformed_json"`` if it is not JSON, ``"not_an_object"`` if it decodes to anything but
        an object; a list, number or boolean -> ``"not_an_object"``.
    """
    if value is None:
        return {}, None, ""
    if isinstance(value, dict):
        return value, None, ""
    if isinstance(value, str):
        if not value.strip():
            return {}, None, ""
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError as e:
            return None, "malformed_json", f"the arguments string is not valid JSON ({_where(e)})"
        if isinstance(decoded, dict):
            return decoded, None, ""
        return None, "not_an_object", f"the arguments string holds a JSON {_json_kind(decoded)}"
    return None, "not_an_object", f"got a JSON {_json_kind(value)}"


def _where(e: json.JSONDecodeError) -> str:
    return f"{e.msg} at line {e.lineno} column {e.colno}"


def call_from_object(obj: Any, raw: str) -> ToolCall:
    """Build a ``ToolCall`` from the decoded call JSON ``{"name": ..., "arguments": ...}``.

    ``"parameters"`` is accepted in place of ``"arguments"`` (Llama-style output); see
    ``decode_arguments`` for the accepted argument forms.

    Returns:
        A well-formed call, or one with ``error`` "no_name" (not an object, or no non-empty
        string name), "malformed_json" or "not_an_object" (bad arguments).
    """
    if not isinstance(obj, dict):
        detail = f"expected a JSON object, got a JSON {_json_kind(obj)}"
        return ToolCall(None, None, raw, "no_name", detail)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(None, None, raw, "no_name", 'the object has no string "name"')
    value = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    arguments, error, detail = decode_arguments(value)
    return ToolCall(name.strip(), arguments, raw, error, detail)


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks anywhere in the text (Qwen2.5 / Hermes format).

    Rules, per block:

    - the text between the markers (stripped) is decoded with ``json.loads``; invalid JSON ->
      ``error="malformed_json"``;
    - a ``<tool_call>`` with no closing tag before the end of the text -> ``error="truncated"``
      (typically cut by the length limit; its JSON may be complete or not); one whose block is
      interrupted by the next ``<tool_call>`` -> ``"malformed_json"``;
    - not an object, or no string ``"name"`` -> ``"no_name"``; arguments as in
      ``decode_arguments``.

    Content is the text outside the blocks: each piece stripped, empty pieces dropped, joined with
    "\\n". A stray ``</tool_call>`` without an opening tag stays in the content.

    Args:
        stop_at_first_call: set ``stop_strings`` to ``("</tool_call>",)`` so each turn carries at
            most one call; by default () (parallel calls; the turn ends at ``<|im_end|>``).
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, stop_at_first_call: bool = False) -> None:
        self.stop_strings: tuple[str, ...] = (self.close_tag,) if stop_at_first_call else ()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """See the class docstring. Never raises for any input string."""
        pieces: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                pieces.append(text[pos:])
                break
            pieces.append(text[pos:start])
            body = start + len(self.open_tag)
            end = text.find(self.close_tag, body)
            next_open = text.find(self.open_tag, body)
            if end >= 0 and not (0 <= next_open < end):
                raw = text[body:end].strip()
                calls.append(self._decode(raw))
                pos = end + len(self.close_tag)
            elif next_open >= 0:
                raw = text[body:next_open].strip()
                calls.append(
                    ToolCall(
                        _peek_name(raw), None, raw, "malformed_json",
                        f"{self.open_tag} is not closed by {self.close_tag} before the next "
                        f"{self.open_tag}",
                    )
                )
                pos = next_open
            else:
                raw = text[body:].strip()
                calls.append(
                    ToolCall(
                        _peek_name(raw), None, raw, "truncated",
                        f"{self.open_tag} has no closing {self.close_tag} (the output was probably "
                        "cut off)",
                    )
                )
                pos = len(text)
                break
        content = "\n".join(p.strip() for p in pieces if p.strip())
        return content, calls

    @staticmethod
    def _decode(raw: str) -> ToolCall:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            return ToolCall(_peek_name(raw), None, raw, "malformed_json", _where(e))
        return call_from_object(obj, raw)


def _peek_name(raw: str) -> str | None:
    """Best-effort tool name from an unparseable call, so the error message can name the tool."""
    key = raw.find('"name"')
    if key < 0:
        return None
    colon = raw.find(":", key + len('"name"'))
    if colon < 0:
        return None
    try:
        name, _ = json.JSONDecoder().raw_decode(raw[colon + 1 :].lstrip())
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and name else None


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}``.

    Several calls may follow each other, separated by whitespace or ";". The message (stripped,
    after an optional leading ``<|python_tag|>``) counts as calls only if it starts with
    ``{"name"``-like JSON: an object holding "name" and "parameters"/"arguments". Anything else is
    returned as content with no calls, so a plain JSON answer is not mistaken for a call. JSON
    that starts like a call but does not decode -> one ``"malformed_json"`` call. Text left after
    the last call is returned as content.
    """

    python_tag = "<|python_tag|>"

    def __init__(self) -> None:
        self.stop_strings: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """See the class docstring. Never raises for any input string."""
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        if not body.startswith("{"):
            return text.strip(), []
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as e:
                if not calls and '"name"' in body[pos:]:
                    raw = body[pos:].strip()
                    return "", [ToolCall(_peek_name(raw), None, raw, "malformed_json", _where(e))]
                break
            is_call = isinstance(obj, dict) and "name" in obj
            if not (is_call and ("parameters" in obj or "arguments" in obj)):
                break
            calls.append(call_from_object(obj, body[pos:end]))
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        if not calls:
            return text.strip(), []
        return body[pos:].strip(), calls


PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}


def get_parser(name: str, **kwargs: Any) -> ToolCallParser:
    """A new parser of the format ``name``.

    Args:
        name: a key of ``PARSERS`` ("hermes", "llama3_json").
        **kwargs: passed to the parser's constructor (e.g. ``stop_at_first_call=True``).

    Returns:
        The parser instance.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name](**kwargs)
