"""Decode throughput of slime's CPU inference server vs transformers `generate`, side by side in one run.

Workload: 64 chat prompts whose output lengths vary (max_new_tokens drawn from 4..64 per prompt, EOS ignored so the
lengths are exact), greedy. The server gets them as concurrent requests and batches continuously; transformers gets
one left-padded static batch, which must run until the longest prompt is done. Both count only the tokens each prompt
asked for, use 1 torch thread, and include tokenized prompts only (no text processing).

    python benchmarks/bench_cpu_server.py [--model-dir DIR] [--num-prompts 64] [--min-new 4] [--max-new 64]
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


def workload(tok, n, lo, hi, seed=0):
    rng = random.Random(seed)
    prompts, lens = [], []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        msgs = [{"role": "user", "content": f"What is {a}+{b}?" + " Think step by step." * (i % 4)}]
        prompts.append(
            list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        )
        lens.append(rng.randint(lo, hi))
    return prompts, lens


def start_server(model_dir, max_running):
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
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(lens),
            min_new_tokens=max(lens),
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - t0
    return elapsed, [out[i, L : L + n].tolist() for i, n in enumerate(lens)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="HF model dir (default: build the tiny Qwen3 kit in a temp dir)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-new", type=int, default=4)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model_dir = a.model_dir
    if model_dir is None:
        from tools.build_tiny_kit import build_model

        model_dir = build_model(os.path.join(tempfile.mkdtemp(prefix="bench-cpu-server-"), "qwen3-tiny"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts, lens = workload(tok, a.num_prompts, a.min_new, a.max_new)
    useful = sum(lens)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    proc, url, session = start_server(model_dir, len(prompts))
    try:
        run_server(url, session, prompts[:8], lens[:8])  # warm-up both
        run_hf(model, prompts[:8], lens[:8])
        # interleaved rounds: a shared machine's load drifts, so both sides of a round see the same conditions
        srv, hf = [], []
        for _ in range(a.repeats):
            t, out_srv = run_server(url, session, prompts, lens)
            srv.append(t)
            t, out_hf = run_hf(model, prompts, lens)
            hf.append(t)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    same = sum(x == y for x, y in zip(out_srv, out_hf))
    print(
        f"workload: {len(prompts)} prompts, {min(len(x) for x in prompts)}-{max(len(x) for x in prompts)} prompt tokens, "
        f"{useful} output tokens ({a.min_new}..{a.max_new} per prompt), greedy, 1 torch thread, "
        f"median (min-max) of {a.repeats} interleaved rounds"
    )
    t_srv, t_hf = statistics.median(srv), statistics.median(hf)
    print(
        f"CPU server (continuous batching, via HTTP): {t_srv:7.3f} s  {useful / t_srv:9.1f} tok/s ({min(srv):.3f}-{max(srv):.3f} s)"
    )
    print(
        f"transformers generate (static padded batch): {t_hf:7.3f} s  {useful / t_hf:9.1f} tok/s ({min(hf):.3f}-{max(hf):.3f} s)"
    )
    ratios = [h / v for v, h in zip(srv, hf)]
    print(
        f"ratio server / transformers: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x, "
        f"same-round pairs; greedy outputs identical for {same}/{len(prompts)} prompts)"
    )


if __name__ == "__main__":
    main()
