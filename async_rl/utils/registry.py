"""One registry and one spec resolver for every pluggable part: policy losses, advantage
estimators, reward functions and tools.

A config names a part by a *spec* string; every kind reads it the same way (``Registry.get``):

=================================  ==========================================================
spec                               resolves to
=================================  ==========================================================
``grpo``                           the object registered under that name
``builtin:grpo``                   the same, but never read as an import path (an unknown name
                                   is an error even if it holds a dot)
``my_pkg.my_mod:attr``             ``attr`` (may be dotted) of the imported module
``my_pkg.my_mod.attr``             the same; the last dot separates module and attribute
``path/to/file.py:attr``           ``attr`` of the file, loaded as a module once per process
                                   (a module part ending in ``.py`` or holding a path
                                   separator is a file)
=================================  ==========================================================

Every failure is one ``ValueError`` line that names the kind and the spec (and, for an unknown
name, the registered names and the path forms). An exception raised while a user module is
imported is wrapped the same way (type and message kept, the original chained as ``__cause__``),
so a bad spec never surfaces as a bare ``ImportError`` deep in a worker.

    >>> from async_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    >>> ADVANTAGE_ESTIMATORS.get("grpo")                        # built-in
    >>> ADVANTAGE_ESTIMATORS.get("my_pkg.my_mod:my_estimator")  # user function, by path
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, Generic, TypeVar

__all__ = ["BUILTIN_PREFIX", "BackendRegistry", "Registry", "load_file_module", "require_callable"]

T = TypeVar("T")

BUILTIN_PREFIX = "builtin:"
"""Spec prefix that forces a registry lookup (``builtin:grpo``)."""

USER_MODULE_NAMESPACE = "async_rl_user"
"""Prefix of the ``sys.modules`` names of user files loaded by spec (one namespace for every kind,
so a file named by a reward spec and by a tool spec is one module)."""

_PATH_FORMS = "an import path 'package.module:function' or a file path 'path/to/file.py:function'"


def require_callable(kind: str, spec: str, obj: Any) -> Any:
    """Default ``coerce`` of a ``Registry``: return ``obj`` if it is callable.

    Raises:
        ValueError: ``obj`` is not callable; the message names the kind, the spec and the type.
    """
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r} is not callable (got {type(obj).__name__})")
    return obj


class Registry(Generic[T]):
    """Name -> object map for one kind of pluggable part, plus the spec resolver of the module
    docstring.

    Args:
        kind: what is registered, e.g. ``"policy loss"``; every error message starts with it.
        coerce: ``(kind, spec, obj) -> T`` applied to whatever a spec resolves to (a registered
            object or an imported one): validates it and may wrap it (estimators wrap a plain
            function in an ``EstimatorSpec``, tools turn a function into a list of ``Tool``).
            Default ``require_callable``.
        help: one sentence appended to "unknown name" errors, e.g. the expected signature.

    ``registry[name]`` returns the registered object as stored (``KeyError`` when absent);
    ``get(spec)`` resolves any spec form and applies ``coerce``.
    """

    def __init__(self, kind: str, coerce: Callable[[str, str, Any], T] | None = None, help: str = "") -> None:
        self.kind = kind
        self.help = help
        self._coerce = coerce or require_callable
        self._objs: dict[str, Any] = {}

    def register(self, name: str, obj: Any = None) -> Any:
        """Register ``obj`` under ``name`` and return it; without ``obj``, a decorator that does so.

        Raises:
            ValueError: ``name`` is empty or holds ":" or "." (reserved for import paths, so it
                could never be looked up), or is already registered.
        """
        if not isinstance(name, str) or not name or ":" in name or "." in name:
            raise ValueError(f"invalid {self.kind} name {name!r}: must be non-empty without ':' or '.' "
                             f"(reserved for import paths)")

        def add(value: Any) -> Any:
            if name in self._objs:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._objs[name]!r})")
            self._objs[name] = value
            return value

        return add if obj is None else add(obj)

    def get(self, spec: str) -> T:
        """Resolve ``spec`` (see the module docstring) and return the coerced object.

        Raises:
            ValueError: empty spec; unknown name (the message lists the registered names and the
                path forms); a module that is not found, a file that does not exist, an
                exception while importing either (type and message kept, chained), a missing
                attribute, or an object ``coerce`` rejects. The message names kind and spec.
        """
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{self.kind} spec {spec!r} is empty or not a string; {self._valid()}")
        spec = spec.strip()
        name = spec[len(BUILTIN_PREFIX):] if spec.startswith(BUILTIN_PREFIX) else spec
        if name in self._objs:
            return self._coerce(self.kind, spec, self._objs[name])
        if name != spec or (":" not in spec and "." not in spec):
            raise ValueError(f"unknown {self.kind} {spec!r}: not a built-in name; {self._valid()}")
        return self._coerce(self.kind, spec, self._import(spec))

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._objs))

    def pop(self, name: str, default: Any = None) -> Any:
        """Unregister ``name``; return its object, or ``default`` when it was not registered."""
        return self._objs.pop(name, default)

    def __getitem__(self, name: str) -> Any:
        return self._objs[name]

    def __contains__(self, name: object) -> bool:
        return name in self._objs

    def __iter__(self) -> Iterator[str]:
        return iter(self._objs)

    def __len__(self) -> int:
        return len(self._objs)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"

    def _valid(self) -> str:
        text = f"built-ins: {', '.join(self.names()) or '(none)'}; or {_PATH_FORMS}"
        return f"{text}. {self.help}" if self.help else text

    def _import(self, spec: str) -> Any:
        if ":" in spec:
            module_part, _, attr_path = spec.rpartition(":")
        else:
            module_part, _, attr_path = spec.rpartition(".")
        if not module_part or not attr_path:
            raise ValueError(f"bad {self.kind} spec {spec!r}: expected {_PATH_FORMS}")
        if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
            module = self._load_file(spec, module_part)
        else:
            module = self._import_module(spec, module_part)
        obj: Any = module
        for attr in attr_path.split("."):
            if not hasattr(obj, attr):
                raise ValueError(f"{self.kind} {spec!r}: {module_part!r} has no attribute {attr_path!r}; "
                                 f"{_defined_here(module, attr)}")
            obj = getattr(obj, attr)
        return obj

    def _import_module(self, spec: str, name: str) -> ModuleType:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            # Only a missing module named by the spec is the user's typo; a missing dependency of
            # their module is their module's error and keeps its own message.
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                raise ValueError(f"{self.kind} {spec!r}: module {name!r} not found") from e
            raise ValueError(f"{self.kind} {spec!r}: importing {name!r} failed: {e}") from e
        except Exception as e:
            raise ValueError(f"{self.kind} {spec!r}: importing {name!r} failed: {type(e).__name__}: {e}") from e

    def _load_file(self, spec: str, path: str) -> ModuleType:
        try:
            return load_file_module(path, USER_MODULE_NAMESPACE, f"{self.kind} {spec!r}: file")
        except ValueError:
            raise
        except Exception as e:
            raise ValueError(f"{self.kind} {spec!r}: loading {path!r} failed: {type(e).__name__}: {e}") from e


class BackendRegistry(Registry[type]):
    """Backend name -> class, for the backends a config key chooses (``generator.backend``,
    ``learner.backend``). Each is registered as an ``"module:Class"`` import path and imported on
    first use only, so listing backends or reading their capabilities never imports an engine
    library that lazily imports inside its module (vLLM, SGLang, megatron-core); each class
    declares what it can do as a ``capabilities`` class attribute of ``capabilities_type``.

    Args:
        kind: what is registered, e.g. ``"generator backend"``.
        config_key: the key that names a backend, e.g. ``"generator.backend"`` (in errors).
        capabilities_type: the type every class's ``capabilities`` must be an instance of.
    """

    def __init__(self, kind: str, config_key: str, capabilities_type: type) -> None:
        super().__init__(kind, coerce=self._backend_class)
        self.config_key = config_key
        self.capabilities_type = capabilities_type

    def _backend_class(self, kind: str, spec: str, obj: Any) -> type:
        # ``coerce``: import a registered path; the class must declare its capabilities.
        if isinstance(obj, str):
            module, _, attr = obj.partition(":")
            obj = getattr(importlib.import_module(module), attr)
        if not isinstance(getattr(obj, "capabilities", None), self.capabilities_type):
            raise ValueError(f"{kind} {spec!r}: {obj!r} declares no {self.capabilities_type.__name__} "
                             f"'capabilities' class attribute")
        return obj

    def backend_class(self, backend: str) -> type:
        """The class of ``<config_key>=backend``, its module imported now (not its engine library).

        Raises:
            ValueError: ``backend`` is not registered (one line listing those that are), or the
                class declares no capabilities.
            ImportError: the class's module cannot be imported.
        """
        if backend not in self:
            raise ValueError(f"{self.config_key} must be one of {tuple(self)}, got {backend!r}")
        return self.get(backend)

    def capabilities(self, backend: str) -> Any:
        """``backend_class(backend).capabilities`` (an instance of ``capabilities_type``).

        Raises:
            ValueError, ImportError: as ``backend_class``.
        """
        return self.backend_class(backend).capabilities

    def names_that(self, predicate: Callable[[Any], bool]) -> str:
        """The registered backends whose capabilities satisfy ``predicate``, joined for a message
        (``"hf or sglang"``); ``"none"`` when none does."""
        names = [n for n in self if predicate(self.capabilities(n))]
        return " or ".join(names) if names else "none"


def _defined_here(module: ModuleType, wanted: str, limit: int = 12) -> str:
    """``"did you mean 'score'? it defines: score, score_v2"``: the public callables a module
    defines itself (not those it imports), in definition order and at most ``limit`` of them,
    led by the one closest to the misspelt ``wanted``."""
    names = [name for name, obj in vars(module).items()
             if not name.startswith("_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__]
    if not names:
        return "it defines no public function"
    close = difflib.get_close_matches(wanted, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"{hint}it defines: {', '.join(names[:limit])}{more}"


def load_file_module(path: str, namespace: str, what: str) -> ModuleType:
    """Import the Python file ``path`` as a module, once per process.

    The module is named ``<namespace>_<file stem>_<hash of the resolved path>`` and registered
    in ``sys.modules`` before it runs (so dataclasses and pickling inside it work); the same
    file named twice gives the same module object.

    Args:
        path: the file (``~`` expanded, symlinks resolved).
        namespace: module-name prefix, e.g. ``"async_rl_user"``.
        what: how error messages name the file, e.g. ``"reward function 'r.py:f': file"``.

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
