"""The training driver: sync (colocated, "hybrid engine") mode.

One training step, all in one process on the same device::

    dataset ──prompts──> generator (policy version v) ──samples──> reward scorer
                                                                       │ trajectories
    generator <──weights v+1── learner.train_step <──batch── advantages (per group)

1. take ``trainer.prompts_per_step`` prompts; sample ``trainer.samples_per_prompt`` responses
   each (one group per prompt) with the behavior log-probs of the sampled tokens;
2. score each response; failures become reward 0 or a counted rejection (``reward.on_error``);
3. compute advantages within each group; collate; the learner recomputes proximal log-probs and
   takes its optimizer step(s) (policy version v -> v + k);
4. push the new weights into the generator in place; evaluate every ``trainer.eval_every_steps``.

Before step 1 an optional supervised warm start (``trainer.warm_start``) trains the same learner
on the rows' reference answers, so a randomly initialised model has a starting signal for RL.

Run with ``async-rl train --config configs/default.yaml``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from async_rl.checkpoint import CheckpointConfig

if TYPE_CHECKING:
    from async_rl.config import Config

logger = logging.getLogger(__name__)

TRAINER_MODES = ("sync", "async")


@dataclass
class WarmStartConfig:
    """Supervised warm start on the rows' reference responses, before RL."""

    steps: int = 0
    """Optimizer steps of supervised training (>= 0); 0 skips the warm start."""
    batch_size: int = 64
    """Prompts per warm-start step (>= 1)."""
    lr: float = 1e-3
    """Constant learning rate of the warm start (> 0)."""
    response_field: str = "extra_info.answer"
    """Dotted path in each row holding the reference response text (``extra_info.<key>``)."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("trainer.warm_start needs steps >= 0, batch_size >= 1 and lr > 0, got "
                             f"steps={self.steps}, batch_size={self.batch_size}, lr={self.lr}")
        if not self.response_field.startswith("extra_info."):
            raise ValueError(f"trainer.warm_start.response_field must look like 'extra_info.<key>', got {self.response_field!r}")


@dataclass
class TrainerConfig:
    """The training loop: mode, length, batch shape, evaluation, outputs."""

    mode: str = "sync"
    """``sync``: generate, train and update the colocated engine in turn (hybrid engine).
    ``async``: a pool of generator actors streams trajectories while the learner trains
    (``async_rl.async_runner``); data is at most ``max_staleness`` policy versions old."""
    total_steps: int = 100
    """Training steps (>= 1); each consumes ``prompts_per_step`` prompts."""
    prompts_per_step: int = 16
    """Prompts (groups) per training step (>= 1)."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt, the group size n (>= 1)."""
    max_staleness: int | None = None
    """Most policy versions (training steps) a sample may lag the learner at train time (>= 0);
    ``None`` = 0 in sync mode, 1 in async mode. Async with 0 reproduces sync mode."""
    max_reuse: int = 1
    """Async: times one group may be trained on (>= 1); 1 = never reused."""
    zmq_address: str | None = None
    """Async: ZeroMQ address the trajectory receiver binds; ``None`` = a free loopback TCP port."""
    zmq_hwm: int = 1024
    """Async: ZeroMQ high-water mark in messages (back-pressure on generators); >= 1."""
    seed: int = 0
    """Seed of the data order, sampler and learner."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    run_name: str | None = None
    """Run directory name under ``output_dir``; ``None`` = a timestamp."""
    eval_every_steps: int = 10
    """Evaluate on the held-out split every K steps (>= 0); 0 = only before step 1 and at the end."""
    eval_greedy: bool = True
    """Evaluate with greedy decoding; ``False`` = one sample per prompt at the training temperature."""
    export_model: bool = True
    """Write the final policy as a Hugging Face directory to ``<run_dir>/final_model``."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When to save checkpoints (``async_rl.checkpoint``)."""
    resume: str | None = None
    """``auto``: continue from ``<output_dir>/<run_name>``'s latest checkpoint if there is one;
    a checkpoint or run directory: continue from it; ``None``: start fresh."""

    def __post_init__(self) -> None:
        if self.mode not in TRAINER_MODES:
            raise ValueError(f"trainer.mode must be one of {TRAINER_MODES}, got {self.mode!r}")
        for key in ("total_steps", "prompts_per_step", "samples_per_prompt"):
            if getattr(self, key) < 1:
                raise ValueError(f"trainer.{key} must be >= 1, got {getattr(self, key)}")
        # max_staleness=None is resolved by mode in config._cross_validate, not here: omegaconf
        # instantiates this class for its schema, and a value filled in then would outlive mode=async.
        if (self.max_staleness is not None and self.max_staleness < 0) or self.eval_every_steps < 0:
            raise ValueError("trainer.max_staleness and trainer.eval_every_steps must be >= 0")
        if self.max_reuse < 1 or self.zmq_hwm < 1:
            raise ValueError(f"trainer.max_reuse and trainer.zmq_hwm must be >= 1, got {self.max_reuse} and {self.zmq_hwm}")
        if self.mode == "sync" and self.max_staleness not in (None, 0):
            raise ValueError(f"trainer.mode=sync trains on-policy: trainer.max_staleness must be 0, got {self.max_staleness}")


# ---------------------------------------------------------------------------------------- parts
def stop_token_ids(tokenizer, model_path: str, extra: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The tokenizer's EOS, every EOS id of the model's generation config and ``extra`` (deduplicated).

    Raises:
        ValueError: no stop id at all.
    """
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += list(extra)
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS is all there is
    if not ids:
        raise ValueError(f"{model_path}: neither the tokenizer nor generation_config.json names an EOS token")
    return sorted(set(ids))


@dataclass
class RolloutResult:
    """Trajectories of one step's groups and what was rejected on the way."""

    trajectories: list  # list[Trajectory]
    num_rejected_samples: int
    num_rejected_groups: int
    num_generated_tokens: int


def group_seed(run_seed: int, group_id: int) -> int:
    """Sampling seed of group ``group_id``: the same in sync and async mode, whichever generator
    samples it, so both modes draw the same responses from the same weights."""
    from async_rl.generators.hf import mix_seed

    return mix_seed(run_seed, group_id)


def rollout(generator, prompts, n: int, params, scorer, tokenizer, first_group_id: int,
            seed: int | None = None, agent=None) -> RolloutResult:
    """Sample ``n`` responses per prompt, score them and build trajectories.

    Args:
        generator: a ``Generator``.
        prompts: ``Prompt``s; prompt i becomes group ``first_group_id + i``.
        n: samples per prompt.
        params: ``SamplingParams``.
        scorer: ``RewardScorer``; a rejected sample (``scored_trajectory``) leaves its group (the
            group keeps its other samples; a group left empty is counted as a rejected group).
        tokenizer: decodes responses for the reward (special tokens skipped).
        first_group_id: id of the first group.
        seed: run seed; group g is sampled with ``group_seed(seed, g)``. ``None``: the
            generator's own call-counter seeds (evaluation).
        agent: an ``async_rl.agent.AgentLoop`` for multi-turn tool use (each sample is a
            conversation; the reward scores its final answer), or ``None`` for single-turn.
    """
    from async_rl.buffers.trajectory import Trajectory

    seeds = None if seed is None else [group_seed(seed, first_group_id + i) for i in range(len(prompts))]
    if agent is not None:
        groups = agent.run(generator, [(p.prompt_ids, p.messages) for p in prompts], n, params, seeds)
    else:
        groups = generator.generate([p.prompt_ids for p in prompts], n, params, seeds=seeds)
    trajectories, rejected_samples, rejected_groups, num_tokens = [], 0, 0, 0
    for i, (prompt, samples) in enumerate(zip(prompts, groups)):
        gid = first_group_id + i
        kept = 0
        for j, s in enumerate(samples):
            num_tokens += sum(s.loss_mask) if agent is not None else len(s.response_ids)  # generated, not tool tokens
            traj = scored_trajectory(s, tokenizer, scorer, gid, j, prompt.uid, prompt.prompt_ids, prompt.data_source,
                                     prompt.ground_truth, prompt.extra_info)
            if traj is None:
                rejected_samples += 1
                continue
            kept += 1
            trajectories.append(traj)
        rejected_groups += kept == 0
    return RolloutResult(trajectories, rejected_samples, rejected_groups, num_tokens)


def scored_trajectory(sample, tokenizer, scorer, group_id: int, index: int, prompt_uid: str, prompt_ids: list[int],
                      data_source: str, ground_truth, extra_info):
    """The ``Trajectory`` of one finished sample with its reward, or ``None`` when it is rejected.

    The one scoring path of both modes (``rollout`` here, the generator actors of
    ``async_rl.generators.pool`` in async mode). A rejected sample (its reward function failed under
    ``reward.on_error=reject``, or returned no reward) is counted by ``scorer`` with its reason and
    must leave its group: it is neither trained nor part of the group's baseline, never a reward 0.

    Args:
        sample: a generator ``Sample`` or an agent ``Conversation``.
        tokenizer: decodes a single-turn response for the reward.
        scorer: the ``RewardScorer``.
        group_id, index: the trajectory id is ``"<group_id>/<index>"``.
        prompt_uid, prompt_ids, data_source, ground_truth, extra_info: the prompt's fields.

    Returns:
        The trajectory with ``reward`` and ``reward_extras`` set, or ``None``.
    """
    traj = trajectory_of(sample, tokenizer, group_id, index, prompt_uid, prompt_ids)
    result = scorer.score(data_source, traj.response_text, ground_truth, extra_info)
    if result.rejected:
        return None
    traj.reward, traj.reward_extras = result.score, {**traj.reward_extras, **result.extras}
    return traj


_FINISH_REASONS = {"stop": "stop", "length": "length", "max_turns": "length"}
"""A sample's finish reason as the trajectory records it: ``max_turns`` is an unfinished answer, like
a length cut, for DAPO's overlong filter. Engines never return an aborted sample (they re-issue it),
so any other reason is a bug, not something to score as truncated."""


def trajectory_of(sample, tokenizer, group_id: int, index: int, prompt_uid: str, prompt_ids: list[int]):
    """An unscored ``Trajectory`` of a generator ``Sample`` or an agent ``Conversation``.

    A conversation keeps its loss mask (0 on tool tokens), its per-token versions, its turn and
    tool counts (in ``reward_extras``: ``agent/turns``, ``agent/tool_calls``,
    ``agent/tool_errors``, ``agent/max_turns``) and its final answer as ``response_text`` (what
    the reward scores); a single-turn sample is masked 1 everywhere and its decoded text is the
    answer.

    Raises:
        ValueError: a finish reason other than ``stop``, ``length`` or ``max_turns``.
    """
    from async_rl.buffers.trajectory import Trajectory

    if sample.finish_reason not in _FINISH_REASONS:
        raise ValueError(f"trajectory {group_id}/{index}: finish reason {sample.finish_reason!r} is not one of "
                         f"{sorted(_FINISH_REASONS)}; an unfinished sample must not be scored as truncated")

    conversation = hasattr(sample, "final_text")
    text = sample.final_text if conversation else tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    traj = Trajectory(
        trajectory_id=f"{group_id}/{index}", group_id=group_id, prompt_uid=prompt_uid, prompt_ids=prompt_ids,
        response_ids=list(sample.response_ids), behavior_logprobs=list(sample.logprobs),
        loss_mask=list(sample.loss_mask) if conversation else [1] * len(sample.response_ids),
        finish_reason=_FINISH_REASONS[sample.finish_reason],
        policy_version=list(sample.policy_version), reward=0.0, response_text=text)
    if conversation:
        traj.reward_extras = {"agent/turns": float(sample.num_turns), "agent/tool_calls": float(sample.num_tool_calls),
                              "agent/tool_errors": float(sample.num_tool_errors),
                              "agent/max_turns": float(sample.finish_reason == "max_turns")}
    return traj


def accuracy_of(trajectories) -> float:
    """Fraction correct: the reward's ``acc`` field where present, else ``reward >= 1``."""
    if not trajectories:
        return float("nan")
    hits = [t.reward_extras.get("acc", float(t.reward >= 1.0)) for t in trajectories]
    return sum(hits) / len(hits)


def evaluate(generator, dataset, params, scorer, tokenizer, agent=None) -> dict[str, float]:
    """Held-out accuracy and mean reward: one response per prompt (greedy or sampled); with an
    agent, one multi-turn conversation per prompt, whose tool use is reported as
    ``eval/tool_calls_mean``, ``eval/turns_mean``, ``eval/tool_errors_mean`` (per conversation)
    and kept out of the training steps' ``tools/*`` counters."""
    with (agent.counted_apart() if agent is not None else contextlib.nullcontext()):
        result = rollout(generator, list(dataset), 1, params, scorer, tokenizer, first_group_id=-(10**9), agent=agent)
    trajs = result.trajectories
    n = max(1, len(trajs))
    out = {
        "eval/accuracy": accuracy_of(trajs),
        "eval/reward_mean": sum(t.reward for t in trajs) / n,
        "eval/response_length_mean": sum(len(t.response_ids) for t in trajs) / n,
        "eval/num_prompts": float(len(trajs)),
    }
    if agent is not None:
        for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors"):
            out[f"eval/{key.split('/')[1]}_mean"] = sum(t.reward_extras.get(key, 0.0) for t in trajs) / n
    return out


def _lookup(prompt, dotted: str):
    key = dotted.split(".", 1)[1]
    if key not in prompt.extra_info or prompt.extra_info[key] is None:
        raise ValueError(f"warm start: row {prompt.uid} has no '{dotted}' (set trainer.warm_start.response_field)")
    return prompt.extra_info[key]


def warm_start(learner, dataset, tokenizer, cfg: WarmStartConfig, eos_id: int, seed: int, log, agent=None) -> None:
    """Supervised warm start: ``cfg.steps`` NLL steps on ``prompt -> reference response + EOS``.

    With an agent (multi-turn tool use) the field holds a demonstration instead: the messages
    after the prompt (assistant tool calls, tool responses, the final answer) as a list or JSON
    text; it is tokenised turn by turn as a rollout would be (``agent.demonstration_ids``), and
    only the assistant turns are trained. Prompts are drawn with their own seeded RNG so the RL
    data stream is not advanced.

    Raises:
        ValueError: a row without the field, or a demonstration the chat template cannot render.
    """
    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(seed + 17)
    for step in range(1, cfg.steps + 1):
        trajs = []
        for k, p in enumerate(rng.choices(dataset.prompts, k=cfg.batch_size)):
            value = _lookup(p, cfg.response_field)
            if agent is not None:
                from async_rl.agent import demonstration_ids

                demo = json.loads(value) if isinstance(value, str) else value
                ids, mask = demonstration_ids(tokenizer, p.messages, demo, agent.schemas, agent.stop_token_ids)
            else:
                ids = tokenizer(str(value), add_special_tokens=False)["input_ids"] + [eos_id]
                mask = [1] * len(ids)
            trajs.append(Trajectory(
                trajectory_id=f"sft/{step}/{k}", group_id=k, prompt_uid=p.uid, prompt_ids=p.prompt_ids,
                response_ids=ids, behavior_logprobs=[0.0] * len(ids), loss_mask=mask,
                finish_reason="stop", policy_version=[0] * len(ids)))
        metrics = learner.sft_step(collate(trajs, tokenizer.pad_token_id), cfg.lr)
        if step % max(1, cfg.steps // 5) == 0 or step == cfg.steps:
            log(f"warm start {step}/{cfg.steps}: loss {float(metrics['sft/loss']):.4f}")


def push_weights(learner, generator) -> dict[str, float]:
    """Colocated weight sync into an engine of this process: the learner's full tensors by name,
    no buffer in between (the ``colocated`` transport of ``async_rl.weight_sync``)."""
    t0 = time.perf_counter()
    generator.update_weights(learner.named_weights(), learner.version)
    return {"timing/weight_sync_s": time.perf_counter() - t0}


# ---------------------------------------------------------------------------------------- driver
def make_run_dir(cfg: "Config") -> Path:
    """Create ``<output_dir>/<run_name>`` and write the resolved ``config.yaml`` into it."""
    from async_rl.config import to_yaml

    name = cfg.trainer.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


@dataclass
class RunContext:
    """Everything one run's loops share (built by ``train``)."""

    cfg: Any
    tokenizer: Any
    model_path: str
    train_ds: Any
    val_ds: Any
    scorer: Any
    eval_scorer: Any
    params: Any
    eval_params: Any
    learner: Any
    generator: Any
    """The colocated engine: sync-mode rollouts, and evaluation in both modes (async mode with
    ``backend: vllm`` evaluates on a colocated HF engine, leaving the pool's engines to rollouts)."""
    run_dir: Path
    log: Any
    publisher: Any = None
    """Sync mode: the ``WeightPublisher`` into ``generator`` (hybrid engine)."""
    agent: Any = None
    """The ``AgentLoop`` of multi-turn tool rollouts (``agent.tools`` set), else ``None``."""


class SyncLoop:
    """Sync (hybrid engine) mode: each step generates with the colocated engine, trains, and
    copies the new weights into the engine in place."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.next_group = 0

    def step(self, step: int) -> dict[str, float]:
        """One training step; returns its metrics."""
        c = self.ctx
        t0 = time.perf_counter()
        ro, metrics, groups_used = collect_step_rollouts(c.cfg, c.train_ds, c.generator, c.scorer, c.tokenizer,
                                                         c.params, self.next_group, c.agent)
        self.next_group += groups_used
        metrics.update(c.scorer.pop_metrics())
        if c.agent is not None:
            metrics.update(c.agent.pop_metrics())
        metrics.update({"perf/tokens_per_s": ro.num_generated_tokens / max(time.perf_counter() - t0, 1e-9),
                        "timing/generate_s": time.perf_counter() - t0})
        metrics.update(learn_on(c, step, ro))
        metrics.update(c.publisher.push(c.learner.version))
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics

    def sync_eval_engine(self) -> None:
        """The colocated engine already holds the latest weights."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue this loop: the next group id and the dataset position."""
        return {"next_group": self.next_group, "dataset": self.ctx.train_ds.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output."""
        self.next_group = int(state["next_group"])
        self.ctx.train_ds.load_state_dict(state["dataset"])

    def close(self) -> dict[str, Any]:
        """Nothing to stop (the engine belongs to ``train``); returns no summary entries."""
        return {}


def train(cfg: "Config") -> dict[str, Any]:
    """Run a whole training job; returns the summary also written to ``<run_dir>/summary.json``.

    Raises:
        ValueError: bad inputs (dataset rows, reward names, dynamic sampling that cannot fill a step).
        RuntimeError: a step whose every sample was rejected, or a generator actor that died.
    """
    from transformers import AutoTokenizer

    from async_rl.checkpoint import (StopRequest, load_trainer_state, resolve_resume, rng_state,
                                     save_checkpoint, set_rng_state)
    from async_rl.config import to_dict
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.metrics import MetricsLogger
    from async_rl.rewards import RewardScorer, default_reward_for, get_reward_fn
    from async_rl.weight_sync import LocalTarget, WeightPublisher, resolve_transport
    from async_rl.generators import make_generator
    from async_rl.generators.base import SamplingParams
    from async_rl.learners.launch import launch_learner

    t_cfg, seed = cfg.trainer, cfg.trainer.seed
    resume_from = resolve_resume(t_cfg.resume, t_cfg.output_dir, t_cfg.run_name)
    resumed = load_trainer_state(resume_from) if resume_from is not None else None
    if t_cfg.resume == "auto" and resumed is None:
        logger.warning("trainer.resume=auto: no checkpoint under %s; starting fresh",
                       Path(t_cfg.output_dir) / str(t_cfg.run_name) / "checkpoints")
    if resumed is not None and resumed["step"] >= t_cfg.total_steps:
        raise ValueError(f"trainer.resume: {resume_from} is at step {resumed['step']}, not before "
                         f"trainer.total_steps={t_cfg.total_steps}: nothing to train (raise trainer.total_steps)")
    if resumed is not None and resumed.get("mode", t_cfg.mode) != t_cfg.mode:
        # The loop states differ (sync: next group id; async: replay buffer and groups in flight).
        raise ValueError(f"trainer.resume: {resume_from} was written in trainer.mode={resumed['mode']}; "
                         f"resume it with the same mode (got trainer.mode={t_cfg.mode})")
    random.seed(seed)
    torch.manual_seed(seed)
    if cfg.learner.num_threads:
        torch.set_num_threads(cfg.learner.num_threads)
    model_path = resolve(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(resolve(cfg.model.tokenizer_path or cfg.model.path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    d = cfg.data
    stops = stop_token_ids(tokenizer, model_path, cfg.generator.extra_stop_token_ids)
    agent = None
    if cfg.agent.enabled:
        from async_rl.agent import AgentLoop

        agent = AgentLoop(cfg.agent, tokenizer, stops)
    # With tools, prompts are rendered with their schemas (the model sees what it may call).
    tools = agent.schemas if agent is not None else None
    train_ds = PromptDataset([resolve(f) for f in d.train_files], tokenizer, d.max_prompt_tokens, seed, d.shuffle,
                             tools=tools)
    val_ds = (PromptDataset([resolve(f) for f in d.val_files], tokenizer, d.max_prompt_tokens, seed, False,
                            limit=d.val_max_prompts, tools=tools) if d.val_files else None)
    fn = get_reward_fn(cfg.reward.fn) if cfg.reward.fn else _dispatch_by_source
    if not cfg.reward.fn:
        # Fail before training, not as a reward error on every sample: each data_source needs a reward.
        for source in {p.data_source for ds in (train_ds, val_ds) if ds is not None for p in ds.prompts}:
            default_reward_for(source)
    # The run directory is made only once the inputs have loaded, so a bad dataset leaves none behind.
    run_dir = make_run_dir(cfg)
    if len(train_ds) < t_cfg.prompts_per_step:
        logger.warning("the train set has %d prompts, fewer than trainer.prompts_per_step=%d: each step repeats "
                       "prompts (every step still draws its full batch, crossing epochs)", len(train_ds),
                       t_cfg.prompts_per_step)
    learner, learner_handle = launch_learner(*learner_args(cfg, model_path))
    ctx = RunContext(
        cfg=cfg, tokenizer=tokenizer, model_path=model_path, train_ds=train_ds, val_ds=val_ds,
        scorer=RewardScorer(fn, on_error=cfg.reward.on_error),
        # Separate counters: eval must not leak into train metrics.
        eval_scorer=RewardScorer(fn, on_error="zero"),
        params=SamplingParams.from_config(cfg.generator, stops),
        eval_params=SamplingParams.from_config(cfg.generator, stops, greedy=t_cfg.eval_greedy),
        learner=learner,
        generator=_colocated_engine(cfg, model_path, tokenizer.pad_token_id, make_generator),
        run_dir=run_dir, log=MetricsLogger(cfg.logging, run_dir, t_cfg.total_steps, run_config=to_dict(cfg)),
        agent=agent,
    )
    learner, generator, log = ctx.learner, ctx.generator, ctx.log
    summary: dict[str, Any] = {"run_dir": str(run_dir), "mode": t_cfg.mode,
                               "data/rejected_prompts_too_long": train_ds.num_rejected_too_long}
    loop = None
    try:
        if t_cfg.mode == "sync":
            ctx.publisher = WeightPublisher(cfg.weight_sync, resolve_transport(cfg.weight_sync, cfg.generator.backend, "sync"),
                                            learner, [LocalTarget(generator)])
        log.print(f"run directory: {run_dir}")
        if train_ds.num_rejected_too_long:
            log.print(f"rejected {train_ds.num_rejected_too_long} train prompts longer than {d.max_prompt_tokens} tokens")
        tail_evals: list[float] = []
        if resumed is None:
            _start_fresh(ctx, summary)
            start_step = 1
        else:
            # Instead of the warm start and begin_rl: weights, optimizer, schedules and the
            # reference policy all come from the checkpoint.
            learner.load_checkpoint(str(resume_from / "learner"))
            if ctx.publisher is not None:
                ctx.publisher.push(learner.version)
            else:
                push_weights(learner, generator)
            summary.update(resumed["summary"])
            tail_evals = list(resumed["tail_evals"])
            start_step = resumed["step"] + 1
            log.print(f"resumed from {resume_from}: step {resumed['step']} done, policy version {learner.version}")
        if t_cfg.mode == "async":
            from async_rl.async_runner import AsyncLoop

            loop = AsyncLoop(ctx, resume_state=resumed["loop"] if resumed else None)
        else:
            loop = SyncLoop(ctx)
            if resumed is not None:
                loop.load_state_dict(resumed["loop"])
        if resumed is not None:
            set_rng_state(resumed["rng"])
        if start_step > 1:
            log.advance(start_step - 1)

        def checkpoint(step: int) -> None:
            t0 = time.perf_counter()
            state = {"mode": t_cfg.mode, "rng": rng_state(), "loop": loop.state_dict(), "tail_evals": tail_evals,
                     "summary": {k: v for k, v in summary.items() if k.startswith("eval_")}}
            path = save_checkpoint(run_dir, step, learner, state, t_cfg.checkpoint.keep_last)
            log.print(f"checkpoint written to {path} ({time.perf_counter() - t0:.1f} s)")

        t_rl = time.perf_counter()
        last_step, saved_step = start_step - 1, start_step - 1
        with StopRequest() as stop:
            for step in range(start_step, t_cfg.total_steps + 1):
                metrics = loop.step(step)
                due = t_cfg.eval_every_steps and step % t_cfg.eval_every_steps == 0
                if val_ds is not None and (due or step == t_cfg.total_steps):
                    t0 = time.perf_counter()
                    loop.sync_eval_engine()
                    metrics.update(evaluate(generator, val_ds, ctx.eval_params, ctx.eval_scorer, tokenizer, ctx.agent))
                    metrics["timing/eval_s"] = time.perf_counter() - t0
                    summary["eval_final"] = metrics["eval/accuracy"]
                    if step > 0.75 * t_cfg.total_steps:
                        tail_evals.append(metrics["eval/accuracy"])
                log.log(metrics, step=step)
                log.advance(step)
                last_step = step
                if stop.requested:
                    summary["interrupted"] = stop.signal_name
                    log.print(f"{stop.signal_name}: stopping after step {step} of {t_cfg.total_steps}")
                    break
                every = t_cfg.checkpoint.every_steps
                if every and step % every == 0:
                    checkpoint(step)
                    saved_step = step
            if t_cfg.checkpoint.save_at_exit and last_step != saved_step:
                checkpoint(last_step)
        summary["last_step"] = last_step
        summary["rl_wall_s"] = time.perf_counter() - t_rl
        summary.update(loop.close())
        loop = None
        if "eval_step_0" in summary and "eval_final" in summary and "interrupted" not in summary:
            summary["eval_gain_points"] = 100.0 * (summary["eval_final"] - summary["eval_step_0"])
            log.print(f"eval accuracy: step 0 {summary['eval_step_0']:.4f} -> step {t_cfg.total_steps} "
                      f"{summary['eval_final']:.4f} ({summary['eval_gain_points']:+.1f} points)")
            # One eval of a small held-out set is noisy; the mean over the last quarter of the run
            # is the steadier figure for comparing runs (modes, algorithms, seeds).
            summary["eval_tail_mean"] = sum(tail_evals) / len(tail_evals)
            summary["eval_tail_gain_points"] = 100.0 * (summary["eval_tail_mean"] - summary["eval_step_0"])
            log.print(f"eval accuracy, mean of the {len(tail_evals)} evals in the last quarter: "
                      f"{summary['eval_tail_mean']:.4f} ({summary['eval_tail_gain_points']:+.1f} points)")
        if t_cfg.export_model and "interrupted" not in summary:
            learner.export_hf(str(run_dir / "final_model"), tokenizer)
            summary["final_model"] = str(run_dir / "final_model")
            log.print(f"final policy written to {run_dir / 'final_model'}")
    finally:
        if loop is not None:
            loop.close()
        if ctx.publisher is not None:
            ctx.publisher.close()
        if hasattr(generator, "close"):
            generator.close()
        learner_handle.close()
        log.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def learner_args(cfg: "Config", model_path: str) -> tuple:
    """``FSDPLearner``'s constructor arguments for a run (the same on every learner rank)."""
    steps_per_train_step = cfg.learner.num_mini_batches * cfg.learner.num_epochs
    return (cfg.learner, cfg.algorithm, model_path, cfg.generator.temperature,
            cfg.trainer.total_steps * steps_per_train_step)


def _start_fresh(ctx: RunContext, summary: dict[str, Any]) -> None:
    """A run's start without a checkpoint: optional warm start (evaluated before, pushed after),
    ``begin_rl``, and the step-0 evaluation (``summary["eval_step_0"]``)."""
    t_cfg, learner, generator, val_ds = ctx.cfg.trainer, ctx.learner, ctx.generator, ctx.val_ds
    if val_ds is not None and t_cfg.warm_start.steps:
        summary["eval_before_warm_start"] = evaluate(generator, val_ds, ctx.eval_params, ctx.eval_scorer,
                                                     ctx.tokenizer, ctx.agent)["eval/accuracy"]
        ctx.log.print(f"eval before warm start: accuracy {summary['eval_before_warm_start']:.4f}")
    if t_cfg.warm_start.steps:
        warm_start(learner, ctx.train_ds, ctx.tokenizer, t_cfg.warm_start, ctx.tokenizer.eos_token_id, t_cfg.seed,
                   ctx.log.print, ctx.agent)
        if ctx.publisher is not None:
            ctx.publisher.push(learner.version)
        else:
            push_weights(learner, generator)
    learner.begin_rl()
    if val_ds is not None:
        ev = evaluate(generator, val_ds, ctx.eval_params, ctx.eval_scorer, ctx.tokenizer, ctx.agent)
        summary["eval_step_0"] = ev["eval/accuracy"]
        ctx.log.log(ev, step=0)
        ctx.log.print(f"step 0: eval accuracy {ev['eval/accuracy']:.4f}")


def _dispatch_by_source(data_source, response_text, ground_truth, extra_info):
    from async_rl.rewards import default_reward_for

    return default_reward_for(data_source)(data_source, response_text, ground_truth, extra_info)


MAX_OVERSAMPLING = 16
"""Dynamic sampling asks for at most this many times the missing groups in one round."""


def _colocated_engine(cfg, model_path: str, pad_token_id: int, make_generator):
    """The engine of the trainer process: the rollout engine in sync mode (hybrid engine); in
    async mode only evaluation runs here, on HF (one more vLLM engine would take cores and
    memory from the pool, for no difference in greedy accuracy)."""
    if cfg.trainer.mode == "async" and cfg.generator.backend != "hf":
        import dataclasses

        return make_generator(dataclasses.replace(cfg.generator, backend="hf"), model_path, pad_token_id,
                              lora=cfg.learner.lora)
    return make_generator(cfg.generator, model_path, pad_token_id, num_threads=os.cpu_count() or 1,
                          lora=cfg.learner.lora)


def collect_step_rollouts(cfg, train_ds, generator, scorer, tokenizer, params, first_group: int, agent=None,
                          ) -> tuple[RolloutResult, dict[str, float], int]:
    """One step's trajectories: a single rollout round, or DAPO dynamic sampling.

    With ``algorithm.dynamic_sampling`` each round takes the missing number of groups divided by
    the acceptance rate so far (at most ``MAX_OVERSAMPLING`` times as many); a group whose (unshaped) rewards are all equal is
    dropped and counted (it carries no group-relative signal); rounds repeat until
    ``trainer.prompts_per_step`` groups have spread, at most ``algorithm.max_generation_rounds``
    times (DAPO, arXiv 2503.14476, Sec. 3.2). Accepted groups beyond the target are trained on
    too (the batch may be larger than ``prompts_per_step`` groups), never dropped.

    Returns:
        ``(rollout, metrics, groups_used)``: the kept trajectories with rejection counts summed
        over rounds, ``rollout/dynamic_sampling_*`` metrics, and how many group ids were used.

    Raises:
        ValueError: fewer groups with spread than needed after the last round (counts in the message).
    """
    from async_rl.algorithms.dapo import fill_groups_with_spread, rewards_have_spread

    t_cfg, algo = cfg.trainer, cfg.algorithm
    n = t_cfg.samples_per_prompt
    if not algo.dynamic_sampling:
        prompts = train_ds.next_batch(t_cfg.prompts_per_step)
        return rollout(generator, prompts, n, params, scorer, tokenizer, first_group, t_cfg.seed, agent), {}, len(prompts)
    totals = {"samples": 0, "groups": 0, "tokens": 0, "used": 0, "accepted": 0}

    def generate_round(missing: int):
        # Oversample by the acceptance rate seen so far in this step (at most 16x): asking for the
        # missing count, or a small multiple of it, converges geometrically slowly once most
        # prompts are solved (a run at 10% acceptance failed that way). Surplus groups are trained
        # on too, so no accepted sample is lost.
        rate = totals["accepted"] / totals["used"] if totals["used"] else 1.0
        prompts = train_ds.next_batch(min(MAX_OVERSAMPLING * missing, math.ceil(missing / max(rate, 1 / MAX_OVERSAMPLING))))
        ro = rollout(generator, prompts, n, params, scorer, tokenizer, first_group + totals["used"], t_cfg.seed, agent)
        totals["used"] += len(prompts)
        totals["samples"] += ro.num_rejected_samples
        totals["groups"] += ro.num_rejected_groups
        totals["tokens"] += ro.num_generated_tokens
        by_group: dict[int, list] = {}
        for t in ro.trajectories:
            by_group.setdefault(t.group_id, []).append(t)
        totals["accepted"] += sum(rewards_have_spread([t.reward for t in g]) for g in by_group.values())
        return list(by_group.values())

    try:
        result = fill_groups_with_spread(generate_round, target_groups=t_cfg.prompts_per_step,
                                         max_rounds=algo.max_generation_rounds,
                                         rewards_of=lambda group: [t.reward for t in group])
    except ValueError as e:
        raise ValueError(f"{e} (algorithm.max_generation_rounds={algo.max_generation_rounds}, "
                         f"trainer.prompts_per_step={t_cfg.prompts_per_step})") from None
    trajectories = [t for group in result.groups + result.surplus for t in group]
    metrics = {"rollout/dynamic_sampling_rounds": float(result.num_rounds),
               "rollout/dynamic_sampling_surplus_groups": float(len(result.surplus)),
               "rollout/dynamic_sampling_rejected_groups": float(result.num_rejected)}
    return RolloutResult(trajectories, totals["samples"], totals["groups"], totals["tokens"]), metrics, totals["used"]


def learn_on(ctx: RunContext, step: int, ro: RolloutResult) -> dict[str, float]:
    """Train on one step's trajectories (both modes): check staleness, build the batch with
    advantages, take the learner's step; returns rollout, loss and staleness metrics.

    Raises:
        RuntimeError: no trajectory to train on, or a sample older than ``trainer.max_staleness``
            (the buffer and admission control should make that impossible).
    """
    from async_rl.buffers.replay import staleness as staleness_of

    cfg, learner = ctx.cfg, ctx.learner
    trajs = ro.trajectories
    if not trajs:
        raise RuntimeError(f"step {step}: every sample was rejected by the reward function (see the warnings above)")
    staleness = [staleness_of(t, learner.version) for t in trajs]
    if max(staleness) > cfg.trainer.max_staleness:
        raise RuntimeError(f"step {step}: a sample is {max(staleness)} policy versions old, more than "
                           f"trainer.max_staleness={cfg.trainer.max_staleness}")
    t1 = time.perf_counter()
    from async_rl.batch import make_batch

    batch, metrics = make_batch(trajs, cfg.algorithm, ctx.tokenizer.pad_token_id,
                                cfg.generator.max_response_tokens, learner)
    train_metrics = learner.train_step(batch)
    t_train = time.perf_counter() - t1
    rewards = torch.tensor([t.reward for t in trajs])
    lengths = torch.tensor([len(t.response_ids) for t in trajs], dtype=torch.float32)
    num_train_tokens = float(batch.attention_mask.sum())
    for k, v in train_metrics.items():
        # The loss returns its mismatch metrics under loss/; they belong to their own namespace.
        metrics[k.replace("loss/mismatch_", "mismatch/")] = v
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors", "agent/max_turns"):
        if key in trajs[0].reward_extras:
            metrics[f"rollout/{key.split('/')[1]}_mean"] = sum(t.reward_extras.get(key, 0.0) for t in trajs) / len(trajs)
    metrics.update({
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "rollout/accuracy": accuracy_of(trajs),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_frac": sum(t.finish_reason == "length" for t in trajs) / len(trajs),
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/rejected_samples": float(ro.num_rejected_samples),
        "rollout/rejected_groups": float(ro.num_rejected_groups),
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": float(max(staleness)),
        "data/epoch": float(ctx.train_ds.epoch),
        "policy/version": float(learner.version),
        "perf/train_tokens_per_s": num_train_tokens / max(t_train, 1e-9),
        "timing/train_s": t_train,
    })
    return metrics
