"""CPU thread defaults (``async_rl.utils.cpu_threads``): OpenMP's passive wait unless the user chose a
wait, thread budgets from the CPU affinity, and a user's ``OMP_NUM_THREADS`` winning."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

from async_rl.utils import cpu_threads
from async_rl.utils.cpu_threads import (SPIN_COUNT, SharedCoreGovernor, available_cores, openmp_wait_defaults,
                                        user_num_threads)
from async_rl.learners.base import LearnerConfig
from async_rl.learners.launch import _follower_threads
from async_rl.loops.async_loop import thread_budget


def test_a_short_spin_is_set_where_the_user_chose_no_wait():
    env = {"PATH": "/bin"}
    assert openmp_wait_defaults(env) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": "10000"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"},
                                  {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10"}])
def test_a_users_wait_policy_wins(user):
    env = dict(user)
    assert openmp_wait_defaults(env) == {}
    assert env == user


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return {**env, **extra}


CLI_PROBE = """
import os, sys
from async_rl.cli import main
try:
    main(["--version"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


@pytest.mark.parametrize("extra, expected", [({}, "None 10000 False"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE None False"),
                                             ({"GOMP_SPINCOUNT": "300000"}, "None 300000 False")])
def test_the_cli_sets_the_wait_before_torch_loads_openmp(extra, expected):
    # libgomp reads the variable once, when torch loads it: the CLI must set it before any import
    # of torch, and every process the run starts inherits it from there.
    done = subprocess.run([sys.executable, "-c", CLI_PROBE], env=_cli_env(**extra), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == expected


def test_available_cores_is_the_affinity_mask_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert available_cores() == 3


@pytest.mark.parametrize("value, threads", [("4", 4), ("4,2", 4), (" 3 ", 3), ("", 0), ("0", 0), ("-2", 0),
                                            ("two", 0)])
def test_user_num_threads_reads_omp_num_threads(value, threads):
    assert user_num_threads({"OMP_NUM_THREADS": value}) == threads
    assert user_num_threads({}) == 0


def test_thread_budget_splits_the_affinity_between_roles(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert thread_budget(1, 0) == (2, 2)  # 4 cores: one generator worker and the learner
    assert thread_budget(3, 0) == (1, 1)  # 4 cores over 4 roles
    assert thread_budget(5, 0) == (1, 1)  # oversubscribed: still 1 each, never 0


def test_a_users_omp_num_threads_wins_over_the_budget():
    assert thread_budget(2, 0, cores=16, user_threads=1) == (1, 1)
    assert thread_budget(2, 3, cores=16, user_threads=1) == (3, 1)  # generator.threads_per_worker is more specific


def test_follower_threads_config_then_pinned_cores_then_affinity(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _follower_threads(LearnerConfig(world_size=2)) == 4
    # Ray sets OMP_NUM_THREADS in a placed rank itself (its num_cpus): not the user's choice.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _follower_threads(LearnerConfig(world_size=2)) == 4
    assert _follower_threads(LearnerConfig(world_size=2, cpu_affinity=[2, 3, 5])) == 3
    assert _follower_threads(LearnerConfig(world_size=2, num_threads=2, cpu_affinity=[2, 3, 5])) == 2


class _FakeClock:
    """Stands in for ``/proc/stat``, the process's CPU time and the clock: ``advance`` moves them."""

    def __init__(self, monkeypatch):
        self.t = self.busy = self.own = 0.0
        monkeypatch.setattr(cpu_threads, "_proc_stat_busy_s", lambda cores: self.busy)
        monkeypatch.setattr(cpu_threads, "_own_cpu_s", lambda: self.own)
        monkeypatch.setattr(cpu_threads, "time", types.SimpleNamespace(perf_counter=lambda: self.t))

    def advance(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` pass; this process uses ``ours`` cores and other tasks ``others`` cores."""
        self.t += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


@pytest.mark.parametrize("cores, others, threads", [(2, 0.0, 2), (2, 0.1, 2), (2, 0.45, 2), (2, 0.6, 1), (2, 1.0, 1),
                                                    (2, 1.9, 1), (4, 1.0, 3), (4, 2.6, 1), (8, 0.3, 8)])
def test_the_governor_leaves_the_cores_others_keep_busy(monkeypatch, cores, others, threads):
    clock, applied = _FakeClock(monkeypatch), []
    gov = SharedCoreGovernor(cores, cores=list(range(cores)), set_threads=applied.append)
    clock.advance(1.0, ours=min(cores - others, 2.0), others=others)
    assert gov.update() == threads
    assert gov.others_cores == pytest.approx(others)
    # A count is applied only when it changes.
    assert applied == ([] if threads == cores else [threads])


def test_the_governor_comes_back_when_the_other_job_ends_and_ignores_short_windows(monkeypatch):
    clock, applied = _FakeClock(monkeypatch), []
    gov = SharedCoreGovernor(2, cores=[0, 1], set_threads=applied.append)
    clock.advance(1.0, ours=1.0, others=1.0)
    assert gov.update() == 1
    clock.advance(0.1, ours=1.0, others=0.0)  # shorter than min_interval_s: too coarse to judge
    assert gov.update() == 1
    clock.advance(1.0, ours=2.0, others=0.0)
    assert gov.update() == 2
    assert applied == [1, 2]


def test_the_governor_refuses_zero_threads():
    with pytest.raises(ValueError, match="max_threads must be >= 1"):
        SharedCoreGovernor(0, cores=[0], set_threads=lambda n: None)


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc/stat and 2 cores")
def test_the_governor_sees_a_real_busy_process_on_its_cores():
    # A process spinning on one of two cores: whatever else the machine runs, the governor must
    # count at least most of that core as taken and use one thread.
    cores = sorted(os.sched_getaffinity(0))[:2]
    applied = []
    spinner = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[0]}}})\nwhile True: pass"])
    try:
        gov = SharedCoreGovernor(2, cores=cores, set_threads=applied.append, min_interval_s=0.0)
        time.sleep(1.0)
        assert gov.update() == 1, gov.others_cores
        assert gov.others_cores > 0.6
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize("change, governed", [
    ({}, True),                                                  # one process, torch's default threads
    ({"backend": "vllm"}, False),                                # engine processes share the cores
    ({"world_size": 2}, False),                                  # follower learner ranks share them
    ({"num_threads": 2}, False),                                 # the user chose the threads
    ({"learner_cores": [0]}, False), ({"generator_cores": [1]}, False),
    ({"env": "2"}, False),                                       # OMP_NUM_THREADS
    ({"torch_threads": 1}, False),                               # nothing to drop
])
def test_a_sync_run_is_governed_only_where_it_owns_the_cores_and_chose_no_threads(monkeypatch, change, governed):
    import torch

    from async_rl.loops.sync import shared_core_governor

    monkeypatch.setattr(torch, "get_num_threads", lambda: change.get("torch_threads", 2))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if "env" in change:
        monkeypatch.setenv("OMP_NUM_THREADS", change["env"])
    cfg = types.SimpleNamespace(
        generator=types.SimpleNamespace(backend=change.get("backend", "hf"), cpu_affinity=change.get("generator_cores", [])),
        learner=types.SimpleNamespace(num_threads=change.get("num_threads", 0), world_size=change.get("world_size", 1),
                                      cpu_affinity=change.get("learner_cores", [])))
    gov = shared_core_governor(cfg)
    assert (gov is not None) is governed
    if governed:
        assert gov.max_threads == 2
