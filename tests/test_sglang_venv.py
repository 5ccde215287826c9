"""Runs the SGLang tests (``tests/test_sglang.py``, ``tests/test_sglang_moe.py``, ``tests/test_sglang_vl.py``)
inside the SGLang venv, from the main suite.

SGLang cannot share the main venv (it is installed with ``--no-deps`` beside stand-ins that must
never reach the vLLM venv; ``envs/sglang-cpu/build.sh``), so the README's single test command
reaches its tests through this one: it runs them with the SGLang venv's interpreter and fails
with their own report if any fails. Without the venv it is skipped, naming the command that
builds it. ``ASYNC_RL_SGLANG_VENV`` points at a venv elsewhere (default ``.venv-sglang``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("ASYNC_RL_SGLANG_VENV", ROOT / ".venv-sglang"))
PYTHON = VENV / "bin" / "python"
SGLANG_TESTS = ("tests/test_sglang.py", "tests/test_sglang_moe.py", "tests/test_sglang_vl.py")
"""The files that run inside the SGLang venv (the dense engine, a mixture-of-experts model, and a
vision-language model)."""


def _in_sglang_venv() -> bool:
    try:
        import sglang  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(_in_sglang_venv(), reason="this interpreter has SGLang: test_sglang.py runs here directly")
@pytest.mark.skipif(not PYTHON.exists(), reason=f"no SGLang venv at {VENV}: build it with envs/sglang-cpu/build.sh "
                                                "(CI's .ci/run does)")
def test_sglang_suite_in_its_venv():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SGLANG_TESTS],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3600)
    lines = proc.stdout.splitlines()
    # SGLang's shutdown chatter fills the tail: keep pytest's own report lines.
    report = [line for line in lines if line.startswith(("FAILED", "ERROR", "E ", "tests/", "_____"))]
    tail = "\n".join(report[-80:] + lines[-3:])
    sys.stdout.write(tail + "\n")
    assert proc.returncode == 0, f"{' '.join(SGLANG_TESTS)} failed in {VENV}:\n{tail}"
    summary = next((line for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    # Every SGLang test ran (none may skip inside its own venv).
    assert "passed" in summary and "skipped" not in summary, tail
