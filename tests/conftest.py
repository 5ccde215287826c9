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
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "cpu_only" in item.keywords and has_cuda:
            item.add_marker(skip_cpu_only)


@pytest.fixture(autouse=True)
def _process_wide_choices():
    """Each test gets back the environment variables that the code under test sets for the whole
    process, as it must in a process of its own: the gloo/NCCL interface (``use_node_interface``,
    run by a generator worker or learner rank built in this process) and Ray's auth mode (the
    CLI's ``main``, run in this process by some tests). Left over, they steer a later test: its
    run's learner rank onto another interface, or its Ray's GCS into token mode that this
    process's Ray client, which read the mode once, does not speak ("Authentication token is
    missing")."""
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RAY_AUTH_MODE")
    saved = {k: os.environ.get(k) for k in names}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
