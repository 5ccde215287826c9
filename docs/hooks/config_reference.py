"""MkDocs hook: writes the configuration reference page at build time from the config dataclasses'
attribute docstrings, through the same walk that ``async-rl config --keys`` prints
(``async_rl.commands.describe_keys``), so the page cannot drift from the code. Nothing is written
into the repository: the page exists only in the build."""

from __future__ import annotations

PAGE = "reference/config.md"


def _md(doc: str) -> str:
    # Docstrings are reST (``code``); Markdown wants `code`.
    return doc.replace("``", "`")


def render() -> str:
    """The page's Markdown: one section per config section, one entry per key."""
    from async_rl.commands import _inline, describe_keys, to_plain

    keys = describe_keys()
    lines = [
        "# Configuration reference",
        "",
        "Every key of the config tree: its type, schema default and meaning. Generated when the site is",
        "built, from the dataclasses' docstrings, by the walk that `async-rl config --keys` prints; set a key",
        "in a YAML file or as a dotted override (`async-rl train --config FILE section.key=value`). See",
        "[configuration](../configuration.md) for how configs load and are checked.",
        "",
    ]
    for d in keys:
        if d.is_section:
            depth = d.key.count(".") + 2
            lines += [f"{'#' * min(depth, 6)} {d.key}", "", _md(d.doc), ""]
            continue
        default = _inline(to_plain(d.default))
        lines += [
            f"`{d.key}`",
            f":   type `{d.type}`, default `{default}`",
            "",
        ]
        for para in _md(d.doc).split("\n\n") if d.doc else []:
            lines += ["    " + " ".join(para.split()), ""]
    return "\n".join(lines) + "\n"


def on_files(files, config):
    """MkDocs' ``on_files`` event: add the page, generated, to the build's files."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
