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

Strings inside a call's JSON may hold anything, the format's own tags included
(``{"s": "</tool_call>"}`` is one argument, not the end of the call). Parse the text exactly as
generated: tokenizers often make the tags special tokens, so decode with special tokens kept
(``ToolCallParser.tags`` lists them).

Pick one by name with ``get_parser("hermes")``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable

from async_rl.tools.executor import ToolCall

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
        tags: the format's markup (``"<tool_call>"``, ...). Tokenizers often hold these as special
            tokens, so the text to parse must be decoded with special tokens kept; the agent
            removes them (and every other special token) from the answer the reward scores.
    """

    stop_strings: tuple[str, ...]
    tags: tuple[str, ...]

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
            decoded = _loads(value)
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

    - the JSON value after ``<tool_call>`` is read as JSON, so strings in it may hold anything,
      the tags included (``{"s": "</tool_call>"}``); when only whitespace separates it from
      ``</tool_call>`` it is the call;
    - the text ran out before the JSON value or its ``</tool_call>`` ended -> ``error="truncated"``
      (typically cut by the length limit; its JSON may be complete or not);
    - otherwise the block is the text up to the first ``</tool_call>`` (stripped) and is invalid
      JSON -> ``"malformed_json"``; a block interrupted by the next ``<tool_call>`` ->
      ``"malformed_json"`` (the call after it is still found);
    - not an object, or no string ``"name"`` -> ``"no_name"``; arguments as in
      ``decode_arguments``.

    Content is the text outside the blocks: each piece stripped, empty pieces dropped, joined with
    "\\n". A stray ``</tool_call>`` without an opening tag stays in the content.

    Example: ``'Sure.\\n<tool_call>\\n{"name": "f", "arguments": {"s": "a</tool_call>"}}\\n</tool_call>'``
    -> content ``"Sure."``, one call ``f({"s": "a</tool_call>"})``.

    Args:
        stop_at_first_call: set ``stop_strings`` to ``("</tool_call>",)`` so each turn carries at
            most one call; by default () (parallel calls; the turn ends at ``<|im_end|>``).
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, stop_at_first_call: bool = False) -> None:
        self.stop_strings: tuple[str, ...] = (self.close_tag,) if stop_at_first_call else ()
        self.tags: tuple[str, ...] = (self.open_tag, self.close_tag)

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
            read = self._read_block(text, body)
            if read is not None:
                call, pos = read
                calls.append(call)
                continue
            # Not a JSON value closed by the tag: the block is the text up to the first tag.
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

    def _read_block(self, text: str, body: int) -> tuple[ToolCall, int] | None:
        """The call whose JSON value starts at ``body`` (after whitespace) and the position after
        it, the value read as JSON so that tags inside its strings are text; None when the value
        is not valid JSON followed by the closing tag and was not cut off by the end of the text."""
        start = _skip_space(text, body)
        try:
            obj, end = _raw_decode(text, start)
        except json.JSONDecodeError as e:
            # An error at the end of the text, or a string never closed, is JSON cut off; any
            # other error is judged on the block up to the closing tag (the model botched the JSON).
            if e.pos < len(text) and not e.msg.startswith("Unterminated string"):
                return None
            raw = text[body:].strip()
            detail = f"the text ends inside the JSON after {self.open_tag} (the output was probably cut off)"
            return ToolCall(_peek_name(raw), None, raw, "truncated", detail), len(text)
        after = _skip_space(text, end)
        if text.startswith(self.close_tag, after):
            return call_from_object(obj, text[start:end]), after + len(self.close_tag)
        if after == len(text):
            raw = text[start:end]
            detail = f"{self.open_tag} has no closing {self.close_tag} (the output was probably cut off)"
            return ToolCall(_peek_name(raw), None, raw, "truncated", detail), len(text)
        return None

    @staticmethod
    def _decode(raw: str) -> ToolCall:
        try:
            obj = _loads(raw)
        except json.JSONDecodeError as e:
            return ToolCall(_peek_name(raw), None, raw, "malformed_json", _where(e))
        return call_from_object(obj, raw)


_DECODER = json.JSONDecoder()


def _raw_decode(text: str, pos: int = 0) -> tuple[Any, int]:
    """``json.JSONDecoder.raw_decode`` of ``text`` from ``pos``, with JSON nested deeper than the
    decoder's recursion allows (``[[[[...``: a model's output can be anything) raised as the
    ``json.JSONDecodeError`` it is to the caller, at ``pos``, rather than as ``RecursionError``.

    Raises:
        json.JSONDecodeError: not a JSON value at ``pos``, or one nested too deeply.
    """
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise json.JSONDecodeError("JSON nested too deeply", text, pos) from None


def _loads(text: str) -> Any:
    """``json.loads`` with the same treatment of deep nesting as ``_raw_decode``.

    Raises:
        json.JSONDecodeError: not one JSON value, or one nested too deeply.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("JSON nested too deeply", text, 0) from None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _peek_name(raw: str) -> str | None:
    """Best-effort tool name from an unparseable call, so the error message can name the tool."""
    key = raw.find('"name"')
    if key < 0:
        return None
    colon = raw.find(":", key + len('"name"'))
    if colon < 0:
        return None
    try:
        name, _ = _raw_decode(raw[colon + 1 :].lstrip())
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) and name else None


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}``.

    Several calls may follow each other, separated by whitespace or ";". The message (stripped,
    after an optional leading ``<|python_tag|>``) counts as calls only if it starts with
    ``{"name"``-like JSON: an object holding "name" and "parameters"/"arguments". Anything else is
    returned as content with no calls, so a plain JSON answer is not mistaken for a call (text
    before the JSON makes the whole message content). JSON that starts like a call (holds
    ``"name"``) but does not decode, first or after other calls -> a ``"malformed_json"`` call
    that takes the rest of the message. Text left after the last call is returned as content.
    Strings inside the JSON may hold anything (tags, ";", unicode).
    """

    python_tag = "<|python_tag|>"

    def __init__(self) -> None:
        self.stop_strings: tuple[str, ...] = ()
        self.tags: tuple[str, ...] = (self.python_tag,)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """See the class docstring. Never raises for any input string."""
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        if not body.startswith("{"):
            return text.strip(), []
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = _raw_decode(body, pos)
            except json.JSONDecodeError as e:
                if body[pos] == "{" and '"name"' in body[pos:]:
                    raw = body[pos:].strip()
                    return "", calls + [ToolCall(_peek_name(raw), None, raw, "malformed_json", _where(e))]
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
