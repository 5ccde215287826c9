"""The documentation: a short README whose links resolve, no file pointing outside the repository,
the MkDocs site building in strict mode, and a configuration reference generated from the config
schema with every key that ``async-rl config --keys`` prints."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HOOK = ROOT / "docs" / "hooks" / "config_reference.py"

# A folder beside the checkout (the parent directory's "shared" folder, which a user of the
# package does not have) or an absolute path of a developer's machine. The sibling name is
# assembled here so that this file does not itself hold the string it forbids.
SIBLING = b".." + b"/shared"
OUTSIDE = re.compile(re.escape(SIBLING) + rb"|(?<![\w.~-])/(?:work|home)/")


def _hook():
    spec = importlib.util.spec_from_file_location("config_reference", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _printed_keys() -> list[str]:
    """Every key and section that ``async-rl config --keys`` prints, read from its output."""
    from async_rl.commands import format_keys

    keys = []
    for line in format_keys().splitlines():
        if m := re.match(r"\[([\w.]+)\]", line):
            keys.append(m.group(1))
        elif m := re.match(r"([a-z_][\w.]*): ", line):
            keys.append(m.group(1))
    return keys


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines; the manual belongs in docs/"
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_readme_commands_are_the_ones_ci_runs():
    """The README's install and test commands and ``.ci/run`` agree: CI installs every extra the README's
    command does, and runs the README's test command."""
    readme, ci = README.read_text(), (ROOT / ".ci" / "run").read_text()
    install = re.search(r"pip install -c constraints-cpu.txt -e '\.\[([\w,-]+)\]'", readme)
    ci_install = re.search(r"pip install -q -c constraints-cpu.txt -e '\.\[([\w,-]+)\]'", ci)
    assert install and ci_install
    assert set(install.group(1).split(",")) <= set(ci_install.group(1).split(",")) | {"docs"}
    assert "docs" in ci_install.group(1).split(","), ".ci/run must install the docs extra to build the site"
    assert "async-rl train --config configs/default.yaml" in readme and (ROOT / "configs" / "default.yaml").exists()
    test_command = re.search(r"# 2\. run the test suite.*\n(.*)", readme).group(1)
    assert test_command.endswith("python -m pytest -q") and "\npython -m pytest -q\n" in ci
    assert "mkdocs build --strict" in ci


def test_no_tracked_file_points_outside_the_repository():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    files = [f for f in _tracked_files() if f.is_file()]
    assert len(files) > 100
    offenders = []
    for f in files:
        for number, line in enumerate(f.read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{f.relative_to(ROOT)}:{number}: {line.decode(errors='replace').strip()[:120]}")
    assert not offenders, "paths outside the repository:\n" + "\n".join(offenders)


def test_the_outside_pattern_catches_what_it_should():
    assert OUTSIDE.search(b"see " + SIBLING + b"/tools/x.py")
    assert OUTSIDE.search(b'path = "/' + b'work/main/learners/x.py"')
    assert OUTSIDE.search(b"cd /" + b"home/dev/async-rl")
    assert not OUTSIDE.search(b"https://example.com/home/page and ~/.cache/async-rl")
    assert not OUTSIDE.search(b"no /etc, /proc, /home, trainer checkout")


def test_config_reference_page_holds_every_key_config_keys_prints():
    page = _hook().render()
    keys = _printed_keys()
    assert len(keys) > 100 and "trainer.total_steps" in keys and "generator" in keys
    missing = [k for k in keys if f"`{k}`" not in page and not re.search(rf"^#+ {re.escape(k)}$", page, re.M)]
    assert not missing, f"keys missing from the generated config reference: {missing}"


def test_docs_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]' (CI installs it)")
    pytest.importorskip("material", reason="the docs extra is not installed: pip install -e '.[docs]' (CI installs it)")
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    reference = (site / "reference" / "config" / "index.html").read_text()
    missing = [k for k in _printed_keys() if k not in reference]
    assert not missing, f"keys missing from the built config reference: {missing}"
    # Every page under docs/ is in the site (strict mode also fails on a page left out of the nav).
    pages = [p.relative_to(ROOT / "docs") for p in (ROOT / "docs").glob("*.md")]
    assert pages and all((site / p.with_suffix("") / "index.html").exists() or p.name == "index.md" for p in pages)
    assert not (ROOT / "docs" / "reference").exists(), "the generated page must not be written into docs/"
