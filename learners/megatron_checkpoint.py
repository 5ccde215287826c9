"""Moved to ``async_rl.learners.megatron.checkpoint``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import checkpoint as _moved

warnings.warn("async_rl.learners.megatron_checkpoint moved to async_rl.learners.megatron.checkpoint; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
