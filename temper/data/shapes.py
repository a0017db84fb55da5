"""The built-in image task: a coloured shape drawn with Pillow, and a question about it.

Each example is one 64 x 64 picture (a circle, square or triangle in red, green, blue or
yellow, at a random size and place on a grey ground) with the question "shape?" or
"colour?" and the one-word answer. Examples are indexed and drawn from their index, so none
is stored; "train" and "eval" use disjoint index ranges. Guessing scores 1/3 on shapes and
1/4 on colours: about 0.29 over both.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Literal

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
}
QUESTIONS = {"shape?": SHAPES, "colour?": tuple(COLOURS)}
SIZE = 64
_EVAL_OFFSET = 10_000_000

Split = Literal["train", "eval"]


def draw_shape(shape: str, colour: str, seed: int) -> Image.Image:
    """``shape`` in ``colour``, its size and place drawn from ``seed``."""
    rng = random.Random(seed)
    side = rng.randint(28, 52)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    image = Image.new("RGB", (SIZE, SIZE), (128, 128, 128))
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse((x, y, x + side, y + side), fill=fill)
    elif shape == "square":
        pen.rectangle((x, y, x + side, y + side), fill=fill)
    else:
        pen.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def shape_example(
    seed: int, split: Split, index: int
) -> tuple[dict[str, Any], str, tuple[str, ...]]:
    """(picture facts, question, the answers to choose from) of example ``index``; the facts
    hold the answer under ``"answer"`` and a loader of the picture under ``"image"``."""
    i = index + (_EVAL_OFFSET if split == "eval" else 0)
    rng = random.Random(f"temper.shapes:{seed}:{i}")
    shape, colour = rng.choice(SHAPES), rng.choice(tuple(COLOURS))
    question = rng.choice(tuple(QUESTIONS))
    answer = shape if question == "shape?" else colour
    image = functools.partial(draw_shape, shape, colour, rng.getrandbits(32))
    return {"answer": answer, "image": image}, question, QUESTIONS[question]


def shape_conversation(question: str, answer: str | None) -> list[dict[str, Any]]:
    """The user turn (the picture, then the question) and, given one, the answer."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    return [user] if answer is None else [user, {"role": "assistant", "content": answer}]


def shape_records(
    seed: int, split: Split, count: int
) -> list[tuple[str, list[dict[str, Any]], list]]:
    """``count`` (name, messages, image loaders) records of ``split``, as image data reads."""
    records = []
    for i in range(count):
        facts, question, _ = shape_example(seed, split, i)
        records.append(
            (f"shapes:{split}:{i}", shape_conversation(question, facts["answer"]), [facts["image"]])
        )
    return records


class ShapeSource:
    """The task's ``count`` examples of ``split`` as chat records whose image part holds the
    picture, drawn when the record is read (a ``temper.data.sources.Source``)."""

    fields = None

    def __init__(self, seed: int, split: Split, count: int) -> None:
        self.seed = seed
        self.split = split
        self.num_records: int | None = count
        self.name = f"builtin shapes {split}"

    def record(self, index: int) -> dict[str, Any]:
        facts, question, _ = shape_example(self.seed, self.split, index)
        user, answer = shape_conversation(question, facts["answer"])
        picture = {"type": "image", "image": facts["image"]()}
        return {"messages": [{**user, "content": [picture, *user["content"][1:]]}, answer]}

    def where(self, index: int) -> str:
        return f"shapes:{self.split}:{index}"
