"""async-rl: asynchronous, off-policy actor-learner RL post-training for LLMs.

The folders are the layers of ``docs/architecture.md``, top to bottom: ``cli.py`` and
``commands/`` (entry), ``trainer.py``, ``config.py``, ``loops/``, ``step/``, the components
(``runtime/``, ``learners``, ``generators``, ``buffers``, ``weight_sync/``, ``data/``) and the
library (``utils/``, ``algorithms/``, ``rewards/``, ``tools/``); ``tests/test_architecture.py``
checks that every import points down them.

The learner, generator and buffer roles keep their own top-level folders in the repository
(``learners/``, ``generators/``, ``buffers/``) and install as ``async_rl.learners``,
``async_rl.generators`` and ``async_rl.buffers`` (pyproject's ``package-dir``). An install (plain
or editable) maps them; imported straight from a checkout with no install (``PYTHONPATH=<repo>``,
as on a machine that cannot ``pip install`` the project), :class:`CheckoutFinder` maps them to the
folders beside this package, so the same imports work either way.

Modules that moved keep their old import path for one release: :data:`MOVED_MODULES` maps each old
path to the new one, and importing an old path gives the new module itself, with one
``DeprecationWarning`` line naming where it went. The package root imports none of its modules itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings
from importlib.machinery import ModuleSpec
from pathlib import Path

ROLE_FOLDERS = ("learners", "generators", "buffers")
"""Repository folders installed as ``async_rl.<folder>``."""


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``async_rl.learners`` (and the other role packages) in the repository folder of a
    source checkout. Last on ``sys.meta_path``: an install's own mapping, if any, wins."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        """The spec of ``async_rl.<role>`` from ``<root>/<role>/__init__.py``; ``None`` for any
        other name (its submodules are then found through the package's ``__path__``)."""
        package, _, role = fullname.partition(".")
        if package != __name__ or role not in ROLE_FOLDERS:
            return None
        init = self.root / role / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def _checkout_root() -> Path | None:
    """The repository root when this package was imported from a checkout whose role folders it
    does not contain (an installed copy holds them inside itself), else ``None``."""
    here = Path(__file__).resolve().parent
    root = here.parent
    if (root / "pyproject.toml").is_file() and all((root / r / "__init__.py").is_file() and not (here / r).exists()
                                                   for r in ROLE_FOLDERS):
        return root
    return None


if (_root := _checkout_root()) is not None and not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.append(CheckoutFinder(_root))

MOVED_MODULES = {
    "async_rl.agent": "async_rl.step.agent",
    "async_rl.batch": "async_rl.step.batch",
    "async_rl.checkpoint": "async_rl.runtime.checkpoint",
    "async_rl.checkpoint_format": "async_rl.utils.checkpoint_format",
    "async_rl.cluster": "async_rl.runtime.cluster",
    "async_rl.cpu_affinity": "async_rl.utils.cpu_affinity",
    "async_rl.cpu_threads": "async_rl.utils.cpu_threads",
    "async_rl.evaluation": "async_rl.step.evaluation",
    "async_rl.inputs": "async_rl.runtime.inputs",
    "async_rl.leftovers": "async_rl.utils.leftovers",
    "async_rl.lora": "async_rl.utils.lora",
    "async_rl.metrics": "async_rl.runtime.metrics",
    "async_rl.placement": "async_rl.runtime.placement",
    "async_rl.plot": "async_rl.commands.plot",
    "async_rl.registry": "async_rl.utils.registry",
    "async_rl.rollout": "async_rl.step.rollout",
}
"""Old import path -> new one, for the modules that left the top of ``async_rl/``; each old path
goes in the next release."""


class MovedModuleAliases(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The import hook behind :data:`MOVED_MODULES`: finds only the old paths, and loads each as
    the new module (``sys.modules[old] is sys.modules[new]``) after one ``DeprecationWarning``."""

    def find_spec(self, fullname, path=None, target=None):
        """A spec served by this loader for an old path; ``None`` (not ours) for anything else."""
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        """The default module; :meth:`exec_module` replaces it in ``sys.modules``."""
        return None

    def exec_module(self, module) -> None:
        """Import the new module, warn once (at the importing line), and alias the old path to it."""
        old = module.__name__
        new = MOVED_MODULES[old]
        moved = importlib.import_module(new)
        warnings.warn(f"{old} moved to {new}; import it from there", DeprecationWarning,
                      stacklevel=_importer_stacklevel())
        sys.modules[old] = moved


def _importer_stacklevel() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside this file and importlib, so the
    warning points at the line that imported the old path (and shows by default in ``__main__``).
    ``warnings`` itself skips importlib's ``_bootstrap`` frames, so only the others are counted."""
    importlib_dir = os.path.dirname(importlib.__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if name != __file__ and not name.startswith(importlib_dir):
            break
        frame, level = frame.f_back, level + 1
    return level


if not any(isinstance(f, MovedModuleAliases) for f in sys.meta_path):
    sys.meta_path.insert(0, MovedModuleAliases())
