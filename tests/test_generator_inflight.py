"""HF generator: batch-invariant seeded sampling, streaming of finished samples, and weight updates
that arrive mid-generation (partial rollouts, ``keep`` and ``abort``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from async_rl.generators.base import GeneratorConfig, SamplingParams
from async_rl.generators.hf import HFGenerator


def _prompts(tok, questions=("1+2=", "13+19=", "7+0=", "4+4=")):
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"]) for q in questions]


def _params(tok, max_tokens=6, **kw):
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=(tok.eos_token_id,), **kw)


@pytest.fixture(scope="module")
def gen(tiny_model_path, tiny_tokenizer):
    return HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=64), tiny_tokenizer.pad_token_id)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_seeded_samples_do_not_depend_on_the_batch(gen, tiny_tokenizer, top_p):
    prompts = _prompts(tiny_tokenizer)
    params = _params(tiny_tokenizer, top_p=top_p)
    together = gen.generate(prompts, 3, params, seeds=[11, 12, 13, 14])
    # The same groups one by one, in reverse order, and inside batches of another size.
    alone = [gen.generate([p], 3, params, seeds=[s])[0] for p, s in reversed(list(zip(prompts, [11, 12, 13, 14])))]
    alone.reverse()
    small = HFGenerator(gen.model.name_or_path, GeneratorConfig(max_batch_size=2), tiny_tokenizer.pad_token_id)
    chunked = small.generate(prompts, 3, params, seeds=[11, 12, 13, 14])
    ids = lambda groups: [[s.response_ids for s in g] for g in groups]  # noqa: E731
    assert ids(together) == ids(alone) == ids(chunked)
    for g1, g2 in zip(together, alone):
        for a, b in zip(g1, g2):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Different seeds give different samples (the test can fail).
    other = gen.generate(prompts, 3, params, seeds=[21, 22, 23, 24])
    assert ids(other) != ids(together)


def test_on_sample_streams_every_sample_once(gen, tiny_tokenizer):
    seen = []
    out = gen.generate(_prompts(tiny_tokenizer), 2, _params(tiny_tokenizer),
                       on_sample=lambda i, j, s: seen.append((i, j, tuple(s.response_ids))))
    assert sorted(seen) == sorted((i, j, tuple(s.response_ids)) for i, g in enumerate(out) for j, s in enumerate(g))


def _run_with_update_at_step(gen, prompts, params, step: int, new_version: int):
    """Generate; the model's forward for token ``step`` starts an updater thread and waits until it
    has staged its weights, so the update lands exactly at the boundary after token ``step``."""
    weights = [(k, v.detach().clone()) for k, v in gen.model.named_parameters()]
    updater = threading.Thread(target=lambda: gen.update_weights(weights, new_version))
    calls = {"n": 0}

    def pre_hook(module, args, kwargs):
        if kwargs.get("past_key_values") is None:
            return  # the engine's prefill of a group's shared prompt, before generate's steps
        calls["n"] += 1
        if calls["n"] == step + 1:
            updater.start()
            deadline = time.monotonic() + 30
            while gen._pending is None:
                assert time.monotonic() < deadline, "update thread never staged its weights"
                time.sleep(0.001)

    handle = gen.model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        out = gen.generate(prompts, 2, params, seeds=[1, 2])
        updater.join(60)
    finally:
        handle.remove()
    return out


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weights_arriving_mid_generation_partial_rollout(tiny_model_path, tiny_tokenizer, mode):
    gen = HFGenerator(tiny_model_path, GeneratorConfig(partial_rollout=mode), tiny_tokenizer.pad_token_id)
    prompts = _prompts(tiny_tokenizer, ("12+7=", "3+3="))
    # No stop token in reach: every response runs the full 12 tokens.
    params = SamplingParams(max_tokens=12, stop_token_ids=(10**6,))
    baseline = gen.generate(prompts, 2, params, seeds=[1, 2])
    out = _run_with_update_at_step(gen, prompts, params, step=5, new_version=7)
    assert gen.policy_version == 7
    for g0, g1 in zip(baseline, out):
        for a, b in zip(g0, g1):
            # Identical weights were loaded, so the tokens are those of an uninterrupted run: the
            # abort path re-issues rows with their partial tokens and their RNG state intact.
            assert b.response_ids == a.response_ids
            assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
            # Tokens 0..5 came from version 0's logits, the rest from version 7's.
            assert b.policy_version == [0] * 6 + [7] * 6
            assert b.finish_reason == "length"
    assert gen.num_weight_updates_in_flight == (1 if mode == "keep" else 0)


def test_update_while_idle_is_immediate(gen):
    weights = [(k, v.detach().clone()) for k, v in gen.model.named_parameters()]
    gen.update_weights(weights, 3)
    assert gen.policy_version == 3 and gen._pending is None


def test_second_stop_id_ends_as_stop_and_pad_equal_to_eos_keeps_eos_fault_case_12(tiny_model_path, tiny_tokenizer):
    from async_rl.buffers.trajectory import Trajectory, collate

    eos = tiny_tokenizer.eos_token_id
    # pad id == EOS id: the padding of finished rows must not leak into responses or the loss mask.
    gen = HFGenerator(tiny_model_path, GeneratorConfig(), pad_token_id=eos)
    prompts = _prompts(tiny_tokenizer)
    greedy = SamplingParams(max_tokens=5, greedy=True, stop_token_ids=(eos,))
    first = gen.generate(prompts[:1], 1, greedy)[0][0].response_ids[0]
    assert first != eos
    # Stop ids {A = EOS, B}: B is the token greedy decoding picks first, so the response is [B].
    out = gen.generate(prompts[:1], 1, SamplingParams(max_tokens=5, greedy=True, stop_token_ids=(eos, first)))[0][0]
    assert out.response_ids == [first] and out.finish_reason == "stop"
    # Sampled rows of different lengths in one batch, pad == EOS: each keeps exactly its real EOS.
    params = SamplingParams(max_tokens=40, stop_token_ids=(eos,))
    samples = [s for g in gen.generate(prompts, 4, params, seeds=[1, 2, 3, 4]) for s in g]
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample reached EOS within 40 tokens"
    for s in samples:
        assert s.response_ids.count(eos) == (s.finish_reason == "stop")
        assert (s.response_ids[-1] == eos) == (s.finish_reason == "stop")
    s = stopped[0]
    t = Trajectory("0/0", 0, "u", prompts[0], s.response_ids, s.logprobs, [1] * len(s.response_ids), "stop",
                   s.policy_version)
    batch = collate([t, Trajectory("0/1", 0, "u", prompts[0], s.response_ids + [5] * 3, s.logprobs + [0.0] * 3,
                                   [1] * (len(s.response_ids) + 3), "length", s.policy_version * 1 + [0] * 3)], eos)
    P, R = len(prompts[0]), len(s.response_ids)
    assert batch.loss_mask[0, P - 1 : P - 1 + R].tolist() == [1.0] * R  # the real EOS is trained
    assert batch.loss_mask[0, P - 1 + R :].sum() == 0  # the pads (same id) are not
