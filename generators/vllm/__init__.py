"""The vLLM engine (``generator.backend=vllm``).

- ``async_rl.generators.vllm.engine``: ``VLLMGenerator``, an ``AsyncLLM`` engine per generator;
- ``async_rl.generators.vllm.worker``: the weight-transfer backend vLLM's worker processes load by
  module path (``WORKER_EXTENSION``);
- ``async_rl.generators.vllm.process``: the engine processes' socket directory and environment;
- ``async_rl.generators.vllm.logging_filter``: the log filter, with its config (``logging.json``
  beside it) that vLLM's processes read by file path.

vLLM itself is imported only when an engine starts (``VLLMGenerator``) or in vLLM's own processes
(``worker``).
"""

# The names of ``async_rl.generators.vllm.engine``, imported on first use: vLLM's own processes import
# ``worker`` and ``logging_filter`` (the latter while ``import vllm`` runs) and need nothing of the engine.
__all__ = ["SHUTDOWN_TIMEOUT_S", "SOCKET_DIR_PREFIX", "SOCKET_PATH_MAX", "WORKER_EXTENSION", "VLLMGenerator",
           "engine_environment", "socket_dir"]


def __getattr__(name: str):
    if name in __all__:
        from async_rl.generators.vllm import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
