"""Moved to ``async_rl.learners.megatron.cpu``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import cpu as _moved

warnings.warn("async_rl.learners.megatron_cpu moved to async_rl.learners.megatron.cpu; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
