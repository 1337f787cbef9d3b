"""Decode throughput of slime's CPU inference server vs transformers `generate`, side by side in one run.

Workload: 64 chat prompts whose output lengths vary (max_new_tokens drawn from 4..64 per prompt, EOS ignored so the
lengths are exact), greedy. The server gets them as concurrent requests and batches continuously; transformers gets
one left-padded static batch, which must run until the longest prompt is done. Both count only the tokens each prompt
asked for, use 1 torch thread, and include tokenized prompts only (no text processing).

`--samples-per-prompt N` (N > 1): a GRPO-shaped workload instead, num-prompts / N distinct prompts each sent N times
(as slime sends a group's samples, one request each, the group's requests next to each other), every sample with its
own max_new_tokens. A second server with `--disable-radix-cache` runs in the same rounds, so the ratio of the shared
prefill to the server without it is measured beside the ratio to transformers.

`--history-tokens H`: each group's prompt starts with H tokens standing for an earlier conversation (seeded random
ids), the multi-turn agent's case, where the shared prefix is long and the decode's reads of it dominate.

`--turns T` (T > 1): every request goes on as a conversation of T turns, each turn's prompt the last one plus its
output plus 5 new tokens (seeded; the user's next message), a turn's requests sent together. The server's prefix cache
then serves each turn's history from the turn before; `--disable-radix-cache` and transformers prefill it whole.

    python benchmarks/bench_cpu_server.py [--model-dir DIR] [--num-prompts 64] [--min-new 4] [--max-new 64]
                                          [--samples-per-prompt 8] [--history-tokens 300] [--turns 4]
"""

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(tok, n, lo, hi, seed=0, samples_per_prompt=1, history_tokens=0):
    rng, history_rng = random.Random(seed), random.Random(seed + 1)  # the same lengths with and without history
    prompts, lens = [], []
    for i in range(n):
        if i % samples_per_prompt:  # another sample of the group's prompt
            prompts.append(prompts[-1])
            lens.append(rng.randint(lo, hi))
            continue
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        g = i // samples_per_prompt
        msgs = [{"role": "user", "content": f"What is {a}+{b}?" + " Think step by step." * (g % 4)}]
        history = [history_rng.randint(3, len(tok) - 1) for _ in range(history_tokens)]
        prompts.append(
            history + list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        )
        lens.append(rng.randint(lo, hi))
    return prompts, lens


def start_server(model_dir, max_running, *extra):
    import requests

    from slime.utils.http_utils import find_available_port

    port = find_available_port(26000)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slime.backends.cpu_server",
            "--model-path",
            model_dir,
            "--port",
            str(port),
            "--max-running-requests",
            str(max_running),
            "--log-level",
            "warning",
            *extra,
        ],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    s = requests.Session()
    s.trust_env = False
    deadline = time.time() + 120
    while True:
        try:
            if s.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, s
        except requests.RequestException:
            pass
        if time.time() > deadline or proc.poll() is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError("CPU server did not come up")
        time.sleep(0.2)


def cpu_seconds(pid) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc): on a shared machine, work done is steadier
    than wall-clock time, which also counts the time other processes held the cores."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(url, session, prompts, lens):
    body = {
        "input_ids": prompts,
        "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lens],
    }
    t0 = time.perf_counter()
    outs = session.post(url + "/generate", json=body, timeout=600).json()
    elapsed = time.perf_counter() - t0
    assert [len(o["output_ids"]) for o in outs] == lens
    return elapsed, [o["output_ids"] for o in outs]


def run_hf(model, prompts, lens):
    import torch

    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(lens),
            min_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=0,
        )
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return elapsed, cpu, [out[i, L : L + n].tolist() for i, n in enumerate(lens)]


def next_turn(prompts, outs, vocab, turn):
    """Each conversation's next prompt: the last one, its output, and 5 new (seeded) tokens."""
    rng = random.Random(1000 + turn)
    return [p + o + [rng.randint(3, vocab - 1) for _ in range(5)] for p, o in zip(prompts, outs)]


def conversations(run, prompts, lens, turns, vocab):
    """run(prompts, lens) -> (*seconds, outputs), over `turns` turns: (*summed seconds, every turn's outputs)."""
    sums, outs = None, []
    for turn in range(turns):
        *seconds, o = run(prompts, lens)
        sums, outs = seconds if sums is None else [a + b for a, b in zip(sums, seconds)], outs + o
        prompts = next_turn(prompts, o, vocab, turn)
    return (*sums, outs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="HF model dir (default: build the tiny Qwen3 kit in a temp dir)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in all (samples included)")
    p.add_argument("--min-new", type=int, default=4)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--samples-per-prompt", type=int, default=1, help="n > 1: groups of n requests with one prompt")
    p.add_argument("--history-tokens", type=int, default=0, help="tokens of earlier conversation before each prompt")
    p.add_argument("--turns", type=int, default=1, help="T > 1: every request goes on as a conversation of T turns")
    a = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model_dir = a.model_dir
    if model_dir is None:
        from tools.build_tiny_kit import build_model

        model_dir = build_model(os.path.join(tempfile.mkdtemp(prefix="bench-cpu-server-"), "qwen3-tiny"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    n = a.samples_per_prompt
    prompts, lens = workload(
        tok, a.num_prompts, a.min_new, a.max_new, samples_per_prompt=n, history_tokens=a.history_tokens
    )
    useful = sum(lens) * a.turns
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # the server as configured by default, and (n > 1 or T > 1) the same server without shared prefill and cache
    sides = {"server": start_server(model_dir, len(prompts))}
    if n > 1 or a.turns > 1:
        sides["server --disable-radix-cache"] = start_server(model_dir, len(prompts), "--disable-radix-cache")
    times = {k: [] for k in sides}
    cpus = {k: [] for k in [*sides, "hf"]}  # CPU seconds of the server process / of transformers, per round
    outs = {}
    hf = []
    try:
        for _, url, session in sides.values():  # warm-up all
            run_server(url, session, prompts[:8], lens[:8])
        run_hf(model, prompts[:8], lens[:8])
        # interleaved rounds: a shared machine's load drifts, so every side of a round sees the same conditions
        for _ in range(a.repeats):
            for k, (_, url, session) in sides.items():
                # every round prefills its first prompts anew: an earlier round's would be in the prefix cache (a
                # later GRPO rollout's prompts are new ones, and a weight update empties the cache anyway)
                assert session.post(url + "/flush_cache", timeout=60).status_code == 200
                c0 = cpu_seconds(sides[k][0].pid)
                t, outs[k] = conversations(
                    lambda p, n_, url=url, session=session: run_server(url, session, p, n_),
                    prompts,
                    lens,
                    a.turns,
                    len(tok),
                )
                times[k].append(t)
                cpus[k].append(cpu_seconds(sides[k][0].pid) - c0)
            t, c, out_hf = conversations(lambda p, n_: run_hf(model, p, n_), prompts, lens, a.turns, len(tok))
            hf.append(t)
            cpus["hf"].append(c)
    finally:
        for proc, _, _ in sides.values():
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    shape = f"{len(prompts)} prompts" if n == 1 else f"{len(prompts) // n} prompts x {n} samples"
    if a.turns > 1:
        shape += f", {a.turns} turns each (first prompts below)"
    print(
        f"workload: {shape}, {min(len(x) for x in prompts)}-{max(len(x) for x in prompts)} prompt tokens, "
        f"{useful} output tokens ({a.min_new}..{a.max_new} per request and turn), greedy, 1 torch thread, "
        f"median (min-max) of {a.repeats} interleaved rounds"
    )
    for k, ts in times.items():
        t = statistics.median(ts)
        print(
            f"CPU {k} (continuous batching, via HTTP): {t:7.3f} s  {useful / t:9.1f} tok/s ({min(ts):.3f}-{max(ts):.3f} s)"
        )
    t_hf = statistics.median(hf)
    print(
        f"transformers generate (static padded batch): {t_hf:7.3f} s  {useful / t_hf:9.1f} tok/s ({min(hf):.3f}-{max(hf):.3f} s)"
    )
    for k, ts in times.items():
        ratios = [h / v for v, h in zip(ts, hf)]
        same = sum(x == y for x, y in zip(outs[k], out_hf))
        print(
            f"ratio {k} / transformers: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x, "
            f"same-round pairs; greedy outputs identical for {same}/{len(out_hf)} requests)"
        )
    for k in sides:
        ratios = [h / v for v, h in zip(cpus[k], cpus["hf"])]
        print(
            f"CPU-time ratio {k} / transformers (server process CPU s vs generate's): median "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x; "
            f"{statistics.median(cpus[k]):.3f} vs {statistics.median(cpus['hf']):.3f} CPU s)"
        )
    if len(sides) > 1:
        ts, off = cpus["server"], cpus["server --disable-radix-cache"]
        ratios = [b / v for v, b in zip(ts, off)]
        print(
            f"CPU-time ratio server / server --disable-radix-cache: median {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}x)"
        )
        ts, off = times["server"], times["server --disable-radix-cache"]
        ratios = [b / v for v, b in zip(ts, off)]
        print(
            f"ratio server / server --disable-radix-cache: median {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}x, same-round pairs; outputs identical: "
            f"{outs['server'] == outs['server --disable-radix-cache']})"
        )


if __name__ == "__main__":
    main()
