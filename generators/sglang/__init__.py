"""The SGLang engine (``generator.backend=sglang``).

- ``async_rl.generators.sglang.engine``: ``SGLangGenerator``, an SGLang ``Engine`` per generator,
  and ``checkpoint_specs``;
- ``async_rl.generators.sglang.process``: the engine's settings, processes, sockets and warnings;
- ``async_rl.generators.sglang.lora``: its LoRA adapters (``SGLangAdapters``).

SGLang itself is imported only when an engine starts.
"""

# The names of ``async_rl.generators.sglang.engine``, imported on first use: importing ``process`` or ``lora``
# alone loads nothing of the engine, as before they were a package.
__all__ = ["SGLangGenerator", "checkpoint_specs"]


def __getattr__(name: str):
    if name in __all__:
        from async_rl.generators.sglang import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
