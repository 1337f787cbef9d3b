"""Sync vs one-step-async RL loop on the tiny kit, same disaggregated layout, measured side by side in one run.

Prints per-phase medians (rollout, train, weight sync, framework overhead = step - the three) for train.py and
train_async.py, and the async/sync step-time ratio (< 1 means async is faster). With `--repeat N` (default 5) both
drivers run N times, interleaved, so that load from other jobs falls on both alike: the phases are the median over
the runs of each run's median, and the ratio is the median (with its min-max range) of the N same-round ratios.

    .venv/bin/python benchmarks/bench_loop.py [--num-rollout 8] [--repeat 5]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PHASES = [("rollout", "perf/rollout_time"), ("train", "perf/train_time"), ("weight sync", "perf/update_weights_time")]


def run(driver, model_dir, data_dir, out_dir, num_rollout):
    metrics = os.path.join(out_dir, f"{driver}.jsonl")
    model_args = subprocess.run(
        ["bash", "-c", "source scripts/models/qwen3-tiny.sh && printf '%s\\n' \"${MODEL_ARGS[@]}\""],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    cmd = [
        sys.executable,
        driver,
        *model_args,
        "--hf-checkpoint",
        model_dir,
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--prompt-data",
        f"{data_dir}/train.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rm-type",
        "answer_match",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--global-batch-size",
        "128",
        "--rollout-max-response-len",
        "16",
        "--lr",
        "1e-4",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--metrics-path",
        metrics,
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(metrics) as f:
        return [json.loads(line) for line in f][1:]  # rollout 0 includes start-up costs


def summarize(rows):
    out = {"step": statistics.median(r["perf/step_time"] for r in rows)}
    for name, key in PHASES:
        out[name] = statistics.median(r.get(key, 0.0) for r in rows)
    out["overhead"] = out["step"] - sum(out[name] for name, _ in PHASES)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rollout", type=int, default=8)
    p.add_argument("--repeat", type=int, default=5, help="runs of each driver, interleaved; medians are reported")
    a = p.parse_args()
    env_defaults = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "SLIME_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k, v in env_defaults.items():
        os.environ.setdefault(k, v)
    from tools.build_tiny_kit import build_data, build_model

    drivers = ("train.py", "train_async.py")
    runs = {d: [] for d in drivers}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_dir = build_model(os.path.join(tmp, "model")), build_data(os.path.join(tmp, "data"))
        for i in range(a.repeat):
            for d in drivers:
                out = os.path.join(tmp, f"round{i}")  # the metrics file is appended to: one per run
                os.makedirs(out, exist_ok=True)
                runs[d].append(summarize(run(d, model_dir, data_dir, out, a.num_rollout)))
                print(f"round {i + 1}/{a.repeat} {d}: step {runs[d][-1]['step']:.3f} s", flush=True)
    keys = ["step", *[n for n, _ in PHASES], "overhead"]
    print(f"{'driver':<16}" + "".join(f"{k:>13}" for k in keys) + f"   (median s over {a.repeat} run(s))")
    for d in drivers:
        print(f"{d:<16}" + "".join(f"{statistics.median(r[k] for r in runs[d]):>13.3f}" for k in keys))
    ratios = [asy["step"] / syn["step"] for asy, syn in zip(runs["train_async.py"], runs["train.py"])]
    print(
        f"async/sync step-time ratio: median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} same-round pairs)"
    )


if __name__ == "__main__":
    main()
