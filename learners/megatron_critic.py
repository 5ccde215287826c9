"""Moved to ``async_rl.learners.megatron.critic``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.learners.megatron import critic as _moved

warnings.warn("async_rl.learners.megatron_critic moved to async_rl.learners.megatron.critic; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
