"""Current slime's own `examples/` plugins, unchanged, under our train.py on the tiny model, called as upstream's launch
scripts call them. They are not part of this repository, so these tests run where a checkout of current slime is
given by `SLIME_UPSTREAM_DIR` (and are skipped elsewhere)."""

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from aiohttp import web

from tests import _procs
from tests._args import make_args

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


def _run_train(tiny_kit, tmp_path, pythonpath, *args, prompt_data=None):
    """train.py on the tiny model (4096-token context: upstream's prompts are long) with upstream's GRPO settings and
    `args`, the plugin directory on PYTHONPATH as upstream's scripts set it; returns the metrics rows."""
    model = _long_context_kit(tiny_kit, tmp_path, 4096)
    cmd = [sys.executable, "train.py", *_model_args(), "--max-position-embeddings", "4096", "--hf-checkpoint", model]
    cmd += (
        "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1".split()
    )
    cmd += ["--prompt-data", prompt_data or os.path.join(tiny_kit[1], "train.jsonl")]
    cmd += (
        "--input-key prompt --apply-chat-template --rollout-shuffle --num-rollout 2 --advantage-estimator grpo".split()
    )
    cmd += "--use-dynamic-batch-size --max-tokens-per-gpu 4096".split()
    cmd += "--use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --eps-clip 0.2 --eps-clip-high 0.28".split()
    cmd += "--optimizer adam --lr 1e-6 --lr-decay-style constant --attention-dropout 0.0 --hidden-dropout 0.0".split()
    cmd += [*args, "--metrics-path", str(tmp_path / "metrics.jsonl")]
    env = dict(_procs.run_env(tmp_path), PYTHONPATH=str(pythonpath))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        _procs.stop_run(proc, tmp_path)
    assert proc.returncode == 0, out[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["rollout_id"] for r in rows] == [0, 1] and all("train/pg_loss" in r for r in rows)
    return rows


@pytest.mark.timeout(600)
def test_retool_generate_and_reward_run_unchanged(tiny_kit, tmp_path):
    """examples/retool: its multi-turn generate function (which keeps `sample.loss_mask` across
    `append_response_tokens` calls) and its dict reward read through `--reward-key score`."""
    plugin_dir = tmp_path / "retool"
    shutil.copytree(os.path.join(UPSTREAM, "examples", "retool"), plugin_dir)
    rows = _run_train(
        tiny_kit,
        tmp_path,
        plugin_dir,
        *"--label-key label --reward-key score --rollout-batch-size 4 --n-samples-per-prompt 2".split(),
        *"--rollout-max-response-len 16 --global-batch-size 8".split(),
        *"--custom-generate-function-path generate_with_retool.generate".split(),
        *"--custom-rm-path generate_with_retool.reward_func".split(),
    )
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
    generate = "examples.multi_agent.rollout_with_multi_agents.generate_with_multi_agents"
    _run_train(
        tiny_kit,
        tmp_path,
        plugin_root,
        *"--label-key label --rm-type deepscaler --rollout-batch-size 2 --n-samples-per-prompt 2".split(),
        *"--rollout-max-context-len 4096 --rollout-max-response-len 8 --rollout-temperature 1".split(),
        *"--global-batch-size 4 --balance-data --use-rollout-logprobs".split(),
        *["--custom-generate-function-path", generate],
        *["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")],
    )
    samples = torch.load(tmp_path / "rollout_0.pt", weights_only=False)["samples"]
    assert len({s["rollout_id"] for s in samples}) == 4 and len(samples) > 4  # 4 rollouts fanned out


class _Retriever:
    """Stands in for Search-R1's local retrieval server (POST /retrieve {queries, topk, return_scores} ->
    {"result": [[{"document": {"contents": "title\ntext"}, "score": s}]]}) on a free port; keeps the requests."""

    def __init__(self):
        self.bodies = []
        app = web.Application()
        app.router.add_post("/retrieve", self.retrieve)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/retrieve"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def retrieve(self, request):
        body = await request.json()
        self.bodies.append(body)
        docs = [
            {"document": {"contents": f"Doc {i}\nThe answer is 5."}, "score": 1 / (i + 1)} for i in range(body["topk"])
        ]
        return web.json_response({"result": [docs for _ in body["queries"]]})

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.timeout(600)
def test_search_r1_generate_and_reward_run_unchanged(tiny_kit, tmp_path):
    """examples/search-r1 with its local search backend pointed at a stand-in retrieval server (the one edit its
    README asks for): multi-turn generate with loss-masked observations, a dict label, its exact-match reward."""
    plugin_dir = tmp_path / "search-r1"
    shutil.copytree(os.path.join(UPSTREAM, "examples", "search-r1"), plugin_dir)
    retriever = _Retriever()
    module = plugin_dir / "generate_with_search.py"
    module.write_text(module.read_text().replace("http://127.0.0.1:8000/retrieve", retriever.url))
    data = tmp_path / "nq.jsonl"
    with open(data, "w") as f:
        for q in ["What is 2 + 3?", "What is 1 + 4?", "What is 4 + 1?", "What is 3 + 2?"]:
            prompt = [{"role": "user", "content": q}]  # upstream's data: chat messages, templated by slime
            f.write(json.dumps({"prompt": prompt, "reward_model": {"ground_truth": {"target": ["5"]}}}) + "\n")
    try:
        rows = _run_train(
            tiny_kit,
            tmp_path,
            plugin_dir,
            *"--label-key reward_model --rollout-batch-size 4 --n-samples-per-prompt 2".split(),
            *"--rollout-max-response-len 12 --rollout-temperature 1 --global-batch-size 8".split(),
            *"--custom-generate-function-path generate_with_search.generate".split(),
            *"--custom-rm-path generate_with_search.reward_func".split(),
            *["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")],
            prompt_data=str(data),
        )
    finally:
        retriever.close()
    # the untrained model never writes a valid <search>/<answer> sequence: exact match 0, no format score
    assert all(r["rollout/raw_reward"] == 0 for r in rows)
    samples = torch.load(tmp_path / "rollout_0.pt", weights_only=False)["samples"]
    for s in samples:  # the tiny model's first turn runs to the length limit, which ends the episode
        assert s["loss_mask"] == [1] * s["response_length"] == [1] * len(s["rollout_log_probs"])


@pytest.mark.usefixtures("mpu_world1")
def test_mis_helper_with_its_own_config_weighs_as_worked_by_hand():
    """examples/train_infer_mismatch_helper: upstream's mis.py as --custom-tis-function-path, configured by its own
    mis.yaml through --custom-config-path (token-level truncation at 2, rejection outside [0.5, 2], veto below
    1e-4, batch normalisation). log rho: sample 1 log[3, 1, 0.5], sample 2 log[1e-5, 1, 1] with its last token
    masked out. By hand: weights [2, 1, 0.5] and [1e-5, 1, 0]; rejection drops rho 3 and (veto) all of sample 2;
    the 5 loss-masked tokens' weights average 0.9, which divides every weight (ours,
    examples/train_infer_mismatch_helper, gives the same: tests/test_consistency.py)."""
    helper = os.path.join(UPSTREAM, "examples", "train_infer_mismatch_helper")
    spec = importlib.util.spec_from_file_location("upstream_mis", os.path.join(helper, "mis.py"))
    mis = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mis)
    args = make_args("--use-tis", "--custom-config-path", os.path.join(helper, "mis.yaml"))
    masks = [torch.ones(3, dtype=torch.int), torch.tensor([1, 1, 0], dtype=torch.int)]
    pg, out_masks, _ = mis.compute_mis_weights_with_cp(
        args,
        pg_loss=torch.ones(6),
        train_log_probs=[torch.zeros(3), torch.zeros(3)],
        rollout_log_probs=[-torch.log(torch.tensor([3.0, 1.0, 0.5])), -torch.log(torch.tensor([1e-5, 1.0, 1.0]))],
        loss_masks=masks,
        total_lengths=[5, 5],
        response_lengths=[3, 3],
    )
    assert [m.tolist() for m in out_masks] == [[0, 1, 1], [0, 0, 0]]
    assert torch.allclose(pg, torch.tensor([2.0, 1.0, 0.5, 1e-5, 1.0, 0.0]) / 0.900002, rtol=1e-5)


def test_upstream_plugin_contract_tests_pass(tmp_path):
    """Current slime's own CPU contract tests for plugin paths, generate functions, rollout hooks, `Sample` and sample
    hooks, run against this repository's `slime` (all but the call-site checks, which read upstream's source files)."""
    shutil.copytree(os.path.join(UPSTREAM, "tests", "plugin_contracts"), tmp_path / "plugin_contracts")
    for name in ("test_sample.py", "test_rollout_sample_hooks.py"):
        shutil.copy(os.path.join(UPSTREAM, "tests", name), tmp_path / name)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not callsite_is_stable", "."]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1]


# ---------------------------------------------------------------- current slime's launch scripts through our parser
# Sourced (BASH_ENV) before each script: commands that would start, stop, download or install anything are no-ops;
# the train.py / train_async.py command line (after `ray job submit ... --` or as run directly) is written to $OUT.
_CAPTURE = r"""
set +e
_cap() { local found=""; for a in "$@"; do if [ -n "$found" ]; then printf '%s\0' "$a" >> "$OUT.args";
  elif [[ "$a" == *train.py || "$a" == *train_async.py ]]; then found=1; echo "$a" > "$OUT.driver"; fi; done; }
ray() { _cap "$@"; }; python() { _cap "$@"; }; python3() { _cap "$@"; }; torchrun() { _cap "$@"; }
pip() { echo "megatron-core 0.16.1 /opt/Megatron-LM"; }
for c in hf huggingface-cli wget curl git docker ssh apt apt-get uv modelscope tmux nohup pkill sleep nvidia-smi \
  kill wait; do eval "$c() { :; }"; export -f "$c"; done
export -f _cap ray python python3 torchrun pip
"""

# What stops each launch script that does not parse, and why that is right (the rest parse cleanly).
SCRIPT_REFUSALS = {
    # impossible on this stack: PD disaggregation, DSA (GLM-5's all-gather CP), FP8 GEMMs on a CPU
    "scripts/run-glm5-744B-A40B.sh": "--prefill-num-servers: not supported",
    "scripts/run-glm5.2-744B-A40B.sh": "--allgather-cp: not supported",
    "scripts/low_precision/run-qwen3-30b-a3b-fp8.sh": "--fp8-format e4m3: FP8 training runs Transformer Engine",
    # the scripts' own mistakes, which current slime / Megatron-LM stop on too: 47 layers over 2 stages without an
    # uneven split; a missing backslash ends the command after --update-weight-buffer-size; a flag current slime
    # no longer declares; no MODEL_ARGS (the dry run reads no config.json: with the checkpoint present it parses)
    "examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh": "--num-layers 47 is not divisible",
    "scripts/run-kimi-k2-Instruct.sh": "the following arguments are required: --rollout-batch-size",
    "slime_plugins/rollout_buffer/rollout_buffer_example.sh": "unrecognized arguments: --ref-micro-batch-size",
    "tests/test_gspo.sh": "--num-layers, --hidden-size, --num-attention-heads required",
}


def test_current_slime_launch_scripts_parse_or_are_refused_for_a_reason(tmp_path, capsys):
    """Every launch script of current slime that starts train.py / train_async.py, run with the commands it would
    start captured (nothing runs), and its command line given to our parse_args (check_paths=False, as for a job
    meant for another machine): it parses, or stops in one line for the reason SCRIPT_REFUSALS gives."""
    import contextlib
    import io

    from slime.config import parse_args

    tree = tmp_path / "slime"
    shutil.copytree(UPSTREAM, tree, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    (tree / "scripts" / "scripts").symlink_to(".")  # scripts that source scripts/models from one level off
    (tmp_path / "capture.sh").write_text(_CAPTURE)
    scripts = subprocess.run(
        ["grep", "-rlE", "--include=*.sh", r"train(_async)?\.py", "."], cwd=tree, capture_output=True, text=True
    ).stdout.split()
    got = {}
    for rel in sorted(s[2:] for s in scripts):
        path = tree / rel
        path.write_text(path.read_text().replace("/root/slime", str(tree)))
        out = str(tmp_path / rel.replace("/", "_"))
        env = dict(os.environ, OUT=out, BASH_ENV=str(tmp_path / "capture.sh"), BASE_DIR="/root")
        env.update(BASE_FOLDER="/root", WANDB_KEY="none", MASTER_ADDR="127.0.0.1")
        subprocess.run(["bash", str(path)], cwd=tree, env=env, capture_output=True, timeout=60)
        argv = [a for a in open(f"{out}.args").read().split("\0") if a]
        driver = open(f"{out}.driver").read().strip()
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parse_args(argv=argv, check_paths=False, asynchronous=driver.endswith("train_async.py"))
            got[rel] = None
        except SystemExit:
            got[rel] = err.getvalue().strip().splitlines()[-1]
    wrong = {
        rel: (SCRIPT_REFUSALS.get(rel), line)
        for rel, line in got.items()
        if (line is None) != (rel not in SCRIPT_REFUSALS) or (line and SCRIPT_REFUSALS[rel] not in line)
    }
    assert not wrong, wrong
    # every low-precision script (FP8 rollout, INT4 QAT) is among them; all but FP8 *training* parse
    low = {rel: line for rel, line in got.items() if rel.startswith("scripts/low_precision/")}
    assert {
        "scripts/low_precision/run-qwen3-4b-fp8.sh",
        "scripts/low_precision/run-qwen3-30b-a3b-fp8.sh",
        "scripts/low_precision/run-qwen3-30B-A3B-int4.sh",
        "scripts/low_precision/run-qwen3-235B-A22B-int4.sh",
        "scripts/low_precision/run-moonlight-16B-A3B-int4.sh",
        "scripts/low_precision/run-kimi-k2-Thinking-int4.sh",
    } <= set(low), sorted(low)
    assert [rel for rel, line in low.items() if line] == ["scripts/low_precision/run-qwen3-30b-a3b-fp8.sh"]
    print(f"{sum(v is None for v in got.values())} of {len(got)} parse; refused: {sorted(SCRIPT_REFUSALS)}")
