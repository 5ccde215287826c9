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
    from async_rl.runtime.cluster import pin_process

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


def _split_in_child(learn_core: int, queue) -> None:
    import torch

    from async_rl.runtime.cluster import split_learner_threads, started_on

    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)  # as Ray's, before the split
    early.start()
    service = split_learner_threads([learn_core], "learner.cpu_affinity")
    before_pool = set(os.listdir("/proc/self/task"))
    torch.set_num_threads(2)
    torch.ones(1 << 20).add_(1)  # starts torch's intra-op threads from the training thread
    torch_threads = set(os.listdir("/proc/self/task")) - before_pool
    with started_on(service):
        late_service = threading.Thread(target=stop.wait, daemon=True)
        late_service.start()
    late_learner = threading.Thread(target=stop.wait, daemon=True)
    late_learner.start()
    tasks = _all_tasks_affinity()
    queue.put({"service": service, "main": tasks[threading.get_native_id()], "early": tasks[early.native_id],
               "torch": [tasks[int(t)] for t in torch_threads if int(t) in tasks],
               "late_service": tasks[late_service.native_id], "late_learner": tasks[late_learner.native_id],
               "main_after": sorted(os.sched_getaffinity(0))})
    stop.set()


@needs_linux
def test_split_learner_threads_keeps_the_learner_cores_for_the_training_thread():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPUs this process may use")
    learn, service = cores[-1], cores[:-1]
    got = _child(_split_in_child, learn)
    assert got["service"] == service
    assert got["main"] == [learn] and got["main_after"] == [learn]
    assert got["early"] == service and got["late_service"] == service
    assert got["late_learner"] == [learn]  # inherited from the thread that started it
    assert got["torch"] and all(cpus == [learn] for cpus in got["torch"]), got


def _worker_in_child(model_path: str, core: int, queue) -> None:
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.loops.actors import GeneratorWorker

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

    from async_rl.runtime.cluster import pin_process
    from async_rl.loops import sync
    from async_rl.step.rollout import RolloutResult

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
    cfg = types.SimpleNamespace(generator=types.SimpleNamespace(cpu_affinity=[gen_core], backend="hf"),
                                learner=types.SimpleNamespace(cpu_affinity=[learn_core], num_threads=0, world_size=1))
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


def _descendant_masks() -> dict[str, list[list[int]]]:
    """Each process under this one (Ray's, the actors'), by ``name[pid]``: its threads' CPU ids."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        names[int(p)] = raw[raw.index("(") + 1:raw.rindex(")")]
        children.setdefault(int(raw.rsplit(")", 1)[1].split()[1]), []).append(int(p))
    out, todo = {}, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            out[f"{names[pid]}[{pid}]"] = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # ended meanwhile
            pass
    return out


def _async_threads_in_child(tmp: str, gen_core: int, learn_core: int, queue) -> None:
    import torch

    from async_rl.loops import async_loop
    from async_rl.trainer import train
    from tests.pipeline_helpers import small_run_cfg

    seen: dict = {}
    learn_on = async_loop.learn_on

    def spying_learn_on(ctx, step, ro, **kwargs):
        if step == 2:  # the pipeline has run a whole step: every thread it starts is up
            seen.update(main=threading.get_native_id(), tasks=_all_tasks_affinity(),
                        names={t.native_id: t.name for t in threading.enumerate()},
                        comms={int(t): Path(f"/proc/self/task/{t}/comm").read_text().strip()
                               for t in os.listdir("/proc/self/task")},
                        processes=_descendant_masks(), torch_threads=torch.get_num_threads())
        return learn_on(ctx, step, ro, **kwargs)

    async_loop.learn_on = spying_learn_on
    before = _all_tasks_affinity()
    # A version per step, one push a step: this test's subject is where threads run, and its
    # child's 300 s were sized for that run (with four pushes a step it ran out of them once,
    # beside a loaded machine).
    summary = train(small_run_cfg(tmp, "pinned", "trainer.mode=async", "trainer.policy_version_per=step",
                                  "generator.num_workers=1",
                                  f"generator.cpu_affinity=[{gen_core}]", f"learner.cpu_affinity=[{learn_core}]",
                                  "trainer.warm_start.steps=2", "data.val_files=[]"))
    queue.put({"seen": seen, "trained": summary["pipeline/trained"], "before": before,
               "after": _all_tasks_affinity()})


@needs_linux
def test_async_mode_keeps_the_learner_core_for_the_training_thread(tmp_path):
    # The training thread (and torch's threads it starts) on the learner's core; the receiver,
    # the dispatcher, ZeroMQ's and Ray's threads and Ray's processes on the other core.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPUs this process may use")
    gen, learn = cores[0], cores[1]
    service = [c for c in cores if c != learn]
    got = _child(_async_threads_in_child, str(tmp_path), gen, learn)
    seen = got["seen"]
    assert got["trained"] == 3 * 4 and seen, got
    tasks, names, comms = seen["tasks"], seen["names"], seen["comms"]
    assert tasks[seen["main"]] == [learn]
    by_name = {name: tid for tid, name in names.items()}
    assert tasks[by_name["receiver"]] == service and tasks[by_name["dispatcher"]] == service
    zmq_threads = [tid for tid, comm in comms.items() if comm.startswith("ZMQbg")]
    assert zmq_threads and all(tasks[tid] == service for tid in zmq_threads), (comms, tasks)
    # Every thread that names itself (Ray's, gRPC's, ZeroMQ's, Arrow's, TCPStore's) or is a
    # Python thread is on the service cores, except the learner's own: gloo's (its collectives)
    # and tqdm's monitor (idle). Unnamed native threads are torch's (or idle libraries').
    assert any(comm.startswith(("grpc", "worker.io", "client.poll")) for comm in comms.values()), comms
    own = {"MainThread", "tqdm_monitor"}
    for tid, cpus in tasks.items():
        named = comms.get(tid) not in (None, comms[seen["main"]]) or tid in names
        if named and names.get(tid) not in own and not comms.get(tid, "").startswith(("gloo", "pt_gloo")):
            assert cpus == service, (tid, comms.get(tid), names.get(tid), cpus)
    # Ray's own processes (started inside started_on) on the service cores; the generator actor
    # pinned itself to its core.
    assert seen["processes"], seen
    for proc, masks in seen["processes"].items():
        assert all(m == service or m == [gen] for m in masks), (proc, masks)
    # The run leaves the process's CPU ids as it found them.
    assert set(map(tuple, got["after"].values())) <= set(map(tuple, got["before"].values())), got
