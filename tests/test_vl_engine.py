"""Vision-language prompts on the HF engine and in the learner's batch: the built-in tiny Qwen2-VL
samples from image+text prompts (a row's tokens and log-probs the same alone or batched beside
other images and text-only rows, equal to a direct transformers forward; the image changes them),
refusals of images for a text model or of the wrong count, the batch's per-row image extras (kept
by ``select`` and ``trimmed``), and the run's prompt-image lookup."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from async_rl.buffers.trajectory import IMAGE_EXTRAS, Trajectory, collate
from async_rl.data.builtin import resolve
from async_rl.data.images import ImageProcessing, expand_image_tokens
from async_rl.generators.base import GeneratorConfig, SamplingParams
from async_rl.data.images import PromptImages
from async_rl.utils.vision import image_kwargs, input_only_token_ids


@pytest.fixture(scope="module")
def vl():
    from transformers import AutoConfig, AutoTokenizer

    torch.set_num_threads(1)
    path = resolve("builtin:tiny-qwen2-vl")
    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    return path, tok, cfg, ImageProcessing(path, cfg.image_token_id)


def _picture(colour: str, w: int = 56, h: int = 84) -> Image.Image:
    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).rectangle([5, 5, 40, 40], fill=colour)
    return img


def _prompt(vl, text: str, pictures: list[Image.Image]):
    _, tok, cfg, processing = vl
    inputs = processing.process(pictures)
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in pictures), {"type": "text", "text": text}]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return expand_image_tokens(ids, inputs, cfg.image_token_id), inputs


@pytest.fixture(scope="module")
def engine(vl):
    from async_rl.generators.hf import HFGenerator

    return HFGenerator(vl[0], GeneratorConfig(max_batch_size=8), pad_token_id=vl[1].pad_token_id)


def _forward_logprobs(vl, prompt: list[int], inputs, response: list[int]) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vl[0], dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, **image_kwargs(ids, [inputs], vl[2].image_token_id, "cpu")).logits
    # Input-only markup has probability 0 in every engine (utils.vision.input_only_token_ids).
    markup = torch.tensor(input_only_token_ids(model.config))
    logprobs = torch.log_softmax(logits[0, len(prompt) - 1: -1].float().index_fill(-1, markup, float("-inf")), -1)
    return logprobs.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_a_row_samples_the_same_alone_or_batched_and_matches_a_direct_forward(vl, engine):
    p1, x1 = _prompt(vl, "what colour?", [_picture("red")])
    p2, x2 = _prompt(vl, "how many shapes are there?", [_picture("blue", 84, 56), _picture("green")])
    p3 = vl[1].apply_chat_template([{"role": "user", "content": "no image"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    params = SamplingParams(temperature=1.0, max_tokens=12, stop_token_ids=(vl[1].eos_token_id,))
    batched = engine.generate([p1, p2, p3], 2, params, seeds=[1, 2, 3], images=[x1, x2, None])
    for prompt, seed, inputs, together in zip([p1, p2, p3], [1, 2, 3], [x1, x2, None], batched):
        alone = engine.generate([prompt], 2, params, seeds=[seed], images=[inputs])[0]
        for a, b in zip(alone, together):
            assert a.response_ids == b.response_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    sample = batched[1][0]
    direct = _forward_logprobs(vl, p2, x2, sample.response_ids)
    np.testing.assert_allclose(sample.logprobs, direct.numpy(), atol=1e-5)


def test_the_image_changes_the_logprobs(vl, engine):
    greedy = SamplingParams(greedy=True, max_tokens=4, stop_token_ids=(vl[1].eos_token_id,))
    prompt, red = _prompt(vl, "what colour?", [_picture("red")])
    green = vl[3].process([_picture("green")])
    a = engine.generate([prompt], 1, greedy, images=[red])[0][0]
    b = engine.generate([prompt], 1, greedy, images=[green])[0][0]
    assert abs(a.logprobs[0] - b.logprobs[0]) > 1e-3


def test_images_are_refused_for_a_text_model_or_in_the_wrong_number(vl, engine, tmp_path):
    from async_rl.generators.hf import HFGenerator

    prompt, inputs = _prompt(vl, "what colour?", [_picture("red")])
    params = SamplingParams(temperature=1.0, max_tokens=4, stop_token_ids=(vl[1].eos_token_id,))
    with pytest.raises(ValueError, match="2 image entries for 1 prompts"):
        engine.generate([prompt], 1, params, images=[inputs, inputs])
    with pytest.raises(ValueError, match="placeholder tokens"):  # placeholders not expanded
        engine.generate([[t for t in prompt if t != vl[2].image_token_id] + [vl[2].image_token_id]], 1, params,
                        images=[inputs])
    text = HFGenerator(resolve("builtin:tiny-qwen2"), GeneratorConfig(), pad_token_id=vl[1].pad_token_id)
    with pytest.raises(ValueError, match="text model"):
        text.generate([[1, 2, 3]], 1, params, images=[inputs])


def _traj(i: int, prompt: list[int], uid: str) -> Trajectory:
    return Trajectory(trajectory_id=f"{i}/0", group_id=i, prompt_uid=uid, prompt_ids=prompt, response_ids=[5, 6],
                      behavior_logprobs=[-0.1, -0.2], loss_mask=[1, 1], finish_reason="stop", policy_version=[0, 0])


def test_the_batch_carries_each_rows_images_on_their_own_axes(vl):
    p1, x1 = _prompt(vl, "a", [_picture("red")])
    p2, x2 = _prompt(vl, "b", [_picture("blue", 84, 56), _picture("green", 28, 28)])
    trajs = [_traj(0, p1, "t:0"), _traj(1, [7, 8, 9], "t:1"), _traj(2, p2, "t:2")]
    batch = collate(trajs, 0, images=[x1, None, x2])
    pv, grid = batch.extras["pixel_values"], batch.extras["image_grid_thw"]
    assert pv.shape == (3, len(x2.pixel_values), 1176) and pv.dtype == torch.float32
    assert grid.shape == (3, 2, 3) and grid.dtype == torch.int64
    assert torch.equal(pv[0, : len(x1.pixel_values)], torch.from_numpy(x1.pixel_values))
    assert not pv[0, len(x1.pixel_values):].any() and not pv[1].any() and not grid[1].any()
    assert torch.equal(grid[2], torch.from_numpy(x2.image_grid_thw))
    picked = batch.select([2])
    assert torch.equal(picked.extras["pixel_values"][0], pv[2])
    trimmed = batch.trimmed()
    assert all(torch.equal(trimmed.extras[k], batch.extras[k]) for k in IMAGE_EXTRAS)
    assert "pixel_values" not in collate(trajs, 0, images=[None, None, None]).extras
    with pytest.raises(ValueError, match="2 image entries for 3 trajectories"):
        collate(trajs, 0, images=[x1, None])


def test_the_runs_prompt_images_are_found_by_uid():
    class Prompt:
        def __init__(self, uid, images):
            self.uid, self.images = uid, images

    class Dataset:
        prompts = [Prompt("train:0", "IMG0"), Prompt("train:1", None)]

    lookup = PromptImages(Dataset(), None)
    assert lookup and lookup("train:0") == "IMG0" and lookup("train:1") is None
    assert lookup.of([_traj(0, [1, 2], "train:1"), _traj(1, [1, 2], "train:0")]) == [None, "IMG0"]
    assert not PromptImages() and PromptImages().of([_traj(0, [1, 2], "x")]) is None


@pytest.mark.parametrize("overrides, message", [
    (["learner.backend=megatron"], "learner.backend=megatron does not train vision-language models yet"),
    (["endpoint.rollout=verifiers"], "endpoint.rollout. do not take images yet"),
    (["reward.model=builtin:tiny-qwen2-reward"], "reward.model does not pass the prompts' images"),
    (["algorithm.distill.teacher=builtin:tiny-qwen2"], "algorithm.distill does not pass the prompts' images"),
])
def test_a_vision_language_run_is_refused_in_one_line_where_a_part_cannot_take_images(overrides, message):
    from pathlib import Path

    from async_rl.config import load_config
    from async_rl.generators import check_model
    from async_rl.runtime.inputs import check_vision_language

    default = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    cfg = load_config(default, ["model.path=builtin:tiny-qwen2-vl", *overrides])
    with pytest.raises(ValueError, match=message) as err:
        check_model(cfg.generator, cfg.model.path)
        check_vision_language(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("transport", ["update_weights", "shm"])
def test_a_pushed_update_changes_vision_and_language_weights_like_a_fresh_engine(vl, tmp_path, transport):
    from transformers import AutoModelForImageTextToText

    from async_rl.generators.hf import HFGenerator
    from async_rl.weight_sync import LocalTarget, ModuleWeights, WeightPublisher, WeightSyncConfig

    torch.manual_seed(3)
    model = AutoModelForImageTextToText.from_pretrained(vl[0], dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name or "language_model" in name:
                p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "perturbed")
    for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (tmp_path / "perturbed" / f).write_bytes((Path(vl[0]) / f).read_bytes())
    source = ModuleWeights(model)
    assert source.weight_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}
    names = [n for n, _, _ in source.weight_metadata()]
    assert any(n.startswith("visual.") for n in names) and "model.layers.0.mlp.up_proj.weight" in names

    prompt, inputs = _prompt(vl, "what colour?", [_picture("red")])
    greedy = SamplingParams(greedy=True, max_tokens=6, stop_token_ids=(vl[1].eos_token_id,))
    config = GeneratorConfig(max_batch_size=8)
    engine = HFGenerator(vl[0], config, pad_token_id=vl[1].pad_token_id)
    before = engine.generate([prompt], 1, greedy, images=[inputs])[0][0]
    if transport == "update_weights":
        engine.update_weights(source.named_weights(), 1)
    else:
        pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=0.05), "shm", source, [LocalTarget(engine)])
        try:
            pub.push(1)
        finally:
            pub.close()
    after = engine.generate([prompt], 1, greedy, images=[inputs])[0][0]
    fresh = HFGenerator(str(tmp_path / "perturbed"), config, pad_token_id=vl[1].pad_token_id)
    expected = fresh.generate([prompt], 1, greedy, images=[inputs])[0][0]
    assert engine.policy_version == 1 and after.response_ids == expected.response_ids
    np.testing.assert_allclose(after.logprobs, expected.logprobs, atol=1e-5)
    assert abs(after.logprobs[0] - before.logprobs[0]) > 1e-3
    # The vision tower's weights alone change what the engine says about the image.
    vision_only = [(n, t) for n, t in ModuleWeights(AutoModelForImageTextToText.from_pretrained(vl[0])).named_weights()
                   if not n.startswith("visual.")] + [(n, t) for n, t in source.named_weights() if n.startswith("visual.")]
    engine.update_weights(vision_only, 2)
    mixed = engine.generate([prompt], 1, greedy, images=[inputs])[0][0]
    assert abs(mixed.logprobs[0] - before.logprobs[0]) > 1e-4


def test_the_engine_never_samples_the_input_only_markup(vl, engine):
    prompt, inputs = _prompt(vl, "what colour?", [_picture("red")])
    params = SamplingParams(temperature=2.0, max_tokens=32, stop_token_ids=(vl[1].eos_token_id,))
    samples = engine.generate([prompt], 16, params, seeds=[7], images=[inputs])[0]
    sampled = {t for s in samples for t in s.response_ids}
    markup = set(input_only_token_ids(vl[2]))
    assert len(markup) == 4 and not sampled & markup and sum(len(s.response_ids) for s in samples) > 300
