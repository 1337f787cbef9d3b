"""Convert a full-precision HuggingFace checkpoint to compressed-tensors W4A16 (round to nearest, no calibration),
with current slime's command line.

    python tools/convert_hf_to_int4_direct.py --model-dir Qwen3-30B-A3B --save-dir Qwen3-30B-A3B-INT4 \
        --group-size 128 --is-symmetric

Every 2-D `.weight` that no `--ignore-rules` entry matches becomes `weight_packed` (int32, 8 nibbles),
`weight_scale` (per row per group, in the weight's dtype) and `weight_shape` (int32 [2]), plus `weight_zero_point`
when asymmetric (the default, as in current slime). A rule `re:<regex>` matches with re.match; a plain rule matches
a name equal to it or starting with it. The default rules (slime.utils.quantization.INT4_DEFAULT_IGNORE_RULES:
current slime's, plus the shared expert, linear attention, MiniMax-M2's router, vision and MTP projections that
those miss) leave only routed MoE experts quantised: a dense model gets nothing quantised. The quantiser is
slime.utils.quantization's, shared with the CPU server.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.utils import quantization as Q  # noqa: E402
from tools._quant_io import rewrite_checkpoint  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--is-symmetric", action="store_true", help="symmetric codes -7..7 (default: asymmetric 0..15)")
    p.add_argument("--ignore-rules", nargs="+", default=list(Q.INT4_DEFAULT_IGNORE_RULES))
    p.add_argument("--max-workers", type=int, default=1)
    args = p.parse_args(argv)
    if args.group_size <= 0 or args.group_size % Q.PACK:
        p.error(f"--group-size must be a positive multiple of {Q.PACK}, got {args.group_size}")
    return args


def convert(
    model_dir, save_dir, group_size=32, symmetric=False, ignore_rules=Q.INT4_DEFAULT_IGNORE_RULES, max_workers=1
):
    qc = Q.int4_config(group_size, symmetric, ignore_rules)
    scheme = Q.QuantScheme(qc)
    rewrite_checkpoint(
        model_dir,
        save_dir,
        lambda _fn, named: list(Q.quantize_named_tensors(named, scheme)),
        quantization_config=qc,
        max_workers=max_workers,
    )
    return qc


def main(argv=None):
    a = parse_args(argv)
    convert(a.model_dir, a.save_dir, a.group_size, a.is_symmetric, a.ignore_rules, a.max_workers)
    print(f"wrote {a.save_dir}")


if __name__ == "__main__":
    main()
