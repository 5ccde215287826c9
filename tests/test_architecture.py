"""The package's shape (issue 14): every import arrow points down, no module reaches into another's
private names, no function grows past a screen, and the installed layout cannot collide. The tree
is the layers: each layer is a set of folders (or files) at the top of the package, and the layer
table of docs/architecture.md names the same ones.

The import graph is read from the source with ``ast`` (every ``import`` and ``from ... import``,
including those inside functions, except under ``if TYPE_CHECKING:``), so a cycle hidden behind a
function-level import is still a cycle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Repository folder -> installed package name (pyproject's package-dir mapping).
FOLDERS = {"async_rl": "async_rl", "learners": "async_rl.learners", "generators": "async_rl.generators",
           "buffers": "async_rl.buffers"}
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([package, *parts])] = f
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that ``name`` (a module or ``module.attr``) lives in, or ``None``."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path):
    """Yield ``(imported module of ours, imported name or None, line)`` for every import."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node, type_checking: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if (owner := _owner(alias.name)) is not None:
                        yield owner, None, child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    owner = _owner(full) if full in MODULES else _owner(base)
                    if owner is not None:
                        yield owner, (None if full in MODULES else alias.name), child.lineno
            yield from visit(child, type_checking)

    yield from visit(tree, False)


def _graph() -> dict[str, set[str]]:
    return {m: {o for o, _, _ in _imports(m, p) if o != m} for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_graph_sees_our_modules():
    # The check below would pass vacuously on an empty graph.
    graph = _graph()
    assert len(graph) > 40
    assert "async_rl.buffers.trajectory" in graph["async_rl.step.batch"]


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (each line one strongly connected set of modules):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


# The layers, top to bottom, as docs/architecture.md draws them: an import may only point down or
# sideways. Each layer is a list of top-level entries of the package (a folder, or a file at the top
# of async_rl/), so the tree shows the layers: a layer of several modules is a folder of its own
# (``step/``) or shares one with its kind (``runtime/`` beside the learners, generators, buffers, ...).
LAYERS = {
    "entry": ["async_rl.cli", "async_rl.commands"],
    "trainer": ["async_rl.trainer"],
    "config": ["async_rl.config"],
    "loops": ["async_rl.loops"],
    "step": ["async_rl.step", "async_rl.endpoint"],
    "components": ["async_rl.runtime", "async_rl.learners", "async_rl.generators", "async_rl.buffers",
                   "async_rl.weight_sync", "async_rl.data"],
    "library": ["async_rl.utils", "async_rl.algorithms", "async_rl.rewards", "async_rl.tools", "async_rl.envs"],
}
# The only modules at the top of async_rl/: the console script (``async_rl.cli:entry``) and the two
# layers of one module each, the main imports of a user's own driver.
TOP_LEVEL_FILES = {"cli", "trainer", "config"}
# In no layer: the package root. It holds only the aliases of moved modules (MOVED_MODULES), which it
# imports by name when a user imports an old path, never on its own; no module of ours imports an
# old path (test_no_module_of_ours_names_a_moved_path).
OUTSIDE_LAYERS = {"async_rl"}


def _layer(module: str) -> int | None:
    for depth, prefixes in enumerate(LAYERS.values()):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return depth
    return None


def test_every_module_has_a_layer_and_every_import_points_down():
    graph = _graph()
    unplaced = sorted(m for m in graph if m not in OUTSIDE_LAYERS and _layer(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS and docs/architecture.md): {unplaced}"
    up = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
          if _layer(m) is not None and _layer(d) is not None and _layer(d) < _layer(m)]
    assert not up, "imports that point up a layer:\n" + "\n".join(sorted(up))
    assert _layer("async_rl.loops.pool") == 3 and _layer("async_rl.utils.lora") == 6


def _top_level_entries() -> dict[str, Path]:
    """``async_rl.<name>`` -> its file or folder, for everything at the top of the installed package."""
    entries = {f"async_rl.{p.stem}": p for p in (ROOT / "async_rl").glob("*.py") if p.name != "__init__.py"}
    entries |= {f"async_rl.{p.name}": p for p in (ROOT / "async_rl").iterdir() if (p / "__init__.py").exists()}
    entries |= {package: ROOT / folder for folder, package in FOLDERS.items() if folder != package}
    return entries


def test_the_tree_is_the_layers():
    # What the layer check enforces is what the folder shows: every top-level entry is in exactly
    # one layer, every layer names top-level entries only, and no flat module sits beside the
    # console script and the one-module layers.
    entries = _top_level_entries()
    named = [p for prefixes in LAYERS.values() for p in prefixes]
    assert sorted(named) == sorted(set(named)), "an entry is in two layers"
    assert set(named) == set(entries), (f"in no layer: {sorted(set(entries) - set(named))}; "
                                        f"not a top-level folder or file: {sorted(set(named) - set(entries))}")
    flat = {p.stem for p in (ROOT / "async_rl").glob("*.py") if p.name != "__init__.py"}
    assert flat == TOP_LEVEL_FILES, f"modules at the top of async_rl/ (put them in their layer's folder): {sorted(flat)}"


def _docs_layers() -> dict[str, list[str]]:
    """The layer table of docs/architecture.md: layer -> its entries as dotted package names."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")]
    layers = {}
    for name, cell in rows[1:]:  # the first row is the header
        paths = [p.strip("`") for p in cell.replace(",", " ").split()]
        layers[name.strip()] = [p.removesuffix("/").removesuffix(".py").replace("/", ".") for p in paths]
    return layers


def test_docs_draw_the_layers_the_test_enforces():
    assert _docs_layers() == LAYERS


def _named_paths(node: ast.AST) -> list[str]:
    """The dotted names an import node imports, or a string constant's text; nothing for other nodes."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return []


def test_no_module_of_ours_names_a_moved_path():
    # The old paths are aliases for users' code: the package's own imports, spec strings
    # ("module:attr"), monkeypatch and mock paths use the new ones, so the layer check above sees
    # every real import.
    import async_rl

    def moved(name: str) -> bool:
        return any(name == old or name.startswith((old + ".", old + ":")) for old in async_rl.MOVED_MODULES)

    bad = [f"{p.relative_to(ROOT)}:{node.lineno} {name[:60]}" for m, p in MODULES.items() if m not in OUTSIDE_LAYERS
           for node in ast.walk(ast.parse(p.read_text())) for name in _named_paths(node) if moved(name)]
    assert not bad, "old module paths named by the package itself:\n" + "\n".join(bad)
    assert moved("async_rl.step") is False and moved(next(iter(async_rl.MOVED_MODULES)) + ":fn")
    assert all(new in MODULES and _layer(new) is not None for new in async_rl.MOVED_MODULES.values())


def test_no_private_name_imported_from_another_module():
    bad = [f"{m}:{line} imports {name} from {owner}" for m, p in MODULES.items()
           for owner, name, line in _imports(m, p)
           if owner != m and name is not None and name.startswith("_") and not name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_function_longer_than_a_screen():
    long = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_no_module_imports_the_repository_folders_as_top_level_packages():
    # They install as async_rl.learners etc.; `import learners` works only from a source checkout.
    bad = []
    for m, p in MODULES.items():
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{m}: import {n}" for n in names if n.split(".")[0] in ("learners", "generators", "buffers")]
    assert not bad, "\n".join(bad)


def test_pyproject_installs_every_package_folder_under_async_rl():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    wanted = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert listed == wanted, f"pyproject packages differ: missing {sorted(wanted - listed)}, extra {sorted(listed - wanted)}"
    for folder, package in FOLDERS.items():
        if folder != package:
            assert project["package-dir"][package] == folder


@pytest.mark.parametrize("package", ["async_rl.learners", "async_rl.generators", "async_rl.buffers"])
def test_subpackages_import_under_async_rl(package):
    import importlib

    mod = importlib.import_module(package)
    assert Path(mod.__file__).resolve().parent == ROOT / package.split(".")[1]


def test_a_checkout_imports_the_role_packages_without_an_install():
    """From a source checkout on ``PYTHONPATH`` with no install (``-S``: not even the editable
    one), ``async_rl.learners``, ``async_rl.generators`` and ``async_rl.buffers`` import from the
    repository's folders (``async_rl.CheckoutFinder``), as on a machine that cannot pip install."""
    import subprocess
    import sys

    code = ("import sys, async_rl, async_rl.learners, async_rl.buffers, async_rl.generators.capabilities as c\n"
            "print(async_rl.learners.__file__); print(async_rl.buffers.__file__); print(c.__file__)\n"
            "print(sum(isinstance(f, async_rl.CheckoutFinder) for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    files = out.stdout.split()
    assert [Path(f).resolve() for f in files[:3]] == [ROOT / "learners" / "__init__.py", ROOT / "buffers" / "__init__.py",
                                                      ROOT / "generators" / "capabilities.py"]
    assert files[3] == "1"
