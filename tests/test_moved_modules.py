"""Modules that moved keep their old import path for one release, as an alias of the module's new
place, with a one-line ``DeprecationWarning`` naming it: the backend families that became
subpackages (issue 31; an alias file at each old path) and the flat modules at the top of
``async_rl/`` that went into their layer's folder (``async_rl.MOVED_MODULES``, one import hook)."""

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
# The flat modules at the top of async_rl/, each in its layer's folder (docs/architecture.md).
LAYER_FOLDERS = {
    "async_rl.plot": "async_rl.commands.plot",
    "async_rl.rollout": "async_rl.step.rollout",
    "async_rl.agent": "async_rl.step.agent",
    "async_rl.batch": "async_rl.step.batch",
    "async_rl.evaluation": "async_rl.step.evaluation",
    "async_rl.checkpoint": "async_rl.runtime.checkpoint",
    "async_rl.metrics": "async_rl.runtime.metrics",
    "async_rl.inputs": "async_rl.runtime.inputs",
    "async_rl.cluster": "async_rl.runtime.cluster",
    "async_rl.placement": "async_rl.runtime.placement",
    "async_rl.lora": "async_rl.utils.lora",
    "async_rl.registry": "async_rl.utils.registry",
    "async_rl.cpu_threads": "async_rl.utils.cpu_threads",
    "async_rl.cpu_affinity": "async_rl.utils.cpu_affinity",
    "async_rl.checkpoint_format": "async_rl.utils.checkpoint_format",
    "async_rl.leftovers": "async_rl.utils.leftovers",
}
MOVED |= LAYER_FOLDERS


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module_with_a_one_line_warning(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning) as caught:
        alias = importlib.import_module(old)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(MOVED[old] in m and old in m and "\n" not in m for m in messages), messages
    assert alias is new and sys.modules[old] is new


def test_the_package_root_lists_every_layer_move():
    import async_rl

    assert async_rl.MOVED_MODULES == LAYER_FOLDERS


@pytest.mark.parametrize("old", ["async_rl.registry", "async_rl.rollout"])
def test_from_the_package_import_an_old_name_warns_once_at_the_importing_line(old, monkeypatch):
    # `from async_rl import registry`, as a user's reward module writes it; the warning points at
    # that line (so Python shows it by default in a __main__ script), and a second import is quiet.
    import warnings

    import async_rl

    name = old.rpartition(".")[2]
    monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delattr(async_rl, name, raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from async_rl import {name} as mod", namespace := {})
        exec(f"import {old}")
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(moved) == 1 and moved[0].filename == "<string>", [(w.filename, str(w.message)) for w in moved]
    assert namespace["mod"] is importlib.import_module(LAYER_FOLDERS[old])


def test_the_package_root_imports_none_of_its_modules():
    # The alias hook costs nothing until an old path is imported: `import async_rl` loads no module
    # of ours, and a new path loads without touching the old one.
    import subprocess

    code = ("import sys, warnings\nwarnings.simplefilter('error', DeprecationWarning)\nimport async_rl\n"
            "assert [m for m in sys.modules if m.startswith('async_rl.')] == [], sorted(sys.modules)\n"
            "import async_rl.utils.cpu_threads, async_rl.commands\n"
            "assert not set(async_rl.MOVED_MODULES) & set(sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_module_under_the_package_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError, match="async_rl.no_such_module"):
        importlib.import_module("async_rl.no_such_module")


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
