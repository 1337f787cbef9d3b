"""Synthetic shapes for a vision-language run a newcomer can watch: each image is one filled circle, square or
triangle in red, green, blue or yellow on a grey background (its size and place random), asked either its colour or
its shape. Writes, as JSON lines with the images inline (base64 PNG, the `images` column):

- sft.jsonl: transcripts (`messages`: the question with an `<image>` placeholder, the one-word answer), a
  `--sft-noise` share of them answered with a word of the same kind drawn at random: the warm start teaches the
  answer format, and at `--sft-noise 1` nothing of what the images show, which GRPO then has to learn;
- train.jsonl, and eval_colour.jsonl / eval_shape.jsonl (one kind of question each): prompts (`prompt`) with the
  answer as `label`.

    python examples/vlm_shapes/prepare_data.py --data-dir outputs/vlm-shapes/data
"""

import argparse
import base64
import io
import json
import os
import random

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": "<image>What colour is the shape? Answer red, green, blue or yellow.",
    "shape": "<image>What shape is it? Answer circle, square or triangle.",
}
SIZE = 56  # pixels each way: 4 image tokens for the tiny Qwen2.5-VL (28 px per token)


def draw(colour, shape, rng):
    grey = rng.randint(90, 160)
    image = Image.new("RGB", (SIZE, SIZE), (grey, grey, grey))
    side = rng.randint(24, 44)
    x, y = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    box = (x, y, x + side - 1, y + side - 1)
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def examples(n, rng, noise=0.0, kinds=tuple(QUESTIONS)):
    for _ in range(n):
        colour, shape, kind = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(kinds)
        answer, choices = (colour, list(COLOURS)) if kind == "colour" else (shape, list(SHAPES))
        if rng.random() < noise:
            answer = rng.choice(choices)
        yield QUESTIONS[kind], answer, draw(colour, shape, rng)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--sft", type=int, default=2000, help="SFT transcripts")
    parser.add_argument("--sft-noise", type=float, default=0.5, help="share of SFT answers drawn at random")
    parser.add_argument("--train", type=int, default=2000, help="RL prompts")
    parser.add_argument("--eval", type=int, default=64, help="eval prompts of each kind")
    parser.add_argument("--questions", default="colour,shape", help="the kinds of question asked, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = tuple(args.questions.split(","))
    if not kinds or any(k not in QUESTIONS for k in kinds):
        parser.error(f"--questions {args.questions!r}: use some of {', '.join(QUESTIONS)}")
    os.makedirs(args.data_dir, exist_ok=True)
    with open(os.path.join(args.data_dir, "sft.jsonl"), "w") as f:
        for question, answer, image in examples(args.sft, rng, args.sft_noise, kinds):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages, "images": [image]}) + "\n")
    splits = [("train", args.train, kinds)] + [(f"eval_{kind}", args.eval, (kind,)) for kind in kinds]
    for name, n, asked in splits:
        with open(os.path.join(args.data_dir, f"{name}.jsonl"), "w") as f:
            for question, answer, image in examples(n, rng, 0.0, asked):
                row = {"prompt": [{"role": "user", "content": question}], "images": [image], "label": answer}
                f.write(json.dumps(row) + "\n")
    print(
        f"wrote {args.sft} SFT transcripts, {args.train} train and {args.eval} eval prompts a kind to {args.data_dir}"
    )


if __name__ == "__main__":
    main()
