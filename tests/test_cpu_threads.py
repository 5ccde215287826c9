"""CPU thread defaults (``async_rl.cpu_threads``): OpenMP's passive wait unless the user chose a
wait, thread budgets from the CPU affinity, and a user's ``OMP_NUM_THREADS`` winning."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from async_rl.cpu_threads import available_cores, passive_openmp_wait, user_num_threads
from async_rl.learners.base import LearnerConfig
from async_rl.learners.launch import _follower_threads
from async_rl.loops.async_loop import thread_budget


def test_passive_wait_is_set_where_the_user_chose_no_wait():
    env = {"PATH": "/bin"}
    assert passive_openmp_wait(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"},
                                  {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10"}])
def test_a_users_wait_policy_wins(user):
    env = dict(user)
    assert passive_openmp_wait(env) == {}
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
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


@pytest.mark.parametrize("extra, expected", [({}, "PASSIVE False"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE False"),
                                             ({"GOMP_SPINCOUNT": "300000"}, "None False")])
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
