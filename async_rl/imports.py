"""Loading user code named in a config by file path (``path/to/file.py:attr`` specs of reward
functions and tools)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from types import ModuleType


def load_file_module(path: str, namespace: str, what: str) -> ModuleType:
    """Import the Python file ``path`` as a module, once per process.

    The module is named ``<namespace>_<file stem>_<hash of the resolved path>`` and registered
    in ``sys.modules`` before it runs (so dataclasses and pickling inside it work); the same
    file named twice gives the same module object.

    Args:
        path: the file (``~`` expanded, symlinks resolved).
        namespace: module-name prefix, e.g. ``"async_rl_user_tools"``.
        what: how error messages name the file, e.g. ``"reward file"``.

    Raises:
        ValueError: the file does not exist or cannot be loaded as a module.
        Exception: whatever executing the module raises (it is removed from ``sys.modules``).
    """
    resolved = os.path.realpath(os.path.expanduser(path))
    if not os.path.isfile(resolved):
        raise ValueError(f"{what} {path!r} not found (resolved to {resolved!r})")
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:12]
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(resolved))[0])
    module_name = f"{namespace}_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{what} {path!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
