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

The parts live in ``async_rl.tools.definition`` (``Tool``, ``@tool``), ``async_rl.tools.registry``
(``ToolRegistry``, ``BUILTIN_TOOLS``, ``register_tool``, ``load_tools``) and
``async_rl.tools.executor`` (``ToolCall``, ``ToolResult``, ``ToolExecutor``, ``ERROR_KINDS``); this
module re-exports them, so ``async_rl.tools.base`` stays an import path for all of them.
"""

from async_rl.tools.definition import Tool, tool
from async_rl.tools.executor import ERROR_KINDS, ToolCall, ToolExecutor, ToolResult
from async_rl.tools.registry import BUILTIN_TOOLS, ToolRegistry, load_tools, register_tool

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

