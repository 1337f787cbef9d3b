"""Shared by the checkpoint converters: rewrite every top-level `*.safetensors` file of an HF directory through a
function of its (name, tensor) pairs, copy the other top-level files, write a fresh weight index, and set or remove
`quantization_config` in config.json."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"


def rewrite_checkpoint(
    model_dir,
    save_dir,
    convert,
    *,
    quantization_config=None,
    drop_quantization=False,
    config_updates=None,
    max_workers=1,
):
    """`convert(file_name, [(name, tensor)]) -> [(name, tensor)]` per file. Returns the new weight map."""
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise SystemExit(f"{model_dir}: no *.safetensors files")
    os.makedirs(save_dir, exist_ok=True)
    for f in os.listdir(model_dir):
        src = os.path.join(model_dir, f)
        if os.path.isfile(src) and not f.endswith(".safetensors") and f != INDEX:
            shutil.copy2(src, os.path.join(save_dir, f))

    def one(fn):
        with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
            named = [(k, f.get_tensor(k)) for k in f.keys()]
            metadata = f.metadata() or {"format": "pt"}
        out = dict(convert(fn, named))
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(save_dir, fn), metadata=metadata)
        return fn, {k: v.numel() * v.element_size() for k, v in out.items()}

    with ThreadPoolExecutor(max(1, max_workers)) as pool:
        results = list(pool.map(one, files))
    weight_map, total = {}, 0
    for fn, sizes in results:
        for k, n in sizes.items():
            weight_map[k] = fn
            total += n
    with open(os.path.join(save_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)

    cfg_path = os.path.join(save_dir, "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
        if drop_quantization:
            cfg.pop("quantization_config", None)
        if quantization_config is not None:
            cfg["quantization_config"] = quantization_config
        cfg.update(config_updates or {})
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    return weight_map
