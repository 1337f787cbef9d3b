"""Weight-sync throughput, trainer -> CPU inference server, next to memcpy bandwidth measured in the same run.

Builds a random Qwen3-style HF model of a few hundred MB locally (no hub), starts one real CPU inference server
(`SGLangEngine`) and one Megatron trainer (Ray actor, TP=1), and times `update_weights()` end to end (pause, gather,
convert, transfer, load into the engine, continue):
  broadcast  disaggregated, --update-weight-transport broadcast (gloo group; the cross-host path)
  shm        disaggregated, --update-weight-transport auto on one host (shared-memory buckets)   target >= 0.6x memcpy
  colocated  --colocate (shared-memory handles of the CPU weight dict)                          target >= 0.8x memcpy
  disk       --update-weight-transport disk: one HF checkpoint per version, loaded by update_weights_from_disk
  delta      --update-weight-mode delta: xor deltas after one Adam-like step (every weight moved by lr = 1e-6),
             pulled into a local checkpoint (/pull_weights) and reloaded; the MB column is what was written

    python benchmarks/bench_weight_sync.py [--model mid|tiny] [--repeats 5] [--modes shm colocated]
    (--model tiny: the test suite's tiny kit sizes; mid: a few hundred MB; --hidden/--ffn/--layers override either)

  --fingerprint  the weight fingerprint's cost (shm path): steps of push, rollout and, with the check, the check as
             the driver runs it before the version's samples train, against the same without
             (--no-check-weight-fingerprints), alternated step by step; median ratios and their ranges

  --bytes    bytes one update sends into a quantised engine against a bf16 one (deterministic, no Ray): FP8 block
             128x128 on the tiny dense Qwen3 and a tiny Qwen3-MoE, INT4 W4A16 (group 32, symmetric, routed experts)
             on the same MoE
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
for k, v in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "SLIME_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(k, v)

import ray  # noqa: E402
import torch  # noqa: E402

# (hidden, ffn, layers): tiny = tools/build_tiny_kit.py's defaults (the test suite's model); mid = a few hundred MB
SIZES = {"tiny": (128, 512, 4), "mid": (1024, 4096, 6)}
# every path and its goal (x memcpy, None: none set)
MODES = (("broadcast", None), ("shm", 0.6), ("colocated", 0.8), ("disk", None), ("delta", None))


def memcpy_gbps(nbytes, repeats=5):
    """Copy into an existing (already faulted-in) buffer: the ceiling any weight transfer is held against."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def sync_bytes(model_dir, quantization_config=None, dtype=torch.bfloat16, only=""):
    """Bytes one weight update sends into an engine serving `quantization_config` (None: full precision): the HF
    tensors the sync converts the trainer's weights to (the checkpoint's names), floats in `dtype`, quantised as the
    sync quantises them. Every transport sends these bytes (disk adds a safetensors header). `only`: count just the
    names containing it (e.g. ".experts.")."""
    from safetensors.torch import load_file

    from slime.utils.quantization import QuantScheme, quantize_named_tensors

    named = []
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            for n, t in load_file(os.path.join(model_dir, f)).items():
                named.append((n, t.to(dtype) if t.is_floating_point() else t))
    if quantization_config:
        named = quantize_named_tensors(named, QuantScheme(quantization_config))
    return sum(t.numel() * t.element_size() for n, t in named if only in n)


def bytes_report():
    """FP8 on the tiny dense model and a tiny MoE, INT4 on the MoE: bytes per update against the same model in bf16."""
    from slime.utils.quantization import INT4_DEFAULT_IGNORE_RULES, fp8_config, int4_config
    from tests._megatron_helpers import build_random_hf
    from tools.build_tiny_kit import build_model

    workdir = tempfile.mkdtemp(prefix="bench-sync-bytes-")
    try:
        dense, moe = os.path.join(workdir, "dense"), os.path.join(workdir, "moe")
        build_model(dense)
        build_random_hf("qwen3moe", moe, vocab_size=512)
        rows = [
            ("tiny dense Qwen3", dense, "FP8 block 128x128", fp8_config([128, 128]), ""),
            ("tiny Qwen3-MoE", moe, "FP8 block 128x128", fp8_config([128, 128]), ""),
            ("  its routed experts", moe, "FP8 block 128x128", fp8_config([128, 128]), ".experts."),
            ("tiny Qwen3-MoE", moe, "INT4 g32 sym", int4_config(32, True, INT4_DEFAULT_IGNORE_RULES), ""),
            (
                "  its routed experts",
                moe,
                "INT4 g32 sym",
                int4_config(32, True, INT4_DEFAULT_IGNORE_RULES),
                ".experts.",
            ),
        ]
        print("bytes sent per weight update (trainer weights in bf16; deterministic)")
        print(f"{'model':<26}{'bf16 bytes':>12}{'engine':>20}{'bytes':>12}{'x bf16':>8}")
        for label, model_dir, engine, qc, only in rows:
            full, quant = sync_bytes(model_dir, None, only=only), sync_bytes(model_dir, qc, only=only)
            print(f"{label:<26}{full:>12}{engine:>20}{quant:>12}{quant / full:>8.3f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def bench_mode(args, engine, mode, repeats, workdir):
    from slime.ray.utils import Lock
    from tests.test_weight_sync import start_trainers, stop

    args.update_weight_transport = {"broadcast": "broadcast", "disk": "disk", "delta": "disk"}.get(mode, "auto")
    args.update_weight_mode = "delta" if mode == "delta" else "full"
    args.update_weight_disk_dir = os.path.join(workdir, f"versions-{mode}")
    args.update_weight_local_checkpoint_dir = os.path.join(workdir, "local") if mode == "delta" else None
    trainers, lock = start_trainers(args, colocate=mode == "colocated"), Lock.remote()
    try:
        ray.get(trainers[0].connect.remote([engine], lock), timeout=600)
        ray.get(trainers[0].update_weights.remote(), timeout=600)  # warm-up: connections, first-touch pages
        runs = []
        for i in range(repeats):
            if mode == "delta":
                ray.get(trainers[0].adam_like_step.remote(1e-6, i), timeout=600)
            runs.append(ray.get(trainers[0].update_weights.remote(), timeout=600))
    finally:
        stop(trainers + [lock])
    times = [r["perf/update_weights_time"] for r in runs]
    return runs[0]["perf/update_weights_bytes"], min(times), statistics.median(times)


def fingerprint_cost(args, engines, repeats, rollout_tokens, swap=False):
    """One step as the driver runs it, for a trainer with the check and one without, alternated push by push, each
    side with its own engine (an engine asked once hashes every later push as it lands): the push (the weight
    update's time), a rollout (16 concurrent requests to the engine, the stand-in for generation, during which the
    trainer and the engine finish hashing), then, with the check, the check itself, as `Run` runs it before the
    version's samples train (the trainer's hashes, the engine's fingerprint, compared). Per pair the ratios. The
    side started first runs without the check, or with it under `swap`: run both to cancel what the start order
    alone does."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from slime.ray.utils import Lock
    from slime.rollout.weight_fingerprints import engine_mismatch
    from tests.test_weight_sync import start_trainers, stop

    args.update_weight_transport, args.update_weight_mode = "auto", "full"
    sides, actors = {}, []
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (24,), generator=gen).tolist() for _ in range(16)]
    sampling = {"max_new_tokens": rollout_tokens, "temperature": 0.8, "ignore_eos": True}
    pool = ThreadPoolExecutor(len(prompts))
    try:
        for on, engine in zip((True, False) if swap else (False, True), engines):
            args.check_weight_fingerprints = on
            trainers, lock = start_trainers(args, colocate=False), Lock.remote()
            actors += trainers + [lock]
            ray.get(trainers[0].connect.remote([engine], lock), timeout=600)
            sides[on] = (trainers[0], engine, ray.get(engine.get_url.remote(), timeout=60))

        def rollout(url):
            def one(ids):
                r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=600)
                r.raise_for_status()

            list(pool.map(one, prompts))

        def step(on):
            """(push, rollout, check) wall times in seconds; the check is 0 without it."""
            trainer, engine, url = sides[on]
            t0 = time.perf_counter()
            version = ray.get(trainer.push.remote(), timeout=600)["update_weights/weight_version"]
            t1 = time.perf_counter()
            rollout(url)
            t2 = time.perf_counter()
            if on:
                sent = ray.get(trainer.sent_weight_hashes.remote(), timeout=600)
                algorithm = sent["update_weights/tensor_hash_algorithm"]
                info = ray.get(engine.get_weights_fingerprint.remote(600, algorithm), timeout=600)
                mismatch = engine_mismatch(sent["update_weights/tensor_hashes"], info, version, "the engine")
                assert mismatch is None, mismatch
            return t1 - t0, t2 - t1, time.perf_counter() - t2

        for on in (False, True, True):  # warm-up: connections, first-touch pages, the engine's first (whole) hash
            step(on)
        runs = {False: [], True: []}
        for i in range(repeats):
            for on in (False, True) if i % 2 == 0 else (True, False):
                runs[on].append(step(on))
    finally:
        pool.shutdown()
        stop(actors)
    args.check_weight_fingerprints = True

    def med(on, k):
        return statistics.median(r[k] for r in runs[on]) * 1e3

    def ratio(label, part):
        rs = sorted(part(a) / part(b) for a, b in zip(runs[True], runs[False]))
        print(f"  {label:<34} median {statistics.median(rs):.3f}x (range {rs[0]:.3f}-{rs[-1]:.3f})")

    first = "with" if swap else "without"
    print(
        f"fingerprint cost, shm path, {repeats} steps each, alternated; rollout 16 x {rollout_tokens} tokens; {first} started first"
    )
    print(f"  without: push {med(False, 0):.1f} ms, rollout {med(False, 1):.1f} ms")
    print(
        f"  with:    push {med(True, 0):.1f} ms, rollout {med(True, 1):.1f} ms, then the check {med(True, 2):.1f} ms"
    )
    ratio("the weight update (push), with/without", lambda r: r[0])
    ratio("the rollout after it", lambda r: r[1])
    ratio("the whole step (push, rollout, check)", lambda r: sum(r))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SIZES), default="mid", help="synthetic model size (default mid)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", nargs="+", choices=[m for m, _ in MODES], default=[m for m, _ in MODES])
    p.add_argument("--fingerprint", action="store_true", help="the weight fingerprint's share of a push, then exit")
    p.add_argument("--rollout-tokens", type=int, default=32, help="--fingerprint: tokens per request of the rollout")
    p.add_argument("--swap", action="store_true", help="--fingerprint: start the side with the check first")
    p.add_argument("--bytes", action="store_true", help="bytes per update into FP8 / INT4 engines vs bf16, then exit")
    opts = p.parse_args()
    if opts.bytes:
        return bytes_report()
    hidden, ffn, layers = SIZES[opts.model]
    opts.hidden, opts.ffn, opts.layers = opts.hidden or hidden, opts.ffn or ffn, opts.layers or layers

    from tests._megatron_helpers import megatron_args
    from tests.test_weight_sync import start_engines, stop
    from tools.build_tiny_kit import build_model

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-weight-sync-")
    engines = []
    try:
        model_dir = os.path.join(workdir, "model")
        build_model(model_dir, hidden=opts.hidden, ffn=opts.ffn, layers=opts.layers)
        nbytes = sum(
            os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
        )
        print(
            f"model: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, fp32, {nbytes / 1e6:.0f} MB on disk"
        )
        memcpy_before = memcpy_gbps(nbytes)
        ray.init(
            num_cpus=8,
            num_gpus=4,
            include_dashboard=False,
            object_store_memory=1 << 30,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        )
        args = megatron_args(
            model_dir,
            rollout_num_gpus_per_engine=1,
            rollout_num_gpus_per_node=4,
            inference_server="cpu",
            update_weight_buffer_size=512 << 20,
            update_weight_timeout=600,
            check_weight_update_equal=False,
        )
        engines = start_engines(args, 2 if opts.fingerprint else 1)
        if opts.fingerprint:
            return fingerprint_cost(args, engines, opts.repeats, opts.rollout_tokens, opts.swap)
        results = {mode: bench_mode(args, engines[0], mode, opts.repeats, workdir) for mode in opts.modes}
    finally:
        stop(engines)
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    # best of the runs on both sides: on a shared machine the best is the least disturbed measurement
    memcpy = max(memcpy_before, memcpy_gbps(nbytes))
    print(f"best of {opts.repeats} updates (median in brackets); memcpy = copy into an existing buffer, best of 10")
    print(f"{'path':<12}{'MB':>8}{'ms':>18}{'GB/s':>8}{'x memcpy':>10}{'target':>8}")
    print(f"{'memcpy':<12}{nbytes / 1e6:>8.1f}{nbytes / memcpy / 1e6:>18.2f}{memcpy:>8.2f}{1.0:>10.3f}")
    for mode, target in MODES:
        if mode not in results:
            continue
        moved, best, median = results[mode]
        gbps = moved / best / 1e9
        print(
            f"{mode:<12}{moved / 1e6:>8.1f}{f'{best * 1e3:.2f} ({median * 1e3:.2f})':>18}{gbps:>8.2f}{gbps / memcpy:>10.3f}{target or '':>8}"
        )
    if "delta" in results:
        print(
            f"delta: {results['delta'][0] / 1e6:.1f} MB written = {results['delta'][0] / nbytes:.2f}x the full version"
        )


if __name__ == "__main__":
    main()
