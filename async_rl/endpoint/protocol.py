"""The OpenAI wire format of the endpoint: requests read and checked, responses built from the
``openai`` package's own types.

Requests are read into ``ChatRequest`` / ``CompletionRequest`` (the fields the OpenAI API
reference defines for ``POST /v1/chat/completions`` and ``POST /v1/completions``). A field that
would change what is sampled in a way the engines cannot do (``logit_bias``, penalties,
``response_format``, a forced ``tool_choice``) is refused with one line naming it, never ignored.
Fields that only describe the caller (``user``, ``metadata``, ``store``, ``parallel_tool_calls``)
are accepted and have no effect.

Responses are ``openai.types.chat.ChatCompletion``, ``ChatCompletionChunk``,
``openai.types.Completion`` and ``openai.types.Model`` objects, built field by field and dumped to
JSON, so their schema is the client library's by construction. Besides the OpenAI fields, a
request may ask for the token ids (``return_token_ids: true``, as vLLM's server names it; from the
``openai`` client, ``extra_body={"return_token_ids": True}``): each choice then carries
``token_ids`` and the response ``prompt_token_ids``.

Tool calls: the assistant turn's text is parsed with the run's tool-call parser
(``async_rl.tools.parsers``, ``hermes`` by default); calls become ``tool_calls`` with JSON-string
``arguments`` and the finish reason ``tool_calls``; the text outside the calls is ``content``
(``None`` when empty). A call the parser flags as faulty (malformed JSON, cut off) is left in the
content as text, as the model wrote it.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from async_rl.tools.parsers import ToolCallParser

__all__ = ["ProtocolError", "ChatRequest", "CompletionRequest", "ChoiceOut", "parse_chat_request",
           "parse_completion_request", "chat_completion", "chat_chunks", "completion", "completion_chunks",
           "model_list", "stream_opening",
           "normalize_messages", "template_messages", "error_body"]

MAX_N = 64
"""Most choices one request may ask for."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token (the OpenAI API's own limit)."""

_ID_PREFIX = secrets.token_hex(6)
_ID_COUNTER = itertools.count()


def new_id(kind: str) -> str:
    """A response's or tool call's id (``chatcmpl-…``, ``cmpl-…``, ``call_…``): unique in the
    process and across processes (a random prefix drawn at import, then a counter). Not secret, so
    not drawn from the OS per response: that draw showed in the endpoint thread's profile, paid
    hundreds of times a step."""
    return f"{kind}{_ID_PREFIX}{next(_ID_COUNTER):010x}"


class ProtocolError(ValueError):
    """A request the endpoint refuses (HTTP ``status``; the message is the OpenAI error's message).

    Attributes:
        status: the HTTP status (400 bad request, 401 unauthorized, 404 unknown session, 409 a
            session that ended, 500 the engine failed).
        param: the request field at fault, if any.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(e: ProtocolError) -> dict[str, Any]:
    """The OpenAI error object of ``e``: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            409: "invalid_request_error"}.get(e.status, "server_error")
    return {"error": {"message": str(e), "type": kind, "param": e.param, "code": None}}


@dataclass
class _Sampling:
    """The sampling fields both endpoints share (already checked)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


@dataclass
class ChatRequest(_Sampling):
    """A checked ``/v1/chat/completions`` request.

    Attributes:
        messages: the conversation, normalized (``normalize_messages``).
        tools: the function schemas offered (OpenAI ``tools`` entries), or ``None``.
        parse_tools: whether tool calls are parsed from the answer (``tool_choice`` is not ``none``).
        logprobs: return each sampled token's log-prob.
        top_logprobs: alternatives per token (0-20; needs ``logprobs``).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class CompletionRequest(_Sampling):
    """A checked ``/v1/completions`` request.

    Attributes:
        prompt: the prompt text, or its token ids (a list of ints).
        logprobs: alternatives per token to return (``None``: no log-probs; 0: the sampled
            token's only; at most 20 alternatives besides it).
        echo: refused (the prompt's own log-probs are not computed).
    """

    prompt: str | list[int] = ""
    logprobs: int | None = None


def _number(body: dict, key: str, kind: type, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise ProtocolError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    value = kind(value)
    if low is not None and (value <= low if low_open else value < low):
        raise ProtocolError(f"{key} must be {'>' if low_open else '>='} {low}, got {value}", param=key)
    if high is not None and value > high:
        raise ProtocolError(f"{key} must be <= {high}, got {value}", param=key)
    return value


def _sampling(body: dict, out: _Sampling) -> None:
    for key, default in (("frequency_penalty", 0), ("presence_penalty", 0)):
        if body.get(key) not in (None, default, 0.0):
            raise ProtocolError(f"{key} is not supported (a penalty changes the sampling distribution the "
                                "learner scores against); leave it 0", param=key)
    for key in ("logit_bias", "suffix", "prediction", "audio", "functions", "function_call", "web_search_options"):
        if body.get(key):
            raise ProtocolError(f"{key} is not supported by this endpoint", param=key)
    if body.get("best_of") not in (None, 1):
        raise ProtocolError("best_of is not supported (ask for n choices instead)", param="best_of")
    fmt = body.get("response_format")
    if fmt not in (None, {}) and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ProtocolError("response_format other than text is not supported (constrained decoding would sample "
                            "from a distribution the learner does not score)", param="response_format")
    if body.get("modalities") not in (None, ["text"]):
        raise ProtocolError("only the text modality is supported", param="modalities")
    out.n = _number(body, "n", int, 1, MAX_N) or 1
    out.temperature = _number(body, "temperature", float, 0.0, 2.0)
    out.top_p = _number(body, "top_p", float, 0.0, 1.0, low_open=True)
    max_tokens = _number(body, "max_completion_tokens", int, 1)
    out.max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", int, 1)
    out.seed = _number(body, "seed", int)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                             or len(stop) > 4):
        raise ProtocolError("stop must be a non-empty string or a list of at most 4 of them", param="stop")
    out.stop = list(stop or [])
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ProtocolError(f"stream must be a boolean, got {stream!r}", param="stream")
    out.stream = bool(stream)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ProtocolError("stream_options must be an object", param="stream_options")
    out.include_usage = bool(options.get("include_usage", False))
    out.return_token_ids = bool(body.get("return_token_ids", False))


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as one string: a string, ``None``, or a list of ``text`` parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProtocolError(f"{where}.content holds a {kind!r} part; only text parts are supported",
                                    param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ProtocolError(f"{where}.content must be a string or a list of text parts", param="messages")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation in one canonical form, so two spellings of the same history compare equal.

    Each message keeps ``role`` and ``content`` (text parts joined; ``None`` where an assistant
    message has only tool calls), an assistant's ``tool_calls`` as ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]`` with ``arguments`` a JSON string (re-serialized
    canonically when it is valid JSON), a tool message's ``tool_call_id`` (and ``name`` if given).

    Raises:
        ProtocolError: not a non-empty list of messages with known roles and text content.
    """
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    out = []
    for k, m in enumerate(messages):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise ProtocolError(f"{where} must have role system, developer, user, assistant or tool", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        content = _text_of(m.get("content"), where)
        msg: dict[str, Any] = {"role": role, "content": content}
        if role != "assistant" and content is None:
            raise ProtocolError(f"{where} ({role}) has no content", param="messages")
        if role == "assistant":
            calls = []
            for c in m.get("tool_calls") or []:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ProtocolError(f"{where}.tool_calls entries must have function.name", param="messages")
                arguments = fn.get("arguments", "{}")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments)
                try:
                    arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
                except json.JSONDecodeError:
                    pass  # kept as sent: the model's own malformed call, echoed back
                calls.append({"id": c.get("id") or "", "type": "function",
                              "function": {"name": fn["name"], "arguments": arguments}})
            if calls:
                msg["tool_calls"] = calls
            elif content is None:
                msg["content"] = ""
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
        out.append(msg)
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat templates expect them: tool-call ``arguments`` as objects
    (Qwen's and Llama's templates serialize them with ``tojson``), ``content`` never ``None``."""
    out = []
    for m in messages:
        t = dict(m)
        if t.get("content") is None:
            t["content"] = ""
        if "tool_calls" in t:
            calls = []
            for c in t["tool_calls"]:
                try:
                    arguments = json.loads(c["function"]["arguments"])
                except json.JSONDecodeError:
                    arguments = c["function"]["arguments"]
                calls.append({"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": arguments}})
            t["tool_calls"] = calls
        out.append(t)
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    """A checked chat request from the JSON body.

    Raises:
        ProtocolError: a field out of range or unsupported (the message names it).
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    out = ChatRequest()
    _sampling(body, out)
    out.messages = normalize_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                                  and isinstance(t.get("function"), dict)
                                                  and isinstance(t["function"].get("name"), str) for t in tools):
            raise ProtocolError("tools must be a list of {type: function, function: {name, ...}}", param="tools")
        out.tools = tools or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ProtocolError("tool_choice must be auto or none (a forced tool call cannot be sampled from the "
                            "policy as it is)", param="tool_choice")
    out.parse_tools = choice != "none"
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise ProtocolError(f"logprobs must be a boolean, got {logprobs!r}", param="logprobs")
    out.logprobs = bool(logprobs)
    out.top_logprobs = _number(body, "top_logprobs", int, 0, MAX_TOP_LOGPROBS) or 0
    if out.top_logprobs and not out.logprobs:
        raise ProtocolError("top_logprobs needs logprobs: true", param="top_logprobs")
    return out


def parse_completion_request(body: Any) -> CompletionRequest:
    """A checked completions request from the JSON body (one prompt: a string or token ids).

    Raises:
        ProtocolError: a field out of range or unsupported, a batch of prompts, ``echo``.
    """
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    out = CompletionRequest()
    _sampling(body, out)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        out.prompt = list(prompt)
    elif isinstance(prompt, str):
        out.prompt = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return parse_completion_request({**body, "prompt": prompt[0]})
    else:
        raise ProtocolError("prompt must be a string or a list of token ids (one prompt per request)",
                            param="prompt")
    if body.get("echo"):
        raise ProtocolError("echo is not supported", param="echo")
    out.logprobs = _number(body, "logprobs", int, 0, MAX_TOP_LOGPROBS)
    return out


@dataclass
class ChoiceOut:
    """One finished choice, as the endpoint answers it.

    Attributes:
        text: the answer's text (special tokens removed; cut before a ``stop`` string).
        token_ids: the sampled ids kept (through the token that completed a stop string).
        logprobs: behavior log-prob of each kept id (nats).
        top_logprobs: per kept id, ``[(id, log-prob), ...]`` alternatives, or empty.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        content: chat: the text outside tool calls (``None`` when empty and there are calls).
        tool_calls: chat: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``.
    """

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def parse_tool_calls(text: str, parser: ToolCallParser | None) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of an assistant turn's text in the OpenAI form; a call the parser
    flags as faulty stays in the content as written (the caller sees what the model wrote)."""
    if parser is None:
        return text, []
    content, calls = parser.parse(text)
    good = [c for c in calls if c.error is None]
    if not good:
        return text, []
    if len(good) != len(calls):
        content = text  # a faulty call among good ones: the whole turn is shown as text
        return content, []
    out = [{"id": new_id("call_"), "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in good]
    return (content or None), out


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tokenizer, choice: ChoiceOut, top: int):
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion_token_logprob import TopLogprob

    out = []
    for k, (tid, lp) in enumerate(zip(choice.token_ids, choice.logprobs)):
        text = _token_text(tokenizer, tid)
        alts = choice.top_logprobs[k][:top] if choice.top_logprobs and top else []
        out.append(ChatCompletionTokenLogprob(
            token=text, bytes=list(text.encode()), logprob=lp,
            top_logprobs=[TopLogprob(token=(t := _token_text(tokenizer, a)), bytes=list(t.encode()), logprob=alp)
                          for a, alp in alts]))
    return out


def _usage(prompt_tokens: int, choices: list[ChoiceOut]):
    from openai.types import CompletionUsage

    completion_tokens = sum(len(c.token_ids) for c in choices)
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def chat_completion(req: ChatRequest, choices: list[ChoiceOut], prompt_ids: list[int], model: str,
                    tokenizer) -> dict[str, Any]:
    """The ``ChatCompletion`` JSON of finished ``choices``."""
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
    from openai.types.chat.chat_completion_message_function_tool_call import (
        ChatCompletionMessageFunctionToolCall, Function)

    out_choices = []
    for index, c in enumerate(choices):
        calls = [ChatCompletionMessageFunctionToolCall(id=t["id"], type="function",
                                                       function=Function(**t["function"])) for t in c.tool_calls]
        message = ChatCompletionMessage(role="assistant", content=c.content, tool_calls=calls or None)
        logprobs = ChoiceLogprobs(content=_chat_logprobs(tokenizer, c, req.top_logprobs)) if req.logprobs else None
        choice = Choice(index=index, message=message, finish_reason=c.finish_reason, logprobs=logprobs)
        if req.return_token_ids:
            choice.token_ids = list(c.token_ids)  # type: ignore[attr-defined] - an extra field, as vLLM's
        out_choices.append(choice)
    body = ChatCompletion(id=new_id("chatcmpl-"), object="chat.completion", created=int(time.time()),
                          model=model, choices=out_choices, usage=_usage(len(prompt_ids), choices))
    data = body.model_dump(exclude_unset=False, mode="json")
    if req.return_token_ids:
        data["prompt_token_ids"] = list(prompt_ids)
        for d, c in zip(data["choices"], choices):
            d["token_ids"] = list(c.token_ids)
    return data


def _text_deltas(tokenizer, ids: list[int]) -> list[str]:
    """One text delta per token: the text the token completes (a token ending inside a multi-byte
    character gives "" and its successor the whole character), joining to the whole text."""
    out, done = [], ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        if text.endswith("\ufffd") and k + 1 < len(ids):
            out.append("")
            continue
        out.append(text[len(done):] if text.startswith(done) else text)
        done = text
    return out


def stream_opening(kind: str, model: str) -> tuple[dict[str, Any], tuple[str, int]]:
    """The first chunk of a streamed answer, sent before sampling ends (chat: choice 0's role;
    completions: an empty text), and the stream's ``(id, created)`` for the chunks after it."""
    from openai.types import Completion, CompletionChoice
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import Choice, ChoiceDelta

    created = int(time.time())
    if kind == "chat":
        cid = new_id("chatcmpl-")
        first = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=model,
                                    choices=[Choice(index=0, delta=ChoiceDelta(role="assistant", content=""))])
        return first.model_dump(mode="json", exclude_none=True), (cid, created)
    cid = new_id("cmpl-")
    first = Completion(id=cid, object="text_completion", created=created, model=model,
                       choices=[CompletionChoice(index=0, text="", finish_reason="stop")]).model_dump(mode="json")
    first["choices"][0]["finish_reason"] = None
    return first, (cid, created)


def chat_chunks(req: ChatRequest, choices: list[ChoiceOut], prompt_ids: list[int], model: str,
                tokenizer, ident: tuple[str, int] | None = None) -> list[dict[str, Any]]:
    """The ``ChatCompletionChunk`` JSON objects of a streamed answer, in order: per choice its
    role (but choice 0's when ``ident`` says the stream's opening carried it), its content one
    token at a time (with that token's log-prob when asked), its tool calls whole, and its finish
    reason; then the usage chunk when ``stream_options.include_usage``."""
    from openai.types.chat import ChatCompletionChunk
    from openai.types.chat.chat_completion import ChoiceLogprobs
    from openai.types.chat.chat_completion_chunk import (Choice, ChoiceDelta, ChoiceDeltaToolCall,
                                                         ChoiceDeltaToolCallFunction)

    cid, created = ident or (new_id("chatcmpl-"), int(time.time()))

    def chunk(index: int, delta, finish: str | None = None, logprobs=None) -> dict[str, Any]:
        c = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=model,
                                choices=[Choice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)])
        return c.model_dump(mode="json", exclude_none=True)

    out = []
    for index, c in enumerate(choices):
        if index or ident is None:
            out.append(chunk(index, ChoiceDelta(role="assistant", content="")))
        if c.content:
            # Content tokens one by one; a turn with tool calls shows its content whole first.
            if c.tool_calls:
                out.append(chunk(index, ChoiceDelta(content=c.content)))
            else:
                per_token = _chat_logprobs(tokenizer, c, req.top_logprobs) if req.logprobs else None
                for k, delta in enumerate(_text_deltas(tokenizer, c.token_ids)):
                    if not delta and per_token is None:
                        continue
                    lp = ChoiceLogprobs(content=[per_token[k]]) if per_token is not None else None
                    out.append(chunk(index, ChoiceDelta(content=delta), logprobs=lp))
        for k, t in enumerate(c.tool_calls):
            out.append(chunk(index, ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=k, id=t["id"], type="function",
                function=ChoiceDeltaToolCallFunction(name=t["function"]["name"],
                                                     arguments=t["function"]["arguments"]))])))
        final = chunk(index, ChoiceDelta(), finish=c.finish_reason)
        if req.return_token_ids:
            final["choices"][0]["token_ids"] = list(c.token_ids)
        out.append(final)
    if req.include_usage:
        usage = ChatCompletionChunk(id=cid, object="chat.completion.chunk", created=created, model=model, choices=[],
                                    usage=_usage(len(prompt_ids), choices))
        out.append(usage.model_dump(mode="json", exclude_none=True))
    return out


def completion(req: CompletionRequest, choices: list[ChoiceOut], prompt_ids: list[int], model: str,
               tokenizer) -> dict[str, Any]:
    """The ``Completion`` JSON of finished ``choices`` (the legacy completions API)."""
    from openai.types import Completion, CompletionChoice
    from openai.types.completion_choice import Logprobs

    out_choices = []
    for index, c in enumerate(choices):
        logprobs = None
        if req.logprobs is not None:
            tokens = [_token_text(tokenizer, t) for t in c.token_ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            top = ([{_token_text(tokenizer, a): alp for a, alp in alts[: req.logprobs]} for alts in c.top_logprobs]
                   if req.logprobs and c.top_logprobs else None)
            logprobs = Logprobs(tokens=tokens, token_logprobs=list(c.logprobs), text_offset=offsets, top_logprobs=top)
        finish = "stop" if c.finish_reason == "tool_calls" else c.finish_reason
        out_choices.append(CompletionChoice(index=index, text=c.text, finish_reason=finish, logprobs=logprobs))
    body = Completion(id=new_id("cmpl-"), object="text_completion", created=int(time.time()),
                      model=model, choices=out_choices, usage=_usage(len(prompt_ids), choices))
    data = body.model_dump(mode="json")
    if req.return_token_ids:
        data["prompt_token_ids"] = list(prompt_ids)
        for d, c in zip(data["choices"], choices):
            d["token_ids"] = list(c.token_ids)
    return data


def completion_chunks(req: CompletionRequest, choices: list[ChoiceOut], prompt_ids: list[int], model: str,
                      tokenizer, ident: tuple[str, int] | None = None) -> list[dict[str, Any]]:
    """Streamed ``Completion`` objects: per choice its text one token at a time, then its finish
    reason; then usage when asked (``ident``: the stream's id and time, from its opening)."""
    from openai.types import Completion, CompletionChoice

    cid, created = ident or (new_id("cmpl-"), int(time.time()))
    out = []
    for index, c in enumerate(choices):
        for delta in _text_deltas(tokenizer, c.token_ids):
            if delta:
                out.append(Completion(id=cid, object="text_completion", created=created, model=model,
                                      choices=[CompletionChoice(index=index, text=delta, finish_reason="stop")]
                                      ).model_dump(mode="json"))
                out[-1]["choices"][0]["finish_reason"] = None
        finish = "stop" if c.finish_reason == "tool_calls" else c.finish_reason
        out.append(Completion(id=cid, object="text_completion", created=created, model=model,
                              choices=[CompletionChoice(index=index, text="", finish_reason=finish)]).model_dump(mode="json"))
    if req.include_usage:
        out.append(Completion(id=cid, object="text_completion", created=created, model=model, choices=[],
                              usage=_usage(len(prompt_ids), choices)).model_dump(mode="json"))
    return out


def model_list(model: str) -> dict[str, Any]:
    """The ``/v1/models`` JSON: the one policy served."""
    from openai.types import Model

    return {"object": "list", "data": [Model(id=model, created=0, object="model", owned_by="async-rl").model_dump()]}
