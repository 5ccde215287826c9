"""Moved to ``async_rl.generators.sglang.process``: this alias of it goes in the next release."""

import sys
import warnings

from async_rl.generators.sglang import process as _moved

warnings.warn("async_rl.generators.sglang_process moved to async_rl.generators.sglang.process; import it from there",
              DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
