"""Shared fixtures. ``gpu`` tests are skipped on machines without CUDA, ``cpu_only`` tests (what
megatron-core does without CUDA) on machines with it."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_cpu_only = pytest.mark.skip(reason="pins megatron-core's behaviour on a machine without CUDA")
    for item in items:
        # The markers, not ``item.keywords``: keywords also hold the names of the folders above
        # the test (a checkout in a folder named ``gpu`` would skip every test).
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("cpu_only") is not None and has_cuda:
            item.add_marker(skip_cpu_only)


SESSION_LEFTOVERS = {
    "/dev/shm": r"psm_[0-9a-f]{8}|sem\.mp-[a-z0-9_]{8}",  # multiprocessing's shared memory, semaphores
}
"""What processes of this session leave when a test SIGKILLs them, with no owner in the name (a
killed vLLM engine's queue buffers and semaphore): removed at the session's end when new since its
start and held by no process (``_session_sweep``). Not ``multiprocessing``'s ``pymp-*`` directories:
a live process keeps its own, empty, between listeners, so holding nothing does not make one dead."""

_session: dict = {}


def _leftover_dirs() -> dict:
    import re

    dirs = {}
    for d, pattern in SESSION_LEFTOVERS.items():
        if os.path.isdir(d):
            dirs[d] = pattern
    return {d: re.compile(p) for d, p in dirs.items()}


def pytest_sessionstart(session):
    import time

    _session["start"] = time.time()
    _session["before"] = {d: set(os.listdir(d)) for d in _leftover_dirs()}


def _session_sweep() -> list[str]:
    """Remove the entries of ``SESSION_LEFTOVERS`` made during this session that no live process
    holds (``async_rl.utils.leftovers.sweep_unheld``). A process that cannot be read and that started
    before the session cannot hold one: their names are random, known only to the session's
    processes."""
    from async_rl.utils.leftovers import cannot_reach, sweep_unheld

    start = _session.get("start")
    if start is None:
        return []

    def unreachable(proc, st):
        return proc[2] < start - 1 or cannot_reach(proc, st)

    removed = []
    for d, pattern in _leftover_dirs().items():
        new = set(os.listdir(d)) - _session["before"].get(d, set())
        if new:
            removed += sweep_unheld(d, pattern, min_age_s=0, only=new, unreachable=unreachable)
    return removed


def pytest_sessionfinish(session, exitstatus):
    """Remove what processes these tests SIGKILLed left, as the next run's start (or engine
    start) would, without waiting for it to age: weight-sync slot files (a sender killed before
    its engines mapped them), W&B temp dirs and vLLM queue buffers of killed runs, vLLM socket
    directories (an engine killed while it started); only entries whose owning process is gone
    (``async_rl.utils.leftovers``). Then what this session's killed processes left with no owner in the
    name (``_session_sweep``)."""
    import tempfile

    from async_rl.generators.vllm.process import sweep_socket_dirs
    from async_rl.utils.leftovers import sweep_wandb_temp_dirs, sweep_weight_slots

    sweep_weight_slots(min_age_s=0)
    sweep_wandb_temp_dirs(min_age_s=0)
    for base in {os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir(), "/tmp"}:
        sweep_socket_dirs(base, min_age_s=0)
    removed = _session_sweep()
    if removed:
        print(f"\nremoved {len(removed)} file(s) that killed test processes left: {', '.join(removed)}")


@pytest.fixture(autouse=True)
def _ray_auth_mode():
    """Each test gets ``RAY_AUTH_MODE`` back: the CLI's ``main`` chooses it for the whole process
    (as it must, at a process's start), and some tests call ``main`` in this process. Left over, a
    later test's Ray starts its GCS in token mode, which this process's Ray client (it read the
    mode once) does not speak ("Authentication token is missing")."""
    saved = os.environ.get("RAY_AUTH_MODE")
    yield
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture
def private_tmpdir(monkeypatch):
    """A temp dir of the test's own for the processes it starts (``TMPDIR``): spawned ranks, a
    local Ray's raylet and workers, subprocesses. This process's own temp dir does not change
    (``tempfile`` read ``TMPDIR`` once), nor does Ray's (``RAY_TMPDIR``: its session folders stay
    where every other test's go, whose socket paths must fit a Unix socket's 107 bytes). Yields
    its path, for the test to check what is left in it; removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    monkeypatch.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR") or tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix="arl-")
    monkeypatch.setenv("TMPDIR", path)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The built-in tiny Qwen2 directory (built once per cache, reused afterwards)."""
    from async_rl.data.builtin import resolve

    return resolve("builtin:tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance for one test module (actors load torch and a model: slow to start)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # left by an earlier module: start this module's own, as configured
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    yield ray
    ray.shutdown()
