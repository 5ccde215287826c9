"""Moved to ``async_rl.generators.sglang.lora``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.generators.sglang import lora as _moved

warnings.warn("async_rl.generators.sglang_lora moved to async_rl.generators.sglang.lora; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
