"""async-rl: asynchronous, off-policy actor-learner RL post-training for LLMs.

The learner, generator and buffer roles keep their own top-level folders in the repository
(``learners/``, ``generators/``, ``buffers/``) and install as ``async_rl.learners``,
``async_rl.generators`` and ``async_rl.buffers`` (pyproject's ``package-dir``). An install (plain
or editable) maps them; imported straight from a checkout with no install (``PYTHONPATH=<repo>``,
as on a machine that cannot ``pip install`` the project), the finder below maps them to the
folders beside this package, so the same imports work either way.
"""

from __future__ import annotations

import importlib.util
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from pathlib import Path

ROLE_FOLDERS = ("learners", "generators", "buffers")
"""Repository folders installed as ``async_rl.<folder>``."""


class CheckoutFinder(MetaPathFinder):
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
