"""What the recording proxy at the router address costs a rollout: the same GRPO-shaped rollout sent straight to the
inference server and through the proxy in front of it, in interleaved rounds of one run, plus the time to match the
samples to the recorded outputs (`RequestLedger.attach`).

Workload: `--prompts` chat prompts x `--samples` samples, one concurrent `/generate` per sample (as slime's default
rollout sends them), temperature 0.8, `--new` tokens each with their log-probs, on slime's CPU server and the tiny
Qwen3 kit (or `--model-dir`). Printed: per round the two wall-clock times, then the median proxy/direct ratio with
its spread and the median attach time as a share of the rollout.

    python benchmarks/bench_recording_proxy.py [--rounds 7] [--prompts 8] [--samples 8] [--new 32]
"""

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.bench_cpu_server import start_server, workload  # noqa: E402


async def rollout(url, prompts, new):
    import aiohttp

    async with aiohttp.ClientSession(trust_env=False, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(ids):
            body = {
                "input_ids": ids,
                "sampling_params": {"temperature": 0.8, "max_new_tokens": new, "ignore_eos": True},
                "return_logprob": True,
            }
            async with session.post(f"{url}/generate", json=body) as resp:
                out = await resp.json()
            return ids, out["output_ids"]

        return await asyncio.gather(*(one(p) for p in prompts))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", default=None)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new", type=int, default=32)
    a = p.parse_args()

    from transformers import AutoTokenizer

    from slime.rollout.recording_proxy import RecordingProxy, RequestLedger
    from slime.utils.types import Sample

    model_dir = a.model_dir
    if model_dir is None:
        from tools.build_tiny_kit import build_model

        model_dir = build_model(os.path.join(tempfile.mkdtemp(prefix="bench-proxy-"), "qwen3-tiny"))
    n = a.prompts * a.samples
    prompts, _ = workload(AutoTokenizer.from_pretrained(model_dir), n, 1, 1, samples_per_prompt=a.samples)
    proc, url, _ = start_server(model_dir, n)
    ledger = RequestLedger(max_tokens=1 << 24)
    proxy = RecordingProxy(url, ledger, timeout=600).start("127.0.0.1")
    try:
        asyncio.run(rollout(url, prompts, a.new))  # warm-up
        ratios, shares = [], []
        for r in range(a.rounds):
            times, outs = {}, {}
            for name, target in (
                (("direct", url), ("proxy", proxy.url)) if r % 2 == 0 else (("proxy", proxy.url), ("direct", url))
            ):
                t0 = time.perf_counter()
                outs[name] = asyncio.run(rollout(target, prompts, a.new))
                times[name] = time.perf_counter() - t0
            samples = [
                Sample(index=i, tokens=ids + out, response_length=len(out))
                for i, (ids, out) in enumerate(outs["proxy"])
            ]
            t0 = time.perf_counter()
            matched = ledger.attach(samples)
            attach = time.perf_counter() - t0
            assert matched == n, f"{matched} of {n} samples matched"
            ratios.append(times["proxy"] / times["direct"])
            shares.append(attach / times["proxy"])
            print(
                f"round {r}: direct {times['direct']:.3f} s, proxy {times['proxy']:.3f} s "
                f"({ratios[-1]:.3f}x), attach {attach * 1e3:.2f} ms",
                flush=True,
            )
        print(
            f"{n} requests x {a.new} tokens: proxy / direct rollout time {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f}) over {a.rounds} rounds; attach "
            f"{100 * statistics.median(shares):.2f}% of the rollout ({100 * min(shares):.2f}-{100 * max(shares):.2f}%)"
        )
    finally:
        proxy.stop()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)


if __name__ == "__main__":
    main()
