"""Backend knowledge stays in the backends (issue 31): product code outside an engine's or a
learner backend's own modules never compares a value with a backend name (``hf``, ``vllm``,
``sglang``, ``fsdp2``, ``megatron``, and whatever the registries list); it asks the backend's
class for its capabilities instead (``async_rl.generators.capabilities``,
``async_rl.learners.capabilities``). ``bench/`` and ``tests/`` may name backends.

The source is read with ``ast``: every ``Compare`` (``==``, ``!=``, ``in``, ``not in``) with a
backend name among its literal operands (a string, or a string inside a tuple, list or set
literal), and every ``match`` case whose pattern is such a literal.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("async_rl", "learners", "generators", "buffers")
BASE_NAMES = {"hf", "vllm", "sglang", "fsdp", "fsdp2", "megatron"}


def _backend_names() -> set[str]:
    """The fixed list plus every name the engine and learner registries hold (an engine added
    later is covered without editing this test)."""
    from async_rl.generators.capabilities import ENGINES
    from async_rl.learners.capabilities import LEARNERS

    return BASE_NAMES | set(ENGINES.names()) | set(LEARNERS.names())


def _owners(path: Path, names: set[str]) -> set[str]:
    """The backend names whose own module ``path`` is: a file named after the backend
    (``vllm.py``, ``vllm_worker.py``) or inside a folder named after it (``megatron/model.py``)."""
    rel = path.relative_to(ROOT)
    parts = [*rel.parts[:-1], rel.stem]
    own = set()
    for name in names:
        if any(p == name or p.startswith(name + "_") for p in parts[1:]):
            own.add(name)
    if "fsdp" in own:  # learners/fsdp.py is the fsdp2 backend
        own.add("fsdp2")
    return own


def _literals(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _literals(e)]
    return []


def _pattern_literals(pattern: ast.AST) -> list[str]:
    if isinstance(pattern, ast.MatchValue):
        return _literals(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return [s for p in pattern.patterns for s in _pattern_literals(p)]
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _pattern_literals(pattern.pattern)
    return []


def name_comparisons(source: str, names: set[str], own: set[str] = frozenset()) -> list[tuple[int, str]]:
    """``(line, backend name)`` for every comparison with, or ``match`` case on, a backend name
    in ``source`` that is not one of ``own``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                found += [(node.lineno, s) for o in operands for s in _literals(o) if s in names - own]
        elif isinstance(node, ast.match_case):
            found += [(node.pattern.lineno, s) for s in _pattern_literals(node.pattern) if s in names - own]
    return found


def test_detector_sees_each_form():
    names = {"vllm", "sglang", "hf"}
    src = ("a == 'vllm'\nb != \"sglang\"\nc in ('hf', 'x')\nd not in ['vllm']\n'hf' == e\n"
           "match f:\n    case 'sglang' | 'y':\n        pass\n    case 'z':\n        pass\n"
           "g = 'vllm'\nh(backend='hf')\ni == 'vllmx'\n")
    assert name_comparisons(src, names) == [(1, "vllm"), (2, "sglang"), (3, "hf"), (4, "vllm"), (5, "hf"),
                                            (7, "sglang")]
    assert name_comparisons("x == 'vllm'", names, own={"vllm"}) == []


def test_own_modules():
    names = {"vllm", "megatron", "fsdp", "fsdp2", "hf"}
    assert _owners(ROOT / "generators" / "vllm_worker.py", names) == {"vllm"}
    assert _owners(ROOT / "generators" / "vllm" / "worker.py", names) == {"vllm"}
    assert _owners(ROOT / "learners" / "megatron" / "model.py", names) == {"megatron"}
    assert _owners(ROOT / "learners" / "fsdp.py", names) == {"fsdp", "fsdp2"}
    assert _owners(ROOT / "async_rl" / "config.py", names) == set()
    assert _owners(ROOT / "generators" / "base.py", names) == set()


def test_no_backend_name_compared_outside_its_backend():
    names = _backend_names()
    bad = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, name in name_comparisons(path.read_text(), names, _owners(path, names)):
                bad.append(f"{path.relative_to(ROOT)}:{line} compares with {name!r}")
    assert not bad, ("backend names compared outside their backend (ask the engine's or learner's "
                     "capabilities instead):\n" + "\n".join(bad))
