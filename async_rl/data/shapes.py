"""The built-in image task ``builtin:shapes``: questions about a few flat shapes in a small picture.

Each picture (``draw_scene``) is a plain light background of 56 or 84 pixels a side (2 or 3
cells of 28 pixels, the tiny Qwen2-VL's merged patch: 4 to 9 image tokens) holding 1 to 4
filled shapes of one kind (circle, square or triangle) and one colour (red, green, blue or
yellow), each inside its own cell (jittered, 14 to 22 pixels across), so no two shapes touch
and each image token sees at most one shape: counting is counting the non-background tokens,
the colour and the kind are what any shape's token sees. A tiny vision tower (two blocks) can
learn all three from a few hundred steps; questions that bind a word to one of several shapes
("what colour is the circle?") it does not learn in a thousand supervised steps here.

Three kinds of question, drawn in turn (``SHAPES_SPEC["questions"]``), each answered by one
word::

    <image>How many shapes?            -> "1" .. "4"
    <image>What colour are the shapes? -> "red", "green", "blue", "yellow"
    <image>Which shape is drawn?       -> "circle", "square", "triangle"

Question kinds and their answers take turns (row ``i``: kind ``i % 3``, then the next answer
of that kind) and the scene is drawn with that answer, so each answer is equally frequent
given its kind: a guess that ignores the picture scores at best 1/4 on counts, 1/4 on colours
and 1/3 on shapes, about 28% overall (``blind_accuracy`` measures it on a split). The reward is
an exact, case-insensitive word match (``async_rl.rewards.shapes``).

The test split is drawn from its own seed, and any (picture, question) pair that also occurs in
the train split is drawn again, so the held-out accuracy is on pairs never trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from pathlib import Path
from typing import Any

# The pictures and questions are the shapes world's (the multi-turn environment draws its own).
from async_rl.envs.shapes import (CELL, COLOURS, KINDS, QUESTIONS, SHAPES_DATA_SOURCE, SHAPES_SPEC,  # noqa: F401
                                  ask, draw_scene, render_png)

def make_shapes_row(png: bytes, question: str, answer: str, kind: str, split: str, index: int) -> dict[str, Any]:
    """One verl-layout row: the picture in ``images``, ``<image>`` before the question in the user
    message, the one-word answer as ``reward_model.ground_truth`` and ``extra_info.answer`` (the
    supervised warm start's target)."""
    return {
        "prompt": [{"role": "user", "content": f"<image>{question}"}],
        # Hugging Face's Image feature layout; the name only labels the bytes, which are read first.
        "images": [{"bytes": png, "path": f"{split}-{index}.png"}],
        "data_source": SHAPES_DATA_SOURCE,
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer, "question_type": kind},
    }


def shapes_rows(num: int, seed: int, split: str, exclude: set[str] | None = None,
                spec: dict[str, Any] = SHAPES_SPEC) -> tuple[list[dict[str, Any]], set[str]]:
    """``num`` rows drawn from ``seed`` and the keys (sha256 of picture and question) of their pairs;
    a pair whose key is in ``exclude`` is drawn again."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    keys: set[str] = set()
    exclude = exclude or set()
    answers = {"count": [str(n) for n in range(spec["min_shapes"], spec["max_shapes"] + 1)],
               "colour": sorted(COLOURS), "shape": list(KINDS)}
    while len(rows) < num:
        # Question kinds and answers in turn, not at random: every answer equally often in each
        # split (a 200-row split drawn at random can favour one count by several points).
        i = len(rows)
        kind = spec["questions"][i % len(spec["questions"])]
        target = answers[kind][(i // len(spec["questions"])) % len(answers[kind])]
        fixed = {"count": int(target)} if kind == "count" else {"colour": target} if kind == "colour" else {"kind": target}
        scene = draw_scene(rng, spec, **fixed)
        qa = ask(scene, kind)
        png = render_png(scene)
        key = hashlib.sha256(png + b"\0" + qa[0].encode()).hexdigest()
        if key in exclude:
            continue
        keys.add(key)
        rows.append(make_shapes_row(png, qa[0], qa[1], kind, split, len(rows)))
    return rows, keys


def build_shapes(out_dir: Path, spec: dict[str, Any] = SHAPES_SPEC) -> None:
    """Write ``train.parquet`` and ``test.parquet`` (verl layout, ``images`` a list of
    ``{"bytes", "path"}`` structs, PNG bytes) to ``out_dir``; the test split holds no
    (picture, question) pair of the train split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train, train_keys = shapes_rows(spec["num_train"], spec["train_seed"], "train", spec=spec)
    test, _ = shapes_rows(spec["num_test"], spec["test_seed"], "test", exclude=train_keys, spec=spec)
    for split, rows in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(rows), Path(out_dir) / f"{split}.parquet")


def blind_accuracy(rows: list[dict[str, Any]], fit_rows: list[dict[str, Any]] | None = None) -> float:
    """The accuracy on ``rows`` of the best guess that sees the question text but not the picture:
    each question answered with its most frequent answer in ``fit_rows`` (default ``rows``), the
    floor a policy that learned to look must beat. Fit on the train split and scored on the test
    split, it is what a policy that ignores the picture can reach on held-out questions."""
    by_question: dict[str, Counter] = {}
    for row in fit_rows if fit_rows is not None else rows:
        by_question.setdefault(row["prompt"][0]["content"], Counter())[row["reward_model"]["ground_truth"]] += 1
    guess = {q: c.most_common(1)[0][0] for q, c in by_question.items()}
    hits = sum(guess.get(row["prompt"][0]["content"]) == row["reward_model"]["ground_truth"] for row in rows)
    return hits / max(1, len(rows))
