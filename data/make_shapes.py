"""Build the built-in visual task in data/shapes/ (seeded: running it again writes the same files).

    python data/make_shapes.py

The task: a 128 x 128 picture of one filled shape (a square, a circle or a triangle) in one of six
colours, of random size and place on a light background, and one of two questions: "What colour is
the shape?" or "What shape is it?", each answered with one word. A fixed random quarter of the
pictures is held out as the test split. The answer is checked by the last word of the reply.

Files (TRL's column conventions, conversational format; `images`: paths relative to the file):
    sft_train.jsonl, sft_test.jsonl          {"messages": [user (image, text), assistant], "images"}
    prompts_train.jsonl, prompts_test.jsonl  {"prompt": [user (image, text)], "answer", "images"}
    images/NNNN.png
"""

import json
import os
import random

from PIL import Image, ImageDraw

SEED, PICTURES, SIZE = 1234, 384, 128
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 210, 40),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape? Answer with one word.",
    "shape": "What shape is it? Answer with one word.",
}


def draw(shape: str, colour: str, rng: random.Random) -> Image.Image:
    grey = rng.randint(225, 255)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = rng.randint(40, 90)
    x, y = rng.randint(4, SIZE - side - 4), rng.randint(4, SIZE - side - 4)
    box, fill, pen = [x, y, x + side, y + side], COLOURS[colour], ImageDraw.Draw(image)
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(x + side // 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def main() -> None:
    rng = random.Random(SEED)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes")
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rows = {"train": [], "test": []}
    test = set(rng.sample(range(PICTURES), PICTURES // 4))
    for i in range(PICTURES):
        shape, colour = SHAPES[i % len(SHAPES)], rng.choice(list(COLOURS))
        path = f"images/{i:04d}.png"
        draw(shape, colour, rng).save(os.path.join(out, path), optimize=True)
        kind = rng.choice(list(QUESTIONS))
        user = {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[kind]}],
        }
        answer = colour if kind == "colour" else shape
        rows["test" if i in test else "train"].append((user, answer, path))
    for split, items in rows.items():
        with open(os.path.join(out, f"sft_{split}.jsonl"), "w") as f:
            for user, answer, path in items:
                messages = [user, {"role": "assistant", "content": answer}]
                f.write(json.dumps({"messages": messages, "images": [path]}) + "\n")
        with open(os.path.join(out, f"prompts_{split}.jsonl"), "w") as f:
            for user, answer, path in items:
                f.write(json.dumps({"prompt": [user], "answer": answer, "images": [path]}) + "\n")
    print(
        f"wrote {PICTURES} pictures: {len(rows['train'])} train, {len(rows['test'])} test, in {out}"
    )


if __name__ == "__main__":
    main()
