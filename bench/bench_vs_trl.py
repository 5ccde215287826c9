"""Our sync and async modes against TRL's ``GRPOTrainer`` on the default job, from the same weights.

Every contender starts from one warm-started checkpoint of the built-in tiny Qwen2 (the default
job's supervised warm start, ``trainer.warm_start`` in ``configs/default.yaml``, run once through
the project's own ``async_rl.step.evaluation.warm_start`` and exported as a Hugging Face directory) and
trains GRPO on ``builtin:arithmetic/train`` with the exact-match reward
(``async_rl.rewards.arithmetic.arithmetic_reward``, which TRL's reward function wraps), with the
same group size, prompts per step, completion length, learning rate and warm-up, optimizer steps
per step, gradient clip and no KL term. Held-out accuracy is measured for all three by our own
evaluation path (``async_rl.step.evaluation.evaluate``: greedy, one response per prompt of
``builtin:arithmetic/test``), TRL's model after exporting it.

Printed per contender: completions/s over the RL phase (steps x prompts x group size / wall s,
held-out evaluations excluded for all three), the ratio to TRL, completions per CPU second of
this process (TRL and sync mode, which do all their work in it; a busy machine moves wall time
many-fold and CPU time far less),
the target (sync >= 3x TRL) and held-out accuracy before and after; plus the wall time each takes
to reach the lowest final accuracy of the three (from our runs' periodic evaluations; TRL's
curve is evaluated at the same steps through a callback).

TRL is an optional ``bench`` extra (``pip install -e .[bench]``), never a runtime dependency.
The contenders run back to back in this process; on a loaded machine the figures move together.

    python bench/bench_vs_trl.py               # 20 steps each (about 10 min on 2 cores)
    python bench/bench_vs_trl.py --full        # the default job's 300 steps, evaluated every 25
    python bench/bench_vs_trl.py --only sync   # one contender (sync, async or trl)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONTENDERS = ("trl", "sync", "async")


DEFAULT_CONFIG = ROOT / "configs/default.yaml"


def default_config(overrides=(), config: Path = DEFAULT_CONFIG):
    """The ``Config`` of the job file ``config`` (the default job unless given) with ``overrides``
    (dotlist strings)."""
    from async_rl.config import load_config

    return load_config(config, list(overrides))


def warm_started_model(out_dir: Path, config: Path = DEFAULT_CONFIG, overrides=()) -> Path:
    """The job's warm start, once: ``trainer.warm_start`` steps of the project's supervised warm
    start on the job's model (``config`` with ``overrides``), exported to ``out_dir/warm`` (reused
    if already there)."""
    target = out_dir / "warm"
    if (target / "config.json").exists():
        return target
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.step.episodes import data_file, make_rollout_agent
    from async_rl.step.evaluation import warm_start
    from async_rl.step.rollout import stop_token_ids
    from async_rl.learners.launch import launch_learner
    from async_rl.trainer import learner_args

    cfg = default_config(overrides, config)
    t_cfg = cfg.trainer
    model_path = resolve(cfg.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    torch_seed(t_cfg.seed)
    # The rows and prompts a run trains on: an environment's task rows (env:train) and tool
    # schemas included, as async_rl.trainer builds them.
    agent = make_rollout_agent(cfg, tokenizer, stop_token_ids(tokenizer, model_path, cfg.generator.extra_stop_token_ids))
    train_ds = PromptDataset([data_file(f, cfg.env) for f in cfg.data.train_files], tokenizer,
                             cfg.data.max_prompt_tokens, t_cfg.seed, cfg.data.shuffle,
                             tools=agent.schemas if agent is not None else None,
                             reference_fields=t_cfg.warm_start.reference_fields())
    learner, handle = launch_learner(*learner_args(cfg, model_path))
    try:
        t0 = time.perf_counter()
        warm_start(learner, train_ds, tokenizer, t_cfg.warm_start, tokenizer.eos_token_id, t_cfg.seed, print, agent)
        learner.export_hf(str(target), tokenizer)
        print(f"warm start: {t_cfg.warm_start.steps} steps in {time.perf_counter() - t0:.1f} s -> {target}")
    finally:
        handle.close()
    return target


def torch_seed(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


class HeldOut:
    """Greedy held-out accuracy of any Hugging Face model directory or in-memory model, through
    our evaluation path (``async_rl.step.evaluation.evaluate`` on the HF generator)."""

    def __init__(self, model_dir: Path, config: Path = DEFAULT_CONFIG, overrides=()) -> None:
        from async_rl.commands import eval_parts, held_out_prompts
        from async_rl.generators import make_generator

        self.cfg = cfg = default_config([*overrides, f"model.path={model_dir}"], config)
        # The evaluation a run makes (async_rl.commands.eval_parts): its prompts, reward and, for
        # an environment's job, the environment's episodes, on every row of data.val_files.
        parts = eval_parts(cfg, str(model_dir), str(model_dir))
        self.tokenizer, self.params, self.scorer, self.agent = parts.tokenizer, parts.params, parts.scorer, parts.agent
        self.val_ds = held_out_prompts(cfg, parts, limit=0)
        self.generator = make_generator(cfg.generator, str(model_dir), self.tokenizer.pad_token_id)
        self.version = 0

    def accuracy(self, model=None) -> float:
        """Accuracy of the generator's weights, after loading ``model``'s (a module with HF names)."""
        from async_rl.step.evaluation import evaluate

        if model is not None:
            # named_parameters yields tied weights once (the engine ties them back itself).
            self.version += 1
            self.generator.update_weights([(k, p.detach()) for k, p in model.named_parameters()], self.version)
        return evaluate(self.generator, self.val_ds, self.params, self.scorer, self.tokenizer,
                        self.agent)["eval/accuracy"]

    def close(self) -> None:
        self.generator.close()
        self.scorer.close()


def run_ours(mode: str, warm: Path, args, out: Path) -> dict:
    """Our ``mode`` run from the warm-started weights (no second warm start); returns its summary
    plus the per-step evaluation curve ``[(rl seconds, accuracy)]`` from metrics.jsonl."""
    from async_rl.trainer import train

    # A fresh run name per invocation: --out may be reused for its warm-started model.
    name = f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [f"model.path={warm}", "trainer.warm_start.steps=0", f"trainer.mode={mode}",
                 f"trainer.total_steps={args.steps}", f"trainer.eval_every_steps={args.eval_every}",
                 f"trainer.output_dir={out}", f"trainer.run_name={name}", "trainer.export_model=false",
                 "logging.progress=false", "logging.console_every_steps=1000"]
    if mode == "async":
        overrides += [f"generator.num_workers={args.workers}"]
    cpu = {"s": 0.0}
    if mode == "sync":
        # CPU seconds of the training steps (this process does all of a sync step's work): a figure
        # that a busy machine moves far less than wall time. Async steps run in other processes too.
        from async_rl.loops.sync import SyncLoop

        step = SyncLoop.step

        def timed(self, n):
            c0 = time.process_time()
            try:
                return step(self, n)
            finally:
                cpu["s"] += time.process_time() - c0

        SyncLoop.step = timed
    try:
        summary = train(default_config(overrides + list(args.override)))
    finally:
        if mode == "sync":
            SyncLoop.step = step
    summary["cpu_s"] = cpu["s"] or None
    lines = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    # time_s: the run's clock when the step was logged (after that step's evaluation); the RL phase
    # starts at the step-0 evaluation. Evaluation time is taken off, as from TRL's.
    t0 = next(l["time_s"] for l in lines if l["step"] == 0)
    eval_s, curve = 0.0, []
    for line in lines:
        if line["step"] >= 1:
            eval_s += line.get("timing/eval_s", 0.0)
        if "eval/accuracy" in line:
            curve.append((line["step"], line["time_s"] - t0 - eval_s, line["eval/accuracy"]))
    summary["curve"] = curve
    summary["rl_wall_s"] -= eval_s
    summary["completions_per_s"] = args.steps * args.prompts * args.group / summary["rl_wall_s"]
    summary["completions_per_cpu_s"] = summary["cpu_s"] and args.steps * args.prompts * args.group / summary["cpu_s"]
    summary["eval_start"], summary["eval_end"] = summary["eval_step_0"], summary["eval_final"]
    return summary


def trl_trainer(warm: Path, cfg, steps: int, out_dir: Path, callbacks=(), extra: dict | None = None):
    """TRL's ``GRPOTrainer`` on the model in ``warm`` with our job ``cfg``'s data, reward and
    optimisation settings, for ``steps`` of our steps (``cfg.trainer.seed`` seeds it).

    One TRL generation round of ``prompts x group`` completions feeds ``num_mini_batches``
    optimizer steps of ``prompts x group / num_mini_batches`` completions each
    (``steps_per_generation``), as our step's mini-batches do; ``beta=0`` (no KL, as our GRPO
    preset); ``loss_type="dapo"``: the token mean over the optimizer step's completions, our
    ``token-mean`` aggregation (TRL's ``"grpo"`` would average per sequence first); rewards scaled
    by the group's std and PPO clip as ours; ``num_iterations=1`` (one pass, on-policy), the same
    LR, warm-up in optimizer steps, constant schedule, AdamW betas, gradient clip, temperature and
    completion length. The reward is the one our runs use for each row's ``data_source``
    (``async_rl.rewards.registry.default_reward_for``), on the completion's text.

    Precision and recomputation match ours too: ``bf16=False`` (TRL's config turns bf16 mixed
    precision on by default, on a CPU as well: accelerate then runs sampling, the old-log-prob
    pass and training under a bfloat16 autocast, where our learner and engine compute in float32)
    and ``gradient_checkpointing=False`` (TRL's default on; our learner does not recompute
    activations). ``extra`` overrides any ``GRPOConfig`` field (``{"bf16": True}`` gives TRL's
    defaults back).

    Raises:
        ValueError: the job's rollouts are an environment's episodes (``env.name`` set).
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import read_rows
    from async_rl.rewards.registry import default_reward_for

    lc, t_cfg = cfg.learner, cfg.trainer
    if cfg.env.enabled:
        # TRL's GRPOTrainer samples one completion per prompt and scores it with a function: an
        # environment's episodes (its rows, turns and scorer) have no counterpart there.
        raise ValueError(f"the TRL contender runs single-turn jobs with a reward function; this job's rollouts are "
                         f"episodes of env.name={cfg.env.name} (run --contenders sync,async)")
    rows = [r for f in cfg.data.train_files for r in read_rows(resolve(f))]
    train = Dataset.from_list([{"prompt": r["prompt"], "data_source": r["data_source"],
                                "ground_truth": str(r["reward_model"]["ground_truth"])} for r in rows])

    def reward(completions, ground_truth, data_source, **_):
        # Conversational prompts give conversational completions: the assistant message's text.
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [default_reward_for(s)(s, t, g, None)["score"] for t, g, s in zip(texts, ground_truth, data_source)]

    per_step = t_cfg.prompts_per_step * t_cfg.samples_per_prompt
    optimizer_steps_per_step = lc.num_mini_batches
    grpo = GRPOConfig(
        output_dir=str(out_dir), use_cpu=True, seed=t_cfg.seed, report_to=[], save_strategy="no",
        logging_steps=optimizer_steps_per_step * 1000, disable_tqdm=True,
        max_steps=steps * optimizer_steps_per_step,
        per_device_train_batch_size=per_step // optimizer_steps_per_step, gradient_accumulation_steps=1,
        steps_per_generation=optimizer_steps_per_step, num_generations=t_cfg.samples_per_prompt, num_iterations=1,
        max_completion_length=cfg.generator.max_response_tokens, temperature=cfg.generator.temperature,
        beta=0.0, loss_type="dapo", scale_rewards="group", epsilon=cfg.algorithm.clip_ratio_low,
        epsilon_high=cfg.algorithm.clip_ratio_high, learning_rate=lc.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=lc.warmup_steps, adam_beta1=lc.betas[0], adam_beta2=lc.betas[1], adam_epsilon=lc.eps,
        weight_decay=lc.weight_decay, max_grad_norm=lc.grad_clip, dataloader_num_workers=0,
        **{"bf16": False, "gradient_checkpointing": False, **(extra or {})},
    )
    model = AutoModelForCausalLM.from_pretrained(str(warm), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(warm))
    return GRPOTrainer(model=model, reward_funcs=reward, args=grpo, train_dataset=train,
                       processing_class=tokenizer, callbacks=list(callbacks))


def run_trl(warm: Path, args, out: Path) -> dict:
    """TRL's ``GRPOTrainer`` (``trl_trainer``) on the default job from ``warm``, evaluated every
    ``args.eval_every`` steps; evaluation time is taken off its wall time."""
    from transformers import TrainerCallback

    cfg = default_config()
    optimizer_steps_per_step = cfg.learner.num_mini_batches
    held_out = HeldOut(warm)
    state = {"eval_s": 0.0, "eval_cpu_s": 0.0, "curve": []}

    class EvalEvery(TrainerCallback):
        """Held-out accuracy every ``eval_every`` of our steps; its time is taken off the wall."""

        def on_step_end(self, _args, tstate, _control, model=None, **_):
            step = tstate.global_step // optimizer_steps_per_step
            if tstate.global_step % optimizer_steps_per_step == 0 and args.eval_every and step % args.eval_every == 0:
                t0, c0 = time.perf_counter(), time.process_time()
                acc = held_out.accuracy(model)
                state["eval_s"] += time.perf_counter() - t0
                state["eval_cpu_s"] += time.process_time() - c0
                state["curve"].append((step, time.perf_counter() - state["t0"] - state["eval_s"], acc))

    per_step = args.prompts * args.group
    try:
        start_acc = held_out.accuracy()
        trainer = trl_trainer(warm, cfg, args.steps, out / f"trl-{time.strftime('%Y%m%d-%H%M%S')}", [EvalEvery()])
        state["t0"], c0 = time.perf_counter(), time.process_time()
        trainer.train()
        wall = time.perf_counter() - state["t0"] - state["eval_s"]
        cpu = time.process_time() - c0 - state["eval_cpu_s"]
        end_acc = held_out.accuracy(trainer.model)
    finally:
        held_out.close()
    curve = [(0, 0.0, start_acc)] + [c for c in state["curve"] if c[0] != args.steps] + [(args.steps, wall, end_acc)]
    return {"rl_wall_s": wall, "completions_per_s": args.steps * per_step / wall, "cpu_s": cpu,
            "completions_per_cpu_s": args.steps * per_step / cpu, "eval_start": start_acc,
            "eval_end": end_acc, "curve": curve}


def time_to(curve, target: float) -> float | None:
    """Seconds of the RL phase until the first evaluation at or above ``target`` (None: never)."""
    return next((t for _, t, acc in curve if t is not None and acc >= target - 1e-9), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps per contender")
    parser.add_argument("--full", action="store_true", help="the default job's 300 steps, evaluated every 25")
    parser.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N steps (0: end only)")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated: trl, sync, async")
    parser.add_argument("--workers", type=int, default=1, help="async generator workers")
    parser.add_argument("--out", default=None, help="output directory (the warm-started model is reused from it)")
    parser.add_argument("override", nargs="*", help="config overrides for our runs (dotlist)")
    args = parser.parse_args()
    if args.full:
        args.steps, args.eval_every = 300, 25
    cfg = default_config()
    args.prompts, args.group = cfg.trainer.prompts_per_step, cfg.trainer.samples_per_prompt
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(only) - set(CONTENDERS))
    if unknown:
        parser.error(f"--only: unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-vs-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    warm = warm_started_model(out)
    results = {}
    for name in CONTENDERS:
        if name not in only:
            continue
        torch_seed(cfg.trainer.seed)
        results[name] = run_trl(warm, args, out) if name == "trl" else run_ours(name, warm, args, out)
        r = results[name]
        print(f"{name}: {r['completions_per_s']:.1f} completions/s, accuracy {r['eval_start']:.3f} -> "
              f"{r['eval_end']:.3f}", flush=True)
    (out / "bench_vs_trl.json").write_text(json.dumps(results, indent=2, default=str))
    target = min(r["eval_end"] for r in results.values())
    base = results.get("trl", {}).get("completions_per_s")
    import os

    import torch

    print(f"\n{args.steps} steps x {args.prompts} prompts x {args.group} completions, "
          f"{cfg.learner.num_mini_batches} optimizer steps per step, lr {cfg.learner.lr:g}; out: {out}")
    # Everything shares the cores with whatever else runs: the load average says how busy they were.
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} cores, load average (1 min) at the end "
          f"{os.getloadavg()[0]:.1f}")
    base_cpu = results.get("trl", {}).get("completions_per_cpu_s")
    print(f"{'contender':10s} {'compl/s':>9s} {'vs TRL':>7s} {'compl/CPU-s':>12s} {'vs TRL':>7s} {'acc start':>10s} "
          f"{'acc end':>8s} {'s to acc ' + format(target, '.2f'):>14s}")
    for name, r in results.items():
        ratio = f"{r['completions_per_s'] / base:6.2f}x" if base else "     -"
        per_cpu = r.get("completions_per_cpu_s")
        cpu_ratio = f"{per_cpu / base_cpu:6.2f}x" if per_cpu and base_cpu else "     -"
        reach = time_to(r["curve"], target)
        print(f"{name:10s} {r['completions_per_s']:9.1f} {ratio:>7s} {(f'{per_cpu:.1f}' if per_cpu else '-'):>12s} "
              f"{cpu_ratio:>7s} {r['eval_start']:10.3f} {r['eval_end']:8.3f} "
              f"{(f'{reach:.1f}' if reach is not None else 'never'):>14s}")
    if base and "sync" in results:
        got = results["sync"]["completions_per_s"] / base
        got_cpu = results["sync"]["completions_per_cpu_s"] / base_cpu
        print(f"target: sync >= 3.00x TRL's completions/s: {'met' if got >= 3 else 'not met'} ({got:.2f}x wall, "
              f"{got_cpu:.2f}x per CPU second)")


if __name__ == "__main__":
    main()
