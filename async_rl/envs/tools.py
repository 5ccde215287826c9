"""``tools``: multi-turn tool use as an environment: the model calls tools, the environment runs them.

Each assistant turn is parsed for tool calls in the chat template's format (``parser``: Hermes/Qwen
``<tool_call>{...}</tool_call>`` by default, ``async_rl.tools.parsers``), read as generated with
special tokens kept (``keep_special_tokens``: tokenizers often make the tags special tokens). A
turn with calls gets the tools' responses as the next observation (``tool`` messages, one per
call, in call order); the first turn without a call is the answer and ends the episode, and the
run's reward (``reward.fn``, or the function of the row's ``data_source``) scores it
(``reward_from_run``). The tools are the ones ``agent.tools`` names (``calculator``, ``python``,
``my_pkg.tools:search``, ``path/to/file.py:my_tool``); their schemas go to the chat template.

Faults become observations: malformed or truncated call JSON, an unknown
tool, bad arguments, a tool that raises or runs past its timeout each answer with an error message
(``async_rl.tools.ToolExecutor``); calls past ``max_tool_calls_per_turn`` in one turn are answered
with an error instead of running. Each episode reports ``tool_calls``, ``tool_errors`` and
``error_<kind>`` in its info (``agent/*`` and ``env/info/*`` metrics), which the episode loop also
counts as ``tools/calls``, ``tools/ok`` and ``tools/error_<kind>`` (every call of a step, those
answered without running included).

``agent.tools`` is this environment's spelling in a run without ``env.name``: ``agent.parser``,
``agent.max_tool_calls_per_turn``, ``agent.max_turns``, ``agent.max_response_tokens`` and
``agent.max_tool_response_tokens`` (as ``env.max_observation_tokens``) carry over
(``async_rl.step.episodes.rollout_env_config``), so a tool run and an environment run go one road.

The episode loop caps each observation at ``env.max_observation_tokens`` and ends the episode at
``env.max_turns`` turns (a call in the last turn runs, its output is not shown) or at
``env.max_response_tokens``.

Config (the calculator example through the episode protocol)::

    env:
      name: tools
      args: {tools: [calculator], parser: hermes}
      max_turns: 3
      max_response_tokens: 160
      max_observation_tokens: 128
"""

from __future__ import annotations

import functools
from typing import Any

from async_rl.envs.base import Environment, EnvStep


@functools.lru_cache(maxsize=None)
def toolbox(tools: tuple[str, ...], parser: str, registry: Any = None) -> tuple[Any, list[dict[str, Any]], Any]:
    """``(executor, schemas, parser)`` of a tool list (or of a ``ToolRegistry`` built in code),
    built once per process: every episode of a run shares them (tools are loaded once). The
    executor's own counters are not the run's: the episode loop counts each loop's calls from
    the steps' ``info`` (``tools/*``), so two runs in one process never mix their counts.

    Raises:
        ValueError: an unknown tool spec or parser, or no tool.
    """
    from async_rl.tools import ToolExecutor, ToolRegistry, get_parser

    if registry is None:
        if not tools:
            raise ValueError("tools: name at least one tool (args.tools: [calculator])")
        registry = ToolRegistry.from_specs(list(tools))
    elif not len(registry):
        raise ValueError("tools: the registry holds no tool")
    return ToolExecutor(registry), registry.schemas(), get_parser(parser)


class ToolUse(Environment):
    """One tool-use episode (see the module docstring).

    Args:
        tools: tool specs, as ``agent.tools`` takes them.
        parser: the tool-call format of the model's chat template.
        max_tool_calls_per_turn: calls run per assistant turn (>= 1).
        registry: a ``ToolRegistry`` built in code, instead of ``tools`` (one toolbox per registry
            object, shared by its episodes).

    Raises:
        ValueError: no tool, an unknown tool or parser, ``max_tool_calls_per_turn`` < 1.
    """

    reward_from_run = True
    keep_special_tokens = True

    def __init__(self, tools: list[str] | tuple[str, ...] = (), parser: str = "hermes",
                 max_tool_calls_per_turn: int = 4, registry: Any = None) -> None:
        if isinstance(tools, str):
            tools = [tools]
        if max_tool_calls_per_turn < 1:
            raise ValueError(f"tools: max_tool_calls_per_turn must be >= 1, got {max_tool_calls_per_turn}")
        self.executor, self.tools, self.parser = toolbox(tuple(tools), parser, registry)
        self.max_calls = max_tool_calls_per_turn

    def answer(self, action: str) -> str:
        """The text outside the turn's calls, without the parser's tags (whether or not the
        tokenizer makes them special tokens): what the run's reward scores."""
        content, _ = self.parser.parse(action)
        for tag in self.parser.tags:
            content = content.replace(tag, "")
        return content

    async def step(self, action: str) -> EnvStep:
        """Run the turn's tool calls and answer with their responses, or end the episode at a
        turn without calls (its answer, which the run's reward scores).

        Args:
            action: the turn as generated, special tokens kept, end-of-turn token left out.
        """
        from async_rl.tools import ToolResult

        _, calls = self.parser.parse(action)
        if not calls:
            return EnvStep(done=True)
        results = await self.executor.execute_async(list(calls[: self.max_calls]))
        results += [ToolResult(name=call.name, ok=False, error_kind="too_many_calls",
                               content=f"Error: at most {self.max_calls} tool calls per turn; this one was not run")
                    for call in calls[self.max_calls:]]
        info = {"tool_calls": float(len(results)), "tool_errors": float(sum(not r.ok for r in results))}
        for r in results:
            if not r.ok:
                info[f"error_{r.error_kind}"] = info.get(f"error_{r.error_kind}", 0.0) + 1.0
        return EnvStep([{"role": "tool", "name": r.name or "", "content": r.content} for r in results], 0.0, False,
                       info)
