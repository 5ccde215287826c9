"""The SGLang engine's processes: the warnings filtered before SGLang is imported, the keyword
arguments its offline ``Engine`` starts with, and what stopping only its own processes must clean
up itself (their sockets in this process, their files). Imports SGLang, ZeroMQ and psutil inside
its functions only."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from async_rl.generators.base import GeneratorConfig
from async_rl.generators.sglang.vision import config_overrides

QUIET_WARNINGS = ("ignore:Only CUDA:UserWarning,ignore:Triton is not supported:UserWarning,"
                  "ignore:resource_tracker:UserWarning")
"""``PYTHONWARNINGS`` entries for the engine's subprocesses (see ``quiet_warnings``)."""


def quiet_warnings() -> None:
    """Filter the warnings SGLang's import prints on a CPU host, here and in the engine's
    subprocesses (through ``PYTHONWARNINGS``, which they inherit).

    SGLang's import warns once per CUDA-only quantization and kernel module on a CPU host (six
    lines per process, forwarded from every actor); nothing they name is used here. Python's
    resource tracker otherwise reports the semaphores of a stopped scheduler as "leaked": on
    Linux each was unlinked when created, so nothing is left to clean.
    """
    for message in ("Only CUDA", "Triton is not supported on current platform"):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    if QUIET_WARNINGS not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), QUIET_WARNINGS]))


def engine_kwargs(model_path: str, cfg: GeneratorConfig, device: str, lora: dict | None) -> dict[str, Any]:
    """The keyword arguments of ``sglang.Engine`` for a generator.

    Args:
        model_path: Hugging Face model directory of the starting weights (a Qwen2-VL checkpoint
            also gets ``json_model_override_args``: ``vision.config_overrides``).
        cfg: generator settings (``cfg.sglang``: dtype, memory, cache; ``seed``, ``max_batch_size``).
        device: ``cpu`` or ``cuda``; ``cpu`` selects SGLang's torch-native attention without CUDA
            graphs or the overlap scheduler.
        lora: ``async_rl.utils.lora.spec`` of the adapters (``rank``, ``target_modules``), or ``None``.
    """
    s = cfg.sglang
    kwargs = dict(model_path=model_path, dtype=s.dtype, random_seed=cfg.seed, skip_tokenizer_init=True,
                  mem_fraction_static=s.mem_fraction_static, max_running_requests=cfg.max_batch_size,
                  disable_radix_cache=not s.enable_prefix_caching, log_level=s.log_level, weight_version="0",
                  # Without it an idle scheduler polls its sockets in a busy loop (a whole core
                  # each): on a few CPU cores that starves the learner. The sleeper blocks in
                  # zmq poll and wakes on the first message, so requests see no added latency.
                  sleep_on_idle=True,
                  # Per-request sampling seeds are honoured only in deterministic mode (each
                  # position drawn from hash(seed, position), independent of the batch), which
                  # SGLang allows only with GPU attention backends: on CPU the sampler draws
                  # from the engine's seeded global generator instead.
                  enable_deterministic_inference=device != "cpu")
    overrides = config_overrides(model_path)
    if overrides:
        # A Qwen2-VL checkpoint of transformers 5 lacks the config name SGLang's vision tower reads.
        kwargs["json_model_override_args"] = json.dumps(overrides)
    if s.context_length:
        kwargs["context_length"] = s.context_length
    if s.max_total_tokens:
        kwargs["max_total_tokens"] = s.max_total_tokens
    if lora is not None:
        # Two slots: requests started on the previous adapter may still be running (keep).
        kwargs.update(enable_lora=True, max_lora_rank=lora["rank"], max_loras_per_batch=2,
                      lora_target_modules=list(lora["target_modules"]))
        if device == "cpu":
            kwargs["lora_backend"] = "torch_native"
    if device == "cpu":
        kwargs.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      disable_overlap_schedule=True)
    return kwargs


def stop_processes(pids: list[int], timeout_s: float = 10.0) -> None:
    """Terminate the processes ``pids`` (those still alive), wait up to ``timeout_s`` seconds, then
    kill those left."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        p.kill()


def engine_sockets(engine) -> list:
    """The ZeroMQ sockets an offline engine holds in this process (its RPC socket and its tokenizer
    manager's sockets to the scheduler and from the detokenizer): ``Engine.shutdown`` closes them
    with ``linger=0``, which a generator that stops only its own processes must do itself."""
    import zmq

    owners = [engine, engine.tokenizer_manager]
    return [v for owner in owners for v in vars(owner).values() if isinstance(v, zmq.Socket) and not v.closed]


def engine_files(engine) -> list[str]:
    """The files an engine's processes made under names derived from its port args (IPC socket
    paths under the temp dir, its load-snapshot segment in ``/dev/shm``), which processes stopped
    from outside leave behind."""
    port_args = getattr(engine, "port_args", None)
    if port_args is None:
        return []
    paths = [v[len("ipc://"):] for v in vars(port_args).values() if isinstance(v, str) and v.startswith("ipc://")]
    try:
        from sglang.srt.managers.load_snapshot import shm_path_for

        paths.append(shm_path_for(port_args.instance_id))
    except (ImportError, AttributeError):
        pass
    return paths
