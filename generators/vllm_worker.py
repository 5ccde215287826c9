"""Moved to ``async_rl.generators.vllm.worker``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.generators.vllm import worker as _moved

warnings.warn("async_rl.generators.vllm_worker moved to async_rl.generators.vllm.worker; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
