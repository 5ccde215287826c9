"""Name -> function registries for pluggable algorithm parts.

Policy losses and advantage estimators are chosen in the config by name. Each kind has one
`Registry`; built-in functions register themselves at import time with `@REG.register("name")`.
A name that holds ":" or "." and is not registered is read as an import path, so a user can plug
in a function of their own without touching this package:

    >>> from async_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    >>> ADVANTAGE_ESTIMATORS.get("grpo")                      # built-in
    >>> ADVANTAGE_ESTIMATORS.get("my_pkg.my_mod:my_estimator")  # user function, by path
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Fn = Callable[..., Any]


class Registry:
    """A small name -> callable map for one kind of function (e.g. "policy loss").

    Args:
        kind: human-readable name of what is registered; it appears in error messages.

    Lookup rules of `get(name)`:
        1. a registered name returns its function;
        2. otherwise a name containing ":" or "." is imported: "pkg.mod:attr" (preferred, the attr
           may be dotted) or "pkg.mod.attr" (the last dot separates module and attribute);
        3. otherwise `ValueError` listing the registered names.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, Fn] = {}

    def register(self, name: str) -> Callable[[Fn], Fn]:
        """Decorator that registers a function under `name` and returns it unchanged.

        Raises:
            ValueError: `name` is empty, already registered, or contains ":" or "." (those are
                reserved for import paths and could never be looked up).
        """
        if not name or ":" in name or "." in name:
            raise ValueError(f"invalid {self.kind} name {name!r}: must be non-empty without ':' or '.'")

        def decorator(fn: Fn) -> Fn:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._fns[name]!r})")
            self._fns[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> Fn:
        """Return the callable registered as `name`, or import it when `name` is a path.

        Raises:
            ValueError: unknown name (the message lists the valid names), or an import path whose
                module cannot be imported, lacks the attribute, or does not name a callable.
        """
        if name in self._fns:
            return self._fns[name]
        if ":" in name or "." in name:
            return self._import(name)
        raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())} "
                         f"(or an import path 'package.module:function')")

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns

    def _import(self, path: str) -> Fn:
        if ":" in path:
            module_name, _, attr_path = path.partition(":")
        else:
            module_name, _, attr_path = path.rpartition(".")
        if not module_name or not attr_path:
            raise ValueError(f"bad {self.kind} import path {path!r}; expected 'package.module:function'")
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"cannot import module {module_name!r} for {self.kind} {path!r}: {e}") from e
        for attr in attr_path.split("."):
            if not hasattr(obj, attr):
                raise ValueError(f"{self.kind} {path!r}: {module_name!r} has no attribute {attr_path!r}")
            obj = getattr(obj, attr)
        if not callable(obj):
            raise ValueError(f"{self.kind} {path!r} is not callable (got {type(obj).__name__})")
        return obj
