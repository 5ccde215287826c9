"""Tools for agentic multi-turn rollouts: definitions, a registry, parsers and an executor.

- ``Tool`` / ``@tool``: a function plus its JSON schema (derived from type hints by ``@tool``).
- ``ToolRegistry``: name -> Tool; ``from_specs(["calculator", "python", "pkg.mod:attr",
  "file.py:attr"])``; ``schemas()`` for ``tokenizer.apply_chat_template(..., tools=...)``.
- ``get_parser("hermes")``: finds ``ToolCall`` s in generated text (``parse(text) ->
  (content, calls)``).
- ``ToolExecutor(registry).execute(calls) -> list[ToolResult]``: runs calls concurrently with
  per-tool timeouts; every fault becomes an ``Error: ...`` observation and a counter
  (``pop_counts()`` -> ``tools/calls``, ``tools/ok``, ``tools/error_<kind>``).
- Built-ins, registered in ``BUILTIN_TOOLS`` by this module as "calculator" and "python":
  ``calculator_tool`` (safe arithmetic, no eval) and ``python_tool`` /
  ``make_python_tool(...)`` (a subprocess with CPU, memory, wall-clock and output limits and no
  network).

One agent turn::

    parser, executor = get_parser("hermes"), ToolExecutor(ToolRegistry.from_specs(["calculator"]))
    content, calls = parser.parse(assistant_text)
    results = executor.execute(calls)
    messages += [{"role": "tool", "content": r.content} for r in results]
"""

from async_rl.tools.calculator import calculator_tool, evaluate
from async_rl.tools.definition import Tool, tool
from async_rl.tools.executor import ERROR_KINDS, ToolCall, ToolExecutor, ToolResult
from async_rl.tools.parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    ToolCallParser,
    get_parser,
)
from async_rl.tools.python_exec import (SandboxIsolation, make_python_tool, network_isolation, python_tool, run_python,
                                       sandbox_isolation)
from async_rl.tools.registry import BUILTIN_TOOLS, ToolRegistry, load_tools, register_tool

# The built-ins register here, above registry.py, so registry.py never imports the tools built on it.
register_tool(calculator_tool, "calculator")
register_tool(python_tool, "python")

__all__ = [
    "BUILTIN_TOOLS",
    "ERROR_KINDS",
    "PARSERS",
    "SandboxIsolation",
    "HermesParser",
    "Llama3JsonParser",
    "Tool",
    "register_tool",
    "ToolCall",
    "ToolCallParser",
    "ToolExecutor",
    "ToolRegistry",
    "ToolResult",
    "calculator_tool",
    "evaluate",
    "get_parser",
    "load_tools",
    "make_python_tool",
    "network_isolation",
    "python_tool",
    "run_python",
    "sandbox_isolation",
    "tool",
]
