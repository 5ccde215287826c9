"""Moved to ``async_rl.learners.megatron.model``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import model as _moved

warnings.warn("async_rl.learners.megatron_model moved to async_rl.learners.megatron.model; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
