"""Multi-turn episodes of a vision-language policy whose environment answers with pictures
(``shapes_dialogue``): each observation's picture is processed once, its placeholders expanded in
the observation's tokens (loss mask 0), shown to every later turn after the prompt's, and carried
by the trajectory to the learner, whose log-probs of the later turns equal the engine's; a
picture that cannot be used, or one offered to a text policy, rejects the episode, counted."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from async_rl.data.builtin import resolve
from async_rl.data.images import ImageProcessing, PromptImages, concat_images, expand_image_tokens
from async_rl.envs import EnvStep, MalformedEnvStepError, ShapesDialogue, check_step
from async_rl.envs.shapes import ask, draw_scene, render_png
from async_rl.generators.base import Sample, SamplingParams
from async_rl.step.agent import render_ids
from async_rl.step.episodes import EnvConfig, EpisodeLoop
from async_rl.step.rollout import GroupRequest, trajectory_of

TEMPERATURE = 1.0


def vl_parts():
    """The tiny VL model's path, tokenizer, config and image processing (``tests/test_vl_vllm.py`` too)."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve("builtin:tiny-qwen2-vl")
    tok, cfg = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    return path, tok, cfg, ImageProcessing(path, cfg.image_token_id)


def shapes_prompts(vl, num: int = 2):
    """The first ``num`` prompts of ``builtin:shapes/test``, loaded as a run loads them."""
    from async_rl.data.dataset import PromptDataset

    path, tok, _, processing = vl
    return PromptDataset([resolve("builtin:shapes/test")], tok, 256, 0, False, images=processing).prompts[:num]


@pytest.fixture(scope="module")
def vl():
    torch.set_num_threads(1)
    return vl_parts()


@pytest.fixture(scope="module")
def prompts(vl):
    return shapes_prompts(vl)


def _request(prompt, group_id: int = 0) -> GroupRequest:
    return GroupRequest(group_id=group_id, prompt_ids=list(prompt.prompt_ids), prompt_uid=prompt.uid,
                        data_source=prompt.data_source, ground_truth=prompt.ground_truth,
                        extra_info=dict(prompt.extra_info), n=1, seed=11, messages=prompt.messages,
                        images=prompt.images)


class Engine:
    """Answers the first ``len(script)`` turns of each episode with the scripted words (then its
    end-of-turn token) and hands later turns to ``real`` (a ``Generator``); records every call's
    prompt ids and images."""

    def __init__(self, tok, script: tuple[str, ...], real=None) -> None:
        self.tok, self.script, self.real, self.calls = tok, script, real, []

    def generate(self, prompts, n, params, seeds=None, on_sample=None, images=None):
        out = []
        for k, ids in enumerate(prompts):
            picture = None if images is None else images[k]
            self.calls.append((list(ids), picture))
            turn = self.tok.decode(ids).count("<|im_start|>assistant") - 1
            if turn < len(self.script):
                reply = self.tok(self.script[turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
                sample = Sample(reply, [-0.5] * len(reply), "stop", [0] * len(reply))
            else:
                sample = self.real.generate([ids], 1, params, images=[picture])[0][0]
            out.append([sample])
            if on_sample is not None:
                on_sample(k, 0, sample)
        return out


def _loop(vl, turns: int, images=True, factory=None, max_response_tokens: int = 400) -> EpisodeLoop:
    path, tok, _, processing = vl
    cfg = EnvConfig(name="shapes_dialogue", args={"turns": turns}, max_turns=turns,
                    max_response_tokens=max_response_tokens)
    return EpisodeLoop(cfg, tok, [tok.eos_token_id], 256, factory=factory, images=processing if images else None)


def _params(tok, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, stop_token_ids=(tok.eos_token_id,))


def _env_pictures(vl, request, turns: int):
    """The pictures ``shapes_dialogue`` shows after the row's, drawn as it draws them (its
    episode seed), processed as the loop processes them."""
    import random

    rng = random.Random(request.seed % 2**31)  # EpisodeLoop.run_groups: the group's seed
    kind = request.extra_info["question_type"]
    scenes = [draw_scene(rng) for _ in range(turns - 1)]
    return scenes, [vl[3].process([_decode(render_png(s))]) for s in scenes], [ask(s, kind) for s in scenes]


def _decode(png: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert("RGB")


def test_an_observation_picture_goes_to_every_later_turn_and_travels_with_the_trajectory(vl, prompts):
    path, tok, cfg, processing = vl
    request = _request(prompts[0])
    engine = Engine(tok, ("red", "3", "circle"))
    loop = _loop(vl, turns=3)
    (episode,), = loop.run_groups(engine, [request], 1, _params(tok), seeds=[request.seed])
    assert episode.rejected is None and episode.num_turns == 3 and episode.finish_reason == "stop"
    scenes, shown, questions = _env_pictures(vl, request, 3)
    # Turn k is generated with the prompt's picture and the k-1 the environment showed, in order.
    grids = [c[1].image_grid_thw.tolist() for c in engine.calls]
    want = [prompts[0].images.image_grid_thw.tolist()]
    for inputs in shown:
        want.append(want[-1] + inputs.image_grid_thw.tolist())
    assert grids == want
    np.testing.assert_array_equal(engine.calls[2][1].pixel_values,
                                  np.concatenate([prompts[0].images.pixel_values, *(x.pixel_values for x in shown)]))
    # The sequence is the template's rendering of the whole conversation, every picture expanded.
    messages = [*prompts[0].messages]
    for word, (question, _) in zip(("red", "3", "circle"), [*questions, (None, None)]):
        messages.append({"role": "assistant", "content": word})
        if question is not None:
            messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    everything = concat_images([prompts[0].images, *shown])
    rendered = expand_image_tokens(render_ids(tok, messages, None, add_generation_prompt=False), everything,
                                   cfg.image_token_id)
    sequence = episode.prompt_ids + episode.response_ids
    assert sequence == rendered[: len(sequence)] and len(rendered) - len(sequence) == 1  # the final "\n"
    # Placeholders are observation tokens: never trained on, never given a behavior log-prob.
    mask = np.asarray(episode.loss_mask)
    pads = np.asarray(episode.response_ids) == cfg.image_token_id
    assert pads.sum() == sum(sum(x.tokens_per_image) for x in shown) and not (mask[pads]).any()
    # The trajectory carries the observations' pictures (not the prompt's: the trainer holds those).
    traj = trajectory_of(episode, tok, 0, 0, request.prompt_uid, request.prompt_ids)
    np.testing.assert_array_equal(traj.observation_pixel_values, np.concatenate([x.pixel_values for x in shown]))
    assert traj.observation_image_grid_thw.tolist() == [g for x in shown for g in x.image_grid_thw.tolist()]
    # The batch builder puts the prompt's picture first, then the trajectory's.
    (batch_images,) = PromptImages(_Dataset(prompts), merge_size=processing.merge_size).of([traj])
    assert batch_images.image_grid_thw.tolist() == want[-1]
    np.testing.assert_array_equal(batch_images.pixel_values, everything.pixel_values)
    assert loop.pop_metrics()["env/observation_images"] == 2


class _Dataset:
    def __init__(self, prompts) -> None:
        self.prompts = prompts


def test_the_episodes_reward_and_accuracy_count_each_turns_answer(vl, prompts):
    _, tok, _, _ = vl
    request = _request(prompts[1])
    _, _, questions = _env_pictures(vl, request, 2)
    right = (request.ground_truth, questions[0][1])
    for script, reward, acc in ((right, 1.0, 1.0), ((right[0], "nonsense"), 0.5, 0.0)):
        (episode,), = _loop(vl, turns=2).run_groups(Engine(tok, script), [request], 1, _params(tok),
                                                    seeds=[request.seed])
        assert (episode.env_return, episode.info["acc"], episode.turn_rewards) == (reward, acc, [0.5, reward - 0.5])


class _PictureEnv(ShapesDialogue):
    """``shapes_dialogue`` whose second observation shows ``picture`` (a test's bad one)."""

    def __init__(self, picture, text: str = "Which shape is drawn?") -> None:
        super().__init__(turns=3)
        self.picture, self.text = picture, text

    async def step(self, action: str) -> EnvStep:
        step = await super().step(action)
        if self.turn == 2:
            step.observation = [{"role": "user", "content": [{"type": "image", "image": self.picture},
                                                             {"type": "text", "text": self.text}]}]
        return step


@pytest.mark.parametrize("picture, images, reason", [
    (b"\x89PNG\r\n\x1a\n not really", True, "image_not_decodable"),
    ("/no/such/picture.png", True, "image_missing_path"),
    (12345, True, "image_bad_type"),
    (render_png(draw_scene(__import__("random").Random(0))), False, "images need a vision-language policy"),
])
def test_a_picture_that_cannot_be_used_rejects_the_episode_counted(vl, prompts, caplog, picture, images, reason):
    _, tok, _, _ = vl
    request = _request(prompts[0])
    loop = _loop(vl, turns=3, images=images, factory=lambda: _PictureEnv(picture))
    if not images:  # a text policy's episode, whose environment shows it a picture
        request = dataclasses.replace(request, images=None, messages=[{"role": "user", "content": "Which shape?"}])
    with caplog.at_level("WARNING"):
        (episode,), = loop.run_groups(Engine(tok, ("a", "b", "c")), [request], 1, _params(tok), seeds=[3])
    assert episode.rejected == "malformed" and loop.pop_metrics()["env/rejected_malformed"] == 1
    assert reason in caplog.text


def test_an_observation_over_the_budget_is_left_out_whole(vl, prompts):
    _, tok, _, _ = vl
    request = _request(prompts[0])
    first = len(tok("red", add_special_tokens=False)["input_ids"]) + 1
    (episode,), = _loop(vl, turns=3, max_response_tokens=first + 5).run_groups(
        Engine(tok, ("red", "3", "circle")), [request], 1, _params(tok), seeds=[request.seed])
    assert episode.finish_reason == "length" and episode.observation_images == []
    assert len(episode.response_ids) == first and episode.images is request.images


def test_a_first_observation_of_the_environments_own_places_the_rows_pictures(vl, prompts):
    _, tok, cfg, _ = vl
    request = _request(prompts[0])

    class Reworded(ShapesDialogue):
        def __init__(self, parts: int) -> None:
            super().__init__(turns=1)
            self.parts = parts

        async def reset(self, task, seed):
            await super().reset(task, seed)
            return [{"role": "user", "content": [*([{"type": "image"}] * self.parts), {"type": "text", "text": "Well?"}]}]

    runs = {}
    for parts in (1, 0, 2):
        loop = _loop(vl, turns=1, factory=lambda p=parts: Reworded(p))
        engine = Engine(tok, ("red",))
        (episode,), = loop.run_groups(engine, [request], 1, _params(tok), seeds=[1])
        runs[parts] = (episode, engine)
    one, none, two = runs[1][0], runs[0][0], runs[2][0]
    assert one.rejected is None and one.prompt_ids.count(cfg.image_token_id) == sum(request.images.tokens_per_image)
    assert runs[1][1].calls[0][1] is request.images
    # No image part: the row's picture is not shown (and not sent: the engine would find no placeholder).
    assert none.rejected is None and runs[0][1].calls[0][1] is None
    assert two.rejected == "malformed" and runs[2][1].calls == []


def test_an_image_part_is_checked_by_the_policy_it_goes_to():
    picture = {"role": "user", "content": [{"type": "image", "image": b"png"}, {"type": "text", "text": "And now?"}]}
    with pytest.raises(MalformedEnvStepError, match="images need a vision-language policy"):
        check_step(EnvStep([picture], 0.0, False))
    assert check_step(EnvStep([picture], 0.0, False), images=True).observation == [picture]
    # An observation's image part holds its picture: a bare one would show nothing.
    with pytest.raises(MalformedEnvStepError, match=r"'image': picture"):
        check_step(EnvStep([{"role": "user", "content": [{"type": "image"}]}], 0.0, False), images=True)


def _learner_logprobs(vl, trajectory, prompt, pixels=None) -> torch.Tensor:
    """The FSDP2 learner's label log-probs ``[L-1]`` of the trajectory, its images found as the
    trainer finds them (the prompt's by uid, then the trajectory's own)."""
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.buffers.trajectory import collate
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner

    if pixels is not None:
        trajectory.observation_pixel_values = pixels
    learner = FSDPLearner(LearnerConfig(), AlgorithmConfig().apply_preset(), vl[0], temperature=TEMPERATURE,
                          total_optimizer_steps=4)
    images = PromptImages(_Dataset([prompt]), merge_size=vl[3].merge_size).of([trajectory])
    return learner.compute_logprobs(collate([trajectory], vl[1].pad_token_id, images=images))[0]


def turn_after_a_picture_agrees(vl, prompt, real, max_tokens: int = 6) -> None:
    """Turn 1 scripted, turn 2 (after the environment's picture) sampled by ``real``: the
    learner's log-probs of turn 2 equal the engine's, and depend on the picture."""
    from vl_helpers import checkpoint_tensors

    _, tok, cfg, _ = vl
    # The learner loads the checkpoint: the engine gets its weights too (an earlier test of the
    # engine's module may have pushed others).
    real.update_weights(checkpoint_tensors(vl[0]), real.policy_version + 1)
    request = _request(prompt)
    (episode,), = _loop(vl, turns=2).run_groups(Engine(tok, ("red",), real=real), [request], 1,
                                                _params(tok, max_tokens=max_tokens), seeds=[request.seed])
    assert episode.rejected is None and episode.num_turns == 2 and len(episode.observation_images) == 1
    traj = trajectory_of(episode, tok, 0, 0, request.prompt_uid, request.prompt_ids)
    P = len(traj.prompt_ids)
    mask = np.asarray(traj.loss_mask)
    last = np.flatnonzero(mask == 0)[-1] + 1  # turn 2 starts after the observation's tokens
    sl = slice(P - 1 + last, P - 1 + len(traj.response_ids))
    got = _learner_logprobs(vl, traj, prompt)
    want = torch.tensor(traj.behavior_logprobs[last:], dtype=torch.float32)
    assert len(want) >= 1
    torch.testing.assert_close(got[sl], want, rtol=1e-5, atol=1e-5)
    other = _learner_logprobs(vl, traj, prompt, pixels=np.ascontiguousarray(traj.observation_pixel_values[::-1]))
    assert (other[sl] - got[sl]).abs().max() > 1e-3


def test_the_learner_scores_a_turn_after_a_picture_as_the_hf_engine_sampled_it(vl, prompts):
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

    engine = HFGenerator(vl[0], GeneratorConfig(max_batch_size=4), pad_token_id=vl[1].pad_token_id)
    turn_after_a_picture_agrees(vl, prompts[0], engine)
