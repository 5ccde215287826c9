"""The FSDP2 learner on a vision-language policy (``builtin:tiny-qwen2-vl``): log-probs of image+text
rows equal transformers' own forward, padded and packed; a training step moves the vision tower
and the language model (only the latter with ``learner.freeze_vision``); the weights sent carry
the checkpoint's names and shapes; LoRA adapts the language model only; Megatron refuses."""

from __future__ import annotations

import os

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.buffers.trajectory import Trajectory, TrainBatch, collate
from async_rl.learners.base import LearnerConfig
from async_rl.learners.fsdp import FSDPLearner
from async_rl.utils.lora import LoRAConfig
from async_rl.utils.vision import input_only_token_ids

IMAGE_TOKEN = 264
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def vl_path() -> str:
    from async_rl.data.builtin import resolve

    return resolve("builtin:tiny-qwen2-vl")


def _images(path: str, colours: list[tuple[tuple[int, int], tuple[int, int, int]]]):
    """``ImageInputs`` of solid rectangles ``[(size (w, h), rgb), ...]`` drawn with PIL (a stripe
    across each, so patches differ within an image)."""
    from PIL import Image, ImageDraw

    from async_rl.data.images import ImageProcessing

    pictures = []
    for (w, h), rgb in colours:
        img = Image.new("RGB", (w, h), rgb)
        ImageDraw.Draw(img).rectangle([0, h // 3, w - 1, h // 2], fill=(255 - rgb[0], 128, rgb[2] // 2))
        pictures.append(img)
    return ImageProcessing(path, IMAGE_TOKEN).process(pictures)


def _rows(path: str, first_colour=(200, 30, 30)):
    """Two rows with different images, image counts and lengths: ``[(prompt ids, response ids,
    ImageInputs)]``, prompts with their placeholders expanded."""
    from async_rl.data.images import expand_image_tokens

    a = _images(path, [((56, 84), first_colour)])
    b = _images(path, [((112, 56), (20, 200, 30)), ((28, 28), (0, 0, 255))])
    return [(expand_image_tokens([5, IMAGE_TOKEN, 7, 8], a, IMAGE_TOKEN), [40, 41, 42, 43, 44], a),
            (expand_image_tokens([5, IMAGE_TOKEN, 6, IMAGE_TOKEN, 7, 9, 10], b, IMAGE_TOKEN), [50, 51, 52], b)]


def _batch(rows, advantage: float = 0.0) -> TrainBatch:
    """Right-padded ``TrainBatch`` of ``rows`` with the image extras of the batch contract:
    ``pixel_values`` ``[B, P_max, 1176]`` and ``image_grid_thw`` ``[B, I_max, 3]``, zero-padded."""
    trajs = [Trajectory(trajectory_id=f"0/{i}", group_id=0, prompt_uid="p", prompt_ids=p, response_ids=r,
                        behavior_logprobs=[-0.5] * len(r), loss_mask=[1] * len(r), finish_reason="stop",
                        policy_version=[0] * len(r), reward=float(i))
             for i, (p, r, _) in enumerate(rows)]
    batch = collate(trajs, pad_token_id=0, advantages=[[advantage * (1 - 2 * i)] * len(r)
                                                        for i, (_, r, _) in enumerate(rows)])
    patches = max(len(x.pixel_values) for *_, x in rows)
    grids = max(len(x.image_grid_thw) for *_, x in rows)
    pv = torch.zeros(len(rows), patches, rows[0][2].pixel_values.shape[1])
    thw = torch.zeros(len(rows), grids, 3, dtype=torch.long)
    for i, (*_, x) in enumerate(rows):
        pv[i, : len(x.pixel_values)] = torch.from_numpy(x.pixel_values)
        thw[i, : len(x.image_grid_thw)] = torch.from_numpy(x.image_grid_thw)
    batch.extras.update(pixel_values=pv, image_grid_thw=thw)
    return batch


def _direct_logprobs(path: str, rows) -> list[torch.Tensor]:
    """Each row's label log-probs ``[n-1]`` from transformers' own forward of that row alone."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response, x in rows:
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids, pixel_values=torch.from_numpy(x.pixel_values),
                           image_grid_thw=torch.from_numpy(x.image_grid_thw),
                           mm_token_type_ids=(ids == IMAGE_TOKEN).long(), use_cache=False).logits[0, :-1]
            # The learner gives the input-only markup probability 0, as the engines sample, and
            # scores a prompt's markup labels 0 (utils.vision.input_only_token_ids).
            markup = torch.tensor(input_only_token_ids(model.config))
            logits = logits.float().index_fill(-1, markup, float("-inf"))
            lp = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(torch.where(torch.isin(ids[0, 1:], markup), torch.zeros(()), lp))
    return out


def _learner(path: str, **cfg) -> FSDPLearner:
    return FSDPLearner(LearnerConfig(**cfg), AlgorithmConfig().apply_preset(), path, temperature=TEMPERATURE,
                       total_optimizer_steps=4)


@pytest.mark.parametrize("cfg", [{}, {"packing": True}, {"packing": True, "max_tokens_per_micro_batch": 20},
                                 {"micro_batch_size": 1}], ids=["padded", "packed", "packed-budget", "mb1"])
def test_logprobs_equal_transformers_forward_and_depend_on_the_image(vl_path, cfg):
    rows = _rows(vl_path)
    learner = _learner(vl_path, **cfg)
    got = learner.compute_logprobs(_batch(rows))
    for i, want in enumerate(_direct_logprobs(vl_path, rows)):
        n = len(rows[i][0]) + len(rows[i][1])
        # The text tests' tolerance (test_learner_options: packed vs padded, fp32).
        torch.testing.assert_close(got[i, : n - 1], want, rtol=1e-5, atol=1e-5)
    # Another picture in row 0 moves row 0's response log-probs and leaves row 1's.
    other = learner.compute_logprobs(_batch(_rows(vl_path, first_colour=(10, 10, 240))))
    p0, r0 = len(rows[0][0]), len(rows[0][1])
    assert (other[0, p0 - 1 : p0 + r0 - 1] - got[0, p0 - 1 : p0 + r0 - 1]).abs().max() > 1e-3
    torch.testing.assert_close(other[1], got[1], rtol=0, atol=1e-6)


def test_packed_row_keeps_each_sequences_mrope_positions(vl_path):
    """The packed call's positions are ``[4, 1, N]``: text positions restarting per sequence,
    then each sequence's own M-RoPE positions (as transformers computes them for it alone)."""
    from async_rl.learners import vision

    rows = _rows(vl_path)
    learner = _learner(vl_path, packing=True)
    inputs = learner._model_inputs(_batch(rows), packed=True)
    pos = inputs["position_ids"]
    lengths = [len(p) + len(r) for p, r, _ in rows]
    assert tuple(pos.shape) == (4, 1, sum(lengths))
    rope = vision.rope_index_fn(learner.model)
    start = 0
    for (p, r, x), n in zip(rows, lengths):
        ids = torch.tensor([p + r])
        alone, _ = rope(ids, mm_token_type_ids=(ids == IMAGE_TOKEN).long(),
                        image_grid_thw=torch.from_numpy(x.image_grid_thw))
        assert torch.equal(pos[0, 0, start : start + n], torch.arange(n))
        assert torch.equal(pos[1:, 0, start : start + n], alone[:, 0])
        start += n
    assert inputs["pixel_values"].shape[0] == sum(len(x.pixel_values) for *_, x in rows)


def _weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in learner.named_weights()}


@pytest.mark.parametrize("freeze", [False, True], ids=["trainable", "frozen"])
def test_train_step_moves_vision_and_language_weights(vl_path, freeze):
    learner = _learner(vl_path, lr=1e-3, freeze_vision=freeze)
    batch = _batch(_rows(vl_path), advantage=1.0)
    before = _weights(learner)
    learner.prepare(batch)
    metrics = learner.train_step(batch)
    assert torch.isfinite(metrics["loss/pg"])
    after = _weights(learner)
    vis = [n for n in before if n.startswith("visual.")]
    lang = [n for n in before if n.startswith("model.layers.")]
    assert vis and lang
    moved = lambda names: [n for n in names if not torch.equal(before[n], after[n])]  # noqa: E731
    assert moved(lang)
    if freeze:
        assert not moved(vis)
        tower = {id(p) for p in learner.model.model.visual.parameters()}
        assert not any(id(p) in tower for g in learner.optimizer.param_groups for p in g["params"])
    else:
        assert "visual.blocks.0.attn.qkv.weight" in moved(vis) and "visual.merger.mlp.0.weight" in moved(vis)


def test_fsdp2_wrapped_vl_learner_scores_like_the_plain_one(vl_path):
    """One fp32 rank wrapped with FSDP2 (vision blocks and decoder layers each a unit): the same
    log-probs as the plain module, and a training step runs through the sharded vision tower."""
    from torch.distributed.fsdp import FSDPModule

    rows = _rows(vl_path)
    plain = _learner(vl_path).compute_logprobs(_batch(rows))
    FSDPLearner.shard_one_rank = True
    try:
        learner = _learner(vl_path, packing=True, lr=1e-3)
    finally:
        FSDPLearner.shard_one_rank = False
    assert isinstance(learner.model.model.visual.blocks[0], FSDPModule)
    assert isinstance(learner.model.model.language_model.layers[0], FSDPModule)
    valid = _batch(rows).attention_mask[:, 1:].bool()
    torch.testing.assert_close(learner.compute_logprobs(_batch(rows))[valid], plain[valid], rtol=1e-5, atol=1e-5)
    batch = _batch(rows, advantage=1.0)
    before = dict(learner.named_weights())["visual.blocks.0.attn.qkv.weight"].clone()
    learner.train_step(batch)
    assert not torch.equal(dict(learner.named_weights())["visual.blocks.0.attn.qkv.weight"], before)


def test_weights_sent_under_checkpoint_names_and_shapes(vl_path):
    from safetensors import safe_open

    learner = _learner(vl_path)
    with safe_open(os.path.join(vl_path, "model.safetensors"), "pt") as f:
        checkpoint = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    meta = {n: tuple(s) for n, _, s in learner.weight_metadata()}
    assert meta == checkpoint
    assert any(n.startswith("visual.") for n in meta) and "model.embed_tokens.weight" in meta
    sent = {n: tuple(t.shape) for n, t in learner.named_weights()}
    assert sent == checkpoint
    # The tied head travels as an alias of a name that is sent.
    assert learner.weight_aliases() == {"lm_head.weight": "model.embed_tokens.weight"}


def test_megatron_refuses_a_vision_language_model(vl_path):
    pytest.importorskip("megatron.core")
    from async_rl.learners.megatron import MegatronLearner

    with pytest.raises(ValueError, match="does not train vision-language models yet; use fsdp2"):
        MegatronLearner(LearnerConfig(backend="megatron"), AlgorithmConfig().apply_preset(), vl_path,
                        temperature=1.0, total_optimizer_steps=1)


def test_a_critic_is_refused_for_a_vision_language_policy(vl_path):
    with pytest.raises(ValueError, match="trains a critic, which does not take images yet"):
        FSDPLearner(LearnerConfig(), AlgorithmConfig(name="ppo").apply_preset(), vl_path, temperature=1.0,
                    total_optimizer_steps=1)


def test_lora_adapts_the_language_model_only(vl_path):
    learner = _learner(vl_path, lora=LoRAConfig(rank=4), lr=1e-3)
    names = [n for n, _, _ in learner.weight_metadata()]
    assert names and all(".language_model.layers." in n for n in names)
    assert any(".self_attn.q_proj.lora_A.weight" in n for n in names)
    assert not any("visual" in n for n in names)
    rows = _rows(vl_path)
    # Adapters start at B = 0: the base model's log-probs; a step then moves only the adapters.
    torch.testing.assert_close(learner.compute_logprobs(_batch(rows)),
                               _learner(vl_path).compute_logprobs(_batch(rows)), rtol=1e-5, atol=1e-5)
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "visual" not in n for n in trainable)
    with pytest.raises(ValueError, match="matches the vision tower"):
        _learner(vl_path, lora=LoRAConfig(rank=4, target_modules=["q_proj", "qkv"]))


def test_lora_export_of_a_vl_policy_is_a_plain_vl_model(vl_path, tmp_path):
    from transformers import AutoModelForImageTextToText

    learner = _learner(vl_path, lora=LoRAConfig(rank=4))
    learner.export_hf(str(tmp_path / "out"))
    model = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert os.path.exists(tmp_path / "out" / "adapter" / "adapter_model.safetensors")
    # Untrained adapters (B = 0) merge to the base weights, under the checkpoint's names.
    from safetensors.torch import load_file

    base, merged = load_file(os.path.join(vl_path, "model.safetensors")), load_file(str(tmp_path / "out" /
                                                                                        "model.safetensors"))
    assert sorted(merged) == sorted(base)
    for name in ("visual.blocks.0.attn.qkv.weight", "model.layers.0.self_attn.q_proj.weight"):
        torch.testing.assert_close(merged[name], base[name], rtol=0, atol=0)


def test_packed_gradients_equal_padded(vl_path):
    """The training pass on image+text rows gives every parameter, vision tower included, the same
    gradient packed as padded."""
    learner = _learner(vl_path)
    batch = _batch(_rows(vl_path))
    grads = {}
    for packed in (False, True):
        learner.model.zero_grad(set_to_none=True)
        logprobs, _ = learner._forward(batch, with_entropy=False, packed=packed)
        (logprobs * batch.loss_mask).sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in learner.model.named_parameters()}
    assert grads[False]["model.visual.blocks.0.attn.qkv.weight"].abs().max() > 0
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_reference_policy_of_a_vl_model_scores_images(vl_path):
    """With a KL term the separately loaded reference (a VL model too) scores the image rows as the
    policy did at the start, and a training step then moves the policy away from it."""
    learner = FSDPLearner(LearnerConfig(packing=True, lr=1e-3), AlgorithmConfig(kl_coef=0.1).apply_preset(), vl_path,
                          temperature=TEMPERATURE, total_optimizer_steps=4)
    learner.begin_rl()
    batch = _batch(_rows(vl_path), advantage=1.0)
    learner.prepare(batch)
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(batch.extras["ref_logprobs"][valid], batch.extras["proximal_logprobs"][valid],
                               rtol=0, atol=1e-6)
    metrics = learner.train_step(batch)
    assert "loss/kl" in metrics
    after = learner.compute_logprobs(batch)
    assert (after[valid] - batch.extras["ref_logprobs"][valid]).abs().max() > 1e-4
