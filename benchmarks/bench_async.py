"""Sync vs one-step-off vs fully async, on the tiny kit, same disaggregated layout (1 trainer + 1 engine).

For each mode: trained samples per second (steady state, rollout 0 excluded), the trainer's wait fraction (time
between train calls over wall time, as the trainer measures it: `perf/wait_time_ratio`), the engine's idle fraction
(sampled independently of slime: `/get_load` of this run's inference server every 50 ms, idle = nothing running or
waiting), and the staleness of every trained sample (trainer version minus the version of its first segment,
read from the saved rollout data).

A single run on a shared machine is noise, not a result: `--repeat N` runs every mode N times, interleaved (sync,
one-step-off, fully async, then again), so that load from other jobs falls on all modes alike; each figure is the
median over the N runs with its range (min-max), and each ratio is taken against the sync run of the same round.
The last column says what limits the mode: the side that is busy while the other waits.

    .venv/bin/python benchmarks/bench_async.py [--num-rollout 12] [--max-staleness 1 2] [--repeat 5]
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import psutil
import requests
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


class EngineLoadSampler(threading.Thread):
    """Polls the /get_load of this run's CPU inference server (its command line names `model_dir`, never another
    job's server on the machine); counts the samples where it had no request."""

    def __init__(self, model_dir, period=0.05):
        super().__init__(daemon=True)
        self.model_dir, self.period, self.stop, self.busy, self.total = model_dir, period, threading.Event(), 0, 0
        self.session = requests.Session()
        self.session.trust_env = False

    def _urls(self):
        urls = []
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            line = " ".join(cmd)
            if "slime.backends.cpu_server" in line and self.model_dir in line and "--port" in cmd:
                urls.append(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}/get_load")
        return urls

    def run(self):
        urls = []
        while not self.stop.is_set():
            urls = urls or self._urls()
            loads = []
            for url in urls:
                try:
                    loads.append(self.session.get(url, timeout=1).json())
                except (requests.RequestException, ValueError):
                    pass
            if loads:  # count only while a server answers (start-up and shutdown excluded)
                self.total += len(loads)
                self.busy += sum(
                    1 for load in loads if any(d.get("num_reqs", 0) or d.get("num_waiting_reqs", 0) for d in load)
                )
            time.sleep(self.period)


def run(name, extra, model_dir, data_dir, out_dir, num_rollout):
    metrics = os.path.join(out_dir, f"{name}.jsonl")
    rollouts = os.path.join(out_dir, name, "r_{rollout_id}.pt")
    model_args = subprocess.run(
        ["bash", "-c", "source scripts/models/qwen3-tiny.sh && printf '%s\\n' \"${MODEL_ARGS[@]}\""],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    driver = "train.py" if name == "sync" else "train_async.py"
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
        "--rollout-shuffle",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--global-batch-size",
        "64",
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
        "--save-debug-rollout-data",
        rollouts,
        *extra,
    ]
    sampler = EngineLoadSampler(model_dir)
    sampler.start()
    try:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        sampler.stop.set()
        sampler.join()
    with open(metrics) as f:
        rows = [json.loads(line) for line in f][1:]  # rollout 0 includes start-up costs
    lags = Counter()
    for path in glob.glob(rollouts.replace("{rollout_id}", "*")):
        r = int(re.search(r"r_(\d+)\.pt$", path).group(1))
        for s in torch.load(path, weights_only=False)["samples"]:
            lags[r + 1 - int(s["weight_versions"][0])] += 1
    samples = sum(16 * 8 for _ in rows)
    return {
        "samples/s": samples / sum(r["perf/step_time"] for r in rows),
        "trainer wait": statistics.mean(r.get("perf/wait_time_ratio", 0.0) for r in rows),
        "engine idle": 1 - sampler.busy / max(1, sampler.total),
        "staleness": dict(sorted(lags.items())),
    }


def spread(values, fmt):
    """Median and range of repeated measurements: "m (lo-hi)", or just the value for a single run."""
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def limited_by(trainer_wait, engine_idle):
    """The side that limits throughput: the one that is busy while the other one waits."""
    if engine_idle > trainer_wait:
        return f"trainer (engine idle {engine_idle:.0%})"
    return f"engine (trainer waits {trainer_wait:.0%})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-rollout", type=int, default=12)
    p.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=5, help="runs of every mode, interleaved; medians are reported")
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

    modes = {"sync": [], "one-step-off": []}
    for k in a.max_staleness:
        modes[f"fully async K={k}"] = ["--rollout-function-path", FULLY_ASYNC, "--max-staleness", str(k)]
    results = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data_dir = build_model(os.path.join(tmp, "model")), build_data(os.path.join(tmp, "data"))
        for i in range(a.repeat):
            for name, extra in modes.items():
                out = os.path.join(tmp, f"round{i}")
                os.makedirs(out, exist_ok=True)
                results[name].append(run(name, extra, model_dir, data_dir, out, a.num_rollout))
                print(f"round {i + 1}/{a.repeat} {name}: {results[name][-1]['samples/s']:.1f} samples/s", flush=True)
    print(f"\nmedian (min-max) of {a.repeat} interleaved run(s) per mode, {a.num_rollout} rollouts each")
    print(
        "| mode | samples/s | vs sync (same round) | trainer wait | engine idle | limited by | staleness (last run) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        ratios = [r["samples/s"] / base["samples/s"] for r, base in zip(runs, results["sync"])]
        wait = [r["trainer wait"] for r in runs]
        idle = [r["engine idle"] for r in runs]
        lag = ", ".join(f"{k}: {v}" for k, v in runs[-1]["staleness"].items())
        print(
            f"| {name} | {spread([r['samples/s'] for r in runs], '.1f')} | {spread(ratios, '.2f')}x | "
            f"{spread(wait, '.2f')} | {spread(idle, '.2f')} | "
            f"{limited_by(statistics.median(wait), statistics.median(idle))} | {lag} |"
        )


if __name__ == "__main__":
    main()
