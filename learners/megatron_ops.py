"""Moved to ``async_rl.learners.megatron.ops``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import ops as _moved

warnings.warn("async_rl.learners.megatron_ops moved to async_rl.learners.megatron.ops; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
