"""Rollout-buffer plugin: BufferQueue rules, the FastAPI endpoints, and a CPU end-to-end run.

End to end: slime's CPU inference server (tiny Qwen3) behind the real sglang-router, the buffer server started with
`python -m slime_plugins.rollout_buffer.buffer`, the base "math" generator, and `rollout_buffer_example.generate_rollout`
feeding a real RolloutDataSourceWithBuffer.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from slime.utils.process_utils import die_with_parent
from slime.utils.types import Sample
from slime_plugins.rollout_buffer.buffer import BufferQueue, create_app, discover_generators
from slime_plugins.rollout_buffer.generator import base_generator
from tests._args import make_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _item(iid, reward, content="7"):
    return {
        "uid": f"u{iid}-{reward}-{content}",
        "instance_id": iid,
        "reward": reward,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}],
        "extra_info": {"timestamp": time.time()},
    }


def test_buffer_queue_groups_and_meta():
    q = BufferQueue(group_size=2)
    q.append(_item(0, 1.0))
    q.append(_item(1, 0.0))
    assert q.get()["data"] == [] and len(q) == 2  # no group is complete yet
    q.append(_item(0, 0.0))
    out = q.get()
    assert [d["instance_id"] for d in out["data"]] == [0, 0]
    assert out["meta_info"] == {
        "total_samples": 2,
        "num_groups": 1,
        "avg_group_size": 2.0,
        "avg_reward": 0.5,
        "finished_groups": [0],
        "dropped_groups": 0,
    }
    assert len(q) == 1  # group 1 is still waiting
    with pytest.raises(ValueError, match="instance_id"):
        q.append({"reward": 1.0})


def test_base_generator_rules():
    # GRPO inside a group, population std: rewards [1, 0, 0, 1] -> mean 0.5, std 0.5 -> [1, -1, -1, 1]
    group = (3, [_item(3, r) for r in (1.0, 0.0, 0.0, 1.0)])
    _, samples = base_generator.normalize_group_data(group)
    assert [round(s["reward"], 6) for s in samples] == [1.0, -1.0, -1.0, 1.0]
    assert [s["extra_info"]["raw_reward"] for s in samples] == [1.0, 0.0, 0.0, 1.0]
    # all-equal rewards: std 0 -> every advantage 0 (eps keeps it finite)
    _, same = base_generator.normalize_group_data((4, [_item(4, 1.0) for _ in range(3)]))
    assert [s["reward"] for s in same] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="outside"):
        base_generator.normalize_group_data((5, [_item(5, 2.0)]))
    # a full group with an empty answer is invalid, and the queue drops it instead of waiting forever
    q = BufferQueue(2, is_valid_group_func=base_generator.is_valid_group)
    q.append(_item(6, 1.0, content="  "))
    q.append(_item(6, 1.0))
    out = q.get()
    assert out["data"] == [] and out["meta_info"]["dropped_groups"] == 1 and len(q) == 0


def test_generator_discovery(tmp_path):
    assert discover_generators()["math"].TASK_TYPE == "math"
    (tmp_path / "echo_gen.py").write_text("TASK_TYPE = 'echo'\ndef run_rollout(data):\n    pass\n")
    (tmp_path / "helper.py").write_text("X = 1\n")  # no TASK_TYPE: not a generator
    found = discover_generators((str(tmp_path),))
    assert sorted(found) == ["echo"]
    (tmp_path / "echo2.py").write_text("TASK_TYPE = 'echo'\ndef run_rollout(data):\n    pass\n")
    with pytest.raises(ValueError, match="both declare TASK_TYPE='echo'"):
        discover_generators((str(tmp_path),))


GENERATOR_WITH_HOOKS = """
TASK_TYPE = "tagged"
SEEN = []


def run_rollout(data):
    pass


def is_valid_group(group, min_size, task_type):
    instance_id, samples = group
    SEEN.append((instance_id, min_size, task_type))
    return instance_id % 2 == 0 and len(samples) >= min_size  # odd instances are never valid


def transform_group(group, task_type):
    instance_id, samples = group
    return instance_id, [dict(s, tag=f"{task_type}:{instance_id}") for s in samples]


def get_group_data_meta_info(temp_data):
    return {"custom": {iid: [s["tag"] for s in samples] for iid, samples in temp_data.items()}}
"""


def test_a_generators_optional_hooks_are_used_by_the_buffer(tmp_path):
    """docs/customization.md: a generator module may define is_valid_group, transform_group and
    get_group_data_meta_info; the buffer of its TASK_TYPE uses them in place of the defaults."""
    from slime_plugins.rollout_buffer.buffer import RolloutBuffer

    (tmp_path / "tagged_gen.py").write_text(GENERATOR_WITH_HOOKS)
    buffer = RolloutBuffer(1, "tagged", (str(tmp_path),))
    module = buffer.generators["tagged"]
    buffer.queue.append(_item(4, 1.0))
    buffer.queue.append(_item(3, 0.0))
    out = buffer.queue.get()
    assert [(d["instance_id"], d["tag"]) for d in out["data"]] == [(4, "tagged:4")]  # transformed, odd one rejected
    assert out["meta_info"] == {"custom": {4: ["tagged:4"]}, "finished_groups": [4], "dropped_groups": 1}
    assert sorted(module.SEEN) == [(3, 1, "tagged"), (4, 1, "tagged")]
    # another task type's buffer keeps the defaults
    other = RolloutBuffer(1, "math", (str(tmp_path),))
    other.queue.append(_item(3, 0.5))
    out = other.queue.get()
    assert "tag" not in out["data"][0] and out["meta_info"]["avg_reward"] == 0.5 and "custom" not in out["meta_info"]


def test_endpoints(tmp_path):
    from fastapi.testclient import TestClient

    (tmp_path / "writer.py").write_text(
        "import httpx\nTASK_TYPE = 'writer'\ndef run_rollout(data):\n    raise RuntimeError('engine exploded')\n"
    )
    client = TestClient(create_app(group_size=2, generator_dirs=(str(tmp_path),)))
    r = client.post("/get_rollout_data", json={})
    assert r.status_code == 200 and r.json()["success"] is False
    assert client.post("/buffer/write", json={"reward": 1}).status_code == 400
    for reward in (1.0, 0.0):
        assert client.post("/buffer/write", json=_item(9, reward)).json()["success"]
    body = client.post("/get_rollout_data", json={}).json()
    assert body["success"] and len(body["data"]["data"]) == 2 and body["data"]["meta_info"]["finished_groups"] == [9]
    bad = client.post("/start_rollout", json={"task_type": "nope"})
    assert bad.status_code == 400 and "writer" in bad.json()["message"]
    assert client.post("/start_rollout", json={"task_type": "writer", "num_repeat_per_sample": 2}).json()["success"]
    # wait for the generator thread's end, not its error: the error is set first and `finished` only after the
    # error's print, so a poll that saw the error could still read generator_finished False on a loaded machine
    deadline = time.time() + 60
    while not client.app.state.buffer.rollout_finished and time.time() < deadline:
        time.sleep(0.05)
    body = client.post("/get_rollout_data", json={}).json()
    assert body["success"] is False and "engine exploded" in body["message"] and body["generator_finished"]


# ---------------------------------------------------------------------------------------------- end to end (CPU)


def _wait_http(url, proc, what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not answer {url} within {timeout}s")


@pytest.fixture()
def processes():
    procs = []

    def start(cmd, log):
        p = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
        )
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def _answer_match(response, label):  # written out here, independent of rm_hub
    m = re.match(r"\s*(-?\d+)", response)
    return 1.0 if m and int(m.group(1)) == int(label) else 0.0


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
@pytest.mark.skipif(importlib.util.find_spec("slime.utils.mask_utils") is None, reason="mask_utils not written yet")
@pytest.mark.timeout(300)
def test_end_to_end_cpu(tiny_kit, tmp_path, processes):
    from transformers import AutoTokenizer

    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.utils.http_utils import free_port
    from slime_plugins.rollout_buffer import rollout_buffer_example as example

    model_dir, data_dir = tiny_kit
    prompts = tmp_path / "prompts.jsonl"
    with open(os.path.join(data_dir, "train.jsonl")) as f:
        prompts.write_text("".join(f.readlines()[:3]))
    log = open(tmp_path / "servers.log", "w")
    base = free_port(4)
    server_port, router_port, metrics_port, buffer_port = base, base + 1, base + 2, base + 3
    server = processes(
        [
            sys.executable,
            "-m",
            "slime.backends.cpu_server",
            "--model-path",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(server_port),
            "--random-seed",
            "1",
        ],
        log,
    )
    _wait_http(f"http://127.0.0.1:{server_port}/health", server, "CPU inference server")
    router = processes(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(router_port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
            "--worker-urls",
            f"http://127.0.0.1:{server_port}",
        ],
        log,
    )
    _wait_http(f"http://127.0.0.1:{router_port}/readiness", router, "sglang-router with one healthy worker")
    buffer = processes(
        [
            sys.executable,
            "-m",
            "slime_plugins.rollout_buffer.buffer",
            "--host",
            "127.0.0.1",
            "--port",
            str(buffer_port),
        ],
        log,
    )
    _wait_http(f"http://127.0.0.1:{buffer_port}/health", buffer, "rollout buffer server")

    args = make_args(
        hf_checkpoint=model_dir,
        rollout_buffer_url=f"http://127.0.0.1:{buffer_port}",
        rollout_task_type="math",
        loss_mask_type="qwen",
        sglang_router_ip="127.0.0.1",
        sglang_router_port=router_port,
        prompt_data=str(prompts),
        input_key="prompt",
        label_key="label",
        num_epoch=1,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        rollout_max_response_len=6,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rm_type="answer_match",
        fetch_trajectory_retry_times=120,
        rollout_global_dataset=False,
        buffer_filter_path=None,
    )
    data_source = RolloutDataSourceWithBuffer(args)
    example._state.update(started=False, tokenizer=None, mask_generator=None)

    groups = example.generate_rollout(args, 0, data_source)
    tok = AutoTokenizer.from_pretrained(model_dir)
    labels = {i: json.loads(line)["label"] for i, line in enumerate(prompts.read_text().splitlines())}
    assert len(groups) == 2 and all(len(g) == 4 for g in groups)
    assert len({g[0].group_index for g in groups}) == 2
    for g in groups:
        gi = g[0].group_index
        raw = [_answer_match(s.response, labels[gi]) for s in g]
        mean = sum(raw) / 4
        std = (sum((r - mean) ** 2 for r in raw) / 4) ** 0.5
        for j, s in enumerate(g):
            assert s.group_index == gi and s.index == gi * 4 + j
            assert s.metadata["raw_reward"] == raw[j] and s.label == labels[gi]
            assert s.reward == pytest.approx((raw[j] - mean) / (std + 1e-8))
            finish = s.metadata["finish_reason"]
            assert s.status == (Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED)
            # the loss mask covers exactly the response: the assistant answer and its end-of-turn token
            assert len(s.loss_mask) == s.response_length > 0 and s.loss_mask[0] == 1
            response_text = tok.decode(s.tokens[-s.response_length :])
            assert response_text.startswith(s.response) and "<|im_end|>" in response_text
            assert "What is" in tok.decode(s.tokens[: len(s.tokens) - s.response_length])
    assert data_source.get_metadata()["0"]  # finished group ids recorded (sent as skip_instance_ids on restart)

    # Only 3 prompts x 1 epoch exist: the next rollout cannot be filled, and says so instead of polling forever.
    with pytest.raises(RuntimeError, match="finished"):
        example.generate_rollout(args, 1, data_source)
