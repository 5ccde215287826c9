"""Moved to ``async_rl.learners.megatron.pipeline``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import pipeline as _moved

warnings.warn("async_rl.learners.megatron_pipeline moved to async_rl.learners.megatron.pipeline; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
