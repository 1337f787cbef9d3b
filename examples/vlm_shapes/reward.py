"""The shapes task's reward: 1.0 when the answer, without chat special tokens and surrounding space, is the label."""

import re

SPECIAL = re.compile(r"<\|[^|<>]*\|>")


async def reward_func(args, sample, **kwargs):
    return float(SPECIAL.sub("", sample.response or "").strip().lower() == str(sample.label).lower())
