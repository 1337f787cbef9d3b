"""Dequantise an FP8 HuggingFace checkpoint to BF16 (current slime's command line).

    python tools/fp8_cast_bf16.py --input-fp8-hf-path DeepSeek-R1 --output-bf16-hf-path DeepSeek-R1-bf16

Every e4m3 tensor with a `<name>_scale_inv` (block scales; the tile from config.json's `weight_block_size`, 128 x 128
when absent) or a `<name>_scale` (per-tensor / per-channel) becomes W = q * s (fp32 product, rounded once to bf16);
its scale is dropped and other tensors are copied unchanged. Unlike current slime's tool, the output's config.json
loses its `quantization_config` (so the result is a plain BF16 `--hf-checkpoint`) and says `torch_dtype: bfloat16`.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.utils import quantization as Q  # noqa: E402
from tools._quant_io import rewrite_checkpoint  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input-fp8-hf-path", required=True)
    p.add_argument("--output-bf16-hf-path", required=True)
    return p.parse_args(argv)


def _block_size(model_dir):
    path = os.path.join(model_dir, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            qc = json.load(f).get("quantization_config") or {}
        if qc.get("weight_block_size"):
            return tuple(qc["weight_block_size"])
    return (128, 128)


def convert(src, dst, dtype=torch.bfloat16):
    block = _block_size(src)
    scales = {}

    def one(_fn, named):
        tensors = dict(named)
        out = []
        for name, t in named:
            if name.endswith(("_scale_inv", "_scale")) and name.rsplit("_scale", 1)[0] in tensors:
                continue  # folded into its weight below
            if t.dtype == Q.FP8_DTYPE:
                if name + "_scale_inv" in tensors:
                    t = Q.dequantize_fp8(t, tensors[name + "_scale_inv"], block, dtype)
                elif name + "_scale" in tensors:
                    t = Q.dequantize_fp8(t, tensors[name + "_scale"], None, dtype)
                else:
                    raise SystemExit(f"{name}: an FP8 tensor without {name}_scale_inv or {name}_scale")
                scales[name] = True
            out.append((name, t))
        return out

    rewrite_checkpoint(
        src, dst, one, drop_quantization=True, config_updates={"torch_dtype": str(dtype).split(".")[-1]}
    )
    return scales


def main(argv=None):
    a = parse_args(argv)
    convert(a.input_fp8_hf_path, a.output_bf16_hf_path)
    print(f"wrote {a.output_bf16_hf_path}")


if __name__ == "__main__":
    main()
