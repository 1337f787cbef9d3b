"""The run script's recipe in plain transformers, without slime: the same SFT warm start, then GRPO (8 sampled answers
per question, group-normalised rewards, the clipped PPO loss averaged per answer, two Adam steps of 32 answers per
rollout) with `model.generate` as the engine. A yardstick for the slime run's curve: if this climbs and slime's does
not (or the other way round), the difference is in slime. Slower than the slime run (one image at a time).

    python examples/vlm_shapes/reference_transformers.py --data-dir outputs/vlm-shapes/data
"""

import argparse
import base64
import glob
import io
import json
import os
import random

import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration

from examples.vlm_shapes.reward import SPECIAL
from slime.utils.processing_utils import load_processor


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--model-dir", default="models/qwen2.5-vl-tiny")
    parser.add_argument("--sft-size", type=int, default=800, help="SFT transcripts, one pass, 32 a step")
    parser.add_argument("--num-rollout", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3, help="GRPO's (SFT's is 3e-3, as in the run script)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    processor = load_processor(args.model_dir)
    tokenizer = processor.tokenizer
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|image_pad|>"])

    def rows(name):
        with open(os.path.join(args.data_dir, name)) as f:
            return [json.loads(line) for line in f]

    def prompt(question, image_b64):
        content = [{"type": "image"}, {"type": "text", "text": question.replace("<image>", "")}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        image = Image.open(io.BytesIO(base64.b64decode(image_b64))).convert("RGB")
        return processor(text=[text], images=[image], return_tensors="pt")

    def log_probs(inputs, response):
        ids = torch.cat([inputs["input_ids"], torch.tensor([response])], 1)
        logits = model(
            input_ids=ids, pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
        ).logits[0, inputs["input_ids"].shape[1] - 1 : -1]
        return logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]

    def step(optimizer, loss):
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def sample(inputs, n):
        with torch.no_grad():
            out = model.generate(
                **inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=8,
                num_return_sequences=n, eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
        return [
            seq[: seq.index(eos) + 1] if eos in seq else seq for seq in out[:, inputs["input_ids"].shape[1] :].tolist()
        ]

    def reward(response, label):
        return float(SPECIAL.sub("", tokenizer.decode(response)).strip().lower() == label.lower())

    sft = rows("sft.jsonl")[: args.sft_size]
    rng.shuffle(sft)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.98))
    for i in range(0, len(sft), 32):
        loss = 0
        for row in sft[i : i + 32]:
            answer = tokenizer(row["messages"][1]["content"])["input_ids"] + [eos]
            loss = loss - log_probs(prompt(row["messages"][0]["content"], row["images"][0]), answer).sum()
        step(
            optimizer,
            loss / sum(len(tokenizer(r["messages"][1]["content"])["input_ids"]) + 1 for r in sft[i : i + 32]),
        )

    evals = {
        os.path.basename(p)[5:-6]: rows(os.path.basename(p))
        for p in sorted(glob.glob(f"{args.data_dir}/eval_*.jsonl"))
    }

    def evaluate(rollout):
        for kind, eval_rows in evals.items():
            right = [
                reward(r, row["label"])
                for row in eval_rows
                for r in sample(prompt(row["prompt"][0]["content"], row["images"][0]), 4)
            ]
            print(f"rollout {rollout} eval/{kind} {sum(right) / len(right):.4f}", flush=True)

    train = rows("train.jsonl")
    rng.shuffle(train)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.99))
    evaluate(0)
    for rollout in range(args.num_rollout):
        answers, rewarded = [], []
        for row in train[rollout * 8 : (rollout + 1) * 8]:
            inputs = prompt(row["prompt"][0]["content"], row["images"][0])
            responses = sample(inputs, 8)
            rewards = torch.tensor([reward(r, row["label"]) for r in responses])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            rewarded += rewards.tolist()
            # transformers cannot score an answer holding an image pad (it counts it as an image token); slime can
            answers += [
                (inputs, r, a.item(), log_probs(inputs, r).detach())
                for r, a in zip(responses, advantages)
                if pad not in r
            ]
        print(f"rollout {rollout} raw_reward {sum(rewarded) / len(rewarded):.4f}", flush=True)
        for half in filter(None, (answers[: len(answers) // 2], answers[len(answers) // 2 :])):
            loss = 0
            for inputs, response, advantage, old in half:
                ratio = (log_probs(inputs, response) - old).exp()
                loss = loss + torch.max(-ratio * advantage, -ratio.clamp(0.8, 1.28) * advantage).mean()
            step(optimizer, loss / len(half))
        if (rollout + 1) % 5 == 0:  # as slime's --eval-interval 5: after rollouts 4, 9, ...
            evaluate(rollout)


if __name__ == "__main__":
    main()
