"""The default rollout-buffer generator (TASK_TYPE "math"): single-turn chat completions, rule reward, GRPO groups.

For every prompt of `input_file` (jsonl; `prompt` = chat messages or a string, `label` = answer) it asks the engine
`num_repeat_per_sample` times through `{remote_engine_url}/v1/chat/completions` (the sglang-router or any
OpenAI-compatible server), scores the answer with slime's rm_hub (`rm_type`, default deepscaler), and POSTs
`{uid, instance_id, messages, reward, extra_info}` to `{remote_buffer_url}/buffer/write`.
Copy this file to write a generator for another task: change TASK_TYPE and the functions below.
"""

import argparse
import asyncio
import json
import time
import uuid

import aiohttp

from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample

TASK_TYPE = "math"
REQUEST_TIMEOUT_S = 600


def read_prompts(input_file, input_key="prompt", label_key="label"):
    rows = []
    with open(input_file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if input_key not in item:
                raise KeyError(f"{input_file}:{lineno} has no {input_key!r} key (keys: {sorted(item)})")
            prompt = item[input_key]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            rows.append({"messages": messages, "label": item.get(label_key)})
    return rows


async def query_chat(session, engine_url, messages, sampling_params, retries=3):
    """(content, finish_reason) of one chat completion; retries transient errors, then raises naming the URL."""
    url = engine_url.rstrip("/") + "/v1/chat/completions"
    body = {"model": "default", "messages": messages, **sampling_params}
    for attempt in range(retries):
        try:
            async with session.post(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{url} answered HTTP {resp.status}: {(await resp.text())[:300]}")
                out = await resp.json()
            choice = out["choices"][0]
            return choice["message"]["content"] or "", choice.get("finish_reason") or "stop"
        except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
            if attempt == retries - 1:
                raise
            await asyncio.sleep(1.0)


async def reward_func(rm_type, response, label):
    """Score with slime's rule graders (the same code the trainer-side rollout uses)."""
    rm_args = argparse.Namespace(rm_type=rm_type, custom_rm_path=None, rm_url=None, reward_key=None)
    return float(await async_rm(rm_args, Sample(prompt="", response=response, label=label)))


class BaseGenerator:
    def __init__(
        self,
        remote_engine_url,
        remote_buffer_url,
        num_repeat_per_sample=1,
        num_process=10,
        task_type=TASK_TYPE,
        max_tokens=4096,
        sampling_params=None,
        skip_instance_ids=None,
        rm_type="deepscaler",
    ):
        self.remote_engine_url = remote_engine_url
        self.remote_buffer_url = remote_buffer_url.rstrip("/") + "/buffer/write"
        self.num_repeat_per_sample = int(num_repeat_per_sample)
        self.num_process = int(num_process)  # concurrent requests (slime used that many worker processes)
        self.task_type = task_type
        self.sampling_params = {"max_tokens": int(max_tokens), **(sampling_params or {})}
        self.skip_instance_ids = set(map(str, skip_instance_ids or []))
        self.rm_type = rm_type

    async def rollout_one(self, session, instance_id, row) -> dict:
        content, finish_reason = await query_chat(
            session, self.remote_engine_url, row["messages"], self.sampling_params
        )
        reward = await reward_func(self.rm_type, content, row["label"])
        return {
            "uid": str(uuid.uuid4()),
            "instance_id": instance_id,
            "messages": row["messages"] + [{"role": "assistant", "content": content}],
            "reward": reward,
            "extra_info": {"finish_reason": finish_reason, "label": row["label"], "timestamp": time.time()},
        }

    async def send_to_buffer(self, session, record):
        async with session.post(self.remote_buffer_url, json=record) as resp:
            if resp.status != 200:
                raise RuntimeError(
                    f"{self.remote_buffer_url} answered HTTP {resp.status}: {(await resp.text())[:300]}"
                )

    async def entry(self, input_file, num_epoch=1, input_key="prompt", label_key="label"):
        rows = read_prompts(input_file, input_key, label_key)
        # instance ids are integers, unique across epochs, so they double as slime sample-group indices
        jobs = [
            (epoch * len(rows) + i, row)
            for epoch in range(int(num_epoch))
            for i, row in enumerate(rows)
            if str(epoch * len(rows) + i) not in self.skip_instance_ids
        ]
        sem = asyncio.Semaphore(self.num_process)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:

            async def one(instance_id, row):
                async with sem:
                    record = await self.rollout_one(session, instance_id, row)
                    await self.send_to_buffer(session, record)

            # Repeats of one prompt are submitted together so groups complete in prompt order.
            await asyncio.gather(*(one(iid, row) for iid, row in jobs for _ in range(self.num_repeat_per_sample)))


def run_rollout(data: dict):
    """Entry point called by the buffer server's /start_rollout (in a background thread)."""
    generator = BaseGenerator(
        data["remote_engine_url"],
        data["remote_buffer_url"],
        num_repeat_per_sample=data.get("num_repeat_per_sample", 1),
        num_process=data.get("num_process", 10),
        task_type=data.get("task_type", TASK_TYPE),
        max_tokens=data.get("max_tokens", 4096),
        sampling_params=data.get("sampling_params"),
        skip_instance_ids=data.get("skip_instance_ids"),
        rm_type=data.get("rm_type") or "deepscaler",
    )
    asyncio.run(
        generator.entry(
            data["input_file"],
            data.get("num_epoch", 1),
            data.get("input_key") or "prompt",
            data.get("label_key") or "label",
        )
    )


def normalize_group_data(group, epsilon=1e-8, algo="grpo"):
    """GRPO within a group: reward -> (r - mean) / (std + eps) (population std); the raw reward is kept."""
    if algo != "grpo":
        raise ValueError(f"normalize_group_data supports algo='grpo' only, got {algo!r}")
    instance_id, samples = group
    rewards = [float(s["reward"]) for s in samples]
    bad = [r for r in rewards if not 0.0 <= r <= 1.0]
    if bad:
        raise ValueError(
            f"group {instance_id}: rewards {bad} are outside [0, 1]; normalize_group_data expects 0/1 scores"
        )
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    for s, r in zip(samples, rewards):
        s["raw_reward"] = r
        s.setdefault("extra_info", {})["raw_reward"] = r
        s["reward"] = (r - mean) / (std + epsilon)
    return instance_id, samples


def is_valid_group(group, min_valid_group_size, task_type):
    """Ready when the group is full and every answer is non-empty."""
    _instance_id, samples = group
    return len(samples) >= min_valid_group_size and all(s["messages"][-1]["content"].strip() for s in samples)


def transform_group(group, task_type):
    return normalize_group_data(group)
