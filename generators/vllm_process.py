"""Moved to ``async_rl.generators.vllm.process``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.generators.vllm import process as _moved

warnings.warn("async_rl.generators.vllm_process moved to async_rl.generators.vllm.process; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
