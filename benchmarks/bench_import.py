"""What a slime process pays before its first step: a fresh interpreter importing slime and megatron-core's GPT model.

On CPU `import slime` makes megatron-core's fused helpers run eagerly (`slime.utils.device.eager_megatron_fusions`);
megatron's default wraps each in `torch.compile` at import time, which imports TorchDynamo. Both are timed here in
fresh interpreters, alternating, so that a shared machine's load falls on both alike:

- eager (what slime does):  `import slime` first, then megatron-core;
- default (megatron's own): megatron-core first, then `import slime` (its hook then leaves megatron as it is).

and prints the median wall seconds of each (min-max) and the median of the same-round ratios.

    .venv/bin/python benchmarks/bench_import.py [--repeats 7]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "megatron.core.models.gpt"
VARIANTS = {
    "eager (import slime first)": f"import slime, {MODEL}, megatron.core.jit as j; assert j.jit_fuser is j.noop_decorator",
    "default (megatron-core first)": f"import {MODEL}, slime, megatron.core.jit as j; assert j.jit_fuser is not j.noop_decorator",
}


def timed(code: str) -> float:
    t0 = time.perf_counter()
    # output captured: megatron imported before slime prints its missing-GPU-kernel warnings, as it would anyway
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True
    )
    if proc.returncode:
        raise RuntimeError(f"{code!r} failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    for code in VARIANTS.values():  # warm the page cache and bytecode for both
        timed(code)
    times = {k: [] for k in VARIANTS}
    for _ in range(a.repeats):
        for k, code in VARIANTS.items():
            times[k].append(timed(code))
    for k, ts in times.items():
        print(f"{k}: median {statistics.median(ts):.2f} s ({min(ts):.2f}-{max(ts):.2f} s)")
    (ke, eager), (kd, default) = times.items()
    ratios = [e / d for e, d in zip(eager, default)]
    print(
        f"ratio {ke} / {kd}: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x, "
        f"same-round pairs of {a.repeats})"
    )


if __name__ == "__main__":
    main()
