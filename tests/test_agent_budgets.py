"""Tool use's budgets (``agent.*``, run by the episode loop) at their boundaries (issue 13, kind 5): every limit is tested with an
input one under it, exactly at it and one over it, with the exact token counts, loss masks,
finish reasons and calls made.

Turns are scripted (``ScriptedGenerator``): each assistant turn is the script's text tokenised
plus the end-of-turn token, cut to the turn's ``max_tokens``. The tool tokenizer is byte-level
with no merges, so ASCII text is one token per character (the tool-markup pieces are single
tokens); counts below are measured with the tokenizer, not assumed.
"""

from __future__ import annotations

import pytest

from test_agent import ScriptedGenerator, _hermes_call, _params, _play, _recording_loop, _tool_loop

MSGS = [{"role": "user", "content": "q"}]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve

    return AutoTokenizer.from_pretrained(resolve("builtin:tiny-qwen2-tools"))


def _n(tok, text: str) -> int:
    """Tokens of ``text`` as the scripted generator produces it, with its end-of-turn token."""
    return len(tok(text, add_special_tokens=False)["input_ids"]) + 1


def _run(loop, tok, turns: list[str], max_tokens: int = 400):
    gen = ScriptedGenerator(tok, {"q": turns})
    conv = _play(loop, gen, MSGS, _params(max_tokens=max_tokens))
    assert len(conv.response_ids) == len(conv.logprobs) == len(conv.loss_mask) == len(conv.policy_version)
    return conv, gen


def _echo_loop(tok, output: str, **cfg):
    """An agent loop whose one tool, ``echo``, returns ``output``."""
    from async_rl.tools import ToolRegistry, tool

    @tool(name="echo", parameters={"type": "object", "properties": {}})
    def echo():
        return output

    registry = ToolRegistry()
    registry.register(echo)
    return _tool_loop(tok, registry, **cfg)


ECHO = '<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("over", [-1, 0, 1], ids=["room-left", "exactly-fills", "one-over"])
def test_tool_response_that_exactly_fills_the_response_budget_is_appended(tok, over):
    """``agent.max_response_tokens`` against the tool turn: a tool turn that exactly fills the
    remaining budget is appended (mask 0) and the conversation ends with ``length``; one token
    more and it is left out. Regression: the exactly-filling tool turn was left out too."""
    call = _hermes_call({"a": 1})
    generated = _n(tok, call)
    probe, _ = _run(_recording_loop(tok, max_response_tokens=1000), tok, [call, ""])
    tool_turn = probe.loss_mask.count(0)
    assert probe.loss_mask == [1] * generated + [0] * tool_turn + [1]  # the answer "" is just end-of-turn

    limit = generated + tool_turn - over
    loop = _recording_loop(tok, max_response_tokens=limit)
    conv, gen = _run(loop, tok, [call, ""])
    assert loop.seen == [{"a": 1}] and conv.num_tool_calls == 1
    if over < 0:  # one token left: the next turn gets it and ends there
        assert conv.response_ids == probe.response_ids and len(conv.response_ids) == limit
        assert (conv.finish_reason, conv.num_turns, conv.final_text) == ("stop", 2, "")
        assert [t for _, t, _ in gen.calls] == [0, 1]
    elif over == 0:
        assert conv.response_ids == probe.response_ids[:limit] and len(conv.response_ids) == limit
        assert conv.loss_mask == [1] * generated + [0] * tool_turn
        assert conv.logprobs[generated:] == [0.0] * tool_turn
        assert (conv.finish_reason, conv.num_turns) == ("length", 1)
        assert conv.messages[-1]["role"] == "tool"
        assert len(gen.calls) == 1
    else:
        assert conv.response_ids == probe.response_ids[:generated] and conv.loss_mask == [1] * generated
        assert (conv.finish_reason, conv.num_turns) == ("length", 1)
        assert conv.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize("answer_turn", [2, 3, 4], ids=["limit-1", "limit", "limit+1"])
def test_max_turns_are_all_taken(tok, answer_turn):
    """``agent.max_turns=3``: a conversation answering in turn 2 or 3 ends with ``stop`` after
    that many turns; one that would answer in turn 4 takes all 3 turns, its third call runs (an
    environment's last step does) without its output shown, and it ends with ``max_turns`` on
    the generated turn (mask 1)."""
    max_turns = 3
    turns = [_hermes_call({"k": k}) for k in range(answer_turn - 1)] + ["the answer"]
    loop = _recording_loop(tok, max_turns=max_turns)
    conv, gen = _run(loop, tok, turns)
    taken = min(answer_turn, max_turns)
    assert conv.num_turns == taken and len(gen.calls) == taken
    called = taken if answer_turn > max_turns else taken - 1
    assert loop.seen == [{"k": k} for k in range(called)] and conv.num_tool_calls == called
    if answer_turn <= max_turns:
        assert (conv.finish_reason, conv.final_text) == ("stop", "the answer")
    else:
        assert (conv.finish_reason, conv.final_text) == ("max_turns", "")
        last = _n(tok, turns[max_turns - 1])
        assert conv.loss_mask[-last:] == [1] * last and conv.messages[-1]["role"] == "assistant"


@pytest.mark.parametrize("size", [-1, 0, 1], ids=["limit-1", "limit", "limit+1"])
def test_tool_response_of_exactly_max_tool_response_tokens_is_not_cut(tok, size):
    """``agent.max_tool_response_tokens=20``: a tool output of 19 or 20 tokens reaches the model
    as it is; one of 21 is cut to 20 tokens and marked truncated."""
    limit = 20
    output = "x" * (limit + size)
    assert _n(tok, output) - 1 == limit + size
    conv, _ = _run(_echo_loop(tok, output, max_tool_response_tokens=limit), tok, [ECHO, "done"])
    shown = conv.messages[2]["content"]
    assert shown == (output if size <= 0 else "x" * limit + " ...[truncated]")
    assert conv.finish_reason == "stop" and conv.final_text == "done"
    tool_text = tok.decode([t for t, m in zip(conv.response_ids, conv.loss_mask) if m == 0])
    assert f"<tool_response>\n{shown}\n</tool_response>" in tool_text


@pytest.mark.parametrize("limit", [4, 5, 6])
def test_a_cut_tool_response_stays_whole_characters_within_the_limit(tok, limit):
    """Regression: the cut fell inside a multi-byte character and left a U+FFFD, so the cut text
    was not what the tool wrote and re-tokenised to more than the limit. "é" is 2 tokens here:
    an odd limit cuts one token earlier."""
    output = "é" * 10
    conv, _ = _run(_echo_loop(tok, output, max_tool_response_tokens=limit), tok, [ECHO, "done"])
    shown = conv.messages[2]["content"]
    head = shown.removesuffix(" ...[truncated]")
    assert shown != head and output.startswith(head) and head == "é" * (limit // 2)
    assert _n(tok, head) - 1 <= limit


def test_a_long_tool_response_of_long_tokens_is_cut_not_silently_shortened(tok):
    """Regression: only the first ``16 * limit + 16`` characters were tokenised and, when those
    held no more than ``limit`` tokens (tokens longer than 16 characters), that prefix was
    returned as the whole response: cut without the truncation mark. Here each token is 18
    characters: 300 tokens, limit 200."""
    piece = '", "arguments": {"'
    assert len(piece) == 18 and _n(tok, piece) == 2
    for tokens, limit in ((200, 200), (300, 200)):
        output = piece * tokens
        conv, _ = _run(_echo_loop(tok, output, max_tool_response_tokens=limit, max_response_tokens=2000), tok,
                       [ECHO, "done"], max_tokens=600)
        shown = conv.messages[2]["content"]
        assert shown == (output if tokens <= limit else piece * limit + " ...[truncated]"), (tokens, limit)


@pytest.mark.parametrize("calls", [2, 3, 4], ids=["limit-1", "limit", "limit+1"])
def test_exactly_max_tool_calls_per_turn_all_run(tok, calls):
    """``agent.max_tool_calls_per_turn=3``: 2 or 3 calls in a turn all run; of 4, the fourth is
    answered with an error instead of running."""
    limit = 3
    loop = _recording_loop(tok, max_tool_calls_per_turn=limit)
    conv, _ = _run(loop, tok, ["".join(_hermes_call({"k": k}) for k in range(calls)), "done"], max_tokens=600)
    ran = min(calls, limit)
    assert loop.seen == [{"k": k} for k in range(ran)]
    assert (conv.num_tool_calls, conv.num_tool_errors) == (calls, calls - ran)
    tool_messages = [m["content"] for m in conv.messages if m["role"] == "tool"]
    assert tool_messages[:ran] == ["recorded"] * ran and len(tool_messages) == calls
    assert all(m.startswith("Error: at most 3 tool calls") for m in tool_messages[ran:])
    metrics = loop.pop_metrics()
    assert metrics["tools/calls"] == calls and metrics["tools/ok"] == ran
    assert metrics.get("tools/error_too_many_calls", 0) == calls - ran
    assert conv.finish_reason == "stop" and conv.final_text == "done"


@pytest.mark.parametrize("over", [-1, 0, 1], ids=["limit-1", "limit", "limit+1"])
@pytest.mark.parametrize("where", ["first turn", "after a tool turn", "turn cap"])
def test_a_turn_that_exactly_uses_its_generation_budget(tok, where, over):
    """The per-turn budget is ``min(max_tokens, max_response_tokens - len(response))``: an answer
    (with its end-of-turn token) of exactly that many tokens ends with ``stop``; one token more is
    cut there and ends with ``length``, its text so far the final text."""
    call = _hermes_call({"a": 1})
    probe, _ = _run(_recording_loop(tok, max_response_tokens=1000), tok, [call, ""])
    used = len(probe.response_ids) - 1  # the call turn and the tool turn
    if where == "first turn":
        max_response, max_tokens, before = 30, 400, []
    elif where == "after a tool turn":
        max_response, max_tokens, before = used + 30, 400, [call]
    else:  # the engine's per-turn max_tokens is the smaller budget
        max_response, max_tokens, before = used + 60, 30, [call]
    budget = 30
    answer = "a" * (budget + over - 1)
    assert _n(tok, answer) == budget + over
    loop = _recording_loop(tok, max_response_tokens=max_response)
    conv, _ = _run(loop, tok, before + [answer], max_tokens=max_tokens)
    start = used if before else 0
    assert conv.num_turns == len(before) + 1
    if over <= 0:
        assert (conv.finish_reason, conv.final_text) == ("stop", answer)
        assert len(conv.response_ids) == start + budget + over
        assert conv.response_ids[-1] == tok.eos_token_id
    else:
        assert (conv.finish_reason, conv.final_text) == ("length", answer[:budget])
        assert len(conv.response_ids) == start + budget and conv.response_ids[-1] != tok.eos_token_id
    assert conv.loss_mask[start:] == [1] * (len(conv.response_ids) - start)


def test_each_conversation_gets_its_own_generation_budget(tok):
    """Regression: a turn's ``max_tokens`` was the smallest remaining budget of all conversations
    in the batch, so a conversation with room left was cut (``length``) because another one in
    the same batch was nearly out of budget: results depended on the batch."""
    long_call, short_call = _hermes_call({"s": "x" * 60}), _hermes_call({"a": 1})
    scripts = {"long": [long_call, "ok"], "short": [short_call, "b" * 40]}
    max_response = 120
    prompts = {u: [{"role": "user", "content": u}] for u in scripts}

    def run(users):
        from async_rl.step.rollout import GroupRequest

        loop = _recording_loop(tok, max_response_tokens=max_response)
        gen = ScriptedGenerator(tok, {u: scripts[u] for u in users})
        batch = [GroupRequest(i, loop.prompt_ids(prompts[u]), u, "calc", "", {}, 1, 1, prompts[u])
                 for i, u in enumerate(users)]
        convs = loop.run_groups(gen, batch, 1, _params(max_tokens=400), [1] * len(users))
        return {u: c for u, (c,) in zip(users, convs)}

    alone = {u: run([u])[u] for u in scripts}
    together = run(["long", "short"])
    # Sanity: the long conversation's remaining budget is smaller than the short one's answer.
    assert max_response - (len(alone["long"].response_ids) - _n(tok, "ok")) < _n(tok, "b" * 40)
    assert alone["short"].finish_reason == "stop" and alone["short"].final_text == "b" * 40
    for u in scripts:
        assert together[u].response_ids == alone[u].response_ids, u
        assert (together[u].finish_reason, together[u].final_text) == (alone[u].finish_reason, alone[u].final_text)
