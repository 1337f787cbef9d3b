"""Current slime's own `examples/` plugins, unchanged, under our train.py on the tiny model, called as upstream's launch
scripts call them. They are not part of this repository, so these tests run where a checkout of current slime is
given by `SLIME_UPSTREAM_DIR` (and are skipped elsewhere)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests import _procs

UPSTREAM = os.environ.get("SLIME_UPSTREAM_DIR")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not UPSTREAM, reason="set SLIME_UPSTREAM_DIR to a checkout of current slime"),
]


def _long_context_kit(tiny_kit, tmp_path, context):
    """The tiny model with a longer context (RoPE, so any length works): upstream's prompts carry long tool specs."""
    model = tmp_path / "model"
    shutil.copytree(tiny_kit[0], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=context)))
    return str(model)


def _model_args():
    out = subprocess.run(
        ["bash", "-c", "source scripts/models/qwen3-tiny.sh && printf '%s\\n' \"${MODEL_ARGS[@]}\""],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.timeout(600)
def test_retool_generate_and_reward_run_unchanged(tiny_kit, tmp_path):
    """examples/retool: its multi-turn generate function (which keeps `sample.loss_mask` across
    `append_response_tokens` calls) and its dict reward read through `--reward-key score`."""
    plugin_dir = tmp_path / "retool"
    shutil.copytree(os.path.join(UPSTREAM, "examples", "retool"), plugin_dir)
    model = _long_context_kit(tiny_kit, tmp_path, 4096)
    cmd = [sys.executable, "train.py", *_model_args(), "--max-position-embeddings", "4096", "--hf-checkpoint", model]
    cmd += (
        "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1".split()
    )
    cmd += ["--prompt-data", os.path.join(tiny_kit[1], "train.jsonl")]
    cmd += "--input-key prompt --label-key label --apply-chat-template --rollout-shuffle --reward-key score".split()
    cmd += "--num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2 --rollout-max-response-len 16".split()
    cmd += (
        "--global-batch-size 8 --use-dynamic-batch-size --max-tokens-per-gpu 2048 --advantage-estimator grpo".split()
    )
    cmd += "--use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --eps-clip 0.2 --eps-clip-high 0.28".split()
    cmd += "--optimizer adam --lr 1e-6 --lr-decay-style constant --attention-dropout 0.0 --hidden-dropout 0.0".split()
    cmd += "--custom-generate-function-path generate_with_retool.generate".split()
    cmd += "--custom-rm-path generate_with_retool.reward_func".split()
    cmd += ["--metrics-path", str(tmp_path / "metrics.jsonl")]
    env = dict(_procs.run_env(tmp_path), PYTHONPATH=str(plugin_dir))  # as upstream's script sets it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        _procs.stop_run(proc, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout_id"] for r in rows] == [0, 1]
    # the untrained model never boxes an answer: math_dapo's -1 plus retool's tool-call term, (0 - 2) / 2 * 0.1
    assert all(r["rollout/raw_reward"] == pytest.approx(-1.1) for r in rows)
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-5 for r in rows)


@pytest.mark.timeout(600)
def test_multi_agent_fan_out_trains_unchanged(tiny_kit, tmp_path):
    """examples/multi_agent: each generate call runs solver / rewriter / selector agents and returns one sample per
    agent call, all sharing the prompt's rollout_id (a fan-out); the trainer takes the variable sample count."""
    plugin_root = tmp_path / "plugins"
    shutil.copytree(os.path.join(UPSTREAM, "examples", "multi_agent"), plugin_root / "examples" / "multi_agent")
    (plugin_root / "examples" / "__init__.py").write_text("")
    model = _long_context_kit(tiny_kit, tmp_path, 4096)
    cmd = [sys.executable, "train.py", *_model_args(), "--max-position-embeddings", "4096", "--hf-checkpoint", model]
    cmd += (
        "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1".split()
    )
    cmd += ["--prompt-data", os.path.join(tiny_kit[1], "train.jsonl")]
    cmd += "--input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler".split()
    cmd += "--num-rollout 2 --rollout-batch-size 2 --n-samples-per-prompt 2 --rollout-max-response-len 8".split()
    cmd += "--rollout-max-context-len 4096 --rollout-temperature 1 --global-batch-size 4 --balance-data".split()
    cmd += "--use-dynamic-batch-size --max-tokens-per-gpu 4096 --advantage-estimator grpo".split()
    cmd += "--use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --eps-clip 0.2 --eps-clip-high 0.28".split()
    cmd += "--use-rollout-logprobs --optimizer adam --lr 1e-6 --lr-decay-style constant".split()
    cmd += "--attention-dropout 0.0 --hidden-dropout 0.0".split()
    generate = "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"
    cmd += ["--custom-generate-function-path", generate]
    cmd += ["--metrics-path", str(tmp_path / "metrics.jsonl")]
    cmd += ["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")]
    env = dict(_procs.run_env(tmp_path), PYTHONPATH=str(plugin_root))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        _procs.stop_run(proc, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout_id"] for r in rows] == [0, 1] and all("train/pg_loss" in r for r in rows)
    samples = torch.load(tmp_path / "rollout_0.pt", weights_only=False)["samples"]
    assert len({s["rollout_id"] for s in samples}) == 4 and len(samples) > 4  # 4 rollouts fanned out
