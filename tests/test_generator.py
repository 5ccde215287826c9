"""HF generator: stop handling, behavior log-probs that match the learner's, weight updates by name."""

from __future__ import annotations

import pytest
import torch

from async_rl.buffers.trajectory import Trajectory, collate
from async_rl.generators.base import GeneratorConfig, SamplingParams, cut_at_stop
from async_rl.generators.hf import HFGenerator, load_named_weights


def test_cut_at_stop_keeps_eos_when_pad_equals_eos():
    eos = pad = 9
    assert cut_at_stop([4, 5, eos, pad, pad], {eos}) == (3, "stop")
    assert cut_at_stop([4, 5, 6], {eos}) == (3, "length")


def test_second_stop_id_counts_as_stop():
    a, b = 7, 8  # the tokenizer's EOS is a; b is an extra stop id
    assert cut_at_stop([1, 2, b, 0, 0], {a, b}) == (3, "stop")


def test_loss_mask_keeps_real_eos_when_pad_equals_eos():
    eos = 9
    kept, reason = cut_at_stop([4, 5, eos, eos, eos], {eos})
    resp = [4, 5, eos, eos, eos][:kept]
    t = Trajectory("0/0", 0, "u", [1, 2], resp, [0.0] * kept, [1] * kept, reason, [0] * kept)
    batch = collate([t, Trajectory("0/1", 0, "u", [1, 2], [4, 5, 6, 7, eos], [0.0] * 5, [1] * 5, "stop", [0] * 5)],
                    pad_token_id=eos)
    # Labels 2.. are the response: [4, 5, eos] trained, the two padding slots not.
    assert batch.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0]


@pytest.fixture(scope="module")
def generator(tiny_model_path, tiny_tokenizer):
    return HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=7, seed=1), tiny_tokenizer.pad_token_id)


def _prompts(tok):
    out = []
    for q in ("1+2=", "13+19=", "7+0="):  # different lengths: the batch is left-padded
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"]))
    return out


def test_generate_shapes_and_reproducibility(generator, tiny_tokenizer):
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    prompts = _prompts(tiny_tokenizer)
    out = generator.generate(prompts, 4, params)
    assert len(out) == 3 and all(len(g) == 4 for g in out)
    for group in out:
        for s in group:
            assert len(s.response_ids) == len(s.logprobs) == len(s.policy_version) >= 1
            assert s.finish_reason in ("stop", "length")
            assert (s.finish_reason == "stop") == (s.response_ids[-1] == tiny_tokenizer.eos_token_id)
            assert all(lp <= 0 for lp in s.logprobs)
    gen2 = HFGenerator(generator.model.name_or_path, GeneratorConfig(max_batch_size=7, seed=1),
                       tiny_tokenizer.pad_token_id)
    again = gen2.generate(prompts, 4, params)
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in out]


def test_a_groups_prompt_is_prefilled_once_and_samples_as_unshared(generator, tiny_tokenizer, monkeypatch):
    params = SamplingParams(temperature=1.0, max_tokens=6, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    prompts = _prompts(tiny_tokenizer)
    seeds = [11, 12, 13]
    prefilled = []
    # A hook, not a wrapper: generate reads forward's signature to decide what to pass.
    hook = generator.model.register_forward_pre_hook(
        lambda module, args, kw: prefilled.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        shared = generator.generate(prompts, 4, params, seeds=seeds)
    finally:
        hook.remove()
    # 3 prompts x 4 samples in batches of 7: the first batch's prefill runs 2 distinct prompts
    # (all but their last token, left-padded), the second's 2; then one token per row a step.
    assert prefilled[0][0] == 2 and prefilled[0][1] == max(len(p) for p in prompts[:2]) - 1
    assert all(shape[1] == 1 for shape in prefilled[1:] if shape[0] == 7)
    monkeypatch.setattr(type(generator), "_prefill_shared", lambda self, *a: {})
    plain = generator.generate(prompts, 4, params, seeds=seeds)
    assert [[s.response_ids for s in g] for g in shared] == [[s.response_ids for s in g] for g in plain]
    for g_shared, g_plain in zip(shared, plain):
        for a, b in zip(g_shared, g_plain):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behavior_logprobs_match_learner_recompute(generator, tiny_tokenizer, temperature):
    """The learner's log-probs (right-padded, position ids from the mask) equal the sampler's (left-padded)."""
    from async_rl.algorithms.logprobs import logprobs_from_logits

    params = SamplingParams(temperature=temperature, max_tokens=6, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    prompts = _prompts(tiny_tokenizer)
    out = generator.generate(prompts, 3, params)
    trajs = [Trajectory(f"{i}/{j}", i, "u", prompts[i], s.response_ids, s.logprobs, [1] * len(s.response_ids),
                        s.finish_reason, s.policy_version) for i, g in enumerate(out) for j, s in enumerate(g)]
    batch = collate(trajs, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        logits = generator.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids).logits[:, :-1]
    lp = logprobs_from_logits(logits, batch.input_ids[:, 1:], temperature)
    diff = ((lp - batch.behavior_logprobs).abs() * batch.loss_mask).max()
    assert diff < 1e-4


def test_update_weights_by_name(tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    gen = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    src = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    gen.update_weights(src.named_parameters(), version=5)
    assert gen.policy_version == 5
    for (name, a), (_, b) in zip(gen.model.named_parameters(), src.named_parameters()):
        assert torch.equal(a, b), name
    # Tied embeddings stay tied after the update.
    assert gen.model.lm_head.weight.data_ptr() == gen.model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(gen.model(ids).logits, src(ids).logits)


def test_update_weights_errors_name_the_problem(tiny_model_path, tiny_tokenizer):
    gen = HFGenerator(tiny_model_path, GeneratorConfig(), tiny_tokenizer.pad_token_id)
    named = dict(gen.model.named_parameters())
    with pytest.raises(KeyError, match="model.layers.0.self_attn.q_projj.weight"):
        load_named_weights(gen.model, [("model.layers.0.self_attn.q_projj.weight", torch.zeros(1))])
    partial = [(k, v.detach().clone()) for k, v in list(named.items())[:-1]]
    with pytest.raises(ValueError, match="left 1 parameters unchanged"):
        load_named_weights(gen.model, partial)
    with pytest.raises(ValueError, match="shape"):
        load_named_weights(gen.model, [("model.norm.weight", torch.zeros(3))])


def test_compacting_a_batch_keeps_every_row_s_tokens_and_only_drops_finished_rows(tiny_model_path, tiny_tokenizer):
    """``generator.compact_batches``: once half the rows of a long-tailed batch have finished, the
    rest go on in a smaller batch; each row's tokens, log-probs and versions are those of the
    uncompacted batch (its own sampler; log-probs up to float noise of the re-prefill)."""
    # 10 stop ids of the random-init tiny model's ~262 tokens: geometric lengths (mean ~26), a long tail.
    params = SamplingParams(temperature=1.0, max_tokens=96, stop_token_ids=tuple(range(100, 110)))
    prompts = _prompts(tiny_tokenizer)
    runs = {}
    for fraction in (1.0, 0.5):
        gen = HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=64, seed=3, compact_batches=fraction),
                          tiny_tokenizer.pad_token_id)
        widths = []
        decode = gen._decode
        gen._decode = lambda rows, p, finish, decode=decode, widths=widths: (widths.append(len(rows)),
                                                                             decode(rows, p, finish))[1]
        runs[fraction] = (gen.generate(prompts, 8, params, seeds=[5, 6, 7]), widths)
    (plain, plain_widths), (compact, widths) = runs[1.0], runs[0.5]
    assert plain_widths == [24]  # one batch, run until its longest row ended
    # Compacted: each restart holds only unfinished rows, at most half the rows before it.
    assert widths[0] == 24 and len(widths) >= 3
    assert all(0 < b <= (a + 1) // 2 for a, b in zip(widths, widths[1:]))
    lengths = sorted(len(s.response_ids) for g in plain for s in g)
    assert lengths[-1] > 3 * lengths[len(lengths) // 2]  # the long tail the compaction is for
    for g_plain, g_compact in zip(plain, compact):
        for a, b in zip(g_plain, g_compact):
            assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
            assert a.policy_version == b.policy_version
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_compact_batches_out_of_range_is_refused():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="generator.compact_batches must be in"):
            GeneratorConfig(compact_batches=bad)


def test_the_engine_holds_its_weights_in_generator_hf_dtype(tiny_model_path, tiny_tokenizer):
    """``generator.hf.dtype=bfloat16``: the engine's weights are bf16 (on a GPU: half the memory,
    faster decoding) and it samples as usual; an update in float32 is rounded into them."""
    from transformers import AutoModelForCausalLM

    from async_rl.generators.base import HFConfig

    gen = HFGenerator(tiny_model_path, GeneratorConfig(max_batch_size=4, hf=HFConfig(dtype="bfloat16")),
                      tiny_tokenizer.pad_token_id)
    assert {p.dtype for p in gen.model.parameters()} == {torch.bfloat16}
    params = SamplingParams(max_tokens=4, stop_token_ids=(tiny_tokenizer.eos_token_id,))
    out = gen.generate(_prompts(tiny_tokenizer), 2, params, seeds=[1, 2, 3])
    assert all(1 <= len(s.response_ids) == len(s.logprobs) <= 4 for g in out for s in g)
    src = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    gen.update_weights(((n, t + 0.5) for n, t in src.state_dict().items()), version=1)
    p = dict(gen.model.named_parameters())["model.embed_tokens.weight"]
    assert p.dtype == torch.bfloat16
    assert torch.equal(p, (src.state_dict()["model.embed_tokens.weight"] + 0.5).to(torch.bfloat16))
