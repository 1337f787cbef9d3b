"""The main job's GRPO stage with `--tree-training` against flat packing, over several seeds: time to an eval accuracy.

Each seed runs `scripts/run-qwen3-tiny-cpu.sh` twice side by side, TREE=1 and TREE=0, each pinned to its own core
(`taskset`), both from one SFT model (SFT_FROM: trained once, by the first run of this benchmark unless given), at a
constant LR, with `--seed` and `--rollout-seed` set to the seed (engine sampling and data order). Per run it reads
`metrics.jsonl`: GRPO time (the sum of `perf/step_time`: the loop's wall time, evals and weight pushes included),
the trainer's part of it (`perf/train_time`), the greedy eval curve (every EVAL_INTERVAL rollouts), and the GRPO time
and the rollouts until the eval first reaches each threshold. Prints each run, then per quantity the median (min-max)
over seeds of tree and of flat, and of the per-seed tree/flat ratios.

    python benchmarks/bench_main_job_tree.py --seeds 1 2 3 --num-rollout 150
    python benchmarks/bench_main_job_tree.py --seeds 1 2 3 4 5 --num-rollout 150 --keep   # two more seeds
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


def run_job(out, cpu, tree, seed, args, sft_from=None):
    """Start the main job pinned to one core; returns the process (its output in `out`.log)."""
    extra = f"--lr-decay-style constant --seed {seed} --rollout-seed {seed}"
    env = dict(os.environ, OUT=out, TREE=str(int(tree)), NUM_ROLLOUT=str(args.num_rollout))
    env.update(EVAL_INTERVAL=str(args.eval_interval), EXTRA_ARGS=extra, RAY_TMPDIR=tempfile.mkdtemp(dir="/tmp"))
    if sft_from:
        env["SFT_FROM"] = sft_from
    log = open(f"{out}.log", "w")
    return subprocess.Popen(["taskset", "-c", str(cpu), "bash", SCRIPT], env=env, stdout=log, stderr=subprocess.STDOUT)


def summary(out, thresholds):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    elapsed, evals, reached = 0.0, [], {}
    for r in rows:
        elapsed += r["perf/step_time"]
        if "eval/addition" in r:
            evals.append(round(r["eval/addition"], 2))
            for t in thresholds:
                if r["eval/addition"] >= t and t not in reached:
                    reached[t] = (elapsed, r["rollout_id"] + 1)
    return {
        "grpo_s": sum(r["perf/step_time"] for r in rows),
        "train_s": sum(r["perf/train_time"] for r in rows),
        "evals": evals,
        "to": {t: reached.get(t, (None, None))[0] for t in thresholds},  # seconds of GRPO
        "rollouts_to": {t: reached.get(t, (None, None))[1] for t in thresholds},
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
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--num-rollout", type=int, default=150)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    p.add_argument("--sft-from", help="an earlier main job's OUT (its sft/); default: train one here first")
    p.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench_main_job_tree"))
    p.add_argument("--keep", action="store_true", help="reuse the seeds' finished runs in --out (add seeds later)")
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("bench_main_job_tree.py: needs 2 cores (the tree and flat runs side by side, one core each)")
    os.makedirs(args.out, exist_ok=True)
    sft_from = args.sft_from
    if sft_from is None and args.keep and os.path.exists(os.path.join(args.out, "sft_job", "sft")):
        sft_from = os.path.join(args.out, "sft_job")
    if sft_from is None:
        sft_from = os.path.join(args.out, "sft_job")
        shutil.rmtree(sft_from, ignore_errors=True)
        env = dict(os.environ, OUT=sft_from, NUM_ROLLOUT="1", EVAL_INTERVAL="1")
        subprocess.run(["bash", SCRIPT], env=env, check=True, stdout=subprocess.DEVNULL)

    results = {}
    for seed in args.seeds:
        outs = {tree: os.path.join(args.out, f"seed{seed}_{'tree' if tree else 'flat'}") for tree in (True, False)}
        if not (args.keep and all(finished(out, args.num_rollout) for out in outs.values())):
            jobs = [run_job(out, cpu, tree, seed, args, sft_from) for cpu, (tree, out) in enumerate(outs.items())]
            for proc, out in zip(jobs, outs.values()):
                if proc.wait() != 0:
                    sys.exit(f"bench_main_job_tree.py: the run in {out} failed; see {out}.log")
        for tree, out in outs.items():
            results[seed, tree] = summary(out, args.thresholds)
            print(f"seed {seed} {'tree' if tree else 'flat'}: {json.dumps(results[seed, tree])}", flush=True)

    print(f"\n{len(args.seeds)} seeds, {args.num_rollout} rollouts each, side by side one core each; seconds of GRPO")
    quantities = [("GRPO time", lambda r: r["grpo_s"]), ("trainer time", lambda r: r["train_s"])]
    for t in args.thresholds:
        quantities += [(f"time to eval >= {t}", lambda r, t=t: r["to"][t])]
        quantities += [(f"rollouts to eval >= {t}", lambda r, t=t: r["rollouts_to"][t])]
    for name, get in quantities:
        tree = [get(results[s, True]) for s in args.seeds]
        flat = [get(results[s, False]) for s in args.seeds]
        ratios = [t / f if t is not None and f is not None else None for t, f in zip(tree, flat)]
        print(f"{name:>24}: tree {spread(tree)}  flat {spread(flat)}  tree/flat {spread(ratios)}")
    final = [(results[s, True]["evals"][-1], results[s, False]["evals"][-1]) for s in args.seeds]
    print(f"{'final greedy eval':>24}: tree {spread([t for t, _ in final])}  flat {spread([f for _, f in final])}")


if __name__ == "__main__":
    main()
