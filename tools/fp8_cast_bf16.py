"""Dequantise an FP8 HuggingFace checkpoint to BF16 (current slime's command line).

    python tools/fp8_cast_bf16.py --input-fp8-hf-path DeepSeek-R1 --output-bf16-hf-path DeepSeek-R1-bf16

Every e4m3 tensor with a `<name>_scale_inv` (block scales; the tile from config.json's `weight_block_size`, 128 x 128
when absent) or a `<name>_scale` (per-tensor / per-channel) becomes W = q * s (fp32 product, rounded once to bf16);
its scale is dropped and other tensors are copied unchanged. A scale may sit in another shard than its weight (as
DeepSeek's own tool allows): it is found through the shards' headers. Unlike current slime's tool, the output's
config.json loses its `quantization_config` (so the result is a plain BF16 `--hf-checkpoint`) and says `bfloat16` in
both `torch_dtype` and `dtype` (transformers 5's name, which would otherwise keep the source's value).
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


def _shard_headers(model_dir):
    """{tensor name: (shard file, safetensors dtype string)} over every top-level `*.safetensors` file (headers only;
    the files rewrite_checkpoint rewrites, so a stale or missing index does not matter)."""
    from safetensors import safe_open

    where = {}
    for fn in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
            for k in f.keys():
                where[k] = (fn, f.get_slice(k).get_dtype())
    return where


def convert(src, dst, dtype=torch.bfloat16):
    from safetensors import safe_open

    block = _block_size(src)
    where = _shard_headers(src)
    scales = {}

    def is_fp8(name):
        return name in where and where[name][1] == "F8_E4M3"

    def scale_of(name, tensors):
        """(the scale of FP8 tensor `name`, its block size or None), from this shard or whichever holds it."""
        for suffix, bs in (("_scale_inv", block), ("_scale", None)):
            if name + suffix in tensors:
                return tensors[name + suffix], bs
            if name + suffix in where:
                with safe_open(os.path.join(src, where[name + suffix][0]), framework="pt") as f:
                    return f.get_tensor(name + suffix), bs
        raise SystemExit(f"{name}: an FP8 tensor without {name}_scale_inv or {name}_scale")

    def one(_fn, named):
        tensors = dict(named)
        out = []
        for name, t in named:
            if name.endswith(("_scale_inv", "_scale")) and is_fp8(name.rsplit("_scale", 1)[0]):
                continue  # folded into its weight, wherever that is
            if t.dtype == Q.FP8_DTYPE:
                s, bs = scale_of(name, tensors)
                t = Q.dequantize_fp8(t, s, bs, dtype)
                scales[name] = True
            out.append((name, t))
        return out

    name = str(dtype).split(".")[-1]
    rewrite_checkpoint(src, dst, one, drop_quantization=True, config_updates={"torch_dtype": name, "dtype": name})
    return scales


def main(argv=None):
    a = parse_args(argv)
    convert(a.input_fp8_hf_path, a.output_bf16_hf_path)
    print(f"wrote {a.output_bf16_hf_path}")


if __name__ == "__main__":
    main()
