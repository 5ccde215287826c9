"""Tool layer for agentic rollouts: schemas, registry loading, parsers, executor faults, built-ins.

CPU only; the python-tool tests spawn short-lived subprocesses (about 3 s in all, most of it the
deliberate CPU-time and wall-clock limit cases).
"""

from __future__ import annotations

import json
import socket
import textwrap
import threading
import time
from typing import Literal, Optional

import pytest

from async_rl.tools import (
    ERROR_KINDS,
    HermesParser,
    Llama3JsonParser,
    Tool,
    ToolCall,
    ToolExecutor,
    ToolRegistry,
    calculator_tool,
    evaluate,
    get_parser,
    make_python_tool,
    network_isolation,
    tool,
)
from async_rl.tools import python_exec
from async_rl.tools.calculator import MAX_EXPRESSION_CHARS


def hermes(obj_text: str) -> str:
    return f"<tool_call>\n{obj_text}\n</tool_call>"


class Recorder:
    """A tool function that records the keyword arguments of every call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        return "recorded"


def recording_registry(name: str = "calculator") -> tuple[ToolRegistry, Recorder]:
    recorder = Recorder()
    registry = ToolRegistry([Tool(name, "records its calls", {"type": "object", "properties": {}}, recorder)])
    return registry, recorder


# ---------------------------------------------------------------------------------------------
# Tool and schema derivation


def test_tool_decorator_derives_schema_from_hints_and_docstring():
    @tool
    def search(query: str, k: int = 3, temperature: float = 0.5, exact: bool = False,
               tags: list[str] | None = None, filters: dict = None,
               mode: Literal["fast", "slow"] = "fast", note: Optional[str] = None, anything=None):
        """Search the corpus
        for passages.

        Longer text that is not part of the description.

        Args:
            query: what to look for.
            k: how many results,
                at most 10.
        """
        return []

    assert search.name == "search"
    assert search.description == "Search the corpus for passages."
    props = search.parameters["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for."}
    assert props["k"] == {"type": "integer", "description": "how many results, at most 10."}
    assert props["temperature"] == {"type": "number"}
    assert props["exact"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["filters"] == {"type": "object"}
    assert props["mode"] == {"enum": ["fast", "slow"], "type": "string"}
    assert props["note"] == {"type": "string"}
    assert props["anything"] == {}
    assert search.parameters["required"] == ["query"]
    assert search.parameters["type"] == "object"
    assert search.schema() == {
        "type": "function",
        "function": {"name": "search", "description": search.description, "parameters": search.parameters},
    }
    assert search(query="x") == []


def test_tool_decorator_with_arguments_and_validation():
    @tool(name="adder", description="Add.", timeout_s=2.0)
    def add(a: int, b: int = 0, *args, **kwargs) -> int:
        return a + b

    assert (add.name, add.description, add.timeout_s) == ("adder", "Add.", 2.0)
    assert set(add.parameters["properties"]) == {"a", "b"}  # *args/**kwargs are not parameters
    explicit = {"type": "object", "properties": {"x": {"type": "string"}}, "required": []}
    assert tool(name="f", parameters=explicit)(lambda x="": x).parameters is explicit

    with pytest.raises(ValueError, match="tool name"):
        Tool("bad name!", "", {"type": "object"}, print)
    with pytest.raises(ValueError, match="object schema"):
        Tool("ok", "", {"type": "array"}, print)
    with pytest.raises(ValueError, match="timeout_s"):
        Tool("ok", "", {"type": "object"}, print, timeout_s=0)


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_basics_and_duplicates():
    registry = ToolRegistry.from_specs(["calculator", "python"])
    assert registry.names() == ["calculator", "python"]
    assert len(registry) == 2 and "calculator" in registry and "nope" not in registry
    assert registry.get("calculator") is calculator_tool and registry.get("nope") is None
    assert [s["function"]["name"] for s in registry.schemas()] == ["calculator", "python"]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(calculator_tool)
    with pytest.raises(ValueError, match="'calculator'.*already registered"):
        ToolRegistry.from_specs(["calculator", "async_rl.tools:calculator_tool"])
    with pytest.raises(KeyError):
        registry["nope"]


def test_registry_from_import_path_and_file(tmp_path, monkeypatch):
    (tmp_path / "my_tools_mod.py").write_text(textwrap.dedent('''
        from async_rl.tools import tool

        def shout(text: str) -> str:
            """Upper-case the text."""
            return text.upper()

        @tool(name="echo")
        def _echo(text: str) -> str:
            return text
    '''))
    (tmp_path / "file_tools.py").write_text(textwrap.dedent('''
        from async_rl.tools import tool

        def double(x: int) -> int:
            return 2 * x

        @tool
        def negate(x: float) -> float:
            return -x

        TOOLS = [double, negate]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = ToolRegistry.from_specs(
        ["my_tools_mod:shout", "my_tools_mod:_echo", f"{tmp_path / 'file_tools.py'}:TOOLS"]
    )
    assert registry.names() == ["shout", "echo", "double", "negate"]
    assert registry.get("shout").description == "Upper-case the text."
    results = ToolExecutor(registry).execute(
        [ToolCall("shout", {"text": "hi"}), ToolCall("double", {"x": 4}), ToolCall("echo", {"text": "e"})]
    )
    assert [r.content for r in results] == ["HI", "8", "e"]


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("not_a_builtin", "not a built-in name"),
        ("no_such_module_xyz:fn", "not found"),
        ("async_rl.tools.calculator:missing_attr", "no attribute"),
        ("async_rl.tools.calculator:MAX_EXPONENT", "int, not a Tool"),
        ("missing_dir/missing.py:fn", "not found"),
        ("", "empty"),
    ],
)
def test_registry_bad_specs_name_spec_and_reason(spec, reason):
    with pytest.raises(ValueError) as info:
        ToolRegistry.from_specs([spec])
    assert repr(spec) in str(info.value) and reason in str(info.value)


def test_registry_bad_file_spec_import_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('broken on import')\n")
    with pytest.raises(ValueError, match="RuntimeError: broken on import") as info:
        ToolRegistry.from_specs([f"{path}:fn"])
    assert str(path) in str(info.value)


# ---------------------------------------------------------------------------------------------
# Parsers


def test_hermes_parses_several_calls_and_content_around_them():
    text = (
        "I will compute both.\n"
        + hermes('{"name": "calculator", "arguments": {"expression": "1+2"}}')
        + "\nThen the second one:\n"
        + hermes('{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}')
        + "\nDone."
    )
    content, calls = HermesParser().parse(text)
    assert content == "I will compute both.\nThen the second one:\nDone."
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None),
        ("python", {"code": "print(1)"}, None),
    ]
    assert calls[0].raw == '{"name": "calculator", "arguments": {"expression": "1+2"}}'


@pytest.mark.parametrize(
    "text, name, arguments, error",
    [
        (hermes('{"name": "f"}'), "f", {}, None),
        (hermes('{"name": "f", "arguments": null}'), "f", {}, None),
        (hermes('{"name": "f", "parameters": {"a": 1}}'), "f", {"a": 1}, None),
        (hermes('{"name": "f", "arguments": {"a": 1}'), "f", None, "malformed_json"),
        (hermes('{"name": "f", "arguments": [1, 2]}'), "f", None, "not_an_object"),
        (hermes('{"name": "f", "arguments": 3}'), "f", None, "not_an_object"),
        (hermes('{"name": "f", "arguments": "not json"}'), "f", None, "malformed_json"),
        (hermes('{"name": "f", "arguments": "\\"a string\\""}'), "f", None, "not_an_object"),
        (hermes('[1, 2]'), None, None, "no_name"),
        (hermes('{"arguments": {}}'), None, None, "no_name"),
        (hermes('{"name": 7, "arguments": {}}'), None, None, "no_name"),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "f", None, "truncated"),
        ('<tool_call>\n{"name": "f", "argu', "f", None, "truncated"),
    ],
)
def test_hermes_single_call_rules(text, name, arguments, error):
    content, [call] = HermesParser().parse("before " + text)
    assert content == "before"
    assert (call.name, call.arguments, call.error) == (name, arguments, error)
    assert bool(call.detail) == (error is not None)


def test_hermes_edge_cases():
    parser = HermesParser()
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("a </tool_call> b") == ("a </tool_call> b", [])
    # A block interrupted by the next <tool_call> does not swallow the well-formed call after it.
    content, calls = parser.parse('<tool_call>{"name": "f"' + hermes('{"name": "g", "arguments": {}}'))
    assert [(c.name, c.error) for c in calls] == [("f", "malformed_json"), ("g", None)]
    assert parser.stop_strings == ()
    assert get_parser("hermes", stop_at_first_call=True).stop_strings == ("</tool_call>",)
    with pytest.raises(ValueError, match="hermes.*llama3_json"):
        get_parser("nope")


def test_parsers_treat_json_nested_too_deeply_as_malformed():
    """Found by tests/test_fuzz.py: JSON nested past the decoder's recursion limit raised
    RecursionError out of both parsers; it is a malformed (or, unclosed, truncated) call."""
    deep = "[" * 100_000
    hermes_parser, llama = HermesParser(), Llama3JsonParser()
    cases = [
        (hermes_parser, f"<tool_call>{deep}</tool_call>", [(None, "malformed_json")]),
        (hermes_parser, f"<tool_call>{deep}", [(None, "truncated")]),
        (hermes_parser, hermes(json.dumps({"name": "f", "arguments": deep})), [("f", "malformed_json")]),
        (llama, '{"name": ' + deep, [(None, "malformed_json")]),
        (llama, '{"name": "f", "parameters": ' + deep, [("f", "malformed_json")]),
    ]
    for parser, text, expected in cases:
        _, calls = parser.parse(text)
        assert [(c.name, c.error) for c in calls] == expected
        assert all("nested too deeply" in c.detail for c in calls if c.error == "malformed_json")


def test_llama3_json_parser():
    parser = get_parser("llama3_json")
    assert isinstance(parser, Llama3JsonParser)
    content, calls = parser.parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parser.parse('{"answer": 42}') == ('{"answer": 42}', [])  # JSON content, not a call
    assert parser.parse("The answer is 42.") == ("The answer is 42.", [])
    _, [bad] = parser.parse('{"name": "f", "parameters": {"x": ')
    assert bad.error == "malformed_json"


# What a model may really generate: each row is (id, generated text, expected content, expected
# calls as (name, arguments, error)). The rows are the contract of "every well-formed call in
# exactly what was generated, faults as observations"; tests/test_agent.py runs the same kind of
# turns through the agent loop with the tags as ordinary and as special tokens.
HERMES_TURNS = [
    ("one call", hermes('{"name": "f", "arguments": {"a": 1}}'), "", [("f", {"a": 1}, None)]),
    ("no whitespace", '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>', "", [("f", {"a": 1}, None)]),
    ("pretty-printed JSON", hermes('{\n  "name": "f",\n  "arguments": {\n    "a": [1, 2]\n  }\n}'), "",
     [("f", {"a": [1, 2]}, None)]),
    ("close tag inside a string", hermes('{"name": "f", "arguments": {"s": "a</tool_call>b"}}'), "",
     [("f", {"s": "a</tool_call>b"}, None)]),
    ("open tag inside a string", hermes('{"name": "f", "arguments": {"s": "<tool_call>"}}'), "",
     [("f", {"s": "<tool_call>"}, None)]),
    ("a whole call inside a string",
     hermes('{"name": "f", "arguments": {"s": "<tool_call>{\\"name\\": \\"g\\"}</tool_call>"}}'), "",
     [("f", {"s": '<tool_call>{"name": "g"}</tool_call>'}, None)]),
    ("tags inside a JSON-string arguments value",
     hermes('{"name": "f", "arguments": "{\\"s\\": \\"</tool_call>\\"}"}'), "", [("f", {"s": "</tool_call>"}, None)]),
    ("special-token text inside a string", hermes('{"name": "f", "arguments": {"s": "<|im_start|>x<|im_end|>"}}'),
     "", [("f", {"s": "<|im_start|>x<|im_end|>"}, None)]),
    ("unicode", hermes('{"name": "f", "arguments": {"s": "héllo → 世界 🎉", "t": "\\u00e9\\ud83c\\udf89"}}'), "",
     [("f", {"s": "héllo → 世界 🎉", "t": "é🎉"}, None)]),
    ("unicode name and text around", "Voilà:\n" + hermes('{"name": "résumé", "arguments": {}}') + "\n完了",
     "Voilà:\n完了", [("résumé", {}, None)]),
    ("nested objects", hermes('{"name": "f", "arguments": {"a": {"b": [1, {"c": null}], "d": {"e": {}}}, "z": true}}'),
     "", [("f", {"a": {"b": [1, {"c": None}], "d": {"e": {}}}, "z": True}, None)]),
    ("several calls, text around",
     "First.\n" + hermes('{"name": "f", "arguments": {"a": 1}}') + "\nthen\n"
     + hermes('{"name": "g", "arguments": {"s": "}</tool_call>{"}}') + "\nlast.",
     "First.\nthen\nlast.", [("f", {"a": 1}, None), ("g", {"s": "}</tool_call>{"}, None)]),
    ("adjacent calls", hermes('{"name": "f", "arguments": {}}') + hermes('{"name": "g", "arguments": {}}'), "",
     [("f", {}, None), ("g", {}, None)]),
    ("text after the call only", hermes('{"name": "f", "arguments": {}}') + " and more", "and more",
     [("f", {}, None)]),
    ("extra text before the close tag", hermes('{"name": "f", "arguments": {}} oops'), "",
     [("f", None, "malformed_json")]),
    ("unclosed object", hermes('{"name": "f", "arguments": {"a": 1}'), "", [("f", None, "malformed_json")]),
    ("unterminated string holding a close tag",
     '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>\nnext', "next", [("f", None, "malformed_json")]),
    ("truncated after a string holding a close tag", '<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call>"}',
     "", [("f", None, "truncated")]),
    ("truncated inside a string holding a close tag", '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>b',
     "", [("f", None, "truncated")]),
    ("truncated", '<tool_call>\n{"name": "f", "argu', "", [("f", None, "truncated")]),
    ("interrupted, then a good call", '<tool_call>{"name": "f"' + hermes('{"name": "g", "arguments": {}}'), "",
     [("f", None, "malformed_json"), ("g", {}, None)]),
    ("a good call, then a bad one",
     hermes('{"name": "f", "arguments": {}}') + hermes('{"name": "g", "arguments": [1]}'), "",
     [("f", {}, None), ("g", None, "not_an_object")]),
    ("no name", hermes('{"arguments": {"name": "f"}}'), "", [(None, None, "no_name")]),
    ("stray close tag stays in the content", "a </tool_call> b", "a </tool_call> b", []),
    ("no calls", "The answer is 42.", "The answer is 42.", []),
]


@pytest.mark.parametrize("text, content, expected", [row[1:] for row in HERMES_TURNS],
                         ids=[row[0] for row in HERMES_TURNS])
def test_hermes_parses_generated_turns(text, content, expected):
    got_content, calls = HermesParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == expected
    assert got_content == content
    assert all(bool(c.detail) == (c.error is not None) for c in calls)


LLAMA3_TURNS = [
    ("one call", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1}, None)]),
    ("python tag", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1}, None)]),
    ("leading whitespace", '\n  {"name": "f", "parameters": {}}', "", [("f", {}, None)]),
    ("arguments key", '{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1}, None)]),
    ("parameters as a JSON string", '{"name": "f", "parameters": "{\\"a\\": 1}"}', "", [("f", {"a": 1}, None)]),
    ("tag-like text inside strings",
     '{"name": "f", "parameters": {"s": "<|python_tag|>{\\"name\\": \\"g\\", \\"parameters\\": {}}", '
     '"t": "</tool_call><|eot_id|>"}}', "",
     [("f", {"s": '<|python_tag|>{"name": "g", "parameters": {}}', "t": "</tool_call><|eot_id|>"}, None)]),
    ("unicode", '{"name": "f", "parameters": {"s": "héllo → 世界 🎉", "t": "\\u00e9"}}', "",
     [("f", {"s": "héllo → 世界 🎉", "t": "é"}, None)]),
    ("nested objects", '{"name": "f", "parameters": {"a": {"b": [1, {"c": null}]}, "z": false}}', "",
     [("f", {"a": {"b": [1, {"c": None}]}, "z": False}, None)]),
    ("several calls, ';' and newlines",
     '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}\n{"name": "h", "parameters": {"s": ";"}}',
     "", [("f", {"a": 1}, None), ("g", {}, None), ("h", {"s": ";"}, None)]),
    ("text after the calls", '{"name": "f", "parameters": {}}\nDone, the result follows.', "Done, the result follows.",
     [("f", {}, None)]),
    ("a plain JSON object after a call", '{"name": "f", "parameters": {}} {"answer": 42}', '{"answer": 42}',
     [("f", {}, None)]),
    # The format: the message is the calls; text before JSON makes the whole message content.
    ("text before the JSON is content", 'Sure: {"name": "f", "parameters": {}}',
     'Sure: {"name": "f", "parameters": {}}', []),
    ("a plain JSON answer", '{"answer": 42}', '{"answer": 42}', []),
    ("malformed first call", '{"name": "f", "parameters": {"a": ', "", [("f", None, "malformed_json")]),
    ("malformed call after a good one", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": ', "",
     [("f", {}, None), ("g", None, "malformed_json")]),
    ("non-object parameters", '{"name": "f", "parameters": [1]}', "", [("f", None, "not_an_object")]),
    ("non-string name", '{"name": 3, "parameters": {}}', "", [(None, None, "no_name")]),
    ("no calls", "The answer is 42.", "The answer is 42.", []),
]


@pytest.mark.parametrize("text, content, expected", [row[1:] for row in LLAMA3_TURNS],
                         ids=[row[0] for row in LLAMA3_TURNS])
def test_llama3_json_parses_generated_turns(text, content, expected):
    got_content, calls = Llama3JsonParser().parse(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == expected
    assert got_content == content
    assert all(bool(c.detail) == (c.error is not None) for c in calls)


# ---------------------------------------------------------------------------------------------
# Executor: faults become observations and counters


@pytest.mark.parametrize(
    "arguments_text, called_with, error_kind",
    [
        ('{"a": 1', None, "malformed_json"),
        ("[1, 2]", None, "not_an_object"),
        ("", {}, None),
        ('{"a": 1}', {"a": 1}, None),
    ],
)
def test_required_argument_strings(arguments_text, called_with, error_kind):
    registry, recorder = recording_registry("calculator")
    call_json = json.dumps({"name": "calculator", "arguments": arguments_text})
    _, calls = HermesParser().parse(hermes(call_json))
    [result] = ToolExecutor(registry).execute(calls)
    assert result.error_kind == error_kind and result.ok == (error_kind is None)
    assert recorder.calls == ([] if called_with is None else [called_with])
    assert result.content == ("recorded" if called_with is not None else result.content)
    if error_kind:
        assert result.content.startswith("Error:")


@pytest.mark.parametrize(
    "arguments_json, called_with, error_kind",
    [
        ('{"a": 1', None, "malformed_json"),  # unterminated object: the whole call is bad JSON
        ("[1, 2]", None, "not_an_object"),
        ("{}", {}, None),
        ('{"a": 1}', {"a": 1}, None),
    ],
)
def test_required_arguments_as_raw_json(arguments_json, called_with, error_kind):
    registry, recorder = recording_registry("calculator")
    _, calls = HermesParser().parse(hermes('{"name": "calculator", "arguments": ' + arguments_json + "}"))
    [result] = ToolExecutor(registry).execute(calls)
    assert result.error_kind == error_kind
    assert recorder.calls == ([] if called_with is None else [called_with])


def test_executor_fault_cases_give_observations_and_counters():
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def explode() -> None:
        raise RuntimeError("boom")

    @tool
    def as_json() -> dict:
        return {"x": [1, 2], "y": "é"}

    registry = ToolRegistry([add, explode, as_json])
    text = "".join([
        hermes('{"name": "add", "arguments": {"a": 1, "b": 2}}'),
        hermes('{"name": "add", "arguments": {"a": 1, "b": 2'),        # malformed
        hermes('{"name": "add", "arguments": [1, 2]}'),                # not an object
        hermes('{"name": "subtract", "arguments": {}}'),               # unknown tool
        hermes('{"name": "add", "arguments": {"a": 1, "c": 2}}'),      # bad arguments
        hermes('{"name": "add", "arguments": {"a": 1}}'),              # missing argument
        hermes('{"name": "explode", "arguments": {}}'),                # raising tool
        hermes('{"arguments": {}}'),                                   # no name
        hermes('{"name": "as_json", "arguments": ""}'),
        '<tool_call>\n{"name": "add", "arguments": {"a"',              # truncated
    ])
    _, calls = HermesParser().parse(text)
    executor = ToolExecutor(registry)
    results = executor.execute(calls)
    kinds = [r.error_kind for r in results]
    assert kinds == [None, "malformed_json", "not_an_object", "unknown_tool", "bad_arguments",
                     "bad_arguments", "tool_error", "no_name", None, "truncated"]
    assert results[0].content == "3" and results[0].ok
    assert json.loads(results[8].content) == {"x": [1, 2], "y": "é"}
    for r in results:
        assert r.ok == (r.error_kind is None)
        if not r.ok:
            assert r.content.startswith("Error:") and "Traceback" not in r.content
    assert "RuntimeError: boom" in results[6].content
    assert "'subtract'" in results[3].content and "add, explode, as_json" in results[3].content
    assert "unexpected argument(s) 'c'; missing required argument(s) 'b'" in results[4].content
    assert "missing required argument(s) 'b'" in results[5].content
    assert "a (integer, required)" in results[4].content
    assert set(kinds) - {None} <= set(ERROR_KINDS)
    expected = {"tools/calls": 10, "tools/ok": 2, "tools/error_malformed_json": 1,
                "tools/error_not_an_object": 1, "tools/error_unknown_tool": 1,
                "tools/error_bad_arguments": 2, "tools/error_tool_error": 1,
                "tools/error_no_name": 1, "tools/error_truncated": 1}
    assert executor.counts() == expected
    assert executor.pop_counts() == expected
    assert executor.counts() == {}
    assert executor.execute([]) == []


def test_executor_timeout_returns_on_time_and_runs_calls_concurrently():
    release = threading.Event()

    @tool(timeout_s=0.3)
    def hang() -> str:
        release.wait(10.0)
        return "late"

    @tool(timeout_s=5.0)
    def nap(s: float) -> str:
        time.sleep(s)
        return f"slept {s}"

    executor = ToolExecutor(ToolRegistry([hang, nap]), max_workers=4)
    start = time.monotonic()
    results = executor.execute([ToolCall("nap", {"s": 0.4}), ToolCall("hang", {}), ToolCall("nap", {"s": 0.4})])
    wall = time.monotonic() - start
    release.set()
    assert [r.error_kind for r in results] == [None, "timeout", None]
    assert results[0].content == "slept 0.4" and "0.3 s" in results[1].content
    assert 0.25 <= results[1].elapsed_s < 1.0
    assert wall < 2.0  # concurrent: about max(0.4, 0.3), not 1.1, and never the hang's 10 s
    assert executor.counts()["tools/error_timeout"] == 1 and executor.abandoned_threads == 1


def test_executor_max_workers_queues_without_timing_out_queued_calls():
    @tool(timeout_s=0.5)
    def nap() -> str:
        time.sleep(0.2)
        return "ok"

    start = time.monotonic()
    results = ToolExecutor(ToolRegistry([nap]), max_workers=1).execute([ToolCall("nap", {})] * 4)
    # Serial: 4 x 0.2 s > 0.5 s, yet no call times out because each one's clock starts when it runs.
    assert [r.content for r in results] == ["ok"] * 4
    assert time.monotonic() - start >= 0.8


def test_executor_async():
    import asyncio

    executor = ToolExecutor(ToolRegistry([calculator_tool]))
    [result] = asyncio.run(executor.execute_async([ToolCall("calculator", {"expression": "6*7"})]))
    assert result.content == "42"


# ---------------------------------------------------------------------------------------------
# Calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("12*34+28", "436"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("2 ** 3 ** 2", "512"),
        ("-2 ** 2", "-4"),
        ("(-2) ** 2", "4"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4.0"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** -1", "0.5"),
        ("1.5 * 2", "3.0"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("+5 - -3", "8"),
        ("2 ** 64", "18446744073709551616"),
    ],
)
def test_calculator_values(expression, expected):
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os')", "function calls"),
        ("__import__('os').system('echo hi')", "function calls"),
        ("x + 1", "names"),
        ("abs(-1)", "function calls"),
        ("(1).real", "attribute"),
        ("[1][0]", "subscripts"),
        ("1 < 2", "comparisons"),
        ("lambda: 1", "lambdas"),
        ("'a' * 3", "only int and float literals"),
        ("True + 1", "only int and float literals"),
        ("1j * 2", "only int and float literals"),
        ("2 ^ 3", "use \\*\\* for powers"),
        ("9 ** 9 ** 9", "exponent"),
        ("(10 ** 100) ** 1000", "too large"),
        ("2 ** 5000", "exponent"),
        ("1e308 * 10", "finite"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("5 // 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("1 +", "not a valid arithmetic expression"),
        ("", "empty"),
        ("1+" * (MAX_EXPRESSION_CHARS // 2) + "1", "limit is 512"),
    ],
)
def test_calculator_rejects(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


def test_calculator_tool_through_executor():
    executor = ToolExecutor(ToolRegistry([calculator_tool]))
    ok, bad = executor.execute([
        ToolCall("calculator", {"expression": "(1 + 2) * 3"}),
        ToolCall("calculator", {"expression": "__import__('os')"}),
    ])
    assert (ok.content, ok.ok) == ("9", True)
    assert bad.error_kind == "tool_error" and bad.content.startswith("Error: tool 'calculator' failed: ValueError:")


# ---------------------------------------------------------------------------------------------
# Python tool


@pytest.fixture(scope="module")
def limited_python() -> Tool:
    return make_python_tool(cpu_s=1, memory_mb=256, wall_s=1.5, max_output_chars=500)


def test_python_prints_output_and_reports_errors(limited_python):
    assert limited_python(code="print(6 * 7)") == "42\n"
    assert limited_python(code="x = 1") == "(no output)"
    out = limited_python(code="import sys\nprint('partial')\nsys.stderr.write('warn\\n')\n1/0")
    assert out.startswith("partial\nwarn\n") and "ZeroDivisionError" in out
    assert 'File "main.py", line 4' in out and "runpy" not in out
    assert out.endswith("Error: the process exited with code 1.")
    # Fresh, clean working directory; stdin is closed.
    out = limited_python(code="import os, sys; print(sorted(os.listdir('.')), repr(sys.stdin.read()))")
    assert out == "['main.py'] ''\n"
    out = limited_python(code="print('x' * 5000)")
    assert len(out) < 600 and "characters omitted" in out


def test_python_cpu_time_limit_kills_busy_loop():
    # A generous wall clock, so on a loaded machine RLIMIT_CPU (not the wall clock) still fires.
    busy = make_python_tool(cpu_s=1, wall_s=20)
    start = time.monotonic()
    out = busy(code="while True:\n    pass")
    assert "CPU time limit of 1 s exceeded" in out
    assert time.monotonic() - start < 10


def test_python_memory_limit_stops_big_allocation(limited_python):
    out = limited_python(code="x = bytearray(1024 ** 3)\nprint('allocated')")
    assert "allocated" not in out and "memory limit of 256 MiB exceeded" in out


def test_python_wall_clock_timeout(limited_python):
    start = time.monotonic()
    out = limited_python(code="import time\nprint('before', flush=True)\ntime.sleep(30)")
    assert time.monotonic() - start < 3.0
    assert out.startswith("before\n") and "wall-clock time limit of 1.5 s exceeded" in out


@pytest.fixture
def listening_port():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_python_network_blocked(limited_python, listening_port):
    code = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {listening_port}), timeout=1)\n"
        "print('CONNECTED')"
    )
    out = limited_python(code=code)
    assert "CONNECTED" not in out and "PermissionError" in out
    # Local sockets that wrap existing descriptors (asyncio's self-pipe) keep working.
    out = limited_python(code="import asyncio\nasyncio.run(asyncio.sleep(0))\nprint('asyncio ok')")
    assert out == "asyncio ok\n"


def test_python_prelude_alone_blocks_sockets(limited_python, listening_port, monkeypatch):
    # Where namespaces are not permitted only the socket prelude remains: it must still block.
    monkeypatch.setattr(python_exec, "network_isolation", lambda: "none")
    out = limited_python(code=f"import socket\nsocket.create_connection(('127.0.0.1', {listening_port}))")
    assert "PermissionError: network access is disabled" in out


def test_python_network_namespace_blocks_raw_sockets(limited_python, listening_port):
    if network_isolation() == "none":
        pytest.skip("network namespaces are not permitted here; only the socket prelude applies")
    code = (
        "import _socket\n"
        "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
        "s.settimeout(1)\n"
        f"s.connect(('127.0.0.1', {listening_port}))\n"
        "print('CONNECTED')"
    )
    out = limited_python(code=code)
    assert "CONNECTED" not in out and "OSError" in out


def test_make_python_tool_validates_limits():
    with pytest.raises(ValueError, match="memory_mb"):
        make_python_tool(memory_mb=8)
    with pytest.raises(ValueError, match="wall_s"):
        make_python_tool(wall_s=0)
    assert make_python_tool().timeout_s == 15.0


# ---------------------------------------------------------------------------------------------
# Chat template accepts the schemas

# The tools part of Qwen2.5's template, cut down: one `tool | tojson` line per tool in <tools>.
QWEN_STYLE_TOOLS_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def test_schemas_render_in_tool_aware_chat_template(tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)  # own copy: the fixture is shared
    tokenizer.chat_template = QWEN_STYLE_TOOLS_TEMPLATE

    @tool
    def lookup(key: str, limit: int = 1) -> str:
        """Look a key up."""
        return key

    registry = ToolRegistry.from_specs(["calculator", "python"])
    registry.register(lookup)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 12*34+28?"}],
        tools=registry.schemas(), tokenize=False, add_generation_prompt=True,
    )
    block = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in block.splitlines()] == registry.schemas()
    for schema in registry.schemas():
        assert json.dumps(schema, ensure_ascii=False) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_register_tool_in_code_makes_it_nameable_in_config():
    from async_rl.tools import BUILTIN_TOOLS, ToolRegistry, register_tool

    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    try:
        registered = register_tool(shout)
        registry = ToolRegistry.from_specs(["shout", "calculator"])
        assert registry.get("shout") is registered and sorted(registry.names()) == ["calculator", "shout"]
        assert registry.get("shout").fn("hi") == "HI"
        with pytest.raises(ValueError, match="already registered"):
            register_tool(shout)
    finally:
        BUILTIN_TOOLS.pop("shout", None)
