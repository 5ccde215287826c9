"""Rollout: prompts -> sampled groups -> scored trajectories, the same road in both modes.

::

    GroupRequest x k ──> engine.generate / EpisodeLoop ──on_sample(i, j, sample)──> decode, submit
                                                                                         │ RewardScorer:
                                                                                         │ worker processes
                      on_trajectory(Trajectory)  <──── kept sample ─── scorer's thread ─┤ (reward.timeout_s)
                      on_group_closed(request, kept) <── all n samples of a group ──────┘

``sample_groups`` is the one function that turns finished samples into trajectories: sync mode
(``rollout``) collects them in a list; each generator actor of async mode
(``async_rl.loops.actors``) streams them over ZeroMQ the moment a sample finishes. A sample whose
reward is rejected leaves its group in both modes (counted by the scorer, never a reward 0); so
does one whose reward function hangs past ``reward.timeout_s`` or kills its worker process, while
the engine keeps decoding (``async_rl.rewards.workers``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from transformers import GenerationConfig

from async_rl.step.agent import Conversation
from async_rl.step.episodes import Episode
from async_rl.buffers.trajectory import Trajectory, routed_experts_array
from async_rl.data.images import concat_images
from async_rl.generators.base import mix_seed
from async_rl.rewards import RewardScorer
from async_rl.rewards.registry import dispatch_by_source, resolve_reward_spec  # noqa: F401 (re-exported)
from async_rl.rewards.teacher import TeacherInput
from async_rl.rewards.workers import RewardWorkers

logger = logging.getLogger(__name__)


def longest_sequence(cfg: Any) -> tuple[int, str]:
    """The most tokens one rollout sequence (prompt + response) can have under the run's config
    ``cfg`` (``async_rl.config.Config``), and how it is derived.

    A prompt has at most ``data.max_prompt_tokens`` tokens (longer ones are rejected at load); a
    response at most ``generator.max_response_tokens``, or with tools (``agent.tools``) a whole
    conversation at most ``agent.max_response_tokens`` (generated and tool tokens together), or
    with an environment (``env.name``) a whole episode at most ``env.max_response_tokens`` (an
    environment's first observation longer than the prompt limit is rejected), or with a rollout
    function (``endpoint.rollout``) a session's chain at most ``endpoint.max_response_tokens``.

    Returns:
        ``(tokens, "data.max_prompt_tokens=P + <key>=R")``.
    """
    prompt = cfg.data.max_prompt_tokens
    endpoint = getattr(cfg, "endpoint", None)
    if endpoint is not None and endpoint.enabled:
        response, key = endpoint.max_response_tokens, "endpoint.max_response_tokens"
    elif cfg.env.enabled:
        response, key = cfg.env.max_response_tokens, "env.max_response_tokens"
    elif cfg.agent.enabled:
        response, key = cfg.agent.max_response_tokens, "agent.max_response_tokens"
    else:
        response, key = cfg.generator.max_response_tokens, "generator.max_response_tokens"
    return prompt + response, f"data.max_prompt_tokens={prompt} + {key}={response}"


def stop_token_ids(tokenizer, model_path: str, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The tokenizer's EOS, every EOS id of the model's generation config and ``extra`` (deduplicated).

    Raises:
        ValueError: no stop id at all.
    """
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += list(extra)
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS is all there is
    if not ids:
        raise ValueError(f"{model_path}: neither the tokenizer nor generation_config.json names an EOS token")
    return sorted(set(ids))


def group_seed(run_seed: int, group_id: int) -> int:
    """Sampling seed of group ``group_id``: the same in sync and async mode, whichever generator
    samples it, so both modes draw the same responses from the same weights."""
    return mix_seed(run_seed, group_id)


def reward_function(spec: str | None) -> Callable[..., Any]:
    """The reward function of ``reward.fn``: a spec (``get_reward_fn``), or ``None`` for one per
    ``data_source`` (``dispatch_by_source``).

    Raises:
        ValueError: the spec names no reward function.
    """
    return resolve_reward_spec(spec)


def reward_model_path(reward_cfg) -> str:
    """The local directory of ``reward.model`` (a ``builtin:`` URI built on first use), absolute,
    so actors need not share the driver's working directory.

    Raises:
        ValueError: an unknown built-in, a missing directory or one without config.json.
    """
    from async_rl.data.builtin import resolve
    from async_rl.rewards.model import validate_model_dir

    path = os.path.abspath(resolve(reward_cfg.model))
    validate_model_dir(path)
    return path


def load_reward_model(reward_cfg, num_threads: int = 0):
    """The ``RewardModel`` of a ``RewardConfig`` (``reward.model`` set) in this process.

    Raises:
        ValueError: as ``reward_model_path`` and ``RewardModel``.
    """
    from async_rl.rewards.model import RewardModel, model_kwargs

    return RewardModel(reward_model_path(reward_cfg), **model_kwargs(reward_cfg), num_threads=num_threads)


def teacher_dir(spec: str, key: str = "algorithm.distill.teacher") -> str:
    """The local Hugging Face directory of a teacher spec, absolute (actors need not share the
    driver's working directory): a model directory, a run directory's ``final_model/``, or a
    ``builtin:`` model (built on first use).

    Raises:
        ValueError: one line naming ``key``: an unknown built-in, or a path that is neither a
            model directory (``config.json``) nor a run directory with ``final_model/``.
    """
    from async_rl.data.builtin import resolve

    if spec.startswith("builtin:"):
        return os.path.abspath(resolve(spec))
    if os.path.isfile(os.path.join(spec, "config.json")):
        return os.path.abspath(spec)
    if os.path.isfile(os.path.join(spec, "final_model", "config.json")):
        return os.path.abspath(os.path.join(spec, "final_model"))
    raise ValueError(f"{key}={spec!r}: neither a Hugging Face model directory (config.json) nor a run "
                     "directory with final_model/ (what async-rl train writes at the end of a run)")


def teacher_routes(distill_cfg) -> dict[str, str]:
    """``DistillConfig.routes`` with each teacher resolved to its directory (``teacher_dir``):
    ``{data_source or "*": directory}``.

    Raises:
        ValueError: as ``teacher_dir``, naming the key (``algorithm.distill.teachers[<source>]``).
    """
    from async_rl.algorithms.distill import teacher_key

    return {source: teacher_dir(spec, teacher_key(source)) for source, spec in distill_cfg.routes.items()}


def check_teachers(cfg, tokenizer, sources) -> dict[str, str]:
    """Check a run's distillation teachers before anything loads: every data source in
    ``sources`` (the train set's) has one, each resolves to a directory, and each has the
    student's ``tokenizer`` (tokenizers only; the models load in ``TeacherModel``).

    Returns:
        ``teacher_routes(cfg.algorithm.distill)``.

    Raises:
        ValueError: one line: the sources without a teacher; a teacher that does not resolve;
            a teacher tokenizer other than the student's.
    """
    from transformers import AutoTokenizer

    from async_rl.algorithms.distill import teacher_key
    from async_rl.rewards.teacher import SAME_TOKENIZER, same_vocabulary

    d = cfg.algorithm.distill
    uncovered = d.uncovered(sources)
    if uncovered:
        raise ValueError(f"algorithm.distill: no teacher for data source(s) {uncovered} of the train set; set "
                         "algorithm.distill.teacher (every source) or algorithm.distill.teachers.<source>")
    routes = teacher_routes(d)
    for source, path in routes.items():
        problem = same_vocabulary(tokenizer, AutoTokenizer.from_pretrained(path))
        if problem:
            raise ValueError(f"{teacher_key(source)}={path!r}: {problem}; {SAME_TOKENIZER}")
    return routes


def load_teacher(cfg, tokenizer_path: str, num_threads: int = 0):
    """The ``TeacherModel`` of a run's ``algorithm.distill`` in this process (sync mode), at the
    generator's sampling temperature.

    Raises:
        ValueError: as ``teacher_routes`` and ``TeacherModel`` (a tokenizer other than the student's).
    """
    from async_rl.rewards.teacher import TeacherModel

    d = cfg.algorithm.distill
    return TeacherModel(teacher_routes(d), tokenizer_path, temperature=cfg.generator.temperature,
                        batch_size=d.batch_size, num_threads=num_threads, top_k=d.top_k if d.uses_topk else 0)


def make_scorer(reward_cfg, on_error: str, score_batch=None, teacher=None) -> RewardScorer:
    """The ``RewardScorer`` of a ``RewardConfig``: its function (none when only ``reward.model``
    is set), run in ``reward.num_workers`` worker processes under ``reward.timeout_s``
    (``RewardWorkers``, started on the first call; in-process with 0) and, with a reward model, a
    ``ModelRewardStage`` calling ``score_batch`` (``RewardModel.score`` here, or a call into the
    reward actor); with ``teacher`` (a ``TeacherStage``), the training samples' teacher
    log-probs last. Call ``close()`` on it when done.

    Raises:
        ValueError: the spec names no reward function; a model without ``score_batch``.
    """
    from async_rl.rewards.model import ModelRewardStage

    with_fn = bool(reward_cfg.fn or not reward_cfg.model)
    # Resolved here too, though the workers load their own copy: a bad spec stops the run at
    # build time in one line, and messages name the function.
    fn = reward_function(reward_cfg.fn) if with_fn else None
    stage = None
    if reward_cfg.model:
        if score_batch is None:
            raise ValueError("make_scorer: reward.model is set but nothing scores with it")
        stage = ModelRewardStage(score_batch, reward_cfg.model_batch_size, reward_cfg.model_weight,
                                 with_fn=fn is not None, on_error=on_error)
    workers = (RewardWorkers(reward_cfg.fn, reward_cfg.num_workers, reward_cfg.timeout_s)
               if with_fn and reward_cfg.num_workers else None)
    return RewardScorer(fn, on_error=on_error, model=stage, workers=workers, teacher=teacher)


@dataclass
class GroupRequest:
    """One prompt to sample ``n`` responses for, as group ``group_id``.

    Attributes:
        group_id: the group's id (unique per run); trajectory ids are ``"<group_id>/<j>"``.
        prompt_ids: rendered prompt token ids.
        prompt_uid: the dataset identity of the prompt.
        data_source, ground_truth, extra_info: what the reward function needs.
        n: samples in the group (>= 1).
        seed: sampling seed of the group (``group_seed``); ``None`` = the engine's own
            call-counter seeds (evaluation).
        messages: the prompt's chat messages (multi-turn tool use continues the conversation).
        params: the group's own ``SamplingParams`` (an evaluation group sampled by the pool:
            greedy, or at k at its temperature); ``None`` = the sampler's rollout params.
        images: the prompt's ``async_rl.data.images.ImageInputs`` (a vision-language dataset;
            ``prompt_ids`` then hold its expanded placeholders), or ``None``. It reaches the
            engine only: a trajectory refers to its prompt's images by ``prompt_uid``, and the
            trainer's dataset, which holds them once, gives them to the learner (images an
            environment's observations add travel with the trajectory).
    """

    group_id: int
    prompt_ids: list[int]
    prompt_uid: str
    data_source: str
    ground_truth: str | None
    extra_info: dict[str, Any]
    n: int
    seed: int | None
    messages: list[dict[str, Any]] = field(default_factory=list)
    params: Any = None
    images: Any = None

    @classmethod
    def of(cls, prompt, group_id: int, n: int, seed: int | None) -> "GroupRequest":
        """The request for a dataset ``Prompt``."""
        return cls(group_id=group_id, prompt_ids=prompt.prompt_ids, prompt_uid=prompt.uid,
                   data_source=prompt.data_source, ground_truth=prompt.ground_truth, extra_info=prompt.extra_info,
                   n=n, seed=seed, messages=prompt.messages, images=getattr(prompt, "images", None))


@dataclass
class RolloutResult:
    """Trajectories of one step's groups and what was rejected on the way.

    Attributes:
        trajectories: kept trajectories, by group then sample index.
        num_rejected_samples: samples whose reward was rejected (they left their group).
        num_rejected_groups: groups left with no sample.
        num_generated_tokens: tokens sampled by the engine (tool output excluded), in tokens.
    """

    trajectories: list[Trajectory]
    num_rejected_samples: int
    num_rejected_groups: int
    num_generated_tokens: int


_FINISH_REASONS = {"stop": "stop", "length": "length", "max_turns": "length"}
"""A sample's finish reason as the trajectory records it: ``max_turns`` is an unfinished answer, like
a length cut, for DAPO's overlong filter. Engines never return an aborted sample (they re-issue it),
so any other reason is a bug, not something to score as truncated."""


def trajectory_of(sample, tokenizer, group_id: int, index: int, prompt_uid: str, prompt_ids: list[int]) -> Trajectory:
    """An unscored ``Trajectory`` of a generator ``Sample`` or an agent ``Conversation``.

    An environment's ``Episode`` also carries its prompt ids (its first observation), its return
    as the reward and ``env/return``, ``env/info/<key>`` in ``reward_extras`` (an episode the
    run's reward scores, ``Episode.reward_from_run``, has no ``env/return``: its reward is set
    when it is scored).
    An episode whose observations held images carries them (``observation_pixel_values``,
    ``observation_image_grid_thw``).
    A conversation keeps its loss mask (0 on tool tokens), its per-token versions, its turn and
    tool counts (in ``reward_extras``: ``agent/turns``, ``agent/tool_calls``,
    ``agent/tool_errors``, ``agent/max_turns``; an episode of a one-turn environment has none)
    and its final answer as ``response_text`` (what the reward scores); a single-turn sample is
    masked 1 everywhere and its decoded text is the answer.

    Raises:
        ValueError: a finish reason other than ``stop``, ``length`` or ``max_turns``.
    """
    if sample.finish_reason not in _FINISH_REASONS:
        raise ValueError(f"trajectory {group_id}/{index}: finish reason {sample.finish_reason!r} is not one of "
                         f"{sorted(_FINISH_REASONS)}; an unfinished sample must not be scored as truncated")
    conversation = isinstance(sample, Conversation)
    text = sample.final_text if conversation else tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    episode = isinstance(sample, Episode)
    # Images an environment's observations added travel with the trajectory (the learner
    # forwards them with the turn); the prompt's own the trainer holds by uid.
    seen = concat_images(sample.observation_images) if episode else None
    traj = Trajectory(
        trajectory_id=f"{group_id}/{index}", group_id=group_id, prompt_uid=prompt_uid,
        # An environment's reset may give a first observation of its own (a game's start).
        prompt_ids=list(sample.prompt_ids) if episode else prompt_ids,
        response_ids=list(sample.response_ids), behavior_logprobs=list(sample.logprobs),
        loss_mask=list(sample.loss_mask) if conversation else [1] * len(sample.response_ids),
        finish_reason=_FINISH_REASONS[sample.finish_reason],
        policy_version=list(sample.policy_version), reward=0.0, response_text=text,
        **({} if seen is None else {"observation_pixel_values": seen.pixel_values,
                                    "observation_image_grid_thw": seen.image_grid_thw}))
    routed = getattr(sample, "routed_experts", None)
    if routed is not None:  # routing replay: one row per token the engine forwarded
        traj.routed_experts = routed_experts_array(routed, traj.trajectory_id)
        if traj.routed_experts.shape[0] != traj.num_tokens - 1:
            raise ValueError(f"trajectory {traj.trajectory_id}: the engine recorded routing for "
                             f"{traj.routed_experts.shape[0]} tokens, but it forwarded P + R - 1 = {traj.num_tokens - 1}")
    if conversation:
        traj.reward_extras = {"agent/turns": float(sample.num_turns), "agent/tool_calls": float(sample.num_tool_calls),
                              "agent/tool_errors": float(sample.num_tool_errors),
                              "agent/max_turns": float(sample.finish_reason == "max_turns")}
    if episode:
        # The environment's return is the reward (its reward model, if any, adds on top), unless
        # the run's reward scores the episode's answer (``reward_from_run``: replaced once scored).
        traj.reward = float(sample.env_return)
        if not sample.reward_from_run:
            traj.reward_extras["env/return"] = traj.reward
        traj.reward_extras.update({f"env/info/{k}": float(v) for k, v in sample.info.items()})
        if "acc" in sample.info:  # the environment's own accuracy (a full score, not partial credit)
            traj.reward_extras["acc"] = float(sample.info["acc"])
        # An environment that runs tools (``async_rl.envs.tools``) counts them in its info.
        for key in ("tool_calls", "tool_errors"):
            if key in sample.info:
                traj.reward_extras[f"agent/{key}"] = float(sample.info[key])
            else:
                del traj.reward_extras[f"agent/{key}"]
        if not sample.multi_turn:  # one turn by construction: no turn counts, as a plain sample has none
            del traj.reward_extras["agent/turns"], traj.reward_extras["agent/max_turns"]
    return traj


def with_reward(traj: Trajectory, result) -> Trajectory | None:
    """``traj`` with the reward of ``result`` (a ``RewardResult``: score and extras), or ``None``
    when ``result`` is rejected (counted by the scorer with its reason; the sample must leave its
    group: neither trained nor part of the group's baseline, never a reward 0)."""
    if result.rejected:
        return None
    traj.reward, traj.reward_extras = result.score, {**traj.reward_extras, **result.extras}
    return traj


def scored_trajectory(sample, tokenizer, scorer, request: GroupRequest, index: int) -> Trajectory | None:
    """The ``Trajectory`` of sample ``index`` of ``request``'s group with its reward (waiting for
    it), or ``None`` when it is rejected (see ``with_reward``).

    Args:
        sample: a generator ``Sample`` or an agent ``Conversation``.
        tokenizer: decodes a single-turn response for the reward (special tokens skipped).
        scorer: the ``RewardScorer``.
        request: the sample's group.
        index: the sample's index in its group.
    """
    traj = trajectory_of(sample, tokenizer, request.group_id, index, request.prompt_uid, request.prompt_ids)
    if scorer.fn is None or (isinstance(sample, Episode) and not sample.reward_from_run):
        return traj  # the reward model alone scores (``ModelRewardStage``), or the environment's return
    return with_reward(traj, scorer.score(request.data_source, traj.response_text, request.ground_truth,
                                          request.extra_info))


@dataclass
class SampleCounts:
    """What one ``sample_groups`` call produced (samples, tokens and groups are counts)."""

    samples: int = 0
    rejected_samples: int = 0
    generated_tokens: int = 0
    """Tokens the engine sampled; a conversation's tool tokens are not generated."""
    groups: int = 0
    rejected_groups: int = 0
    """Groups whose every sample was rejected."""


def model_input(request: GroupRequest, traj: Trajectory, tokenizer):
    """What the reward model reads of one sample: the prompt's messages and plain text (its
    messages' contents, else the decoded prompt) and the response text."""
    from async_rl.rewards.model import ModelInput

    texts = [m["content"] for m in request.messages if isinstance(m.get("content"), str)]
    prompt_text = "\n".join(texts) if texts else tokenizer.decode(request.prompt_ids, skip_special_tokens=True)
    return ModelInput(messages=list(request.messages), prompt_text=prompt_text, response=traj.response_text)


def sample_groups(engine, requests: Sequence[GroupRequest], params, tokenizer, scorer, agent,
                  on_trajectory: Callable[[Trajectory], None],
                  on_group_closed: Callable[[GroupRequest, int], None] | None = None,
                  counts: SampleCounts | None = None, wait_scored: bool = True,
                  with_teacher: bool = True) -> SampleCounts:
    """Sample every request's group and score each sample the moment it finishes (both modes).

    The engine's callback only submits each finished sample to ``scorer``; decoding never waits
    for a reward. Where ``on_trajectory`` and ``on_group_closed`` run (always one thread for all
    of them, so they need no lock of their own):

    - reward workers (``scorer.workers``, ``reward.num_workers`` >= 1): on the worker pool's
      thread, in the order scores come back;
    - in-process (``reward.num_workers=0``): on the episode loop's thread as episodes end (on the
      engine's callback thread as samples finish, without an ``EpisodeLoop``);
    - with a reward model (``scorer.model``, a ``ModelRewardStage``): the function's result is
      queued for the model, and both run on the stage's thread once the model has scored it;
    - with a teacher (``scorer.teacher``, a ``TeacherStage``, and ``with_teacher``): last, each
      rewarded sample is queued for the teacher, and both run on its stage's thread once the
      teacher's log-probs are set (``Trajectory.teacher_logprobs``).

    Args:
        engine: a ``Generator``.
        requests: groups of one size ``n``; seeded by their ``seed`` (all ``None``: unseeded).
        params: ``SamplingParams`` (of one assistant turn with an agent).
        tokenizer: decodes single-turn responses for the reward.
        scorer: the ``RewardScorer``.
        agent: an ``EpisodeLoop`` (each sample is an episode of an environment, whose return is
            its reward unless the run's reward scores it, tool use and ``single_turn`` included;
            a rejected episode leaves its group: every run's road, ``make_rollout_agent``) or
            ``None`` (plain samples from one engine call, each handed on as it finishes: the
            reference ``bench/bench_env_throughput.py`` measures the episode road against).
        on_trajectory: receives each kept trajectory, in finishing order.
        on_group_closed: called as ``(request, num_kept)`` once all ``n`` samples of a group are
            scored, rejected ones included.
        counts: counters to add to as each sample is scored (a generator actor's running totals,
            read while it samples); ``None``: fresh ones.
        wait_scored: return only once every sample of this call is scored and handed on
            (``scorer.drain()``); ``False`` (a generator actor) returns when sampling ends, so
            the next batch samples while the reward workers and model score the last one (the
            actor drains before it stops).
        with_teacher: send the samples through ``scorer.teacher`` when it has one (training
            rollouts); ``False`` for evaluation groups, which nothing trains on.

    Returns:
        ``counts``, with this call's samples added.

    Raises:
        ValueError: requests of different group sizes, or of mixed seeded and unseeded groups.
    """
    n = requests[0].n
    if any(r.n != n for r in requests):
        raise ValueError("sample_groups: the requests mix group sizes")
    seeded = [r.seed is not None for r in requests]
    if any(seeded) and not all(seeded):
        raise ValueError("sample_groups: the requests mix seeded and unseeded groups")
    seeds = [r.seed for r in requests] if all(seeded) else None
    counts = SampleCounts() if counts is None else counts
    kept, finished = [0] * len(requests), [0] * len(requests)

    stage = getattr(scorer, "model", None)
    teacher = getattr(scorer, "teacher", None) if with_teacher else None

    def on_sample(i: int, j: int, sample) -> None:
        # On the engine's thread: only build the trajectory and submit it; the reward arrives on
        # the scorer's side (``scored``), so decoding never waits for a reward function.
        counts.samples += 1
        counts.generated_tokens += sum(sample.loss_mask) if isinstance(sample, Conversation) else len(sample.response_ids)
        r = requests[i]
        if getattr(sample, "rejected", None):  # an environment's fault, counted by the episode loop
            hand_on(i, None)
            return
        traj = trajectory_of(sample, tokenizer, r.group_id, j, r.prompt_uid, r.prompt_ids)
        if scorer.fn is None or (isinstance(sample, Episode) and not sample.reward_from_run):
            scored(i, traj)  # the reward model or the environment's return scores it
        else:
            scorer.submit(r.data_source, traj.response_text, r.ground_truth, r.extra_info,
                          done=lambda result: scored(i, with_reward(traj, result)))

    def scored(i: int, traj: Trajectory | None) -> None:
        if stage is None:
            to_teacher(i, traj)
        else:
            item = model_input(requests[i], traj, tokenizer) if traj is not None else None
            stage.submit(item, traj, lambda t: to_teacher(i, t))

    def to_teacher(i: int, traj: Trajectory | None) -> None:
        # A rejected sample goes through the stage too: every hand_on of this call then runs on
        # one thread, the teacher's.
        if teacher is None:
            hand_on(i, traj)
        else:
            item = (TeacherInput(requests[i].data_source, traj.prompt_ids, traj.response_ids)
                    if traj is not None else None)
            teacher.submit(item, traj, lambda t: hand_on(i, t))

    def hand_on(i: int, traj: Trajectory | None) -> None:
        if traj is None:
            counts.rejected_samples += 1
        else:
            kept[i] += 1
            on_trajectory(traj)
        finished[i] += 1
        if finished[i] == n:
            counts.groups += 1
            counts.rejected_groups += kept[i] == 0
            if on_group_closed is not None:
                on_group_closed(requests[i], kept[i])

    if agent is not None:
        agent.run_groups(engine, requests, n, params, seeds, on_sample=on_sample)
    else:
        images = [r.images for r in requests]
        # Only a vision-language dataset passes images: an engine that serves none (its
        # capabilities say so; the config refuses such a run) is called as it always was.
        engine.generate([r.prompt_ids for r in requests], n, params, seeds=seeds, on_sample=on_sample,
                        **({"images": images} if any(x is not None for x in images) else {}))
    if wait_scored:
        scorer.drain()
    return counts


def rollout(generator, prompts, n: int, params, scorer, tokenizer, first_group_id: int,
            seed: int | None = None, agent=None) -> RolloutResult:
    """Sample ``n`` responses per prompt, score them and build trajectories (sync mode, evaluation).

    Args:
        generator: a ``Generator``.
        prompts: ``Prompt``s; prompt i becomes group ``first_group_id + i``.
        n: samples per prompt.
        params: ``SamplingParams``.
        scorer: ``RewardScorer``; a rejected sample leaves its group (a group left empty is
            counted as a rejected group).
        tokenizer: decodes responses for the reward (special tokens skipped).
        first_group_id: id of the first group.
        seed: run seed; group g is sampled with ``group_seed(seed, g)``. ``None``: the
            generator's own call-counter seeds (evaluation).
        agent: an ``async_rl.step.episodes.EpisodeLoop`` (environment episodes, tool use
            included), or ``None``.

    Returns:
        The kept trajectories, ordered by group and then sample index, with the counts.
    """
    requests = [GroupRequest.of(p, first_group_id + i, n, None if seed is None else group_seed(seed, first_group_id + i))
                for i, p in enumerate(prompts)]
    trajectories: list[Trajectory] = []
    counts = sample_groups(generator, requests, params, tokenizer, scorer, agent, trajectories.append)
    # Engines finish samples in any order; the batch must not depend on it.
    trajectories.sort(key=lambda t: (t.group_id, int(t.trajectory_id.rsplit("/", 1)[1])))
    return RolloutResult(trajectories, counts.rejected_samples, counts.rejected_groups, counts.generated_tokens)
