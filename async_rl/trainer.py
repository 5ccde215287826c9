"""The trainer: one run from config to summary, in either mode.

``train`` reads as the run does: build the parts (``build``), start fresh or from a checkpoint
(``start``), run the loop of ``trainer.mode`` for the remaining steps (``run_steps``), and
finish (``finish``: the summary, the exported model). The loops themselves live in
``async_rl.loops`` (``SyncLoop``, ``AsyncLoop``); every weight push into the colocated engine
goes through ``RunContext.publisher``.

Run with ``async-rl train --config configs/default.yaml``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from transformers import AutoTokenizer

from async_rl.runtime.checkpoint import (RunDirectory, StopRequest, latest_checkpoint, load_trainer_state,
                                         resolve_resume, rng_state, save_checkpoint, set_rng_state)
from async_rl.step.episodes import (data_file, env_gives_reward, environment_services, make_rollout_agent,
                                    rollout_env_config)
from async_rl.config import to_dict, to_yaml
from async_rl.utils.cpu_threads import available_cores, user_num_threads
from async_rl.data.builtin import resolve
from async_rl.data.dataset import PromptDataset, image_processing_for
from async_rl.step.evaluation import EvalAtK, evaluate, warm_start
from async_rl.runtime.inputs import check_inputs
from async_rl.utils.leftovers import sweep_at_start
from async_rl.data.images import PromptImages
from async_rl.generators import make_generator
from async_rl.generators.base import Generator, SamplingParams
from async_rl.runtime.cluster import (LOOPBACK, Cluster, PlacementConfig, cpus_restored, pin_process,
                                      split_learner_threads, started_on)
from async_rl.learners.launch import LearnerHandle, LearnerRankDied, launch_learner, launched_by_torchrun
from async_rl.loops.base import Loop, RunContext, TrainerConfig
from async_rl.loops.sync import SyncLoop
from async_rl.runtime.metrics import MetricsLogger
from async_rl.rewards import check_rewards_work, default_reward_for, failure_summary
from async_rl.rewards.teacher import TeacherStage
from async_rl.step.rollout import check_teachers, load_reward_model, load_teacher, make_scorer, stop_token_ids
from async_rl.weight_sync import LocalTarget, WeightPublisher, engine_protocol, resolve_transport

if TYPE_CHECKING:
    from async_rl.config import Config

logger = logging.getLogger(__name__)


def train(cfg: "Config") -> dict[str, Any]:
    """Run a whole training job; returns the summary also written to ``<run_dir>/summary.json``.

    The inputs are checked before anything loads (``async_rl.runtime.inputs.check_inputs``: data files,
    model) and the run directory (``RunDirectory``) is made only once they have loaded; a run that
    fails or is interrupted before its first training step leaves no directory behind.

    Raises:
        ValueError: bad inputs (a missing data file or model, dataset rows, reward names, a run
            name already used by another run, a checkpoint of another mode or already at
            ``total_steps``, dynamic sampling that cannot fill a step).
        RunInterrupted: SIGINT before the first training step (nothing saved).
        RuntimeError: a step whose every sample was rejected, or a generator actor that died.
        LearnerRankDied: a follower learner rank died (a ``RuntimeError`` naming the rank, how it
            ended and the checkpoint ``trainer.resume=auto`` continues from).
    """
    # Pinned roles move this process's threads between cores; they come back as they were.
    with cpus_restored(bool(cfg.learner.cpu_affinity or cfg.generator.cpu_affinity)):
        return _train(cfg)


def _train(cfg: "Config") -> dict[str, Any]:
    """``train``'s body (see there)."""
    sweep_at_start()  # what earlier runs, SIGKILLed, left in /dev/shm and the temp dir (utils/leftovers.py)
    resume_from, resumed = resume_point(cfg.trainer)
    run = RunDirectory(cfg.trainer)
    check_inputs(cfg)
    progress = Progress(summary={})
    # An environment's servers (env.args.serve) run for the whole run, before its actors start.
    with environment_services(cfg.env, LOOPBACK), _kept_only_if_trained(run, progress):
        ctx, learner_handle = build(cfg, run)
        progress.summary.update({"run_dir": str(ctx.run_dir), "mode": cfg.trainer.mode, **ctx.train_ds.summary()})
        loop: Loop | None = None
        failed = True
        try:
            progress.stage = ("the resume" if resumed is not None else
                              "the warm start" if cfg.trainer.warm_start.steps else "the step-0 evaluation")
            start(ctx, progress, resume_from, resumed)
            progress.stage = "the start of the training loop"
            loop = make_loop(ctx, resumed)
            if ctx.cluster is not None:  # every actor is placed by now: say where
                for line in ctx.cluster.describe():
                    ctx.log.print(line)
                ctx.cluster.save(ctx.run_dir)
            run_steps(ctx, loop, progress)
            progress.summary.update(loop.close())
            if (late := loop.evaluation_after_last_step()) is not None:
                record_late_eval(ctx, progress, late)
            loop = None
            finish(ctx, progress)
            failed = False
        except LearnerRankDied as e:
            raise LearnerRankDied(e.rank, f"{e}; {resume_point_note(ctx.run_dir, cfg.trainer)}") from e
        finally:
            if loop is not None:  # the run failed: stop the loop without masking that failure
                try:
                    loop.close()
                except Exception:  # noqa: BLE001 - a consequence; the run's own failure propagates
                    logger.exception("closing the %s loop after the run failed", cfg.trainer.mode)
            ctx.publisher.close()
            ctx.generator.close()
            ctx.scorer.close()  # their reward worker processes
            ctx.eval_scorer.close()
            learner_handle.close(failed=failed)
            if ctx.cluster is not None:
                ctx.cluster.close()
            ctx.log.close()
    # Strict JSON (as metrics.jsonl): a figure that is not a number (no evaluation scored) is null.
    strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in progress.summary.items()}
    (ctx.run_dir / "summary.json").write_text(json.dumps(strict, indent=2))
    return progress.summary


def resume_point_note(run_dir: Path, t_cfg) -> str:
    """Where a run that failed can go on from, for its error: the last complete checkpoint in
    ``run_dir`` and the step it holds, or that there is none (``trainer.checkpoint.every_steps``)."""
    path = latest_checkpoint(run_dir)
    if path is None:
        return (f"no checkpoint was written (trainer.checkpoint.every_steps={t_cfg.checkpoint.every_steps}): "
                "a new run starts over")
    return (f"the last good checkpoint is {path} (after step {int(path.name.split('_')[1])}): "
            "run again with trainer.resume=auto to continue from it")


class RunInterrupted(KeyboardInterrupt):
    """SIGINT stopped a run before its first training step: nothing was saved (a resumed run
    keeps its checkpoint), and the run directory, if this run made it, was removed. ``str()`` is
    the line to show, naming the stage (``Progress.stage``)."""


@contextlib.contextmanager
def _kept_only_if_trained(run: RunDirectory, progress: "Progress") -> Iterator[None]:
    """Around a run: when it ends by an exception before it trained a step, remove the run
    directory if this run made it and it holds no checkpoint (a config and the scores of an
    untrained model are not worth keeping, and a half-written directory would block the name),
    and turn a SIGINT there into ``RunInterrupted`` naming ``progress.stage``. A run that trained
    keeps its directory."""
    try:
        yield
    except BaseException as e:
        if progress.last_step >= progress.start_step:
            raise
        saved = latest_checkpoint(run.path)
        removed = saved is None and run.discard()
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, RunInterrupted):
            news = f"nothing saved since {saved}" if saved is not None else "nothing saved yet"
            where = f" (removed {run.path})" if removed else ""
            raise RunInterrupted(f"interrupted during {progress.stage}; {news}{where}") from None
        raise


@dataclass
class Progress:
    """What a run has done so far, as checkpoints carry it.

    Attributes:
        summary: the run's summary (``eval_*`` entries travel in checkpoints).
        tail_evals: held-out accuracies of the last quarter of the run.
        start_step: the first step still to train (1 for a fresh run).
        last_step: the last step trained.
        stage: what the run does before its first training step (named if a SIGINT stops it there).
    """

    summary: dict[str, Any]
    tail_evals: list[float] = field(default_factory=list)
    start_step: int = 1
    last_step: int = 0
    stage: str = "the loading of the model and data"


# ------------------------------------------------------------------------------------------ build
def resume_point(t_cfg: TrainerConfig) -> tuple[Path | None, dict[str, Any] | None]:
    """``(checkpoint path, its trainer state)`` to continue from, or ``(None, None)``.

    Raises:
        ValueError: the checkpoint is already at ``trainer.total_steps``, or was written in the
            other mode (the loop states differ: sync keeps the next group id; async the replay
            buffer and the groups in flight).
    """
    resume_from = resolve_resume(t_cfg.resume, t_cfg.output_dir, t_cfg.run_name)
    resumed = load_trainer_state(resume_from) if resume_from is not None else None
    if t_cfg.resume == "auto" and resumed is None:
        logger.warning("trainer.resume=auto: no checkpoint under %s; starting fresh",
                       Path(t_cfg.output_dir) / str(t_cfg.run_name) / "checkpoints")
    if resumed is not None and resumed["step"] >= t_cfg.total_steps:
        raise ValueError(f"trainer.resume: {resume_from} is at step {resumed['step']}, not before "
                         f"trainer.total_steps={t_cfg.total_steps}: nothing to train (raise trainer.total_steps)")
    if resumed is not None and resumed.get("mode", t_cfg.mode) != t_cfg.mode:
        raise ValueError(f"trainer.resume: {resume_from} was written in trainer.mode={resumed['mode']}; "
                         f"resume it with the same mode (got trainer.mode={t_cfg.mode})")
    return resume_from, resumed


WARM_START_HINT = ("the warm start's reference response: set trainer.warm_start.response_field to the dotted path "
                   "of the row field that holds it, such as reward_model.ground_truth or extra_info.solution, or "
                   "trainer.warm_start.steps=0 for no warm start, as for a pretrained model")
"""Ends the error of a train row without a reference response while a warm start is configured."""


def build(cfg: "Config", run: RunDirectory) -> tuple[RunContext, LearnerHandle]:
    """Seed, load the tokenizer, data and reward, make the run directory (``run.create``), launch
    the learner and build the colocated engine with its weight publisher.

    Returns:
        ``(ctx, learner_handle)``; ``learner_handle.close()`` stops a multi-rank learner.

    Raises:
        ValueError: a bad dataset row, a data source without a reward function, a bad reward spec.
    """
    t_cfg, d, seed = cfg.trainer, cfg.data, cfg.trainer.seed
    random.seed(seed)
    torch.manual_seed(seed)
    if cfg.learner.num_threads:
        torch.set_num_threads(cfg.learner.num_threads)
    model_path = resolve(cfg.model.path)
    tokenizer_path = resolve(cfg.model.tokenizer_path or cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    stops = stop_token_ids(tokenizer, model_path, cfg.generator.extra_stop_token_ids)
    # One image processor (the model's, with data.image_*_pixels) for the rows' images and the
    # observations' of a multi-turn run; None for a text policy.
    images = image_processing_for(model_path, d)
    agent = make_rollout_agent(cfg, tokenizer, stops, images=images)
    # With tools, prompts are rendered with their schemas (the model sees what it may call).
    tools = agent.schemas if agent is not None else None
    # The warm start's reference responses are read (and a row without one refused) as the rows load.
    rows_env = rollout_env_config(cfg)  # whose rows ``env:<split>`` data files are
    train_ds = PromptDataset([data_file(f, rows_env) for f in d.train_files], tokenizer, d.max_prompt_tokens, seed, d.shuffle,
                             tools=tools, reference_fields=t_cfg.warm_start.reference_fields(),
                             reference_hint=WARM_START_HINT, on_bad_row=d.on_bad_row,
                             images=images)
    val_ds = (PromptDataset([data_file(f, rows_env) for f in d.val_files], tokenizer, d.max_prompt_tokens, seed, False,
                            limit=d.val_max_prompts, tools=tools, on_bad_row=d.on_bad_row,
                            images=images) if d.val_files else None)
    if not cfg.reward.fn and not cfg.reward.model and not env_gives_reward(rows_env):
        # Fail before training, not as a reward error on every sample: each data_source needs a reward.
        for source in {p.data_source for ds in (train_ds, val_ds) if ds is not None for p in ds.prompts}:
            default_reward_for(source)
    if cfg.algorithm.needs_teacher:  # every train source has a teacher, with the student's tokenizer
        check_teachers(cfg, tokenizer, [p.data_source for p in train_ds.prompts])
    # The run directory is made only once the inputs have loaded, so a bad dataset leaves none behind.
    run_dir = run.create(to_yaml(cfg))
    if len(train_ds) < t_cfg.prompts_per_step:
        logger.warning("the train set has %d prompts, fewer than trainer.prompts_per_step=%d: each step repeats "
                       "prompts (every step still draws its full batch, crossing epochs)", len(train_ds),
                       t_cfg.prompts_per_step)
    # Async mode keeps the learner's cores for the thread that trains (and torch's threads it
    # starts): Ray, ZeroMQ, Arrow and the pipeline's threads run on the other cores. Before any
    # parallel torch op (the reward model's, the learner's) starts torch's intra-op pool, after
    # the datasets' readers started theirs. Sync mode moves the whole process per phase.
    split = cfg.trainer.mode == "async" and bool(cfg.learner.cpu_affinity)
    service = split_learner_threads(cfg.learner.cpu_affinity, "learner.cpu_affinity") if split else []
    # Sync mode scores with it; async mode only evaluates with it (the workers use the reward actor).
    reward_model = load_reward_model(cfg.reward) if cfg.reward.model else None
    # Sync mode's teacher scores in this process; async mode's in the teacher actor (AsyncLoop).
    teacher = (TeacherStage(load_teacher(cfg, tokenizer_path).scores, cfg.algorithm.distill.batch_size)
               if cfg.algorithm.needs_teacher and cfg.trainer.mode == "sync" else None)
    with started_on(service):  # Ray's processes and this process's Ray threads
        cluster = Cluster.start(cfg) if uses_ray(cfg) else None
    try:
        if not split:
            # Once Ray's own processes have started (they would inherit the mask): rank 0 on its cores.
            pin_process(cfg.learner.cpu_affinity, "learner.cpu_affinity")
        if cfg.learner.cpu_affinity and not cfg.learner.num_threads:
            torch.set_num_threads(len(cfg.learner.cpu_affinity))
        if split and torch.get_num_threads() > 1:
            # OpenMP starts torch's intra-op threads at the first parallel op, with the mask of
            # the thread that runs it: here, the learner's cores (not inside a started_on block).
            torch.ones(1 << 20).add_(1)
        if cfg.trainer.mode == "async":
            # Reserved now, taken by the pool after the warm start: a cluster that cannot hold the
            # generators, or a loopback bind_host with one on another node, fails in seconds.
            cluster.place("generators", cfg.generator.num_workers, PlacementConfig.of_generators(cfg.generator))
            cluster.check_reachable("generator", cluster.placed["generators"])
        learner, learner_handle = launch_learner(*learner_args(cfg, model_path), cluster=cluster)
    except BaseException:
        if cluster is not None:
            cluster.close()
        raise
    generator = None
    try:
        generator, transport = colocated_engine(cfg, model_path, tokenizer.pad_token_id)
        ctx = RunContext(
            cfg=cfg, tokenizer=tokenizer, model_path=model_path, train_ds=train_ds, val_ds=val_ds,
            scorer=make_scorer(cfg.reward, cfg.reward.on_error, reward_model and reward_model.score, teacher=teacher),
            # Separate counters: eval must not leak into train metrics.
            eval_scorer=make_scorer(cfg.reward, "zero", reward_model and reward_model.score),
            params=dataclasses.replace(SamplingParams.from_config(cfg.generator, stops),
                                       return_routed_experts=cfg.algorithm.records_routing),
            eval_params=SamplingParams.from_config(cfg.generator, stops, greedy=t_cfg.eval_greedy),
            learner=learner, generator=generator,
            publisher=WeightPublisher(cfg.weight_sync, transport, learner, [LocalTarget(generator)],
                                      protocol=engine_protocol(cfg.generator.backend if cfg.trainer.mode == "sync" else "hf")),
            run_dir=run_dir, log=MetricsLogger(cfg.logging, run_dir, t_cfg.total_steps, run_config=to_dict(cfg)),
            agent=agent, cluster=cluster, service_cores=service,
            eval_at_k=EvalAtK.from_config(t_cfg, SamplingParams.from_config(cfg.generator, stops)),
            prompt_images=PromptImages(train_ds, merge_size=images.merge_size if images else None))
    except BaseException:
        # Nothing of a run that could not be built may outlive it: the engine, the learner's
        # ranks, and a Ray instance this run started (a later ray.init in this process would fail).
        if generator is not None:
            generator.close()
        learner_handle.close(failed=True)
        if cluster is not None:
            cluster.close()
        raise
    ctx.log.print(f"run directory: {run_dir}")
    if train_ds.num_rejected_too_long:
        ctx.log.print(f"rejected {train_ds.num_rejected_too_long} train prompts longer than {d.max_prompt_tokens} tokens")
    if train_ds.summary()["data/rejected_rows"]:
        ctx.log.print(f"train rows rejected (data.on_bad_row={d.on_bad_row}): {train_ds.describe_rejected()}")
    return ctx, learner_handle


def uses_ray(cfg: "Config") -> bool:
    """Whether the run places Ray actors: the async generator pool, or learner ranks 1..N-1
    (unless torchrun started them)."""
    return cfg.trainer.mode == "async" or (cfg.learner.world_size > 1 and not launched_by_torchrun())


def learner_args(cfg: "Config", model_path: str) -> tuple:
    """``FSDPLearner``'s constructor arguments for a run (the same on every learner rank)."""
    steps_per_train_step = cfg.learner.num_mini_batches * cfg.learner.num_epochs
    return (cfg.learner, cfg.algorithm, model_path, cfg.generator.temperature,
            cfg.trainer.total_steps * steps_per_train_step)


def colocated_engine(cfg: "Config", model_path: str, pad_token_id: int) -> tuple[Generator, str]:
    """The engine of the trainer process and the weight transport into it.

    Sync mode: the rollout engine (hybrid engine), reached by ``weight_sync.transport`` (``auto``:
    ``colocated`` for HF, ``shm`` for vLLM's engine processes). Async mode: only evaluation runs
    here, on HF with the ``colocated`` transport (one more vLLM engine would take cores and memory
    from the pool, for no difference in greedy accuracy).
    """
    if cfg.trainer.mode == "async":
        hf = dataclasses.replace(cfg.generator, backend="hf")
        return make_generator(hf, model_path, pad_token_id, lora=cfg.learner.lora), "colocated"
    engine = make_generator(cfg.generator, model_path, pad_token_id, num_threads=user_num_threads() or available_cores(),
                            lora=cfg.learner.lora)
    return engine, resolve_transport(cfg.weight_sync, cfg.generator.backend, "sync")


# ------------------------------------------------------------------------------------------ start
def start(ctx: RunContext, progress: Progress, resume_from: Path | None, resumed: dict[str, Any] | None) -> None:
    """A fresh start (optional warm start, ``begin_rl``, the step-0 evaluation) or a resume
    (weights, optimizer, schedules and the reference policy from the checkpoint; RNG state
    restored by ``make_loop``); either way the colocated engine then holds the learner's weights."""
    if resumed is None:
        start_fresh(ctx, progress.summary)
        return
    ctx.learner.load_checkpoint(str(resume_from / "learner"))
    ctx.publisher.push(ctx.learner.version)
    progress.summary.update(resumed["summary"])
    progress.tail_evals = list(resumed["tail_evals"])
    progress.start_step, progress.last_step = resumed["step"] + 1, resumed["step"]
    # Checkpoints written before the run's clock was saved continue it from 0.
    ctx.log.resume(resumed["step"], resumed.get("elapsed_s", 0.0))
    ctx.log.print(f"resumed from {resume_from}: step {resumed['step']} done, policy version {ctx.learner.version}")


def start_fresh(ctx: RunContext, summary: dict[str, Any]) -> None:
    """A run's start without a checkpoint: optional warm start (evaluated before, pushed after),
    ``begin_rl``, and the step-0 evaluation (``summary["eval_step_0"]``).

    Raises:
        ValueError: the reward function failed on every call of the step-0 evaluation.
    """
    t_cfg, learner, val_ds = ctx.cfg.trainer, ctx.learner, ctx.val_ds
    if val_ds is not None and t_cfg.warm_start.steps:
        ctx.eval_scorer.pop_metrics()
        summary["eval_before_warm_start"] = evaluate(ctx.generator, val_ds, ctx.eval_params, ctx.eval_scorer,
                                                     ctx.tokenizer, ctx.agent)["eval/accuracy"]
        ctx.log.print(f"eval before warm start: accuracy {summary['eval_before_warm_start']:.4f}")
        window = ctx.eval_scorer.pop_metrics()
        if window["reward/scored"] and window["reward/errors"] >= window["reward/scored"]:
            # Not fatal yet: a model before its warm start may write what a reward cannot parse.
            ctx.log.print(f"warning: the reward function failed on every call of this evaluation; first error: "
                          f"{ctx.eval_scorer.first_error} (the run stops if it still does at step 0)")
    if t_cfg.warm_start.steps:
        sources = ", ".join(f"'{k}' ({n} rows)" for k, n in ctx.train_ds.reference_sources.items())
        ctx.log.print(f"warm start: {t_cfg.warm_start.steps} steps on the reference responses in {sources}")
        with ctx.log.phase("warm start", t_cfg.warm_start.steps) as update:
            warm_start(learner, ctx.train_ds, ctx.tokenizer, t_cfg.warm_start, ctx.tokenizer.eos_token_id, t_cfg.seed,
                       ctx.log.print, ctx.agent, on_step=lambda k, loss: update(k, f"loss {loss:.4f}"))
        ctx.publisher.push(learner.version)
    learner.begin_rl()
    if val_ds is not None:
        ctx.eval_scorer.pop_metrics()
        ev = evaluate(ctx.generator, val_ds, ctx.eval_params, ctx.eval_scorer, ctx.tokenizer, ctx.agent, ctx.eval_at_k)
        summary["eval_step_0"] = ev["eval/accuracy"]
        ctx.log.log(ev, step=0)
        rejected = int(ev.get("eval/rejected", 0))
        ctx.log.print(f"step 0: eval accuracy {ev['eval/accuracy']:.4f}" + (
            f" ({rejected} of {rejected + int(ev['eval/num_prompts'])} held-out samples rejected, counted wrong: "
            "see the warnings above)" if rejected else ""))
        check_rewards_work(ctx.eval_scorer.pop_metrics(), ctx.eval_scorer.first_error, "step 0 evaluation")


def make_loop(ctx: RunContext, resumed: dict[str, Any] | None) -> Loop:
    """The ``Loop`` of ``trainer.mode``, continued from a checkpoint's loop state if any; a
    checkpoint's RNG state is restored once the loop is built, as the run left it."""
    state = resumed["loop"] if resumed is not None else None
    if ctx.cfg.trainer.mode == "async":
        # Ray and the pool load only for async runs.
        from async_rl.loops.async_loop import AsyncLoop

        # Its receiver, dispatcher, ZeroMQ and Ray threads start on the service cores, if any.
        with started_on(ctx.service_cores):
            loop: Loop = AsyncLoop(ctx, resume_state=state)
    else:
        loop = SyncLoop(ctx, resume_state=state)
    if resumed is not None:
        set_rng_state(resumed["rng"])
    return loop


# -------------------------------------------------------------------------------------------- run
def run_steps(ctx: RunContext, loop: Loop, progress: Progress) -> None:
    """Train from ``progress.start_step`` to ``trainer.total_steps``, evaluating every
    ``trainer.eval_every_steps`` and at the end, checkpointing every ``checkpoint.every_steps``;
    a SIGINT/SIGTERM stops after the current step (checkpointed with ``save_at_exit``)."""
    t_cfg = ctx.cfg.trainer
    t_rl = time.perf_counter()
    saved_step = progress.last_step
    with StopRequest() as stop:
        for step in range(progress.start_step, t_cfg.total_steps + 1):
            metrics = loop.step(step)
            if "eval/started_step" in metrics:  # an evaluation on the async pool ended during this step
                # A record of its own: an evaluation due now (below) must not mix with it.
                pooled = {k: metrics.pop(k) for k in list(metrics) if k.startswith("eval/")}
                record_eval(ctx, progress, int(pooled["eval/started_step"]), pooled)
                ctx.log.log(pooled, step=step)
            due = t_cfg.eval_every_steps and step % t_cfg.eval_every_steps == 0
            if ctx.val_ds is not None and (due or step == t_cfg.total_steps):
                # Between steps on the async pool (trainer.eval_on_pool) while training goes on;
                # the last one, and any without a pool, on the colocated engine now.
                if step == t_cfg.total_steps or not loop.start_evaluation(step):
                    metrics.update(evaluate_now(ctx, loop, progress, step))
            ctx.log.log(metrics, step=step)
            ctx.log.advance(step)
            progress.last_step = step
            if stop.requested:
                progress.summary["interrupted"] = stop.signal_name
                ctx.log.print(f"{stop.signal_name}: stopping after step {step} of {t_cfg.total_steps}")
                break
            every = t_cfg.checkpoint.every_steps
            if every and step % every == 0:
                checkpoint(ctx, loop, progress, step)
                saved_step = step
        if t_cfg.checkpoint.save_at_exit and progress.last_step != saved_step:
            checkpoint(ctx, loop, progress, progress.last_step)
    progress.summary["last_step"] = progress.last_step
    progress.summary["rl_wall_s"] = time.perf_counter() - t_rl


def evaluate_now(ctx: RunContext, loop: Loop, progress: Progress, step: int) -> dict[str, float]:
    """Held-out evaluation after ``step`` on the colocated engine (brought up to date first)."""
    t0 = time.perf_counter()
    loop.sync_eval_engine()
    metrics = evaluate(ctx.generator, ctx.val_ds, ctx.eval_params, ctx.eval_scorer, ctx.tokenizer, ctx.agent,
                       ctx.eval_at_k)
    metrics["timing/eval_s"] = time.perf_counter() - t0
    record_eval(ctx, progress, step, metrics)
    return metrics


def record_eval(ctx: RunContext, progress: Progress, step: int, metrics: dict[str, float]) -> None:
    """Keep an evaluation of the policy after ``step`` in the run's summary: the latest accuracy
    (``eval_final``), and those of the last quarter of the steps (``eval_tail_mean``)."""
    progress.summary["eval_final"] = metrics["eval/accuracy"]
    if step > 0.75 * ctx.cfg.trainer.total_steps:
        progress.tail_evals.append(metrics["eval/accuracy"])


def record_late_eval(ctx: RunContext, progress: Progress, metrics: dict[str, float]) -> None:
    """Log an evaluation on the async pool that ended only after the last step, as its own
    record at that step; it counts towards ``eval_tail_mean`` like any other started in the last
    quarter, never as ``eval_final`` (the colocated evaluation of the final policy is that)."""
    ctx.log.log(metrics, step=progress.last_step)
    if metrics["eval/started_step"] > 0.75 * ctx.cfg.trainer.total_steps:
        progress.tail_evals.append(metrics["eval/accuracy"])


def checkpoint(ctx: RunContext, loop: Loop, progress: Progress, step: int) -> None:
    """Save the learner and the trainer state after ``step`` (``async_rl.runtime.checkpoint``)."""
    t0 = time.perf_counter()
    state = {"mode": ctx.cfg.trainer.mode, "rng": rng_state(), "loop": loop.state_dict(),
             "tail_evals": progress.tail_evals, "elapsed_s": ctx.log.elapsed_s,
             "summary": {k: v for k, v in progress.summary.items() if k.startswith("eval_")}}
    path = save_checkpoint(ctx.run_dir, step, ctx.learner, state, ctx.cfg.trainer.checkpoint.keep_last)
    ctx.log.print(f"checkpoint written to {path} ({time.perf_counter() - t0:.1f} s)")


# ----------------------------------------------------------------------------------------- finish
def finish(ctx: RunContext, progress: Progress) -> None:
    """The reward failures' line (if any failed), the summary's gains (final and last-quarter
    mean accuracy against step 0) and the exported final policy; an interrupted run gets neither
    of the last two."""
    summary, t_cfg = progress.summary, ctx.cfg.trainer
    # One line for a reward function that failed sometimes (the loops stop one that always fails).
    summary["reward/eval_scored"], summary["reward/eval_errors"] = (
        ctx.eval_scorer.num_scored, ctx.eval_scorer.num_errors)
    for line in (failure_summary(summary, summary.get("reward/first_error"), "training reward calls"),
                 failure_summary(ctx.eval_scorer.counts(), ctx.eval_scorer.first_error, "evaluation reward calls")):
        if line is not None:
            ctx.log.print(line)
    if "eval_step_0" in summary and "eval_final" in summary and "interrupted" not in summary:
        summary["eval_gain_points"] = 100.0 * (summary["eval_final"] - summary["eval_step_0"])
        ctx.log.print(f"eval accuracy: step 0 {summary['eval_step_0']:.4f} -> step {t_cfg.total_steps} "
                      f"{summary['eval_final']:.4f} ({summary['eval_gain_points']:+.1f} points)")
        # One eval of a small held-out set is noisy; the mean over the last quarter of the run
        # is the steadier figure for comparing runs (modes, algorithms, seeds).
        tail = progress.tail_evals
        summary["eval_tail_mean"] = sum(tail) / len(tail)
        summary["eval_tail_gain_points"] = 100.0 * (summary["eval_tail_mean"] - summary["eval_step_0"])
        ctx.log.print(f"eval accuracy, mean of the {len(tail)} evals in the last quarter: "
                      f"{summary['eval_tail_mean']:.4f} ({summary['eval_tail_gain_points']:+.1f} points)")
    if t_cfg.export_model and "interrupted" not in summary:
        ctx.learner.export_hf(str(ctx.run_dir / "final_model"), ctx.tokenizer)
        summary["final_model"] = str(ctx.run_dir / "final_model")
        ctx.log.print(f"final policy written to {ctx.run_dir / 'final_model'}")
