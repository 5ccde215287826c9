"""Where tools come from: ``ToolRegistry`` (name -> ``Tool``), the ``BUILTIN_TOOLS`` short names
configs may use, ``register_tool`` and ``load_tools`` (a spec -> its tools).

A spec is a registered short name, an import path ``"package.module:attr"`` or a file path
``"path/to/file.py:attr"`` (``async_rl.utils.registry.Registry`` resolves it). The built-ins register
in ``async_rl.tools`` (its ``__init__``), so this module never imports the tools built on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from async_rl.utils.registry import Registry
from async_rl.tools.definition import Tool, tool

__all__ = ["BUILTIN_TOOLS", "ToolRegistry", "load_tools", "register_tool"]


def _as_tools(kind: str, spec: str, obj: Any) -> list[Tool]:
    """``coerce`` of ``BUILTIN_TOOLS``: a Tool, a function, a ``ToolRegistry`` or a list of Tools
    and functions -> list of Tools."""
    if isinstance(obj, Tool):
        return [obj]
    if isinstance(obj, ToolRegistry):
        return list(obj)
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    tools: list[Tool] = []
    for item in items:
        if isinstance(item, Tool):
            tools.append(item)
        elif callable(item) and not isinstance(item, type):
            try:
                tools.append(tool(item))
            except ValueError as e:
                raise ValueError(f"{kind} spec {spec!r}: cannot wrap {item!r} as a tool: {e}") from e
        else:
            raise ValueError(
                f"{kind} spec {spec!r} names a {type(item).__name__}, not a Tool, a function or a "
                "list of them"
            )
    if not tools:
        raise ValueError(f"{kind} spec {spec!r} names an empty list")
    return tools


BUILTIN_TOOLS: Registry[list[Tool]] = Registry(
    "tool", coerce=_as_tools,
    help="A tool spec's attr is a Tool, a function (wrapped with tool()) or a list of them.")
"""Tools configs may name by short name (``agent.tools: [calculator]``): the built-ins, registered
by ``async_rl.tools`` (its ``__init__``), and whatever ``register_tool`` adds."""


def register_tool(obj: "Tool | Callable[..., Any]", name: str | None = None) -> Tool:
    """Register a tool in code so configs can name it in ``agent.tools`` like a built-in.

    Args:
        obj: a ``Tool``, or a function (wrapped with ``tool()``, schema from its type hints).
        name: the name configs use; default the tool's own name.

    Returns:
        The registered ``Tool``.

    Raises:
        ValueError: the name is taken (built-ins included).

    Example::

        @register_tool
        def lookup(key: str) -> str: ...
        # agent.tools: [lookup]

    In async mode generator actors load tools in their own processes: register in a module
    the actors import too (or name the tool by import path instead).
    """
    t = obj if isinstance(obj, Tool) else tool()(obj)
    return BUILTIN_TOOLS.register(name or t.name, t)


class ToolRegistry:
    """Name -> ``Tool`` map, in registration order (the order the model sees the schemas in).

    ``get(name)`` returns None for an unknown name (as ``dict.get``); ``registry[name]`` raises
    KeyError. Iterating yields the tools.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.register(t)

    def register(self, tool: Tool) -> Tool:
        """Add ``tool`` and return it (so ``@registry.register`` on a ``@tool`` works).

        Raises:
            ValueError: a tool of the same name is already registered, or ``tool`` is not a Tool.
        """
        if not isinstance(tool, Tool):
            raise ValueError(f"expected a Tool, got {type(tool).__name__}; wrap functions with tool()")
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    def schemas(self) -> list[dict]:
        """``Tool.schema()`` of every tool, in registration order, for ``apply_chat_template``."""
        return [t.schema() for t in self._tools.values()]

    def __getitem__(self, name: str) -> Tool:
        try:
            return self._tools[name]
        except KeyError:
            raise KeyError(f"unknown tool {name!r}; registered: {self.names()}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __repr__(self) -> str:
        return f"ToolRegistry({self.names()})"

    @classmethod
    def from_specs(cls, specs: Iterable[str]) -> ToolRegistry:
        """Build a registry from tool specs (see ``load_tools``), in the given order.

        Args:
            specs: e.g. ``["calculator", "python", "my_pkg.tools:search", "tools.py:TOOLS"]``.

        Returns:
            A new registry.

        Raises:
            ValueError: a spec cannot be loaded, or two specs yield the same tool name; the
                message names the spec and the reason.
        """
        if isinstance(specs, str):
            raise ValueError(f"from_specs takes a list of specs, got the string {specs!r}")
        registry = cls()
        for spec in specs:
            for t in load_tools(spec):
                if t.name in registry:
                    raise ValueError(
                        f"tool spec {spec!r}: tool {t.name!r} is already registered by an "
                        "earlier spec"
                    )
                registry.register(t)
        return registry


def load_tools(spec: str) -> list[Tool]:
    """Load the tools one spec names.

    A spec is a registered short name (``BUILTIN_TOOLS``: "calculator", "python", and what
    ``register_tool`` added), ``builtin:<name>``, an import path ``"package.module:attr"`` or a
    file path ``"path/to/file.py:attr"``, resolved by ``async_rl.utils.registry.Registry.get``.
    ``attr`` may be dotted and may name a ``Tool``, a function (wrapped with ``tool()``), a
    ``ToolRegistry``, or a list/tuple of Tools and functions.

    Returns:
        The tools, in order.

    Raises:
        ValueError: unknown short name, empty or malformed spec, missing module or file, an
            exception while importing the module (chained), missing attribute, or an attribute
            of the wrong kind; the message names the spec.
    """
    return BUILTIN_TOOLS.get(spec)
