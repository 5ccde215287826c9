"""The GPU check (issue 20, P7): the whole pipeline on one GPU with a model of Qwen2.5-0.5B's shape.

One prepared script for a lent GPU machine, meant to work the first time. It builds a
random-initialised Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, vocab 151,936; ``async_rl.data.builtin.build_qwen2`` with the
project's own tokenizer, nothing downloaded) and runs it through the project's real code:

==================  ========================================================================
stage               what runs (each in its own process, with a time limit)
==================  ========================================================================
env                 the GPU's name and memory; torch, transformers, vLLM, Ray, flash-attn
config              ``load_config`` of every dotted override below, both modes, and the same
                    for the GPU overrides under ``--dry-run`` (every key must exist)
model               the 0.5B-shaped model directory (``--dry-run``: ``builtin:tiny-qwen2``)
learner             ``FSDPLearner`` alone (FSDP2 on NCCL, bf16 mixed precision, packed
                    sequences through flash-attention's varlen kernel, or ``sdpa``'s
                    block-diagonal mask when flash-attn does not import: said in the row) on
                    synthetic GRPO groups: ``make_batch`` (proximal pass) + ``train_step``
sync                ``python -m async_rl.cli train`` in sync mode: vLLM on CUDA (bf16) as the
                    trainer's engine, the learner as above, weights over ``shm`` in bf16 (the
                    project's transport into a vLLM engine on the learner's host); with
                    ``--engine hf``, transformers' ``generate`` on CUDA in bf16 instead
                    (``generator.hf.device=cuda``, ``generator.hf.dtype=bfloat16``), weights
                    ``colocated`` (copied in place, same process)
async               the same in async mode with one engine in a Ray actor on the same GPU; FAIL
                    at once, naming the module, where Ray (or, for vLLM, vLLM) is not installed
weight-sync-check   ``bench/gpu_weight_sync.py --skip-vllm --skip-broadcast`` on the same model:
                    ``colocated``, ``shm`` and CUDA IPC (one handle per tensor, as vLLM's
                    ``ipc`` engine) into an HF engine process, each checked bit for bit
==================  ========================================================================

Each stage prints ``PASS``, ``FAIL`` with one line saying why (its log's last lines follow), or
``SKIP``; one failing never stops the others. At the end: a table of the stages and one of the
figures: generation tokens/s, learner tokens/s, weight-sync seconds and GB/s (the learner's bf16
bytes over the seconds of ``timing/weight_sync_s``, export start to every engine loaded), and
the median step time of each mode (steps after the first) with their ratio. Exit status 1 if a
stage failed, 0 otherwise.

How to run (repo root, on the GPU machine; about 5-7 minutes, never measured: a GPU has not
run it yet; ``--timeout-s`` (default 450) is the hard overall limit, after which the stages
not reached FAIL as such)::

    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out-dir $OUT 2>&1 | tee $OUT/gpu_check.log

``--out-dir`` gets each child stage's log as it runs (``gpu_check_<stage>.log``: learner, sync,
async, weight_sync_check) and, at the end, ``gpu_check_summary.json`` (the plan, every stage's
result and figures): at most five files, one folder deep (``$OUT``: any directory of yours).
Smaller or larger: ``--steps``, ``--prompts``, ``--samples``, ``--response-tokens``.

On an image without vLLM (it must be built for that image's torch and CUDA), ``--engine hf``
runs both modes with the HF engine on CUDA. The project need not be installed: with the
repository root on ``PYTHONPATH`` its role folders import as ``async_rl.learners`` etc.
(``async_rl/__init__.py``), and a pure-Python wheel of omegaconf (2.4 vendors its antlr4 runtime)
unpacked beside it is all the config needs (``$SITE``: any scratch directory)::

    python3 -m pip install -q --no-index --no-deps --target $SITE omegaconf-*.whl
    export PYTHONPATH=$SITE:$PWD
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --engine hf --out-dir $OUT 2>&1 | tee $OUT/gpu_check.log

CPU dry-run (CI runs it: ``tests/test_gpu_check.py``)::

    python bench/gpu_check.py --dry-run

runs the same stages on CPU with the built-in tiny model, the HF engine (``--engine vllm`` for
vLLM's CPU build), gloo, ``sdpa`` and the ``colocated``/``shm`` transports; its figures mean
nothing and are marked so.

What the GPU needs installed: torch with CUDA, transformers, safetensors, msgpack, pyarrow, rich
and numpy (the model, learner and weight-sync-check stages need nothing else), omegaconf (the
config stage and both runs), vLLM built for that torch (both runs with ``--engine vllm``), Ray and
pyzmq (the async run), flash-attn (optional). The sync run with ``--engine hf`` imports neither
vLLM, Ray, pyzmq, wandb (``logging.wandb.mode=disabled``) nor math-verify (the arithmetic task's
exact-match reward). A run whose engine or pool library is missing FAILs at once naming it; the
other stages still give their figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN25_05B_SPEC: dict[str, Any] = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "vocab_size": 151936, "seed": 0,
}
"""Qwen2.5-0.5B's shape (its config.json), random weights: 494M parameters."""

STAGES = ("env", "config", "model", "learner", "sync", "async", "weight-sync-check")
STAGE_CAP_S = {"learner": 150, "sync": 240, "async": 270, "weight-sync-check": 150}
"""Each child stage's own limit, in seconds (the overall ``--timeout-s`` still applies)."""
PROMPT_TOKENS = 32
"""``data.max_prompt_tokens`` of both runs (the built-in arithmetic prompts have 14)."""


@dataclass
class Workload:
    """How much one training step does: ``prompts`` groups of ``samples`` responses of at most
    ``response_tokens`` tokens; ``steps`` steps a run; micro-batches of at most
    ``micro_batch_tokens`` packed tokens."""

    prompts: int
    samples: int
    response_tokens: int
    steps: int
    micro_batch_tokens: int


@dataclass
class Plan:
    """What every stage needs, written as JSON for the child stages."""

    dry_run: bool
    workdir: str
    model_path: str
    engine: str
    """``vllm`` (default on GPU; its CPU build in a dry-run) or ``hf`` (default in a dry-run; on
    GPU, ``--engine hf``: transformers on CUDA in bf16, for an image without vLLM)."""
    attn: str
    """``flash_attention_2`` when flash-attn imports (GPU), else ``sdpa``."""
    workload: Workload
    timeout_s: float

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


@dataclass
class StageResult:
    """A stage's outcome: ``status`` PASS/FAIL/SKIP, a one-line ``note`` and named figures."""

    name: str
    status: str = "FAIL"
    note: str = ""
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------- the run's settings
def learner_settings(plan: Plan) -> dict[str, Any]:
    """The ``learner.*`` keys of every stage that trains (``LearnerConfig`` fields)."""
    w = plan.workload
    return {"device": plan.device, "mixed_precision": "fp32" if plan.dry_run else "bf16", "packing": True,
            "attn_implementation": plan.attn, "max_tokens_per_micro_batch": w.micro_batch_tokens,
            "micro_batch_size": w.prompts * w.samples, "num_mini_batches": 1, "lr": 1e-6, "warmup_steps": 0}


def overrides(plan: Plan, mode: str) -> list[str]:
    """Dotted overrides of ``configs/default.yaml`` for the ``mode`` run (``sync`` or ``async``):
    no warm start, no evaluation, no checkpoint, no export; the workload of ``plan``."""
    w = plan.workload
    out = [
        f"model.path={plan.model_path}", "data.val_files=[]", f"data.max_prompt_tokens={PROMPT_TOKENS}",
        f"trainer.mode={mode}", f"trainer.total_steps={w.steps}", f"trainer.prompts_per_step={w.prompts}",
        f"trainer.samples_per_prompt={w.samples}", "trainer.warm_start.steps=0", "trainer.eval_every_steps=0",
        "trainer.export_model=false", "trainer.checkpoint.every_steps=0", "trainer.checkpoint.save_at_exit=false",
        f"trainer.output_dir={Path(plan.workdir) / 'runs'}", f"trainer.run_name={mode}",
        f"generator.backend={plan.engine}", f"generator.max_response_tokens={w.response_tokens}",
        f"generator.max_batch_size={w.prompts * w.samples}",
        "logging.progress=false", "logging.console_every_steps=1", "logging.wandb.mode=disabled",
        *(f"learner.{k}={v}" for k, v in learner_settings(plan).items()),
    ]
    if plan.engine == "hf":
        out += [f"generator.hf.device={plan.device}", f"generator.hf.dtype={'float32' if plan.dry_run else 'bfloat16'}"]
    if plan.engine == "vllm":
        out += [f"generator.vllm.dtype={'float32' if plan.dry_run else 'bfloat16'}",
                f"generator.vllm.max_model_len={PROMPT_TOKENS + w.response_tokens}",
                "generator.vllm.gpu_memory_utilization=0.3"]
    if not plan.dry_run:
        out.append("weight_sync.wire_dtype=bfloat16")
    if mode == "async":
        out.append("generator.num_workers=1")
        if not plan.dry_run:
            # Ray gives an actor that asks for no GPU an empty CUDA_VISIBLE_DEVICES: the engine
            # must ask for the one GPU, which the learner (the trainer process, not a Ray actor)
            # shares without Ray knowing.
            out.append("generator.num_gpus_per_worker=1")
    return out


# ------------------------------------------------------------------------------- stages in this process
def stage_env(plan: Plan, res: StageResult) -> None:
    """Versions, the GPU's name and memory, and which optional packages import."""
    import importlib.metadata as md
    import importlib.util

    import torch
    import transformers

    def version(dist: str, module: str) -> str:
        if importlib.util.find_spec(module) is None:
            return "missing"
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "present"

    packages = {name: version(dist, mod) for name, dist, mod in (
        ("vllm", "vllm", "vllm"), ("ray", "ray", "ray"), ("flash-attn", "flash-attn", "flash_attn"),
        ("omegaconf", "omegaconf", "omegaconf"), ("pyzmq", "pyzmq", "zmq"))}
    log(f"  python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
        + ", ".join(f"{k} {v}" for k, v in packages.items()))
    if plan.dry_run:
        res.status, res.note = "PASS", f"dry-run on CPU ({os.cpu_count()} cores seen); no GPU used"
        return
    if not torch.cuda.is_available():
        res.note = "torch sees no CUDA device (run with --dry-run for the CPU stages)"
        return
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    res.figures.update({"gpu_memory_gib": total / 2**30, "gpu_free_gib": free / 2**30})
    res.status = "PASS"
    res.note = (f"{torch.cuda.get_device_name(0)}, {total / 2**30:.1f} GiB ({free / 2**30:.1f} free), "
                f"{props.multi_processor_count} SMs, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s); "
                f"attention {plan.attn}")


def choose_attention(dry_run: bool) -> tuple[str, str]:
    """``(attn_implementation, why)``: flash-attention 2 when transformers finds it usable."""
    if dry_run:
        return "sdpa", "dry-run: sdpa's block-diagonal mask on CPU"
    try:
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return "flash_attention_2", "flash-attn's varlen kernel"
    except Exception as e:  # noqa: BLE001  (an import failure of any kind means: not usable)
        return "sdpa", f"flash-attn not usable ({type(e).__name__}: {e}): sdpa's block-diagonal mask instead"
    return "sdpa", "flash-attn does not import: sdpa's block-diagonal mask instead of the varlen kernel"


def stage_config(plan: Plan, res: StageResult, gpu_plans: list[Plan]) -> None:
    """``load_config`` of both runs' overrides (and, in a dry-run, of the GPU runs' too, one plan
    per engine), so a renamed or mistyped key fails here in one line rather than minutes into a
    GPU run."""
    from async_rl.config import load_config
    from async_rl.learners.base import LearnerConfig

    plans = [plan] + (gpu_plans if plan.dry_run else [])
    checked = set()
    for p in plans:
        LearnerConfig(**learner_settings(p))
        for mode in ("sync", "async"):
            ov = overrides(p, mode)
            cfg = load_config(ROOT / "configs" / "default.yaml", ov)
            assert cfg.trainer.mode == mode and cfg.learner.packing and cfg.generator.backend == p.engine
            checked.update(o.split("=", 1)[0] for o in ov)
    res.status = "PASS"
    res.note = f"{len(checked)} keys exist and validate ({', '.join(f'{p.engine}/{p.device}' for p in plans)})"


def stage_model(plan: Plan, res: StageResult) -> None:
    """Build (or reuse, with ``--workdir``) the model directory; figures: parameters and bytes."""
    path = Path(plan.model_path)
    if plan.dry_run:
        from async_rl.data.builtin import resolve

        path = Path(resolve("builtin:tiny-qwen2"))
        plan.model_path = str(path)
        note = "builtin:tiny-qwen2"
    elif (path / "config.json").exists() and (path / "tokenizer.json").exists():
        note = f"reused {path}"
    else:
        from async_rl.data.builtin import build_qwen2

        tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=path.parent))
        build_qwen2(tmp, QWEN25_05B_SPEC)
        tmp.rename(path)
        note = f"built {path}"
    cfg = json.loads((path / "config.json").read_text())
    h, i, n, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    # Per layer: q (h*h + h), k and v (h*kv + kv each), o (h*h), gate/up/down (3*h*i), two norms (2*h).
    params = v * h + n * (2 * h * h + h + 2 * (h * kv + kv) + 3 * h * i + 2 * h) + h
    if not cfg.get("tie_word_embeddings", False):
        params += v * h
    res.figures.update({"params": params, "bf16_bytes": 2.0 * params})
    res.status = "PASS"
    res.note = (f"{note}: Qwen2 hidden {h}, {n} layers, {cfg['num_attention_heads']} heads, "
                f"{cfg['num_key_value_heads']} KV heads, intermediate {i}, vocab {v}, tied "
                f"{cfg.get('tie_word_embeddings')}: {params / 1e6:.1f}M parameters")


# ------------------------------------------------------------------------------- child stages
def child_learner(plan: Plan) -> dict[str, Any]:
    """The learner alone on synthetic GRPO groups; returns its figures (in the child process).

    Each step: ``async_rl.step.batch.make_batch`` (collate, the learner's proximal pass, GRPO
    advantages) and ``train_step``, timed together as ``async_rl.loops.common.learn_on`` times
    them; tokens/s = real (unpadded) tokens / that time. Responses are ``response_tokens`` minus
    up to a quarter (packing has unequal rows to pack); rewards 0 or 1 at random.
    """
    import torch
    from transformers import AutoTokenizer

    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.step.batch import make_batch
    from async_rl.buffers.trajectory import Trajectory
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.launch import learner_class

    w = plan.workload
    cfg = LearnerConfig(**learner_settings(plan))
    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=w.response_tokens, behavior_correction="none")
    algo.apply_preset()
    learner = learner_class(cfg)(cfg, algo, plan.model_path, temperature=1.0, total_optimizer_steps=w.steps)
    learner.begin_rl()
    pad = AutoTokenizer.from_pretrained(plan.model_path).pad_token_id
    vocab = learner.model.config.vocab_size
    rng = random.Random(0)
    sync = torch.cuda.synchronize if plan.device == "cuda" else (lambda: None)
    times, tokens, skipped = [], [], 0
    for step in range(w.steps):
        trajs = []
        for g in range(w.prompts):
            gid = step * w.prompts + g
            prompt = [rng.randrange(vocab) for _ in range(14)]
            for k in range(w.samples):
                n = w.response_tokens - rng.randrange(w.response_tokens // 4 + 1)
                trajs.append(Trajectory(
                    trajectory_id=f"{gid}/{k}", group_id=gid, prompt_uid=f"p{gid}", prompt_ids=prompt,
                    response_ids=[rng.randrange(vocab) for _ in range(n)], behavior_logprobs=[-math.log(vocab)] * n,
                    loss_mask=[1] * n, finish_reason="length", policy_version=[learner.version] * n,
                    reward=float(rng.random() < 0.5)))
        sync()
        t0 = time.perf_counter()
        batch, _ = make_batch(trajs, algo, pad, w.response_tokens, learner)
        metrics = learner.train_step(batch)
        sync()
        times.append(time.perf_counter() - t0)
        tokens.append(float(batch.attention_mask.sum()))
        skipped += int(float(metrics.get("actor/skipped_mini_batches", 0)))
        log(f"  learner step {step + 1}: {tokens[-1]:.0f} tokens in {times[-1]:.2f} s "
            f"(loss/pg {float(metrics.get('loss/pg', float('nan'))):.4f})")
    timed = slice(1, None) if len(times) > 1 else slice(None)
    t, n = sum(times[timed]), sum(tokens[timed])
    figures = {"learner_tokens_per_s": n / t, "learner_step_s": statistics.median(times[timed])}
    if plan.device == "cuda":
        figures["learner_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    note = (f"FSDP2 {'NCCL' if plan.device == 'cuda' else 'gloo'}, {learner_settings(plan)['mixed_precision']}, "
            f"packed ({plan.attn}, {w.micro_batch_tokens} tokens a micro-batch), "
            f"{w.prompts}x{w.samples} sequences a step, steps after the first timed")
    if skipped:
        raise RuntimeError(f"{skipped} mini-batches were skipped (no loss token): the figure would not be a step's")
    return {"status": "PASS", "note": note, "figures": figures}


CHILDREN: dict[str, Callable[[Plan], dict[str, Any]]] = {"learner": child_learner}


def child_main(name: str, plan_file: str, result_file: str) -> None:
    """Run child stage ``name`` with the plan in ``plan_file``; write its result as JSON."""
    raw = json.loads(Path(plan_file).read_text())
    raw["workload"] = Workload(**raw["workload"])
    plan = Plan(**raw)
    out = CHILDREN[name](plan)
    Path(result_file).write_text(json.dumps(out))


# ------------------------------------------------------------------------------- running a process
def child_env() -> dict[str, str]:
    """The environment of every child: this tree importable (vLLM's and Ray's processes import
    ``async_rl`` by module path), unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_process(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session with its output in ``log_path``; at ``timeout_s`` its whole
    process group is stopped (SIGTERM, then SIGKILL after 15 s).

    Returns:
        ``(exit status or None on timeout, the log's last 40 lines)``.
    """
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            rc = None
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
    lines = log_path.read_text(errors="replace").splitlines()
    return rc, "\n".join(lines[-40:])


def stage_log(logs: Path, name: str) -> Path:
    """Where child stage ``name`` writes its log: ``gpu_check_<name>.log`` in ``logs`` (the
    ``--out-dir`` when given, so a run stopped from outside still leaves every log there)."""
    return logs / f"gpu_check_{name}.log"


_ERROR_LINE = re.compile(r"(Error|Exception|error:|FAIL|Traceback|Killed|refus)", re.IGNORECASE)


def reason_from(tail: str, rc: int | None, timeout_s: float) -> str:
    """One line saying why a child failed: its last error-looking line (or its last line)."""
    if rc is None:
        head = f"did not finish within {timeout_s:.0f} s"
    else:
        head = f"exit status {rc}"
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and not ln.startswith("File ")]
    last = (errors or lines or ["(no output)"])[-1]
    return f"{head}: {last[:300]}"


def medians(metrics_file: Path, keys: tuple[str, ...]) -> tuple[dict[str, float], int]:
    """Median of each of ``keys`` over a run's training steps after the first (every step if it
    ran only one), from its ``metrics.jsonl``; and the number of steps found."""
    rows = [json.loads(ln) for ln in metrics_file.read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if r.get("step", 0) >= 1 and "timing/step_s" in r]
    timed = steps[1:] or steps
    out = {}
    for k in keys:
        vals = [r[k] for r in timed if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = statistics.median(vals)
    return out, len(steps)


RUN_KEYS = ("timing/step_s", "perf/engine_tokens_per_s", "perf/gen_tokens_per_s", "perf/train_tokens_per_s",
            "timing/train_s", "timing/weight_sync_s", "weight_sync/gb_per_s", "weight_sync/bytes",
            "timing/generate_s", "timing/wait_for_data_s", "rollout/response_length_mean",
            "mismatch/logprob_abs_diff")


def missing_modules(plan: Plan, mode: str) -> list[str]:
    """The top-level modules the ``mode`` run needs that are not installed (found without
    importing them): ``vllm`` for the vLLM engine, ``ray`` for async mode's generator pool."""
    import importlib.util

    needed = (["vllm"] if plan.engine == "vllm" else []) + (["ray"] if mode == "async" else [])
    return [m for m in needed if importlib.util.find_spec(m) is None]


def stage_run(plan: Plan, res: StageResult, mode: str, timeout_s: float, logs: Path, model_bytes: float) -> None:
    """One training run of ``mode`` through ``python -m async_rl.cli train``; figures from its
    ``metrics.jsonl``. A run whose engine or pool library is not installed fails at once, naming
    it, without starting."""
    missing = missing_modules(plan, mode)
    if missing:
        why = {"vllm": f"the {mode} run's vLLM engine (--engine hf runs without it)",
               "ray": "async mode's generator pool (Ray actors)"}
        res.note = "not run: " + "; ".join(f"No module named '{m}': {why[m]} needs it" for m in missing)
        return
    run_dir = Path(plan.workdir) / "runs" / mode
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", "configs/default.yaml", *overrides(plan, mode)]
    log("  $ " + " ".join(cmd[1:]))
    rc, tail = run_process(cmd, stage_log(logs, mode), timeout_s)
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        res.note = reason_from(tail, rc, timeout_s) if rc != 0 else "the run wrote no metrics.jsonl"
        log(_indent(tail))
        return
    med, n = medians(metrics, RUN_KEYS)
    if n < plan.workload.steps:
        res.note = f"the run logged {n} of {plan.workload.steps} steps"
        return
    ws = med.get("timing/weight_sync_s")
    if ws and "weight_sync/gb_per_s" not in med:
        # colocated (dry-run, HF engine): no bytes on a wire; the tensors' bytes over the time.
        med["weight_sync/gb_per_s"] = model_bytes / 1e9 / ws
        med["weight_sync/gb_per_s_from_model_bytes"] = 1.0
    res.figures = med
    res.status = "PASS"
    from async_rl.weight_sync import WeightSyncConfig, resolve_transport

    res.note = (f"{n} steps of {plan.workload.prompts}x{plan.workload.samples} samples, {plan.engine} engine"
                f"{' in 1 Ray actor' if mode == 'async' else ''}, weights over "
                f"{resolve_transport(WeightSyncConfig(), plan.engine, mode)}; median step "
                f"{med.get('timing/step_s', 0):.2f} s (steps after the first)")


def stage_learner(plan: Plan, res: StageResult, timeout_s: float, logs: Path) -> None:
    """``child_learner`` in a child process."""
    plan_file, result_file = Path(plan.workdir) / "plan.json", Path(plan.workdir) / "learner.json"
    plan_file.write_text(json.dumps(dataclasses.asdict(plan)))
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "learner", "--plan", str(plan_file),
           "--result", str(result_file)]
    rc, tail = run_process(cmd, stage_log(logs, "learner"), timeout_s)
    if rc != 0 or not result_file.exists():
        res.note = reason_from(tail, rc, timeout_s)
        log(_indent(tail))
        return
    out = json.loads(result_file.read_text())
    res.status, res.note, res.figures = out["status"], out["note"], out["figures"]


_ROW = re.compile(r"^(PASS|FAIL|SKIP)\s+(.*)$")
_RATE = re.compile(r"(colocated|shm|cuda-ipc|broadcast): best ([\d.]+) s = ([\d.]+) GB/s")


def stage_weight_sync_check(plan: Plan, res: StageResult, timeout_s: float, logs: Path) -> None:
    """``bench/gpu_weight_sync.py`` (its torch-only rows) on the stage's model; figures: each
    transport's best seconds and GB/s (float32 bytes, as that script counts them)."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_weight_sync.py"), "--model-dir", plan.model_path,
           "--skip-vllm", "--skip-broadcast", "--reps", "1", "--num-receivers", "1",
           "--buckets-mb", "64" if plan.dry_run else "1024", "--timeout-s", str(int(max(timeout_s - 10, 30)))]
    if plan.dry_run:
        cmd += ["--device", "cpu"]
    log("  $ " + " ".join(cmd[1:]))
    rc, tail = run_process(cmd, stage_log(logs, "weight_sync_check"), timeout_s)
    text = stage_log(logs, "weight_sync_check").read_text(errors="replace")
    summary = text.split("==== summary", 1)[-1] if "==== summary" in text else ""
    rows = [m.groups() for m in map(_ROW.match, summary.splitlines()) if m]
    for status, line in rows:
        m = _RATE.search(line)
        if m and status == "PASS":
            res.figures[f"{m.group(1)}_s"] = float(m.group(2))
            res.figures[f"{m.group(1)}_gb_per_s"] = float(m.group(3))
    failed = [line for status, line in rows if status == "FAIL"]
    if rc != 0 or not rows or failed:
        res.note = (failed[0][:300] if failed else reason_from(tail, rc, timeout_s))
        log(_indent(tail))
        return
    res.status = "PASS"
    res.note = "; ".join(f"{s} {re.split(r' ->|:', line, maxsplit=1)[0]}" for s, line in rows)


def _indent(text: str) -> str:
    return "\n".join("    | " + ln for ln in text.splitlines())


# ------------------------------------------------------------------------------- the report
def figures_table(results: dict[str, StageResult], dry_run: bool) -> list[tuple[str, str, str]]:
    """``(figure, value, where from)`` rows of the final table; ``-`` where a stage gave none."""
    def get(stage: str, key: str) -> float | None:
        r = results.get(stage)
        return r.figures.get(key) if r is not None and r.status == "PASS" else None

    def fmt(v: float | None, spec: str, unit: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{unit}"

    sync_s, async_s = get("sync", "timing/step_s"), get("async", "timing/step_s")
    ipc = "shm" if dry_run else "cuda-ipc"
    return [
        ("generation tokens/s (sync, engine time)", fmt(get("sync", "perf/engine_tokens_per_s"), ",.0f"),
         "sync run: perf/engine_tokens_per_s"),
        ("generation tokens/s (async, wall time)", fmt(get("async", "perf/gen_tokens_per_s"), ",.0f"),
         "async run: perf/gen_tokens_per_s"),
        ("learner tokens/s (learner alone)", fmt(get("learner", "learner_tokens_per_s"), ",.0f"),
         "learner stage: make_batch + train_step"),
        ("learner tokens/s (sync run)", fmt(get("sync", "perf/train_tokens_per_s"), ",.0f"),
         "sync run: perf/train_tokens_per_s"),
        ("weight sync s (sync run)", fmt(get("sync", "timing/weight_sync_s"), ".3f", " s"),
         "sync run: timing/weight_sync_s"),
        ("weight sync GB/s (sync run)", fmt(get("sync", "weight_sync/gb_per_s"), ".2f"),
         "sync run: weight_sync/gb_per_s" + (" (colocated: the model's bytes / s)"
                                             if get("sync", "weight_sync/gb_per_s_from_model_bytes") else "")),
        (f"weight sync s, GB/s ({ipc}, check)",
         "-" if get("weight-sync-check", f"{ipc}_s") is None else
         f"{get('weight-sync-check', f'{ipc}_s'):.3f} s, {get('weight-sync-check', f'{ipc}_gb_per_s'):.2f}",
         "weight-sync-check: float32 bytes"),
        ("step time sync / async", f"{fmt(sync_s, '.2f', ' s')} / {fmt(async_s, '.2f', ' s')}",
         "median timing/step_s, steps after the first"),
        ("async speed-up (sync step / async step)",
         fmt(sync_s / async_s if sync_s and async_s else None, ".2f", "x"), "sync / async"),
        ("engine vs learner |logprob diff| (sync run)", fmt(get("sync", "mismatch/logprob_abs_diff"), ".1e"),
         "sync run: mismatch/logprob_abs_diff"),
    ]


def print_report(results: dict[str, StageResult], dry_run: bool, wall_s: float) -> None:
    mark = " [dry-run on CPU: figures meaningless]" if dry_run else ""
    log("\n==== gpu_check summary" + mark + " " + "=" * 40)
    log(f"{'stage':<19} {'status':<6} {'s':>5}  note")
    for name in STAGES:
        r = results[name]
        log(f"{name:<19} {r.status:<6} {r.seconds:>5.0f}  {r.note}")
    log("\n" + f"{'figure':<44} {'value':<22} from")
    for name, value, source in figures_table(results, dry_run):
        log(f"{name:<44} {value:<22} {source}{' (dry-run)' if dry_run else ''}")
    n_failed = sum(r.status == "FAIL" for r in results.values())
    log(f"\n{n_failed} stage(s) failed; wall {wall_s:.0f} s")


def write_summary(path: Path, plan: Plan, results: dict[str, StageResult], wall_s: float) -> None:
    """The plan, every stage's result and the figures table as JSON at ``path``."""
    summary = {"plan": dataclasses.asdict(plan), "wall_s": wall_s,
               "stages": {name: dataclasses.asdict(r) for name, r in results.items()},
               "figures": [{"figure": f, "value": v, "from": src} for f, v, src in figures_table(results, plan.dry_run)]}
    path.write_text(json.dumps(summary, indent=1))


# ------------------------------------------------------------------------------- main
def make_plan(args, dry_run: bool, workdir: str) -> Plan:
    """The plan of a GPU run or, with ``dry_run``, of the CPU dry-run."""
    if dry_run:
        w = Workload(prompts=args.prompts or 4, samples=args.samples or 4, response_tokens=args.response_tokens or 8,
                     steps=args.steps or 3, micro_batch_tokens=256)
        return Plan(True, workdir, "builtin:tiny-qwen2", args.engine or "hf", "sdpa", w, args.timeout_s or 900)
    w = Workload(prompts=args.prompts or 32, samples=args.samples or 8, response_tokens=args.response_tokens or 256,
                 steps=args.steps or 4, micro_batch_tokens=8192)
    return Plan(False, workdir, str(Path(workdir) / "qwen2.5-0.5b-shape"), args.engine or "vllm", "sdpa", w,
                args.timeout_s or 450)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same stages on CPU with the built-in tiny model")
    parser.add_argument("--engine", choices=("hf", "vllm"), help="the runs' engine (GPU: default vllm; hf where vLLM "
                                                                 "is not installed. Dry-run: default hf)")
    parser.add_argument("--steps", type=int, help="training steps per run (GPU 4, dry-run 3)")
    parser.add_argument("--prompts", type=int, help="groups per step (GPU 32, dry-run 4)")
    parser.add_argument("--samples", type=int, help="samples per group (GPU 8, dry-run 4)")
    parser.add_argument("--response-tokens", type=int, help="most tokens per response (GPU 256, dry-run 8)")
    parser.add_argument("--timeout-s", type=float, help="hard overall limit (GPU 450, dry-run 900)")
    parser.add_argument("--workdir", help="where the model, runs and logs go (default: a new temporary directory, "
                                          "removed at the end; a given one is kept and its model reused)")
    parser.add_argument("--out-dir", help="write every stage's log (gpu_check_<stage>.log) and the results "
                                          "(gpu_check_summary.json) here, e.g. $OUT")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.plan, args.result)
        return 0

    t_start = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu-check-")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    logs = Path(args.out_dir) if args.out_dir else Path(workdir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args, args.dry_run, workdir)
    if not args.dry_run:
        plan.attn, attn_why = choose_attention(False)
    else:
        attn_why = choose_attention(True)[1]
    gpu_plans = [make_plan(argparse.Namespace(**{**vars(args), "engine": engine}), False, workdir)
                 for engine in ("vllm", "hf")]
    for p in gpu_plans:
        p.attn = "flash_attention_2"
    deadline = t_start + plan.timeout_s
    w = plan.workload
    log(f"gpu_check{' --dry-run' if plan.dry_run else ''}: engine {plan.engine}; workdir {workdir}; {w.steps} steps a run of "
        f"{w.prompts} prompts x {w.samples} samples x <= {w.response_tokens} response tokens; attention "
        f"{plan.attn} ({attn_why}); overall limit {plan.timeout_s:.0f} s")

    results = {name: StageResult(name) for name in STAGES}
    model_bytes = 0.0

    def remaining() -> float:
        return deadline - time.perf_counter()

    for name in STAGES:
        res = results[name]
        if remaining() < 20:
            res.note = f"not run: the overall limit ({plan.timeout_s:.0f} s, --timeout-s) was reached"
            log(f"FAIL {name}: {res.note}")
            continue
        if not plan.dry_run and name not in ("env", "config") and results["env"].status != "PASS":
            # No GPU: building a 0.5B model on the CPU only to fail on CUDA would take minutes.
            res.note = f"not run: {results['env'].note}"
            log(f"FAIL {name}: {res.note}")
            continue
        log(f"\n---- {name}")
        t0 = time.perf_counter()
        cap = min(STAGE_CAP_S.get(name, 120) * (3 if plan.dry_run else 1), remaining() - 10)
        try:
            if name == "env":
                stage_env(plan, res)
            elif name == "config":
                stage_config(plan, res, gpu_plans)
            elif name == "model":
                stage_model(plan, res)
                model_bytes = res.figures.get("bf16_bytes", 0.0) * (2 if plan.dry_run else 1)  # fp32 in a dry-run
            elif name == "learner":
                stage_learner(plan, res, cap, logs)
            elif name in ("sync", "async"):
                if results["model"].status != "PASS":
                    res.note = "no model (the model stage failed)"
                else:
                    stage_run(plan, res, name, cap, logs, model_bytes)
            elif name == "weight-sync-check":
                stage_weight_sync_check(plan, res, cap, logs)
        except BaseException as e:  # noqa: BLE001  (a stage's failure is reported; the next stage runs)
            if isinstance(e, KeyboardInterrupt):
                raise
            res.status = "FAIL"
            res.note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            log(_indent(traceback.format_exc(limit=6)))
        res.seconds = time.perf_counter() - t0
        log(f"{res.status} {name} ({res.seconds:.0f} s): {res.note}")

    wall_s = time.perf_counter() - t_start
    print_report(results, plan.dry_run, wall_s)
    if args.out_dir:
        write_summary(Path(args.out_dir) / "gpu_check_summary.json", plan, results, wall_s)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if any(r.status == "FAIL" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
