"""Backend families became subpackages (issue 31): each old flat module path still imports for one
release, as an alias of the module's new place, with a one-line ``DeprecationWarning`` naming it."""

from __future__ import annotations

import importlib
import sys

import pytest

MOVED = {
    "async_rl.learners.megatron_model": "async_rl.learners.megatron.model",
    "async_rl.learners.megatron_checkpoint": "async_rl.learners.megatron.checkpoint",
    "async_rl.learners.megatron_cpu": "async_rl.learners.megatron.cpu",
    "async_rl.learners.megatron_critic": "async_rl.learners.megatron.critic",
    "async_rl.learners.megatron_ops": "async_rl.learners.megatron.ops",
    "async_rl.learners.megatron_pipeline": "async_rl.learners.megatron.pipeline",
    "async_rl.generators.vllm_worker": "async_rl.generators.vllm.worker",
    "async_rl.generators.vllm_process": "async_rl.generators.vllm.process",
    "async_rl.generators.vllm_logging": "async_rl.generators.vllm.logging_filter",
    "async_rl.generators.sglang_process": "async_rl.generators.sglang.process",
    "async_rl.generators.sglang_lora": "async_rl.generators.sglang.lora",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module_with_a_one_line_warning(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        alias = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(MOVED[old] in m and old in m and "\n" not in m for m in messages), messages
    assert alias is new and sys.modules[old] is new


@pytest.mark.parametrize("package, names", [
    ("async_rl.learners.megatron", ["MegatronLearner"]),
    ("async_rl.generators.vllm", ["VLLMGenerator", "WORKER_EXTENSION", "SOCKET_DIR_PREFIX", "socket_dir"]),
    ("async_rl.generators.sglang", ["SGLangGenerator", "checkpoint_specs"]),
])
def test_the_old_backend_modules_are_their_packages(package, names):
    # `from async_rl.generators.vllm import VLLMGenerator` etc. keep working without a warning.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        mod = importlib.import_module(package)
    assert all(hasattr(mod, n) for n in names)


def test_vllm_loads_our_worker_extension_and_log_filter_by_their_new_names():
    from async_rl.generators.vllm import WORKER_EXTENSION
    from async_rl.generators.vllm.logging_filter import CONFIG_FILE

    module, _, cls = WORKER_EXTENSION.rpartition(".")
    assert module == "async_rl.generators.vllm.worker" and cls == "AsyncRLWorkerExtension"
    assert "async_rl.generators.vllm.logging_filter.KnownWarnings" in CONFIG_FILE.read_text()


def test_vllms_processes_import_the_worker_and_log_filter_without_the_engine():
    # vLLM builds our log filter while `import vllm` runs in each of its processes: importing the
    # engine there (torch, our config types) broke its worker processes' start.
    import subprocess

    code = ("import sys, async_rl.generators.vllm.logging_filter, async_rl.generators.vllm.process\n"
            "assert 'async_rl.generators.vllm.engine' not in sys.modules, 'engine imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
