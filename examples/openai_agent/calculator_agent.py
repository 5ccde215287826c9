"""An agent of your own, trained as it is: a rollout function written against the ``openai`` client.

The task is the built-in calculator task (``builtin:calc``: "24*13+28="): the agent offers the model
a calculator tool through the OpenAI ``tools`` parameter, runs each tool call the model makes,
sends the results back as ``tool`` messages, and stops when the model answers without calling a
tool. Its reward is 1 when that answer is the right integer. Nothing here knows about async-rl's
trainer but ``RolloutResult``: the same function runs against any OpenAI-compatible server.

    async-rl train --config examples/openai_agent/config.yaml
"""

from __future__ import annotations

import json

from async_rl.endpoint import RolloutResult
from async_rl.tools import ToolRegistry
from async_rl.tools.calculator import evaluate

TOOLS = ToolRegistry.from_specs(["calculator"]).schemas()
"""The calculator's OpenAI tool schema (the one ``endpoint.tools: [calculator]`` renders the
warm start's prompts with)."""


def run_tool(name: str, arguments: str) -> str:
    """The tool's answer to one call, or an error message the model reads (as a tool server would)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        expression = json.loads(arguments)["expression"]
        return evaluate(str(expression))
    except Exception as e:  # noqa: BLE001 - the model's malformed call is answered, not raised
        return f"error: {e}"


def is_correct(answer: str | None, expected: str) -> bool:
    """Whether the final answer is exactly the expected integer (surrounding whitespace aside)."""
    try:
        return answer is not None and int(answer.strip()) == int(expected)
    except ValueError:
        return False


async def rollout(client, task, max_turns: int = 3) -> RolloutResult:
    """One episode: the model may call the calculator, then answers.

    Args:
        client: an ``openai.AsyncOpenAI`` bound to this episode's session.
        task: the dataset row (``task.messages``: the question; ``task.ground_truth``: the answer).
        max_turns: most model calls.

    Returns:
        reward 1.0 for a correct final answer, else 0.0; ``info``: ``acc`` (the same) and
        ``tool_calls`` (calls the model made).
    """
    messages = list(task.messages)
    calls = 0
    answer = None
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content
            break
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": run_tool(call.function.name, call.function.arguments)})
    correct = float(is_correct(answer, task.ground_truth))
    return RolloutResult(reward=correct, info={"acc": correct, "tool_calls": float(calls)})
