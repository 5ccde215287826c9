"""Environments: the episode protocol, the episode loop's tokens and faults, the built-ins (a
guessing game, gymnasium text games), and whole runs through both modes."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import threading
import time
from pathlib import Path

import pytest

from async_rl.envs import (ENVIRONMENTS, EnvStep, Environment, GuessNumber, MalformedEnvStepError, Task, check_step,
                           make_env, register_env)
from async_rl.generators.base import Sample, SamplingParams
from async_rl.step.agent import render_ids
from async_rl.step.episodes import EnvConfig, Episode, EpisodeLoop
from async_rl.step.rollout import GroupRequest, sample_groups

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve

    return AutoTokenizer.from_pretrained(resolve("builtin:tiny-qwen2"))


class ScriptedGenerator:
    """Assistant turn k of every episode is ``replies[k]`` (cut at ``max_tokens``), log-prob -0.5,
    policy version 7; records each prompt's ids."""

    def __init__(self, tok, replies: list[str]):
        self.tok, self.replies, self.prompts = tok, replies, []

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        out = []
        for ids in prompts:
            self.prompts.append(list(ids))
            turn = self.tok.decode(ids).count("<|im_start|>assistant") - 1
            reply = self.tok(self.replies[turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            reply = reply[: params.max_tokens]
            out.append([Sample(reply, [-0.5] * len(reply), "stop" if reply[-1] == self.tok.eos_token_id else "length",
                               [7] * len(reply))])
            if on_sample is not None:  # as an engine streams its samples
                on_sample(len(out) - 1, 0, out[-1][0])
        return out


def _request(tok, group_id=0, n=2, content="Guess.", extra=None, seed=11):
    messages = [{"role": "user", "content": content}]
    return GroupRequest(group_id, render_ids(tok, messages, None, True), f"uid-{group_id}", "game", None,
                        dict(extra or {}), n, seed, messages)


def _loop(tok, factory, **cfg):
    return EpisodeLoop(EnvConfig(name="guess_number", **cfg), tok, [tok.eos_token_id], max_prompt_tokens=256,
                       factory=factory)


def _params(max_tokens=32):
    return SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,))


# ------------------------------------------------------------------ the protocol
def test_check_step_refuses_each_malformed_field():
    assert check_step(EnvStep([{"role": "user", "content": "x"}], 1, False)).reward == 1
    assert check_step(EnvStep([], 0.5, True, {"k": 2})).done
    for bad, match in [("nope", "must return an EnvStep"), (EnvStep([], float("nan"), True), "finite"),
                       (EnvStep([], True, True), "finite"), (EnvStep([], 0.0, 1), "bool"),
                       (EnvStep([{"role": "assistant", "content": "x"}], 0.0, False), r"observation\[0\]"),
                       (EnvStep([{"role": "user", "content": 3}], 0.0, False), r"observation\[0\]"),
                       (EnvStep([], 0.0, False), "empty but the episode is not done"),
                       (EnvStep([], 0.0, True, {"k": "v"}), "info")]:
        with pytest.raises(MalformedEnvStepError, match=match):
            check_step(bad)


def test_environment_specs_resolve_or_fail_in_one_line(tmp_path):
    assert isinstance(make_env("guess_number", {"low": 1, "high": 4})(), GuessNumber)
    assert isinstance(make_env("builtin:guess_number")(), GuessNumber)
    user = tmp_path / "my_envs.py"
    user.write_text("from async_rl.envs import Environment, EnvStep\n"
                    "class Echo(Environment):\n"
                    "    async def step(self, action):\n"
                    "        return EnvStep([], float(action == 'hi'), True)\n"
                    "class NotAnEnv:\n    pass\n"
                    "def returns_int():\n    return 3\n")
    assert type(make_env(f"{user}:Echo")()).__name__ == "Echo"
    for spec, args, match in [("no_such_env", {}, "unknown environment 'no_such_env'"),
                              (f"{user}:NotAnEnv", {}, "not an Environment subclass"),
                              (f"{user}:returns_int", {}, "returned a int, not an Environment"),
                              ("guess_number", {"low": 5, "high": 1}, "low=5 is above high=1"),
                              ("guess_number", {"colour": "red"}, "unexpected keyword argument 'colour'")]:
        with pytest.raises(ValueError, match=match) as info:
            make_env(spec, args)
        assert "\n" not in str(info.value)

    @register_env(name="test_registered_env")
    class Registered(Environment):
        pass

    try:
        assert make_env("test_registered_env")().__class__ is Registered
    finally:
        ENVIRONMENTS.pop("test_registered_env")


def test_guess_number_plays_by_its_rules():
    env = GuessNumber(1, 16)
    first = asyncio.run(env.reset(Task("u", [], "game", None, {}), seed=3))
    assert first[0]["role"] == "user" and "between 1 and 16" in first[0]["content"]
    secret = env.secret
    again = GuessNumber(1, 16)
    asyncio.run(again.reset(Task("u", [], "game", None, {}), seed=3))
    assert again.secret == secret  # a group's episodes share the seed, hence the secret
    asyncio.run(env.reset(Task("u", [{"role": "user", "content": "row"}], "game", None, {"secret": 9}), seed=3))
    assert env.secret == 9
    assert asyncio.run(env.step("maybe 4?")).observation[0]["content"] == "4 is wrong: higher."
    assert asyncio.run(env.step("12")).observation[0]["content"] == "12 is wrong: lower."
    no_number = asyncio.run(env.step("no idea"))
    assert no_number.reward == 0.0 and not no_number.done and no_number.info == {"invalid": 1.0}
    right = asyncio.run(env.step("It is 9."))
    assert (right.reward, right.done, right.info) == (1.0, True, {"guesses": 3.0})


# ------------------------------------------------------------------ the episode loop
class Countdown(Environment):
    """Feedback 'again' with reward 0.25 per turn, done after ``turns`` steps."""

    def __init__(self, turns: int = 2):
        self.turns, self.steps, self.closed = turns, 0, False

    async def step(self, action):
        self.steps += 1
        done = self.steps >= self.turns
        return EnvStep([] if done else [{"role": "user", "content": f"again {self.steps}"}], 0.25, done,
                       {"chars": float(len(action))})


def test_episode_ids_equal_the_template_and_the_return_sums_the_turns(tok):
    loop = _loop(tok, lambda: Countdown(3))
    gen = ScriptedGenerator(tok, ["first", "second", "third"])
    seen = []
    (row,) = loop.run_groups(gen, [_request(tok)], 2, _params(), seeds=[5], on_sample=lambda i, j, c: seen.append(j))
    assert sorted(seen) == [0, 1]
    for c in row:
        assert isinstance(c, Episode) and c.finish_reason == "stop" and c.rejected is None
        assert c.turn_rewards == [0.25] * 3 and c.env_return == 0.75 and c.info == {"chars": 5 + 6 + 5}
        whole = render_ids(tok, c.messages, None, add_generation_prompt=False)
        # Generated ids and observation glue together are the template's rendering of the episode
        # (up to the last end-of-turn token; the template adds a newline after it).
        assert c.prompt_ids + c.response_ids == whole[: len(c.prompt_ids) + len(c.response_ids)]
        assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
        assert len(c.response_ids) == len(c.logprobs) == len(c.loss_mask) == len(c.policy_version)
        generated = [k for k, m in enumerate(c.loss_mask) if m]
        assert all(c.logprobs[k] == -0.5 and c.policy_version[k] == 7 for k in generated)
        assert all(c.logprobs[k] == 0.0 for k in range(len(c.loss_mask)) if not c.loss_mask[k])
        assert c.num_turns == 3 and c.env is None
    assert loop.pop_metrics() == {"env/episodes": 2.0}
    assert loop.pop_metrics() == {}


def test_an_environment_may_keep_its_expected_answer_in_self_answer(tok):
    # ``answer`` is also the name of Environment's hook (the text the run's reward scores); an
    # environment that stores its expected answer under that name must still run.
    class Quiz(Environment):
        async def reset(self, task, seed):
            self.answer = "second"
            return list(task.messages)

        async def step(self, action):
            return EnvStep([], float(action == self.answer), True)

    (row,) = _loop(tok, Quiz).run_groups(ScriptedGenerator(tok, ["second"]), [_request(tok, n=1)], 1, _params(),
                                         seeds=[1])
    assert row[0].rejected is None and row[0].env_return == 1.0 and row[0].final_text == "second"


def test_turn_and_token_limits_end_episodes(tok):
    loop = _loop(tok, lambda: Countdown(10), max_turns=2)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["a", "b"]), [_request(tok, n=1)], 1, _params(), seeds=[1])
    assert row[0].finish_reason == "max_turns" and row[0].turn_rewards == [0.25, 0.25]
    # A turn cut by the budget never reaches the environment.
    loop = _loop(tok, lambda: Countdown(10), max_response_tokens=3)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["a long answer that goes on"]), [_request(tok, n=1)], 1,
                             _params(), seeds=[1])
    assert row[0].finish_reason == "length" and row[0].turn_rewards == [] and len(row[0].response_ids) == 3
    # An observation with no room for a next turn after it ends the episode with "length".
    loop = _loop(tok, lambda: Countdown(10), max_response_tokens=8)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["ok", "ok"]), [_request(tok, n=1)], 1, _params(), seeds=[1])
    assert row[0].finish_reason == "length" and row[0].turn_rewards == [0.25] and set(row[0].loss_mask) == {1}


class Shouts(Environment):
    """Answers every turn with a long observation."""

    async def step(self, action):
        return EnvStep([{"role": "user", "content": "é" * 40}], 0.0, False)


def test_long_observations_are_cut_to_env_max_observation_tokens(tok):
    loop = _loop(tok, Shouts, max_turns=2, max_observation_tokens=10)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["a", "b"]), [_request(tok, n=1)], 1, _params(), seeds=[1])
    # 10 byte-level tokens hold 5 whole two-byte characters; the cut is marked.
    assert row[0].messages[2]["content"] == "é" * 5 + " ...[truncated]"
    assert row[0].finish_reason == "max_turns"
    (row,) = _loop(tok, Shouts, max_turns=2).run_groups(ScriptedGenerator(tok, ["a", "b"]), [_request(tok, n=1)], 1,
                                                       _params(), seeds=[1])
    assert row[0].messages[2]["content"] == "é" * 40
    with pytest.raises(ValueError, match="env.max_observation_tokens must be >= 1"):
        EnvConfig(max_observation_tokens=0)


def test_warm_start_reads_an_environments_demonstration_from_a_list_or_its_json_text(tok):
    from async_rl.step.evaluation import _demonstration

    loop = _loop(tok, Countdown)
    demo = [{"role": "assistant", "content": "3"}, {"role": "user", "content": "higher"},
            {"role": "assistant", "content": "5"}]
    assert _demonstration(demo, loop) == demo
    assert _demonstration(json.dumps(demo), loop) == demo
    # Answers of one turn, even ones that read as JSON, are not demonstrations.
    for answer in ["42", "[1, 2]", "[not json", '{"a": 1}', ""]:
        assert _demonstration(answer, loop) is None
    assert _demonstration("42", None) is None


class Faulty(Environment):
    def __init__(self, mode: str):
        self.mode = mode

    async def reset(self, task, seed):
        if self.mode == "reset_raises":
            raise RuntimeError("no server")
        if self.mode == "long_prompt":
            return [{"role": "user", "content": "word " * 400}]
        if self.mode == "reset_malformed":
            return "not messages"
        return list(task.messages)

    async def step(self, action):
        if self.mode == "step_raises":
            raise ConnectionError("server gone")
        if self.mode == "hangs":
            await asyncio.sleep(60)
        if self.mode == "blocks":
            time.sleep(1.5)  # synchronous work inside a coroutine: blocks the loop itself
        if self.mode == "malformed":
            return {"reward": 1}
        return EnvStep([], 1.0, True)


@pytest.mark.parametrize("mode,reason", [("reset_raises", "error"), ("reset_malformed", "malformed"),
                                         ("long_prompt", "prompt_too_long"), ("step_raises", "error"),
                                         ("hangs", "timeout"), ("malformed", "malformed"), ("blocks", "timeout")])
def test_environment_faults_reject_the_episode_with_its_reason(tok, mode, reason):
    loop = _loop(tok, lambda: Faulty(mode), step_timeout_s=1.0)
    t0 = time.monotonic()
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["x"]), [_request(tok, n=2)], 2, _params(), seeds=[1])
    assert time.monotonic() - t0 < 30
    assert [c.rejected for c in row] == [reason, reason]
    assert loop.pop_metrics() == {"env/episodes": 2.0, f"env/rejected_{reason}": 2.0}
    # The loop serves the next episodes (a blocked event loop was replaced).
    loop.factory = lambda: Faulty("fine")
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["x"]), [_request(tok, n=2)], 2, _params(), seeds=[1])
    assert [c.rejected for c in row] == [None, None] and [c.env_return for c in row] == [1.0, 1.0]


def test_an_environment_that_blocks_its_event_loop_is_given_up_and_replaced(tok):
    class Blocks(Environment):
        async def step(self, action):
            time.sleep(7)  # past twice the timeout plus 5 s: the loop itself is stuck
            return EnvStep([], 1.0, True)

    loop = _loop(tok, Blocks, step_timeout_s=0.5)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["x"]), [_request(tok, n=1)], 1, _params(), seeds=[1])
    assert [c.rejected for c in row] == ["timeout"]
    loop.factory = lambda: Countdown(1)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["x"]), [_request(tok, n=1)], 1, _params(), seeds=[1])
    assert [c.env_return for c in row] == [0.25]


class Recording:
    """A reward scorer that must never be asked: episodes carry their return."""

    fn = object()
    model = None

    def submit(self, *args, **kwargs):
        raise AssertionError("an episode's reward went to the reward function")

    def drain(self):
        pass


class HalfFaulty(Environment):
    """Odd seeds of the per-episode counter raise in ``step``; the others score 1 at once."""

    made = 0

    def __init__(self):
        HalfFaulty.made += 1
        self.bad = HalfFaulty.made % 2 == 0

    async def reset(self, task, seed):
        return [{"role": "user", "content": f"seed {seed}"}]

    async def step(self, action):
        if self.bad:
            raise RuntimeError("boom")
        return EnvStep([], 1.0, True)


def test_sample_groups_takes_the_return_as_reward_and_drops_rejected_episodes(tok):
    HalfFaulty.made = 0
    loop = _loop(tok, HalfFaulty)
    kept, closed = [], []
    requests = [_request(tok, group_id=g, n=2, seed=100 + g) for g in range(2)]
    counts = sample_groups(ScriptedGenerator(tok, ["a"]), requests, _params(), tok, Recording(), loop, kept.append,
                           lambda r, k: closed.append((r.group_id, k)))
    assert (counts.samples, counts.rejected_samples, counts.groups, counts.rejected_groups) == (4, 2, 2, 0)
    assert sorted(closed) == [(0, 1), (1, 1)]
    for t in kept:
        assert t.reward == 1.0 and t.reward_extras["env/return"] == 1.0
        # The first observation of reset (not the row's prompt) is the trajectory's prompt.
        seed = int(tok.decode(t.prompt_ids).split("seed ")[1].split("<")[0])
        assert list(t.prompt_ids) == render_ids(tok, [{"role": "user", "content": f"seed {seed}"}], None, True)
        assert seed == requests[t.group_id].seed % 2**31


def test_evaluation_episodes_are_counted_apart(tok):
    loop = _loop(tok, lambda: Countdown(1))
    loop.run_groups(ScriptedGenerator(tok, ["a"]), [_request(tok, n=1)], 1, _params(), seeds=None)
    with loop.counted_apart() as own:
        loop.run_groups(ScriptedGenerator(tok, ["a"]), [_request(tok, n=3)], 3, _params(), seeds=None)
    assert own == {"env/episodes": 3.0}
    assert loop.pop_metrics() == {"env/episodes": 1.0}
    assert loop.counts() == {"env/episodes": 4.0}


# ------------------------------------------------------------------ single-turn prompts as an environment
class ScriptedSampler(ScriptedGenerator):
    """``ScriptedGenerator`` with ``n`` samples per prompt and the streaming callback, as the plain
    single-turn road calls an engine."""

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        out = [[s for _ in range(n) for s in super(ScriptedSampler, self).generate([ids], 1, params)[0]]
               for ids in prompts]
        for i, row in enumerate(out):
            for j, sample in enumerate(row):
                if on_sample is not None:
                    on_sample(i, j, sample)
        return out


def test_single_turn_episodes_are_scored_by_the_run_reward_as_plain_samples_are(tok):
    from async_rl.rewards.config import RewardConfig
    from async_rl.step.rollout import make_scorer

    def requests():
        return [GroupRequest(g, render_ids(tok, [{"role": "user", "content": f"{g}+7="}], None, True), f"u{g}",
                             "async_rl/arithmetic", str(g + 7), {}, 2, 100 + g, [{"role": "user", "content": f"{g}+7="}])
                for g in range(2)]

    scorer = make_scorer(RewardConfig(fn="arithmetic", num_workers=0), "zero")
    loop = EpisodeLoop(EnvConfig(name="single_turn"), tok, [tok.eos_token_id], max_prompt_tokens=256)
    episodes, plain = [], []
    sample_groups(ScriptedSampler(tok, ["8"]), requests(), _params(), tok, scorer, loop, episodes.append)
    sample_groups(ScriptedSampler(tok, ["8"]), requests(), _params(), tok, scorer, None, plain.append)
    key = lambda t: t.trajectory_id  # noqa: E731
    assert [t.trajectory_id for t in sorted(episodes, key=key)] == ["0/0", "0/1", "1/0", "1/1"]
    for e, p in zip(sorted(episodes, key=key), sorted(plain, key=key)):
        # 1+7=8 is right, 0+7=8 is not: the run's reward function scored the episode's answer.
        assert e.reward == p.reward == float(e.group_id == 1)
        eight = tok("8", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert list(e.response_ids) == list(p.response_ids) == eight
        assert list(e.prompt_ids) == list(p.prompt_ids) and list(e.loss_mask) == list(p.loss_mask) == [1, 1]
        assert e.response_text == "8" and "env/return" not in e.reward_extras
    assert loop.pop_metrics() == {"env/episodes": 4.0}


def test_single_turn_takes_the_run_reward_and_other_environments_refuse_it():
    from async_rl.config import ConfigError, load_config

    cfg = load_config(None, ["model.path=x", "data.train_files=[x]", "env.name=single_turn", "reward.fn=arithmetic"])
    assert cfg.reward.fn == "arithmetic"
    for name in ("guess_number", "mix"):
        with pytest.raises(ConfigError, match="the environment's return is the reward"):
            load_config(None, ["model.path=x", "data.train_files=[x]", f"env.name={name}", "reward.fn=arithmetic",
                               "env.args={envs: {g: {name: guess_number}}}"] if name == "mix" else
                        ["model.path=x", "data.train_files=[x]", f"env.name={name}", "reward.fn=arithmetic"])


def test_a_single_turn_row_without_a_reward_function_stops_the_run_at_load(tmp_path, monkeypatch):
    import async_rl.trainer
    from async_rl.config import load_config
    from async_rl.trainer import train

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started: the missing reward function was not caught at load")

    monkeypatch.setattr(async_rl.trainer, "make_generator", no_engine)

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "data_source": "nobody/scores_this",
                                "reward_model": {"ground_truth": "1"}}) + "\n")
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "env.name=single_turn", f"data.train_files=[{rows}]", "data.val_files=[]", "trainer.warm_start.steps=0",
        f"trainer.output_dir={tmp_path / 'out'}", "trainer.prompts_per_step=1"])
    with pytest.raises(ValueError, match="no built-in reward for data_source .nobody/scores_this"):
        train(cfg)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_plain_run_takes_the_episode_road_of_single_turn():
    from async_rl.config import load_config
    from async_rl.step.episodes import rollout_env_config

    cfg = load_config(ROOT / "configs" / "default.yaml", ["generator.max_response_tokens=12"])
    assert not cfg.env.enabled and not cfg.agent.enabled
    env_cfg = rollout_env_config(cfg)
    assert (env_cfg.name, env_cfg.max_turns, env_cfg.max_response_tokens) == ("single_turn", 1, 12)


def test_episodes_are_handed_on_while_the_engine_still_decodes(tok):
    """An episode that ends is scored the moment its turn is sampled, as a plain sample is, not
    when the engine's whole batch is done."""
    handed = threading.Event()

    class Streaming(ScriptedGenerator):
        waited: list[bool] = []  # per generate call: whether the first episode was handed on meanwhile

        def generate(self, prompts, n, params, seeds=None, on_sample=None):
            out = super().generate(prompts, n, params, seeds)
            on_sample(0, 0, out[0][0])
            # The engine is still decoding the second row: the first must reach on_sample meanwhile.
            self.waited.append(handed.wait(timeout=10))
            on_sample(1, 0, out[1][0])
            return out

    loop = EpisodeLoop(EnvConfig(name="single_turn", max_turns=1), tok, [tok.eos_token_id], max_prompt_tokens=256)
    got = []

    def on_sample(i, j, episode):
        got.append((i, j))
        handed.set()

    engine = Streaming(tok, ["8"])
    (row,) = loop.run_groups(engine, [_request(tok, n=2)], 2, _params(), seeds=[1], on_sample=on_sample)
    assert engine.waited == [True] and sorted(got) == [(0, 0), (0, 1)]
    assert [c.finish_reason for c in row] == ["stop", "stop"]


def test_the_default_job_runs_through_the_single_turn_environment(tmp_path):
    from async_rl.trainer import train

    from async_rl.config import load_config

    # No env.name: the default road is single_turn's episodes.
    cfg = load_config(ROOT / "configs" / "default.yaml", [
        "trainer.total_steps=2", "trainer.warm_start.steps=20",
        "trainer.prompts_per_step=8", "trainer.eval_every_steps=2", "data.val_max_prompts=16",
        f"trainer.output_dir={tmp_path}", "logging.console_every_steps=1"])
    train(cfg)
    metrics = [json.loads(line) for line in next(tmp_path.rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [m for m in metrics if "rollout/reward_mean" in m]
    assert len(steps) == 2 and all(m["env/episodes"] == 64 for m in steps)
    assert all("env/return_mean" not in m for m in steps)


# ------------------------------------------------------------------ gymnasium text games
GAME = '''
import gymnasium
from gymnasium import spaces


class SayTheWord(gymnasium.Env):
    """Text in, text out: say the word of the round; two rounds."""

    WORDS = ["one", "two", "three", "four"]

    def __init__(self, rounds: int = 2):
        self.observation_space = spaces.Text(64)
        self.action_space = spaces.Text(64)
        self.rounds = rounds

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.round = 0
        self.word = self.WORDS[int(self.np_random.integers(len(self.WORDS)))]
        return f"Say {self.word}.", {}

    def step(self, action):
        self.round += 1
        reward = float(self.word in action.lower())
        self.word = self.WORDS[int(self.np_random.integers(len(self.WORDS)))]
        done = self.round >= self.rounds
        return ("" if done else f"Say {self.word}."), reward, done, False, {"round": self.round}


def parse(text):
    if not text.strip():
        raise ValueError("say something")
    return text
'''


def test_a_gymnasium_text_game_runs_unchanged(tok, tmp_path):
    pytest.importorskip("gymnasium")
    game = tmp_path / "game.py"
    game.write_text(GAME)
    factory = make_env("gym", {"id": f"{game}:SayTheWord", "kwargs": {"rounds": 2}, "action": f"{game}:parse",
                               "system_prompt": "Repeat the word."})
    loop = _loop(tok, factory)
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["one two", "three four"]), [_request(tok, n=2, seed=4)], 2,
                             _params(), seeds=[4])
    for c in row:
        assert c.finish_reason == "stop" and c.rejected is None
        assert c.messages[0] == {"role": "system", "content": "Repeat the word."}
        assert c.messages[1]["content"].startswith("Say ") and len(c.turn_rewards) == 2
        assert c.env_return == sum(c.turn_rewards) and c.info == {"round": 1.0 + 2.0}
    assert row[0].messages == row[1].messages  # one seed per group: the same game
    assert loop.pop_metrics() == {"env/episodes": 2.0}
    invalid = loop.factory()
    asyncio.run(invalid.reset(None, 0))
    step = asyncio.run(invalid.step("  "))
    assert step.observation == [{"role": "user", "content": "Invalid action: say something"}] and not step.done
    with pytest.raises(ValueError, match="gymnasium environment 'NoSuchGame-v0'"):
        make_env("gym", {"id": "NoSuchGame-v0"})


# ------------------------------------------------------------------ whole runs
def _guess_rows(path: Path, count: int, offset: int) -> Path:
    from async_rl.envs import guess_prompt

    with path.open("w") as f:
        for k in range(count):
            # The warm start's demonstration: a short answer that ends its turn, so turns reach
            # the environment (the untrained model rarely ends a turn within the budget).
            f.write(json.dumps({"prompt": [{"role": "user", "content": guess_prompt(1, 4)}],
                                "data_source": "guess_number",
                                "extra_info": {"secret": 1 + (k + offset) % 4,
                                               "demonstration": [{"role": "assistant", "content": "one 2"}]}})
                    + "\n")
    return path


def _run(tmp_path, name, *overrides, env=("env.name=guess_number", "env.args={low: 1, high: 4}")):
    from async_rl.config import load_config
    from async_rl.trainer import train

    train_file = _guess_rows(tmp_path / "train.jsonl", 16, 0)
    val_file = _guess_rows(tmp_path / "val.jsonl", 4, 1)
    cfg = load_config(None, [
        "model.path=builtin:tiny-qwen2", f"data.train_files=[{train_file}]", f"data.val_files=[{val_file}]",
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2", "trainer.eval_every_steps=2",
        "trainer.warm_start.steps=30", "trainer.warm_start.batch_size=8", "trainer.warm_start.lr=3e-3",
        "trainer.warm_start.response_field=extra_info.demonstration", "logging.progress=false",
        "generator.max_response_tokens=8",
        *env, "env.max_turns=3", "env.max_response_tokens=48",
        "generator.num_workers=1", *overrides])
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, [line for line in lines if line["step"] >= 1 and "loss/pg" in line]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_guess_number_runs_end_to_end(tmp_path, mode):
    summary, steps = _run(tmp_path, mode, f"trainer.mode={mode}")
    assert [s["policy/version"] for s in steps] == [1, 2]
    for s in steps:
        assert 1.0 <= s["rollout/turns_mean"] <= 3.0 and s["rollout/num_trajectories"] > 0
        assert 0.0 <= s["rollout/reward_mean"] <= 1.0
    assert sum(s.get("env/episodes", 0.0) for s in steps) >= 8
    assert "eval_final" in summary
    if mode == "async":
        ledger = {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("pipeline/")}
        assert ledger["trained"] == 8


def test_a_gymnasium_text_game_runs_end_to_end_in_async_mode(tmp_path):
    """The game's file is named by path: each generator actor loads it."""
    pytest.importorskip("gymnasium")
    game = tmp_path / "game.py"
    game.write_text(GAME)
    summary, steps = _run(tmp_path, "gym", "trainer.mode=async",
                          env=("env.name=gym", f"env.args={{id: '{game}:SayTheWord', kwargs: {{rounds: 2}}}}"))
    assert [s["policy/version"] for s in steps] == [1, 2]
    for s in steps:
        # After the warm start turns end and reach the game ("one 2" says the word "one" or "two").
        assert s["rollout/env_info_round_mean"] > 1.0 and s["rollout/turns_mean"] > 1.0
    assert summary["pipeline/trained"] == 8


def test_env_config_is_checked_at_load(tmp_path):
    from async_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="env.name=guess_number and agent.tools"):
        load_config(None, ["model.path=x", "data.train_files=[x]", "env.name=guess_number", "agent.tools=[calculator]"])
    with pytest.raises(ConfigError, match="the environment's return is the reward"):
        load_config(None, ["model.path=x", "data.train_files=[x]", "env.name=guess_number", "reward.fn=math"])
    with pytest.raises(ConfigError, match="env.name: unknown environment 'nope'"):
        load_config(None, ["model.path=x", "data.train_files=[x]", "env.name=nope"])
    with pytest.raises(ConfigError, match="env.step_timeout_s must be > 0"):
        load_config(None, ["model.path=x", "data.train_files=[x]", "env.step_timeout_s=0"])
    cfg = load_config(None, ["model.path=x", "data.train_files=[x]", "env.name=guess_number",
                             "env.max_response_tokens=100", "data.max_prompt_tokens=50"])
    from async_rl.step.rollout import longest_sequence

    assert longest_sequence(cfg) == (150, "data.max_prompt_tokens=50 + env.max_response_tokens=100")


# ------------------------------------------------------------------ reasoning-gym
RG_TASKS = {"chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
            "spell_backward": {"weight": 1, "config": {"min_word_len": 3, "max_word_len": 4}}}


def test_weighted_shares_sum_to_the_total_in_proportion():
    from async_rl.envs.base import weighted_shares

    assert weighted_shares([1, 1, 1], 100) == [34, 33, 33]  # rounding each share gave 99
    assert weighted_shares([1, 3], 8) == [2, 6]
    assert weighted_shares([2, 1], 1) == [1, 0]
    assert sum(weighted_shares([0.1, 0.7, 0.2], 1001)) == 1001
    with pytest.raises(ValueError, match="positive"):
        weighted_shares([1, 0], 10)


def test_reasoning_gym_rows_mix_tasks_and_hold_out_unseen_questions():
    pytest.importorskip("reasoning_gym")
    from async_rl.envs.reasoning_gym import task_rows

    train = task_rows("train", tasks=RG_TASKS, size=300, val_size=40, seed=3)
    val = task_rows("val", tasks=RG_TASKS, size=300, val_size=40, seed=3)
    assert len(train) == 300 and len(val) == 40
    assert {r["data_source"] for r in train} == {"reasoning_gym/chain_sum", "reasoning_gym/spell_backward"}
    assert {r["data_source"] for r in val} == {"reasoning_gym/chain_sum", "reasoning_gym/spell_backward"}
    questions = {r["prompt"][0]["content"] for r in train}
    assert not questions & {r["prompt"][0]["content"] for r in val}
    assert len({r["prompt"][0]["content"] for r in val}) == 40
    assert train == task_rows("train", tasks=RG_TASKS, size=300, val_size=40, seed=3)  # seeded
    row = train[0]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["entry"]["answer"]
    json.dumps(row)  # plain JSON: the entry's tuples became lists
    small = {"chain_sum": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}}
    def per_task(rows):
        return collections.Counter(r["data_source"].split("/")[1] for r in rows)

    assert per_task(train) == {"chain_sum": 150, "spell_backward": 150} and per_task(val) == {"chain_sum": 20,
                                                                                              "spell_backward": 20}
    # A small task space (chain_sum of one-digit terms repeats its questions) keeps its weighted share
    # of the held-out rows: a mixed draw filtered afterwards gave it 30 of 100 at weights 1:1.
    tilted = {"chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}},
              "spell_backward": {"weight": 3, "config": RG_TASKS["spell_backward"]["config"]}}
    assert per_task(task_rows("val", tasks=tilted, size=2000, val_size=100, seed=1)) == {"chain_sum": 25,
                                                                                         "spell_backward": 75}
    with pytest.raises(ValueError, match="only 0 distinct held-out chain_sum questions .* too small"):
        task_rows("val", tasks=small, size=3000, val_size=10, seed=0)
    with pytest.raises(ValueError, match="unknown keys \\['wieght'\\]"):
        task_rows("train", tasks={"chain_sum": {"wieght": 1}})
    with pytest.raises(ValueError, match="reasoning_gym"):
        make_env("reasoning_gym", {"tasks": ["no_such_task"]})


def test_reasoning_gym_scores_exact_answers_and_partial_credit():
    pytest.importorskip("reasoning_gym")
    from async_rl.envs.reasoning_gym import task_rows

    rows = task_rows("train", tasks={"spell_backward": RG_TASKS["spell_backward"]}, size=5, seed=1)
    entry = rows[0]["extra_info"]["entry"]
    task = Task("u", rows[0]["prompt"], rows[0]["data_source"], None, rows[0]["extra_info"])
    env = make_env("reasoning_gym", {"tasks": ["spell_backward"]})()
    assert asyncio.run(env.reset(task, 0)) == rows[0]["prompt"]
    exact = asyncio.run(env.step(f"  {entry['answer']} "))
    assert (exact.reward, exact.done, exact.info) == (1.0, True, {"score": 1.0, "acc": 1.0})
    partial = asyncio.run(env.step(entry["answer"][:-1]))
    assert 0.0 < partial.reward < 1.0 and partial.info["acc"] == 0.0
    tagged = make_env("reasoning_gym", {"tasks": ["spell_backward"], "answer_tag": "answer"})()
    asyncio.run(tagged.reset(task, 0))
    assert asyncio.run(tagged.step(f"I think <answer>{entry['answer']}</answer>")).info["acc"] == 1.0
    with pytest.raises(ValueError, match="no extra_info.entry"):
        asyncio.run(env.reset(Task("u", [], "x", None, {}), 0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_reasoning_gym_tasks_run_end_to_end_with_per_task_metrics(tmp_path, mode):
    pytest.importorskip("reasoning_gym")
    from async_rl.config import load_config
    from async_rl.trainer import train

    cfg = load_config(None, [
        "model.path=builtin:tiny-qwen2", "data.train_files=[env:train]", "data.val_files=[env:val]",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=rg", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2", "trainer.eval_every_steps=2",
        "trainer.warm_start.steps=20", "trainer.warm_start.batch_size=8", "trainer.warm_start.lr=3e-3",
        "trainer.warm_start.response_field=reward_model.ground_truth", "logging.progress=false",
        "generator.max_response_tokens=8", "env.name=reasoning_gym", f"trainer.mode={mode}",
        f"env.args={json.dumps({'tasks': RG_TASKS, 'size': 64, 'val_size': 8, 'seed': 1})}"])
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "rg" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["step"] >= 1 and "loss/pg" in line]
    assert [s["policy/version"] for s in steps] == [1, 2]
    if mode == "sync":
        assert all(s["env/episodes"] == 8 for s in steps)
    else:  # the actors' episodes between two steps: sampling runs ahead, but every trained one counted
        assert sum(s.get("env/episodes", 0.0) for s in steps) >= 16
    # Partial credit and exact accuracy side by side; accuracy counts full scores only.
    assert any("rollout/env_info_score_mean" in s for s in steps)
    for s in steps:
        if "rollout/env_info_acc_mean" in s:
            assert s["rollout/accuracy"] == s["rollout/env_info_acc_mean"] <= s["rollout/env_info_score_mean"]
    tasks = ["reasoning_gym/chain_sum", "reasoning_gym/spell_backward"]
    for s in steps:  # the two tasks' figures apart, adding up to the step's
        counts = [s.get(f"env/{task}/num_trajectories", 0.0) for task in tasks]
        assert sum(counts) == s["rollout/num_trajectories"]
        assert sum(s.get(f"env/{task}/reward_mean", 0.0) * c for task, c in zip(tasks, counts)) == pytest.approx(
            s["rollout/reward_mean"] * s["rollout/num_trajectories"])
    evals = [line for line in lines if "eval/num_prompts" in line]
    assert evals and all(e["eval/num_prompts"] == 8.0 for e in evals)
    for e in evals:
        assert sum(e.get(f"eval/{task}/num_prompts", 0.0) for task in tasks) == 8.0
        assert all(0.0 <= e.get(f"eval/{task}/accuracy", 0.0) <= 1.0 for task in tasks)
    assert 0.0 <= summary["eval_final"] <= 1.0


# ------------------------------------------------------------------ servers lost mid-episode, OpenEnv
class LosesItsServer(Environment):
    """The environments made ``lost`` (numbered as made, per class) lose their server at the first step."""

    made = 0
    lost: set[int] = set()

    def __init__(self):
        LosesItsServer.made += 1
        self.number = LosesItsServer.made

    async def step(self, action):
        from async_rl.envs import EnvironmentLost

        if self.number in LosesItsServer.lost:
            raise EnvironmentLost("server gone")
        return EnvStep([], 1.0, True)


@pytest.mark.parametrize("lost,rejected", [({2}, False), ({2, 4}, True)])
def test_an_episode_whose_server_is_lost_starts_over_once(tok, lost, rejected):
    """Environments are made in order: 1 the loop's own probe of the spec, 2 and 3 episodes 0 and
    1, 4 episode 0's second start. Lost once, episode 0 starts over and scores; lost twice, it is
    rejected. Episode 1 is unaffected."""
    LosesItsServer.made, LosesItsServer.lost = 0, lost
    loop = _loop(tok, LosesItsServer)
    seen = []
    (row,) = loop.run_groups(ScriptedGenerator(tok, ["a", "b"]), [_request(tok, n=2)], 2, _params(), seeds=[1],
                             on_sample=lambda i, j, c: seen.append((j, c.rejected, c.env_return)))
    assert sorted(seen) == [(0, "lost" if rejected else None, 0.0 if rejected else 1.0), (1, None, 1.0)]
    assert row[0].restarted and not row[1].restarted
    expected = {"env/episodes": 2.0, "env/reissued_episodes": 1.0}
    if rejected:
        expected["env/rejected_lost"] = 1.0
    assert loop.pop_metrics() == expected


GUESS_SERVER = ROOT / "examples" / "openenv_guess" / "server.py"


def test_openenv_servers_are_health_checked_restarted_and_stopped():
    pytest.importorskip("openenv")
    from async_rl.envs import OpenEnvServers

    with OpenEnvServers(f"{GUESS_SERVER}:app", "127.0.0.1", replicas=1) as servers:
        (proc,) = servers.procs
        proc.kill()
        deadline = time.monotonic() + 60
        while servers.restarts != [1] or servers.procs[0] is proc:
            assert time.monotonic() < deadline, "the killed server was not restarted"
            time.sleep(0.1)
        servers._wait_healthy(0)  # the replacement answers on the same URL
        replacement = servers.procs[0]
    assert replacement.poll() is not None  # stopped with the run
    with pytest.raises(ValueError, match="did not answer /health within 3 s"):
        OpenEnvServers(f"{GUESS_SERVER}:no_such_app", "127.0.0.1", replicas=1, startup_timeout_s=3).start()


class KillsTheServer(ScriptedGenerator):
    """Kills the OpenEnv server before generating the second turn (once)."""

    def __init__(self, tok, replies, servers):
        super().__init__(tok, replies)
        self.servers, self.killed = servers, False

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        if not self.killed and any(self.tok.decode(p).count("<|im_start|>assistant") == 2 for p in prompts):
            self.servers.procs[0].kill()
            self.servers.procs[0].wait()
            self.killed = True
        return super().generate(prompts, n, params, seeds, on_sample)


def test_openenv_episodes_play_the_served_game_and_start_over_when_it_dies(tok):
    pytest.importorskip("openenv")
    from async_rl.envs import OpenEnvServers

    with OpenEnvServers(f"{GUESS_SERVER}:app", "127.0.0.1", replicas=1) as servers:
        loop = _loop(tok, make_env("openenv", {"url": servers.urls}), max_turns=8)
        guesses = [str(k) for k in range(1, 9)]  # a guess per turn: 1, 2, ... finds any secret in 1..8
        (row,) = loop.run_groups(ScriptedGenerator(tok, guesses), [_request(tok, n=2, seed=3)], 2, _params(),
                                 seeds=[3])
        for c in row:
            assert c.finish_reason == "stop" and c.env_return == 1.0 and c.rejected is None
            assert c.messages[0]["content"].startswith("I am thinking of a number between 1 and 8")
            assert c.messages[2]["content"] == "1 is wrong: it is between 2 and 8." or c.num_turns == 1
        assert loop.pop_metrics() == {"env/episodes": 2.0}
        # The server dies before the second turn: each episode starts over on its replacement.
        killer = KillsTheServer(tok, guesses, servers)
        (row,) = loop.run_groups(killer, [_request(tok, n=2, seed=5)], 2, _params(), seeds=[5])
        assert killer.killed
        assert [c.restarted for c in row] == [True, True] and all(c.env_return == 1.0 for c in row)
        assert loop.pop_metrics() == {"env/episodes": 2.0, "env/reissued_episodes": 2.0}


def test_openenv_game_served_by_the_run_survives_its_server_being_killed(tmp_path, caplog):
    """A run that starts its own OpenEnv server; the server is killed after the first step: it is
    restarted, the episodes it held start over, and the ledger balances."""
    pytest.importorskip("openenv")
    import logging
    import os
    import signal
    import threading

    def kill_after_first_step():
        metrics = tmp_path / "openenv" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and '"loss/pg"' in metrics.read_text():
                break
            time.sleep(0.2)
        for line in os.popen(f"pgrep -P {os.getpid()} -f 'uvicorn server:app'").read().split():  # ours only
            os.kill(int(line), signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    with caplog.at_level(logging.INFO, logger="async_rl.envs.openenv"):
        summary, steps = _run(tmp_path, "openenv", "trainer.mode=async", "trainer.total_steps=4",
                              env=("env.name=openenv", f"env.args={{serve: {{app: '{GUESS_SERVER}:app'}}}}"))
    killer.join(timeout=5)
    assert [s["policy/version"] for s in steps] == [1, 2, 3, 4]
    ledger = {k.split("/", 1)[1]: v for k, v in summary.items() if k.startswith("pipeline/")}
    assert ledger["trained"] == 16
    assert any("exited" in r.message and "restart 1" in r.message for r in caplog.records)
    assert any("replica restarts [1]" in r.message for r in caplog.records)


# ------------------------------------------------------------------ several environments in one run
MIX = {"guess": {"name": "guess_number", "weight": 1, "args": {"low": 1, "high": 4}},
       "sums": {"name": "reasoning_gym", "weight": 3,
                "args": {"tasks": {"chain_sum": RG_TASKS["chain_sum"]}, "size": 200, "val_size": 20}}}


def test_mixed_environments_draw_rows_by_weight_and_dispatch_episodes_by_row(tok):
    pytest.importorskip("reasoning_gym")
    from async_rl.envs import MixedEnv

    rows = MixedEnv.task_rows("train", envs=MIX, size=40, seed=2)
    assert len(rows) == 40 and sum(r["extra_info"]["env"] == "sums" for r in rows) == 30
    assert {r["data_source"] for r in rows} == {"guess_number", "reasoning_gym/chain_sum"}
    assert rows == MixedEnv.task_rows("train", envs=MIX, size=40, seed=2)
    assert len(MixedEnv.task_rows("val", envs=MIX, size=40, val_size=8, seed=2)) == 8
    with pytest.raises(ValueError, match="envs.g \\(gym\\) offers no task rows"):
        MixedEnv.task_rows("train", envs={"g": {"name": "gym", "args": {}}})
    with pytest.raises(ValueError, match="is itself a mix"):
        make_env("mix", {"envs": {"m": {"name": "mix"}}})
    # Each episode goes to its row's environment: the guessing game answers, a sum is scored.
    guess = next(r for r in rows if r["extra_info"]["env"] == "guess")
    total = next(r for r in rows if r["extra_info"]["env"] == "sums")
    env = make_env("mix", {"envs": MIX})()
    asyncio.run(env.reset(Task("g", guess["prompt"], guess["data_source"], None, guess["extra_info"]), 0))
    secret = guess["extra_info"]["secret"]
    assert asyncio.run(env.step(str(secret))).reward == 1.0
    asyncio.run(env.reset(Task("s", total["prompt"], total["data_source"], None, total["extra_info"]), 0))
    assert asyncio.run(env.step(total["reward_model"]["ground_truth"])).info == {"score": 1.0, "acc": 1.0}
    with pytest.raises(ValueError, match="names none of the mixed environments"):
        asyncio.run(env.reset(Task("x", [], "x", None, {"env": "nope"}), 0))


def test_mixed_environments_run_end_to_end_with_per_environment_metrics(tmp_path):
    pytest.importorskip("reasoning_gym")
    mix = {**MIX, "sums": {**MIX["sums"], "weight": 1}}
    summary, steps = _run(tmp_path, "mix", "data.train_files=[env:train]", "data.val_files=[env:val]",
                          "trainer.warm_start.steps=0",
                          env=("env.name=mix", f"env.args={json.dumps({'envs': mix, 'size': 64, 'val_size': 8})}"))
    sources = ["guess_number", "reasoning_gym/chain_sum"]
    for s in steps:
        assert sum(s.get(f"env/{src}/num_trajectories", 0.0) for src in sources) == s["rollout/num_trajectories"]
    lines = [json.loads(line) for line in (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval/num_prompts" in line]
    assert evals and all(e["eval/guess_number/num_prompts"] == e["eval/reasoning_gym/chain_sum/num_prompts"] == 4.0
                         for e in evals)


def test_the_openenv_example_rows_demonstrate_one_guess_random_games_or_binary_search():
    pytest.importorskip("openenv")
    from async_rl.utils.registry import load_file_module

    client = load_file_module(str(ROOT / "examples" / "openenv_guess" / "client.py"), "async_rl_test", "example")
    for secret in range(1, 9):
        demo = client.binary_search(secret)
        guesses = [int(m["content"]) for m in demo if m["role"] == "assistant"]
        assert guesses[-1] == secret and len(guesses) <= 4 and len(set(guesses)) == len(guesses)
        assert all(" is wrong: it is between " in m["content"] for m in demo if m["role"] == "user")
    rows = client.GuessClient.task_rows("train", size=16)
    assert [r["extra_info"]["demonstration"] for r in rows[:2]] == [[{"role": "assistant", "content": "1"}],
                                                                    [{"role": "assistant", "content": "2"}]]
    assert rows[0]["prompt"][0]["content"] == client.INSTRUCTION
    assert client.GuessClient.task_rows("val", size=16, val_size=3, demonstration="binary_search")[2][
        "extra_info"]["demonstration"] == client.binary_search(3)
    # Random games: a number every turn, the server's true answers between them, the game over at
    # the right guess or after `turns` guesses; in range: every guess inside the range the answers
    # leave. The same rows on every call, other rows per split.
    for demonstration, turns in (("feedback_blind", 4), ("in_range", 3)):
        rows = client.GuessClient.task_rows("train", size=64, demonstration=demonstration, turns=turns)
        assert rows == client.GuessClient.task_rows("train", size=64, demonstration=demonstration, turns=turns)
        val = client.GuessClient.task_rows("val", size=64, val_size=64, demonstration=demonstration, turns=turns)
        assert [r["extra_info"]["demonstration"] for r in val] != [r["extra_info"]["demonstration"] for r in rows]
        lengths, outside = set(), 0
        for k, row in enumerate(rows):
            secret, demo = 1 + k % 8, row["extra_info"]["demonstration"]
            guesses = [int(m["content"]) for m in demo if m["role"] == "assistant"]
            assert [m["role"] for m in demo] == ["assistant", "user"] * (len(guesses) - 1) + ["assistant"]
            assert all(1 <= g <= 8 for g in guesses) and 1 <= len(guesses) <= turns
            assert secret not in guesses[:-1] and (len(guesses) == turns or guesses[-1] == secret)
            low, high = 1, 8
            for guess, said in zip(guesses, [m["content"] for m in demo if m["role"] == "user"] + [None]):
                outside += not low <= guess <= high
                if said is not None:
                    low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
                    assert said == f"{guess} is wrong: it is between {low} and {high}."
                    assert low <= secret <= high
            lengths.add(len(guesses))
        assert len(lengths) > 1
        assert (outside == 0) == (demonstration == "in_range")
    # A share of the rows demonstrates the binary search instead, spread over the secrets.
    mixed = client.GuessClient.task_rows("train", size=512, demonstration="feedback_blind", binary_search_share=0.25)
    searched = [k for k, r in enumerate(mixed) if r["extra_info"]["demonstration"] == client.binary_search(1 + k % 8)
                and 1 + k % 8 != 4]  # the search's first guess is 4: that game is one guess either way
    assert 0.18 * 448 < len(searched) < 0.32 * 448 and {1 + k % 8 for k in searched} == {1, 2, 3, 5, 6, 7, 8}
    # Slips: every guess reads the answers, at the middle of the range left or (a slip) its low
    # end; a game of `turns` guesses at most, lost games included.
    assert [m["content"] for m in client.binary_search(8, turns=3)] == ["4", "4 is wrong: it is between 5 and 8.",
                                                                       "6", "6 is wrong: it is between 7 and 8.", "7"]
    assert [m["content"] for m in client.binary_search(5, turns=3, slip=1.0, rng=random.Random(0))
            if m["role"] == "assistant"] == ["1", "2", "3"]
    slipped = client.GuessClient.task_rows("train", size=256, demonstration="binary_search", turns=3, slip=0.5)
    kinds = collections.Counter()
    for k, row in enumerate(slipped):
        secret, low, high = 1 + k % 8, 1, 8
        for m in row["extra_info"]["demonstration"]:
            if m["role"] == "assistant":
                guess = int(m["content"])
                kinds["middle" if guess == (low + high) // 2 else "low" if guess == low else "other"] += 1
                if guess != secret:
                    low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
        assert len(row["extra_info"]["demonstration"]) <= 5
    assert kinds["other"] == 0 and 0.35 < kinds["low"] / (kinds["low"] + kinds["middle"]) < 0.65, kinds
    won = sum(r["extra_info"]["demonstration"][-1]["content"] == str(1 + k % 8) for k, r in enumerate(slipped))
    assert 0.5 < won / 256 < 0.7  # 59% expected (the docstring's figure)
    with pytest.raises(ValueError, match="slip needs an rng"):
        client.binary_search(5, slip=0.5)
    with pytest.raises(ValueError, match=r"slip must be in \[0, 1\], got -0.1"):
        client.GuessClient.task_rows("train", slip=-0.1)
    with pytest.raises(ValueError, match="guess, feedback_blind, in_range, binary_search"):
        client.GuessClient.task_rows("train", demonstration="bogus")
    with pytest.raises(ValueError, match=r"binary_search_share must be in \[0, 1\], got 1.5"):
        client.GuessClient.task_rows("train", binary_search_share=1.5)


def test_the_throughput_bench_samples_both_roads_and_prints_their_ratio():
    """``bench/bench_env_throughput.py`` in a short form: both roads keep every sample (the bench
    exits non-zero otherwise) and the ratio row is printed; no time is asserted."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_env_throughput.py"), "--prompts", "2", "--n",
                          "2", "--reps", "1"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "protocol (env single_turn)" in out.stdout and ">= 0.95: wall" in out.stdout
