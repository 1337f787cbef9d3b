"""Convert a Megatron torch_dist checkpoint (a training `iter_xxxxxxx` or a converter `release`) to HF safetensors.

    python tools/convert_torch_dist_to_hf.py --input-dir /root/ckpt/iter_0000099 --output-dir /root/Qwen3-4B-rl \
        --origin-hf-dir /root/Qwen3-4B

No distributed setup and no model construction: the shards are read with torch.distributed.checkpoint straight
from `.metadata` + `*.distcp` (tensors are stored in global, TP/PP-independent coordinates, so any training layout
works), about one shard's worth at a time, and renamed with slime's Megatron->HF converters (`megatron_to_hf.convert_to_hf`).
The architecture comes from the `args` slime stores in `common.pt` (else from `--origin-hf-dir`/config.json); every
non-weight file of `--origin-hf-dir` (config, tokenizer, generation config) is copied next to the weights.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

TRACKER = "latest_checkpointed_iteration.txt"
_MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.", "visual.")
_MTP_EXPERTS = ".transformer_layer.mlp.experts.experts."
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class UserError(Exception):
    pass


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Megatron torch_dist checkpoint -> HF safetensors (slime).")
    p.add_argument("--input-dir", required=True, help="{save}/iter_xxxxxxx or {save}/release (or {save} itself)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--origin-hf-dir", default=None, help="HF dir whose config/tokenizer files are copied over")
    p.add_argument("--model-name", default=None, help="converter family (qwen2, qwen3, qwen3moe, llama)")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="strip Megatron's vocab padding down to this many rows (default: origin config's vocab_size)",
    )
    p.add_argument("--chunk-size", type=int, default=5 * 1024**3, help="max bytes per safetensors shard")
    p.add_argument("-f", "--force", action="store_true", help="overwrite the weights in an existing --output-dir")
    return p.parse_args(argv)


# ---- checkpoint location and architecture ---------------------------------------------------------------------


def resolve_input_dir(path):
    """The torch_dist directory itself; a `--save` root is followed through its tracker file."""
    if not os.path.isdir(path):
        raise UserError(
            f"--input-dir {path} does not exist (expected a torch_dist checkpoint such as "
            "{save}/iter_0000010 or {save}/release)."
        )
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    tracker = os.path.join(path, TRACKER)
    if os.path.exists(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        if it == "release" or it.isdigit():
            sub = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
            if os.path.exists(os.path.join(sub, ".metadata")):
                return sub
    raise UserError(
        f"--input-dir {path} is not a torch_dist checkpoint: it has no .metadata file (nor a {TRACKER} "
        "pointing at one). Pass the iteration directory, e.g. {save}/iter_0000010."
    )


def load_common(ckpt_dir):
    path = os.path.join(ckpt_dir, "common.pt")
    if not os.path.exists(path):
        return {}
    # slime keeps plain-valued args there; Megatron-LM checkpoints also hold megatron-core classes (its safe globals).
    import megatron.core  # noqa: F401  (registers megatron-core's torch.load safe globals)

    # Registered for good, as megatron-core does: a `safe_globals([...])` context would unregister Namespace on exit,
    # and a process that converts and then loads a Megatron checkpoint (common.pt holds the run's args) would fail.
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # objects we will not unpickle: the architecture must then come from --origin-hf-dir
        print(
            f"convert_torch_dist_to_hf: ignoring {path} ({type(e).__name__}: {str(e).splitlines()[0]})",
            file=sys.stderr,
        )
        return {}


def model_args(common, origin_hf_dir):
    """Architecture flags (heads, query groups, kv channels, tying, vocab, model name) for the converters."""
    args = common.get("args")
    hf_cfg = None
    if origin_hf_dir:
        from transformers import AutoConfig  # heavy: only with --origin-hf-dir

        hf_cfg = AutoConfig.from_pretrained(origin_hf_dir, trust_remote_code=True)
    if args is None:
        if hf_cfg is None:
            raise UserError(
                "the checkpoint's common.pt has no `args` (not saved by slime): pass --origin-hf-dir so "
                "the architecture can be read from its config.json."
            )
        from slime.backends.megatron_utils.hf_config import hf_architecture  # heavy: only without slime's args

        args = argparse.Namespace(**hf_architecture(hf_cfg))
    # Args stored by another trainer (Megatron-LM, an older slime) or read from config.json may lack these fields.
    for name, default in (("model_name", None), ("vocab_size", None), ("untie_embeddings_and_output_weights", False)):
        if not hasattr(args, name):
            setattr(args, name, default)
    if hf_cfg is not None and not args.model_name:
        args.model_name = type(hf_cfg).__name__.lower()
    return args, hf_cfg


# ---- reading regions of the global tensors --------------------------------------------------------------------


@dataclasses.dataclass
class Region:
    """`name` (Megatron parameter) = the block of checkpoint tensor `key` at `offsets` with shape `sizes`."""

    name: str
    key: str
    offsets: tuple
    sizes: tuple
    dtype: torch.dtype
    stacked: int = 0  # leading stacking axes (layer, expert) dropped from the result

    @property
    def nbytes(self):
        n = self.dtype.itemsize
        for s in self.sizes:
            n *= s
        return n


def model_regions(metadata, tied):
    """One Region per Megatron parameter, layer by layer. Megatron stacks layers (and MoE experts) along leading
    axes: `decoder.layers.X` is [num_layers, ...], `decoder.layers.mlp.experts.experts.X` is [layers, experts, ...]."""
    head, layers, tail = [], {}, []
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not key.startswith(_MODEL_KEY_PREFIXES):
            continue  # optimizer state, RNG, TE `_extra_state` bytes
        if tied and key == "output_layer.weight":
            continue  # tied to the embedding: HF stores it once
        size, dtype = tuple(meta.size), meta.properties.dtype
        if key.startswith("mtp."):  # MTP layers (after the decoder): one tensor each, experts stacked
            if _MTP_EXPERTS in key:
                layer, local = key.split(".mlp.experts.experts.", 1)
                for e in range(size[0]):
                    name = f"{layer}.mlp.experts.local_experts.{e}.{local}"
                    tail.append(Region(name, key, (e,) + (0,) * (len(size) - 1), (1,) + size[1:], dtype, 1))
            else:
                tail.append(Region(key, key, (0,) * len(size), size, dtype))
            continue
        rest = key[len("decoder.layers.") :] if key.startswith("decoder.layers.") else None
        if rest is not None and rest.split(".", 1)[0].isdigit() and ".mlp.experts.experts." in rest:
            # a per-layer key (dense and MoE layers mixed) still stacks its experts along the first axis
            layer, local = rest.split(".mlp.experts.experts.", 1)
            for e in range(size[0]):
                layers.setdefault(int(layer), []).append(
                    Region(
                        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{local}",
                        key,
                        (e,) + (0,) * (len(size) - 1),
                        (1,) + size[1:],
                        dtype,
                        1,
                    )
                )
            continue
        if rest is None or rest.split(".", 1)[0].isdigit():  # not stacked: top-level or per-layer (heterogeneous) keys
            region = Region(key, key, (0,) * len(size), size, dtype)
            if rest is not None:
                layers.setdefault(int(rest.split(".", 1)[0]), []).append(region)
            else:
                (tail if key.startswith(("decoder.final_layernorm", "output_layer.")) else head).append(region)
            continue
        experts = rest.startswith("mlp.experts.experts.")
        for layer in range(size[0]):
            if experts:
                local = rest[len("mlp.experts.experts.") :]
                for e in range(size[1]):
                    layers.setdefault(layer, []).append(
                        Region(
                            f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{local}",
                            key,
                            (layer, e) + (0,) * (len(size) - 2),
                            (1, 1) + size[2:],
                            dtype,
                            2,
                        )
                    )
            else:
                layers.setdefault(layer, []).append(
                    Region(
                        f"decoder.layers.{layer}.{rest}",
                        key,
                        (layer,) + (0,) * (len(size) - 1),
                        (1,) + size[1:],
                        dtype,
                        1,
                    )
                )
    return head + [r for layer in sorted(layers) for r in layers[layer]] + tail


class _RegionPlanner(DefaultLoadPlanner):
    """Reads each Region into its own buffer; buffers are keyed by their index, so one checkpoint tensor can feed
    many regions in a single pass over the files."""

    def __init__(self, regions, buffers):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions, self.buffers = regions, buffers

    def create_local_plan(self):
        items = []
        for i, r in enumerate(self.regions):
            chunk = ChunkStorageMetadata(offsets=torch.Size(r.offsets), sizes=torch.Size(r.sizes))
            for item in create_read_items_for_chunk_list(r.key, self.metadata.state_dict_metadata[r.key], [chunk]):
                items.append(dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=str(i))))
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        buf = self.buffers[int(read_item.dest_index.fqn)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            buf = buf.narrow(dim, start, length)
        return buf


def read_regions(reader, regions):
    buffers = [torch.empty(r.sizes, dtype=r.dtype) for r in regions]
    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=reader, planner=_RegionPlanner(regions, buffers), no_dist=True)
    return [b.reshape(r.sizes[r.stacked :]) for r, b in zip(regions, buffers)]


# ---- writing ---------------------------------------------------------------------------------------------------


class ShardWriter:
    """Safetensors shards of at most `chunk_size` bytes; `model.safetensors` alone, or `model-0000i-of-0000n` +
    `model.safetensors.index.json` as transformers writes them."""

    def __init__(self, output_dir, chunk_size):
        self.output_dir, self.chunk_size = output_dir, chunk_size
        self.current, self.current_bytes, self.files, self.weight_map, self.total = {}, 0, [], {}, 0

    def add(self, name, tensor):
        if name in self.weight_map or name in self.current:
            raise ValueError(f"two Megatron tensors convert to the same HF tensor {name!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.chunk_size:
            self._flush()
        # clone: the converters return views (gate/up halves); safetensors wants distinct, contiguous storage
        self.current[name] = tensor.detach().clone(memory_format=torch.contiguous_format)
        self.current_bytes += nbytes
        self.total += nbytes

    def _flush(self):
        path = os.path.join(self.output_dir, f".shard-{len(self.files):05d}.tmp")
        save_file(self.current, path, metadata={"format": "pt"})
        self.files.append((path, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self):
        if self.current:
            self._flush()
        n = len(self.files)
        for i, (tmp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.output_dir, final))
            self.weight_map.update({k: final for k in names})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
            with open(os.path.join(self.output_dir, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return n


def pass_through_mtp(origin_hf_dir, writer):
    """A checkpoint saved without `--mtp-num-layers` has no MTP layers: copy MiMo's (`model.mtp_layers.*`) and
    Qwen3-Next / Qwen3.5's (`mtp.*`) from the origin checkpoint unchanged, so the export stays a complete checkpoint."""
    from slime.backends.megatron_utils.megatron_to_hf.hf_to_megatron import SafetensorsReader  # heavy (Megatron)

    origin = SafetensorsReader(origin_hf_dir)
    for name in sorted(origin.key_to_file):
        if name.startswith(("model.mtp_layers.", "mtp.")):
            writer.add(name, origin.get(name))


def prepare_output_dir(output_dir, force):
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise UserError(f"--output-dir {output_dir} exists and is not a directory.")
        if os.listdir(output_dir) and not force:
            raise UserError(
                f"--output-dir {output_dir} already exists and is not empty; pass -f to overwrite the "
                "weights there, or pick another directory."
            )
        for fname in os.listdir(output_dir):  # stale shards of an earlier export would mix with the new ones
            if fname.endswith(_WEIGHT_SUFFIXES) or fname in _WEIGHT_INDEXES or fname.startswith(".shard-"):
                os.remove(os.path.join(output_dir, fname))
    os.makedirs(output_dir, exist_ok=True)


def copy_hf_files(origin_hf_dir, output_dir):
    """Config, tokenizer and generation files: every top-level file of the origin dir that is not a weight file."""
    for fname in sorted(os.listdir(origin_hf_dir)):
        src = os.path.join(origin_hf_dir, fname)
        if os.path.isfile(src) and not fname.endswith(_WEIGHT_SUFFIXES) and fname not in _WEIGHT_INDEXES:
            shutil.copy2(src, os.path.join(output_dir, fname))


# ---- main ------------------------------------------------------------------------------------------------------


def convert(
    input_dir, output_dir, *, origin_hf_dir=None, model_name=None, vocab_size=None, chunk_size=5 * 1024**3, force=False
):
    """Write the HF export of `input_dir` to `output_dir`; returns the number of safetensors shards."""
    if origin_hf_dir is not None and not os.path.isdir(origin_hf_dir):
        raise UserError(f"--origin-hf-dir {origin_hf_dir} is not a directory.")
    if chunk_size <= 0:
        raise UserError(f"--chunk-size {chunk_size}: must be a positive number of bytes.")
    ckpt = resolve_input_dir(input_dir)
    # heavy (Megatron): after the argument checks
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf, get_family
    from slime.backends.megatron_utils.megatron_to_hf._common import CheckpointLayout
    from slime.backends.megatron_utils.param_utils import PREFIX, remove_padding

    args, hf_cfg = model_args(load_common(ckpt), origin_hf_dir)
    model_name = model_name or args.model_name
    if not model_name:
        raise UserError(
            "cannot tell which converter to use: pass --model-name (qwen2, qwen3, qwen3moe, llama) or --origin-hf-dir."
        )
    try:
        get_family(model_name)
    except ValueError as e:
        raise UserError(str(e)) from None
    if vocab_size is None:
        vocab_size = getattr(hf_cfg, "vocab_size", None) or args.vocab_size
    tied = not args.untie_embeddings_and_output_weights

    reader = FileSystemReader(ckpt)
    regions = model_regions(reader.read_metadata(), tied)
    # the MTP layers the checkpoint holds (DeepSeek-V3 / GLM-4.5 exports repeat the embedding and head in each)
    args.mtp_num_layers = len({r.name.split(".")[2] for r in regions if r.name.startswith("mtp.")}) or None
    if not regions:
        raise UserError(
            f"--input-dir {ckpt}: the checkpoint holds no model tensors (embedding./decoder./output_layer.)."
        )
    prepare_output_dir(output_dir, force)
    writer = ShardWriter(output_dir, chunk_size)
    layout = CheckpointLayout(get_family(model_name), args.num_experts)  # e.g. Qwen3-VL-MoE's stacked experts
    batch, batch_bytes = [], 0
    for i, region in enumerate(regions):  # read about a shard's worth at a time: memory stays ~2 shards
        batch.append(region)
        batch_bytes += region.nbytes
        if batch_bytes < chunk_size and i + 1 < len(regions):
            continue
        for r, tensor in zip(batch, read_regions(reader, batch)):
            name = PREFIX + r.name
            for hf_name, hf_tensor in convert_to_hf(args, model_name, name, remove_padding(name, tensor, vocab_size)):
                for ready in layout.add(hf_name, hf_tensor):
                    writer.add(*ready)
        batch, batch_bytes = [], 0
    layout.close()
    if origin_hf_dir and not args.mtp_num_layers:
        pass_through_mtp(origin_hf_dir, writer)
    shards = writer.close()
    if origin_hf_dir:
        copy_hf_files(origin_hf_dir, output_dir)
    return shards


def main(argv=None):
    a = parse_args(argv)
    try:
        shards = convert(
            a.input_dir,
            a.output_dir,
            origin_hf_dir=a.origin_hf_dir,
            model_name=a.model_name,
            vocab_size=a.vocab_size,
            chunk_size=a.chunk_size,
            force=a.force,
        )
    except UserError as e:
        sys.exit(f"convert_torch_dist_to_hf: {e}")
    print(f"wrote {shards} safetensors shard(s) to {a.output_dir}")


if __name__ == "__main__":
    main()
