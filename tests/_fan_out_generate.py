"""A fan-out generate function for the tests (importable by dotted path): one engine call per prompt sample, returned
as 1 + index % 3 identical siblings sharing the sample's rollout id, as current slime's multi-agent example returns
one sample per agent call."""

import copy

from slime.rollout.sglang_rollout import generate as generate_one


async def generate(args, sample, sampling_params):
    done = await generate_one(args, sample, sampling_params)
    siblings = [copy.deepcopy(done) for _ in range(1 + sample.index % 3)]
    for s in siblings:
        s.rollout_id = sample.index
    return siblings
