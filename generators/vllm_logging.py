"""Moved to ``async_rl.generators.vllm.logging_filter``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.generators.vllm import logging_filter as _moved

warnings.warn("async_rl.generators.vllm_logging moved to async_rl.generators.vllm.logging_filter; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
