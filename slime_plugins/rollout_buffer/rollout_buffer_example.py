"""A slime rollout function that trains on trajectories from the rollout buffer server.

    --rollout-function-path slime_plugins.rollout_buffer.rollout_buffer_example.generate_rollout
    --rollout-buffer-url http://127.0.0.1:8889 --rollout-task-type math --loss-mask-type qwen
    --disable-rewards-normalization        # the generator already normalised rewards within each group

The first call asks the buffer to start the generator for `--rollout-task-type` on `--prompt-data` against slime's
router; every call then polls `/get_rollout_data` until enough complete groups arrived, tokenises each trajectory's
chat with a loss mask on the assistant turns, and returns `--rollout-batch-size` groups (newest first; extra groups
stay in slime's data buffer for the next call). Evaluation is not implemented.
"""

import time
from collections import defaultdict

import httpx

from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.types import Sample

__all__ = ["generate_rollout"]

POLL_INTERVAL_S = 1.0
HTTP_TIMEOUT_S = 60.0
RECORD_KEYS = ("uid", "instance_id", "messages", "reward", "extra_info")

_state = {"started": False, "tokenizer": None, "mask_generator": None}


def _post(url, payload):
    try:
        resp = httpx.post(url, json=payload, timeout=HTTP_TIMEOUT_S, trust_env=False)
    except httpx.HTTPError as e:
        raise ConnectionError(
            f"rollout buffer at {url} unreachable ({type(e).__name__}: {e}); is buffer.py running "
            f"there (--rollout-buffer-url)?"
        ) from e
    return resp


def start_rollout(api_base_url, args, metadata):
    """POST /start_rollout: run the generator of `--rollout-task-type`, skipping groups already trained on."""
    finished = [iid for ids in (metadata or {}).values() if isinstance(ids, list) for iid in ids]
    payload = {
        # Not a slime flag: a job's own arguments (add_custom_arguments) may add --rollout-num-process.
        "num_process": str(getattr(args, "rollout_num_process", None) or 100),
        "num_epoch": str(args.num_epoch or 3),
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": args.rollout_buffer_url,
        "task_type": args.rollout_task_type,
        "input_file": args.prompt_data,
        "input_key": args.input_key,
        "label_key": args.label_key,
        "num_repeat_per_sample": str(args.n_samples_per_prompt),
        "max_tokens": str(args.rollout_max_response_len),
        "sampling_params": {
            "max_tokens": args.rollout_max_response_len,
            "temperature": args.rollout_temperature,
            "top_p": args.rollout_top_p,
        },
        "rm_type": args.rm_type,
        "tokenizer_path": args.hf_checkpoint,
        "skip_instance_ids": finished,
    }
    resp = _post(f"{api_base_url}/start_rollout", payload)
    if resp.status_code == 409:  # already running (e.g. the controller restarted): keep consuming it
        return resp.json()
    if resp.status_code != 200:
        raise RuntimeError(
            f"{api_base_url}/start_rollout refused task_type {args.rollout_task_type!r} "
            f"(--rollout-task-type): HTTP {resp.status_code} {resp.text[:500]}"
        )
    return resp.json()


def get_rollout_data(api_base_url):
    """One poll of /get_rollout_data -> (records, meta_info, server reply)."""
    resp = _post(f"{api_base_url}/get_rollout_data", {})
    if resp.status_code != 200:
        raise RuntimeError(f"{api_base_url}/get_rollout_data: HTTP {resp.status_code} {resp.text[:500]}")
    reply = resp.json()
    if not reply.get("success"):
        return [], None, reply
    return reply["data"]["data"], reply["data"]["meta_info"], reply


def _group_records(records, n):
    groups = defaultdict(list)
    for i, record in enumerate(records):
        missing = [k for k in RECORD_KEYS if k not in record]
        if missing:
            raise KeyError(f"rollout buffer record {i} lacks {missing} (every record needs {list(RECORD_KEYS)})")
        groups[record["instance_id"]].append(record)
    for instance_id, group in groups.items():
        if len(group) != n:
            raise ValueError(
                f"rollout buffer group {instance_id!r} has {len(group)} trajectories, but "
                f"--n-samples-per-prompt is {n}; the generator's num_repeat_per_sample must match it"
            )
    # newest groups first: they were generated with the most recent weights
    return sorted(groups.values(), key=lambda g: -max(float(r["extra_info"].get("timestamp", 0)) for r in g))


def _to_sample(args, record, position):
    if _state["mask_generator"] is None:
        from transformers import AutoTokenizer  # heavy

        _state["tokenizer"] = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        _state["mask_generator"] = MultiTurnLossMaskGenerator(_state["tokenizer"], tokenizer_type=args.loss_mask_type)
    gen = _state["mask_generator"]
    token_ids, loss_mask = gen.get_loss_mask(record["messages"])
    response_length = gen.get_response_lengths([loss_mask])[0]
    extra = dict(record["extra_info"])
    extra.setdefault("raw_reward", record.get("raw_reward", record["reward"]))
    extra["instance_id"], extra["uid"] = record["instance_id"], record["uid"]
    instance_id = record["instance_id"]
    group_index = instance_id if isinstance(instance_id, int) else None
    return Sample(
        index=group_index * args.n_samples_per_prompt + position if group_index is not None else None,
        group_index=group_index,
        prompt=record["messages"][:-1],
        tokens=list(token_ids),
        response=record["messages"][-1]["content"],
        response_length=response_length,
        label=extra.get("label"),
        reward=record["reward"],
        loss_mask=list(loss_mask[-response_length:]) if response_length else [],
        status=Sample.Status.TRUNCATED if extra.get("finish_reason") == "length" else Sample.Status.COMPLETED,
        metadata=extra,
    )


def generate_rollout(args, rollout_id, data_buffer, evaluation=False):
    if evaluation:
        raise NotImplementedError("the rollout-buffer example has no evaluation; leave --eval-interval unset")
    base_url = args.rollout_buffer_url.rstrip("/")
    if not _state["started"]:
        start_rollout(base_url, args, data_buffer.get_metadata())
        _state["started"] = True

    n = args.n_samples_per_prompt
    need = (args.rollout_batch_size - data_buffer.get_buffer_length()) * n
    retries, records, meta_infos = args.fetch_trajectory_retry_times, [], []
    attempt = 0
    while len(records) < need:
        data, meta, reply = get_rollout_data(base_url)
        records.extend(data)
        if meta:
            meta_infos.append(meta)
        if len(records) >= need:
            break
        if reply.get("generator_error"):
            raise RuntimeError(f"rollout buffer generator failed: {reply['message']}")
        if reply.get("generator_finished") and not reply.get("buffered_samples") and not data:
            raise RuntimeError(
                f"the rollout buffer's generator finished and has no more groups: got {len(records)} of "
                f"{need} trajectories for rollout {rollout_id} (raise num_epoch or lower the batch size)"
            )
        attempt += 1
        if retries != -1 and attempt >= retries:
            raise TimeoutError(
                f"got {len(records)} of {need} trajectories from {base_url} after {attempt} polls "
                f"(--fetch-trajectory-retry-times {retries})"
            )
        time.sleep(POLL_INTERVAL_S)

    groups = [[_to_sample(args, r, j) for j, r in enumerate(g)] for g in _group_records(records, n)]
    finished = [iid for m in meta_infos for iid in m.get("finished_groups", [])]
    data_buffer.update_metadata({str(rollout_id): finished})
    data_buffer.add_samples(groups)
    return data_buffer.get_samples(args.rollout_batch_size)
