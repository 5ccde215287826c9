"""generator.max_response_tokens at its boundary: a response may have exactly that many tokens;
it is ``stop`` when its last token is a stop token and ``length`` otherwise, and a stop token
one position earlier is ``stop`` with a token to spare."""

from __future__ import annotations

import pytest

from async_rl.generators.base import GeneratorConfig, SamplingParams
from async_rl.generators.hf import HFGenerator

SEED = 1234


@pytest.fixture(scope="module")
def sampled_case(tiny_model_path, tiny_tokenizer):
    """The HF engine, a prompt, a seeded sampled continuation and a position k >= 2 whose token
    first occurs there (so making that token the only stop id ends the response at exactly k
    tokens). Sample j of a seeded prompt depends only on its seed, so the prefix is the same
    whatever the stop ids and the limit."""
    gen = HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=4, seed=0), tiny_tokenizer.pad_token_id)
    for q in ("1+2=", "13+19=", "7+0=", "45+45="):
        prompt = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                         add_generation_prompt=True, tokenize=True)["input_ids"])
        # A stop id the model never emits here: the continuation runs to the limit.
        never = max(tiny_tokenizer.get_vocab().values())
        s = gen.generate([prompt], 1, SamplingParams(max_tokens=12, stop_token_ids=(never,)), seeds=[SEED])[0][0]
        assert s.finish_reason == "length" and len(s.response_ids) == 12 and never not in s.response_ids
        for i in range(1, 12):
            if s.response_ids[i] not in s.response_ids[:i]:
                return gen, prompt, s.response_ids, i + 1
    pytest.skip("every continuation repeats one token")


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_finish_reason_at_max_response_tokens(sampled_case, delta):
    gen, prompt, cont, k = sampled_case
    stop = cont[k - 1]  # first occurs at position k - 1: a response ending there has k tokens
    limit = k + delta
    out = gen.generate([prompt], 1, SamplingParams(max_tokens=limit, stop_token_ids=(stop,)), seeds=[SEED])[0][0]
    if delta < 0:
        # The limit cuts one token before the stop token.
        assert (out.response_ids, out.finish_reason) == (cont[: k - 1], "length")
    else:
        # A stop token exactly at the limit (delta 0) or with one to spare (delta 1) is "stop".
        assert (out.response_ids, out.finish_reason) == (cont[:k], "stop")
    assert len(out.response_ids) <= limit


def test_a_response_of_exactly_max_tokens_without_a_stop_is_length(sampled_case):
    gen, prompt, cont, k = sampled_case
    never = max(gen.model.config.vocab_size - 1, 0)
    if never in cont[:k]:
        pytest.skip("the last vocabulary id occurs in the continuation")
    out = gen.generate([prompt], 1, SamplingParams(max_tokens=k, stop_token_ids=(never,)), seeds=[SEED])[0][0]
    assert (out.response_ids, out.finish_reason) == (cont[:k], "length")
