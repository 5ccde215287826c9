"""The shapes world: small pictures of flat shapes, questions about them, and ``shapes_dialogue``,
a multi-turn environment whose observations are pictures (a built-in environment).

A scene (``draw_scene``) is a plain light background of 2 or 3 cells of 28 pixels a side (the
tiny Qwen2-VL's merged patch) holding 1 to 4 filled shapes of one kind and one colour, one per
cell; ``ask`` puts one of three questions to it (how many, what colour, which shape), each
answered by one word. ``builtin:shapes`` (``async_rl.data.shapes``) draws its rows from here.

``shapes_dialogue`` (``ShapesDialogue``) starts from a ``builtin:shapes`` row: the model answers
the row's question about the row's picture; the environment then shows a new picture (an image
in its observation) and asks the same kind of question about it, ``turns`` pictures in all.
Each right answer earns ``1 / turns``; ``acc`` is 1 when every answer was right. The pictures
after the first are drawn from the episode's seed, so the episodes of a group see the same ones.
"""

from __future__ import annotations

import io
import random
from typing import Any

from async_rl.envs.base import Environment, EnvStep, Task
from async_rl.rewards.shapes import shapes_reward

SHAPES_DATA_SOURCE = "async_rl/shapes"

CELL = 28
"""Side of one grid cell, pixels: the tiny Qwen2-VL's merged patch (2 x 14-pixel patches)."""

COLOURS: dict[str, tuple[int, int, int]] = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (40, 60, 220),
                                            "yellow": (235, 200, 20)}
"""Colour names (the answers) and their RGB fills: far apart, and from the light background."""

KINDS = ("circle", "square", "triangle")
"""Shape names (the answers)."""

SHAPES_SPEC: dict[str, Any] = {
    "grid_sides": [2, 3],  # cells per side: 56x56 or 84x84 pixels
    "min_shapes": 1,
    "max_shapes": 4,
    "min_size": 14,  # a shape's bounding box, pixels
    "max_size": 22,
    "background": [225, 255],  # grey level range of the plain background
    "questions": ["count", "colour", "shape"],  # in turn, each kind's answers in turn (balanced)
    "revision": 3,  # of the drawing code: a change the fields above do not capture rebuilds the splits
    "num_train": 2000,
    "num_test": 200,
    "train_seed": 0,
    "test_seed": 1,
}
"""``builtin:shapes``: picture and question law, split sizes and seeds; part of the artefact's
cache key (a change rebuilds it)."""


def draw_scene(rng: random.Random, spec: dict[str, Any] = SHAPES_SPEC, count: int | None = None,
               kind: str | None = None, colour: str | None = None) -> dict[str, Any]:
    """One random scene: ``{"side": cells per side, "background": grey level, "shapes": [{"kind",
    "colour", "cell": (row, col), "box": (x0, y0, x1, y1)}]}``, shapes in distinct cells, all of
    one kind and one colour; ``count``, ``kind`` and ``colour`` fix those (else drawn)."""
    side = rng.choice(spec["grid_sides"])
    n = count if count is not None else rng.randint(spec["min_shapes"], min(spec["max_shapes"], side * side))
    kind = kind if kind is not None else rng.choice(KINDS)
    colour = colour if colour is not None else rng.choice(sorted(COLOURS))
    cells = rng.sample([(r, c) for r in range(side) for c in range(side)], n)
    shapes = []
    for r, c in sorted(cells):
        size = rng.randint(spec["min_size"], spec["max_size"])
        x0 = c * CELL + rng.randint(1, CELL - size - 1)
        y0 = r * CELL + rng.randint(1, CELL - size - 1)
        shapes.append({"kind": kind, "colour": colour, "cell": (r, c), "box": (x0, y0, x0 + size, y0 + size)})
    return {"side": side, "background": rng.randint(*spec["background"]), "shapes": shapes}


def render_png(scene: dict[str, Any]) -> bytes:
    """The scene as PNG bytes: an RGB picture of ``side * CELL`` pixels a side."""
    from PIL import Image, ImageDraw

    px = scene["side"] * CELL
    bg = scene["background"]
    img = Image.new("RGB", (px, px), (bg, bg, bg))
    draw = ImageDraw.Draw(img)
    for s in scene["shapes"]:
        x0, y0, x1, y1 = s["box"]
        fill = COLOURS[s["colour"]]
        if s["kind"] == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif s["kind"] == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


QUESTIONS = {"count": "How many shapes?", "colour": "What colour are the shapes?", "shape": "Which shape is drawn?"}
"""The question of each kind (``SHAPES_SPEC["questions"]``)."""


def ask(scene: dict[str, Any], kind: str) -> tuple[str, str]:
    """``(question, answer)`` of the question ``kind`` (``count``, ``colour``, ``shape``) about the scene."""
    shapes = scene["shapes"]
    answer = {"count": str(len(shapes)), "colour": shapes[0]["colour"], "shape": shapes[0]["kind"]}[kind]
    return QUESTIONS[kind], answer


class ShapesDialogue(Environment):
    """The multi-turn picture dialogue of the module docstring, one episode per object.

    Args:
        turns: pictures (and answers) per episode, the row's included (>= 1).

    Raises:
        ValueError: ``turns < 1``; at ``reset``, a row without ``extra_info.question_type`` (one
            of ``QUESTIONS``) or without a ground truth (rows of ``builtin:shapes`` have both).
    """

    def __init__(self, turns: int = 2) -> None:
        if int(turns) < 1:
            raise ValueError(f"shapes_dialogue: turns must be >= 1, got {turns}")
        self.turns = int(turns)
        self.turn = self.correct = 0
        self.kind = self.expected = ""
        self.rng = random.Random(0)

    async def reset(self, task: Task, seed: int) -> list[dict[str, Any]]:
        """The row's question about the row's picture (its messages, whose image the request carries)."""
        kind = task.extra_info.get("question_type")
        if kind not in QUESTIONS or not task.ground_truth:
            raise ValueError(f"shapes_dialogue: row {task.uid} needs extra_info.question_type in {sorted(QUESTIONS)} "
                             f"and a ground truth (rows of builtin:shapes), got {kind!r} and {task.ground_truth!r}")
        self.kind, self.expected, self.rng = kind, str(task.ground_truth), random.Random(seed)
        return list(task.messages)

    async def step(self, action: str) -> EnvStep:
        """Score the answer; show the next picture with its question, or end after ``turns``."""
        hit = shapes_reward(SHAPES_DATA_SOURCE, action, self.expected, None)["acc"]
        self.turn += 1
        self.correct += int(hit)
        if self.turn >= self.turns:
            return EnvStep([], hit / self.turns, True, {"acc": float(self.correct == self.turns), "correct_turns": hit})
        scene = draw_scene(self.rng)
        question, self.expected = ask(scene, self.kind)
        picture = [{"type": "image", "image": render_png(scene)}, {"type": "text", "text": question}]
        return EnvStep([{"role": "user", "content": picture}], hit / self.turns, False, {"correct_turns": hit})
