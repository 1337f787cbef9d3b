"""Convert a full-precision HuggingFace checkpoint to FP8 e4m3 (current slime's command line).

    python tools/convert_hf_to_fp8.py --model-dir Qwen3-4B --save-dir Qwen3-4B-FP8 --strategy block --block-size 128 128

`block`: `X.weight` e4m3 + `X.weight_scale_inv` fp32 per (bn, bk) tile, config `quant_method: fp8` with
`weight_block_size` (the format slime's FP8 rollout serves); `tensor`: one `X.weight_scale` per tensor, same config
without `weight_block_size`; `channel`: `X.weight_scale` per output row, a compressed-tensors float-quantized W8A8
config. Quantised: every 2-D `.weight` except embeddings, lm_head, norms, routers (`mlp.gate.`), shared-expert gates,
MTP `eh_proj`/`fc`/`input_proj`/`shared_head.head`, indexer `weights_proj`, linear-attention conv1d/A_log/dt_bias/
in_proj_a/b (slime.utils.quantization.FP8_SKIP_SUBSTRINGS); those are copied unchanged and listed in
`modules_to_not_convert`. The quantiser is slime.utils.quantization's, shared with the CPU server.
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
    p.add_argument("--strategy", choices=["block", "channel", "tensor"], default="block")
    p.add_argument("--block-size", type=int, nargs="*", default=None)
    p.add_argument("--max-workers", type=int, default=1)
    p.add_argument("--scale-fmt", choices=["ue8m0"], default=None)
    args = p.parse_args(argv)
    if args.strategy == "block" and (not args.block_size or len(args.block_size) != 2):
        p.error("--strategy block needs --block-size N K (e.g. --block-size 128 128)")
    if args.scale_fmt:
        p.error("--scale-fmt ue8m0 is not supported: power-of-two scales are DeepGEMM's (Blackwell GPUs) layout")
    return args


def convert(model_dir, save_dir, strategy="block", block_size=None, max_workers=1):
    not_converted = set()

    def one(_fn, named):
        out = []
        for name, t in named:
            if not Q.fp8_should_quantize(name, t):
                if name.endswith(".weight"):
                    not_converted.add(name[: -len(".weight")])
                out.append((name, t))
                continue
            if strategy == "block":
                q, s = Q.quantize_fp8_block(t, block_size)
                scale_name = name + "_scale_inv"
            elif strategy == "tensor":
                q, s = Q.quantize_fp8_tensor(t)
                scale_name = name + "_scale"
            else:
                q, s = Q.quantize_fp8_channel(t)
                scale_name = name + "_scale"
            out += [(name, q), (scale_name, s)]
        return out

    # the config lists what was left unconverted, known only once every file is done: write it afterwards
    rewrite_checkpoint(model_dir, save_dir, one, max_workers=max_workers)
    skipped = sorted(not_converted)
    qc = (
        Q.fp8_channel_config(skipped)
        if strategy == "channel"
        else Q.fp8_config(block_size if strategy == "block" else None, skipped)
    )
    _set_config(save_dir, qc)
    return qc


def _set_config(save_dir, qc):
    import json

    path = os.path.join(save_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def main(argv=None):
    a = parse_args(argv)
    convert(a.model_dir, a.save_dir, a.strategy, a.block_size, a.max_workers)
    print(f"wrote {a.save_dir}")


if __name__ == "__main__":
    main()
