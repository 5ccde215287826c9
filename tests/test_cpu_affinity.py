"""CPU pinning of the roles (``generator.cpu_affinity``, ``learner.cpu_affinity``): validation at
load, and the mask applied to every thread of a started process (read back with
``os.sched_getaffinity`` in the child)."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from pathlib import Path

import pytest

from async_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
needs_linux = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU pinning needs Linux")


def test_cpu_affinity_defaults_off_and_bad_ids_refused():
    cfg = load_config(ROOT / "configs/default.yaml")
    assert cfg.generator.cpu_affinity == [] and cfg.learner.cpu_affinity == []
    cfg = load_config(ROOT / "configs/default.yaml", ["generator.cpu_affinity=[0]", "learner.cpu_affinity=[1,2]"])
    assert cfg.generator.cpu_affinity == [0] and cfg.learner.cpu_affinity == [1, 2]
    with pytest.raises(ConfigError, match="generator.cpu_affinity lists a CPU id twice"):
        load_config(ROOT / "configs/default.yaml", ["generator.cpu_affinity=[0,0]"])
    with pytest.raises(ConfigError, match="learner.cpu_affinity must list CPU ids >= 0"):
        load_config(ROOT / "configs/default.yaml", ["learner.cpu_affinity=[-1]"])


def _all_tasks_affinity() -> dict[int, list[int]]:
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


def _pin_in_child(cores: list[int], queue) -> None:
    from async_rl.cluster import pin_process

    stop = threading.Event()
    # A thread that runs before the pin (as Ray's and torch's do) must be pinned too.
    early = threading.Thread(target=stop.wait, daemon=True)
    early.start()
    try:
        pin_process(cores, "generator.cpu_affinity")
    except ValueError as e:
        queue.put(("error", str(e)))
        return
    seen: list[list[int]] = []
    late = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))  # started after
    late.start()
    late.join()
    queue.put(("ok", {"tasks": _all_tasks_affinity(), "late": seen[0]}))
    stop.set()


def _child(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(timeout=60)
    return result


@needs_linux
def test_pin_process_pins_every_thread_of_the_process():
    core = sorted(os.sched_getaffinity(0))[-1]
    kind, got = _child(_pin_in_child, [core])
    assert kind == "ok", got
    assert len(got["tasks"]) >= 2  # the main thread and the early one at least
    assert all(cpus == [core] for cpus in got["tasks"].values()), got
    assert got["late"] == [core]


@needs_linux
def test_pin_process_refuses_a_cpu_the_machine_lacks():
    kind, got = _child(_pin_in_child, [os.cpu_count() + 3])
    assert kind == "error"
    assert got.startswith(f"generator.cpu_affinity=[{os.cpu_count() + 3}]: this machine has CPU ids 0..")


def _worker_in_child(model_path: str, core: int, queue) -> None:
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.loops.pool import GeneratorWorker

    class Sender:
        def send(self, msg):
            pass

        def close(self):
            pass

    worker = GeneratorWorker(0, model_path, model_path, GeneratorConfig(cpu_affinity=[core]),
                             SamplingParams(max_tokens=4, stop_token_ids=(0,)), None, "zero", Sender, num_threads=1)
    queue.put(_all_tasks_affinity())
    worker.close()


@needs_linux
def test_generator_worker_runs_on_its_cores(tiny_model_path):
    # The actor's process as Ray starts it: the worker pins itself before its engine loads.
    core = sorted(os.sched_getaffinity(0))[0]
    tasks = _child(_worker_in_child, tiny_model_path, core)
    assert tasks and all(cpus == [core] for cpus in tasks.values()), tasks


def _sync_phases_in_child(gen_core: int, learn_core: int, queue) -> None:
    import types

    import torch

    from async_rl.cluster import pin_process
    from async_rl.loops import sync
    from async_rl.rollout import RolloutResult

    pin_process([learn_core], "learner.cpu_affinity")  # as the trainer does at build
    torch.set_num_threads(1)
    seen = []

    def collect(*args, **kwargs):
        seen.append(("generate", sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
        return RolloutResult([], 0, 0, 0), {}, 1

    def learn_on(ctx, step, ro):
        seen.append(("train", sorted(os.sched_getaffinity(0)), torch.get_num_threads()))
        return {}

    sync.collect_step_rollouts, sync.learn_on = collect, learn_on
    scorer = types.SimpleNamespace(pop_metrics=lambda: {"reward/scored": 1.0, "reward/errors": 0.0}, first_error=None)
    publisher = types.SimpleNamespace(push=lambda version: {})
    cfg = types.SimpleNamespace(generator=types.SimpleNamespace(cpu_affinity=[gen_core]))
    ctx = types.SimpleNamespace(cfg=cfg, scorer=scorer, publisher=publisher, agent=None, train_ds=None,
                                generator=None, tokenizer=None, params=None, learner=types.SimpleNamespace(version=1))
    loop = sync.SyncLoop(ctx)
    loop.step(1)
    loop.step(2)
    queue.put(seen)


@needs_linux
def test_sync_mode_generates_on_the_generator_cores_and_trains_on_the_learner_cores():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPUs this process may use")
    gen, learn = cores[0], cores[1]
    seen = _child(_sync_phases_in_child, gen, learn)
    assert seen == [("generate", [gen], 1), ("train", [learn], 1)] * 2
