"""The SGLang engine (``generator.backend=sglang``).

- ``async_rl.generators.sglang.engine``: ``SGLangGenerator``, an SGLang ``Engine`` per generator,
  and ``checkpoint_specs``;
- ``async_rl.generators.sglang.process``: the engine's settings, processes, sockets and warnings;
- ``async_rl.generators.sglang.lora``: its LoRA adapters (``SGLangAdapters``).

SGLang itself is imported only when an engine starts.
"""

from async_rl.generators.sglang.engine import SGLangGenerator, checkpoint_specs

__all__ = ["SGLangGenerator", "checkpoint_specs"]
