"""Two variants of the main job's GRPO stage, over several seeds: time and rollouts to an eval accuracy.

`--pair` names the variants (PAIRS below): `tree`, `--tree-training` against flat packing; `tree-today`, against flat
packing on an engine without shared prefill, one request per sample (`--sglang-disable-radix-cache
--rollout-request-per-sample`: the main job before any of the three existed); `one-request`, the main job as it is
against the same with `--rollout-request-per-sample`; `fp8-tis`, an FP8 engine (the tiny kit converted by
tools/convert_hf_to_fp8.py, block 128x128: every push quantises the trainer's weights) with `--use-tis` against the
same without it. Each seed runs `scripts/run-qwen3-tiny-cpu.sh` once per variant, side by
side, each pinned to its own core (`taskset`), both from one SFT model (SFT_FROM: trained once, by the first run of
this benchmark unless given), at a constant LR, with `--seed` and `--rollout-seed` set to the seed (engine sampling
and data order). Per run it reads `metrics.jsonl`: GRPO time (the sum of `perf/step_time`: the loop's wall time,
evals and weight pushes included), the trainer's part of it (`perf/train_time`), the mean trainer/engine log-prob
gap (`train/train_rollout_logprob_abs_diff`), the greedy eval curve (every EVAL_INTERVAL rollouts), and the GRPO
time and the rollouts until the eval first reaches each threshold. Prints each run, then per quantity the median
(min-max) over seeds of each variant, and of the per-seed first/second ratios; `--plot PNG` also draws every run's
eval accuracy against its seconds of GRPO.

    python benchmarks/bench_main_job.py --pair tree --seeds 1 2 3 --num-rollout 150
    python benchmarks/bench_main_job.py --pair tree --seeds 1 2 3 4 5 --num-rollout 150 --keep   # two more seeds
    python benchmarks/bench_main_job.py --pair tree-today --seeds 1 2 3 4 --keep --plot docs/tree_main_job_curve.png
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "run-qwen3-tiny-cpu.sh")
FP8_DIR = os.path.join(ROOT, "models", "qwen3-tiny-fp8")

# pair -> the two variants: (name, the script's environment, extra arguments)
PAIRS = {
    "tree": [("tree", {"TREE": "1"}, ""), ("flat", {"TREE": "0"}, "")],
    # the baseline: flat packing, an engine without shared prefill, one request per sample (the main job
    # before any of the three existed)
    "tree-today": [
        ("tree", {"TREE": "1"}, ""),
        ("today", {"TREE": "0"}, "--sglang-disable-radix-cache --rollout-request-per-sample"),
    ],
    # a group's fresh samples in one /generate (the default) against one request per sample
    "one-request": [("group", {}, ""), ("per_sample", {}, "--rollout-request-per-sample")],
    "fp8-tis": [
        ("fp8_tis", {"MODEL_DIR": FP8_DIR}, "--use-tis --get-mismatch-metrics"),
        ("fp8", {"MODEL_DIR": FP8_DIR}, "--get-mismatch-metrics"),
    ],
}


def run_job(out, cpu, variant, seed, args, sft_from, ray_dir):
    """Start the main job pinned to one core, its own local Ray in `ray_dir`; returns the process (output in
    `out`.log)."""
    _, variant_env, variant_args = variant
    extra = f"--lr-decay-style constant --seed {seed} --rollout-seed {seed} {variant_args}"
    env = dict(os.environ, OUT=out, NUM_ROLLOUT=str(args.num_rollout), SFT_FROM=sft_from, **variant_env)
    env.update(EVAL_INTERVAL=str(args.eval_interval), EXTRA_ARGS=extra, RAY_TMPDIR=ray_dir)
    os.makedirs(ray_dir, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        cmd = ["taskset", "-c", str(cpu), "bash", SCRIPT]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def summary(out, thresholds):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    elapsed, evals, reached, curve = 0.0, [], {}, []
    for r in rows:
        elapsed += r["perf/step_time"]
        if "eval/addition" in r:
            evals.append(round(r["eval/addition"], 2))
            curve.append((elapsed, r["eval/addition"]))
            for t in thresholds:
                if r["eval/addition"] >= t and t not in reached:
                    reached[t] = (elapsed, r["rollout_id"] + 1)
    return {
        "grpo_s": sum(r["perf/step_time"] for r in rows),
        "train_s": sum(r["perf/train_time"] for r in rows),
        "logprob_gap": statistics.mean(r["train/train_rollout_logprob_abs_diff"] for r in rows),
        "evals": evals,
        "to": {t: reached.get(t, (None, None))[0] for t in thresholds},  # seconds of GRPO
        "rollouts_to": {t: reached.get(t, (None, None))[1] for t in thresholds},
        "curve": curve,  # (seconds of GRPO, greedy eval accuracy) at each eval
    }


def finished(out, num_rollout):
    path = os.path.join(out, "metrics.jsonl")
    return os.path.exists(path) and sum(1 for _ in open(path)) == num_rollout


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g}, n={len(values)})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=sorted(PAIRS), default="tree")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--num-rollout", type=int, default=150)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    p.add_argument("--sft-from", help="an earlier main job's OUT (its sft/); default: train one here first")
    p.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_main_job"))
    p.add_argument("--keep", action="store_true", help="reuse the seeds' finished runs in --out (add seeds later)")
    p.add_argument("--plot", help="also draw every run's greedy eval against its seconds of GRPO into this PNG")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench_main_job.py: needs 2 cores (the two variants side by side, one core each)")
    os.makedirs(args.out, exist_ok=True)
    if args.pair == "fp8-tis" and not os.path.exists(os.path.join(FP8_DIR, "config.json")):
        tiny = os.path.join(ROOT, "models", "qwen3-tiny")
        subprocess.run([sys.executable, "tools/build_tiny_kit.py", "--model-dir", tiny], cwd=ROOT, check=True)
        convert = [
            "tools/convert_hf_to_fp8.py",
            "--model-dir",
            tiny,
            "--save-dir",
            FP8_DIR,
            "--block-size",
            "128",
            "128",
        ]
        subprocess.run([sys.executable, *convert], cwd=ROOT, check=True)
    sft_from = args.sft_from
    if sft_from is None and args.keep and os.path.exists(os.path.join(args.out, "sft_job", "sft")):
        sft_from = os.path.join(args.out, "sft_job")
    if sft_from is None:
        sft_from = os.path.join(args.out, "sft_job")
        shutil.rmtree(sft_from, ignore_errors=True)
        env = dict(os.environ, OUT=sft_from, NUM_ROLLOUT="1", EVAL_INTERVAL="1")
        subprocess.run(["bash", SCRIPT], env=env, check=True, stdout=subprocess.DEVNULL)

    variants = PAIRS[args.pair]
    names = [name for name, _, _ in variants]
    results = {}
    for seed in args.seeds:
        outs = [os.path.join(args.out, f"seed{seed}_{name}") for name in names]
        if not (args.keep and all(finished(out, args.num_rollout) for out in outs)):
            with tempfile.TemporaryDirectory(dir="/tmp") as ray_root:
                jobs = [
                    run_job(out, cpu, v, seed, args, sft_from, os.path.join(ray_root, str(cpu)))
                    for cpu, (v, out) in enumerate(zip(variants, outs))
                ]
                for proc, out in zip(jobs, outs):
                    if proc.wait() != 0:
                        sys.exit(f"bench_main_job.py: the run in {out} failed; see {out}.log")
        for name, out in zip(names, outs):
            results[seed, name] = summary(out, args.thresholds)
            shown = {k: v for k, v in results[seed, name].items() if k != "curve"}
            print(f"seed {seed} {name}: {json.dumps(shown)}", flush=True)

    a, b = names
    print(f"\n{len(args.seeds)} seeds, {args.num_rollout} rollouts each, side by side one core each; seconds of GRPO")
    quantities = [
        ("GRPO time", lambda r: r["grpo_s"]),
        ("trainer time", lambda r: r["train_s"]),
        ("log-prob gap", lambda r: r["logprob_gap"]),
    ]
    for t in args.thresholds:
        quantities += [(f"time to eval >= {t}", lambda r, t=t: r["to"][t])]
        quantities += [(f"rollouts to eval >= {t}", lambda r, t=t: r["rollouts_to"][t])]
    quantities += [("final greedy eval", lambda r: r["evals"][-1])]
    for label, get in quantities:
        first = [get(results[s, a]) for s in args.seeds]
        second = [get(results[s, b]) for s in args.seeds]
        ratios = [x / y if x is not None and y else None for x, y in zip(first, second)]
        print(f"{label:>24}: {a} {spread(first)}  {b} {spread(second)}  {a}/{b} {spread(ratios)}")
    if args.plot:
        plot(args.plot, results, args.seeds, names)


def plot(path, results, seeds, names):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in zip(names, ["tab:blue", "tab:orange"]):
        for i, seed in enumerate(seeds):
            x, y = zip(*results[seed, name]["curve"])
            ax.plot(x, y, color=color, alpha=0.7, marker=".", label=name if i == 0 else None)
    ax.set_xlabel("seconds of GRPO (one core each, side by side)")
    ax.set_ylabel("greedy eval accuracy")
    ax.set_title(f"main job, {len(seeds)} seeds per variant")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
