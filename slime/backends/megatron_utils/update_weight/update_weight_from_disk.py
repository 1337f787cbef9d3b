"""Weight sync through a filesystem (`--update-weight-transport disk`): each version is written once, as an HF
checkpoint directory (`--update-weight-mode full`) or as compressed deltas against the previous version
(`--update-weight-mode delta`), and the engines load it through SGLang's `update_weights_from_disk`.

Every pipeline stage's source rank (dp 0, tp 0) writes the HF tensors of its stage into one partial directory;
rank 0 then publishes it under `weight_v{N:06d}` in one rename (`slime.utils.disk_delta.publish`). With
`--update-weight-local-checkpoint-dir` each engine first pulls the version into its host's local checkpoint
(`/pull_weights`: a full version copied, a delta applied on its base; every file the index names is checked against
the checksum its writer recorded in the index, every delta tensor against its own, before the local checkpoint
changes) and reloads from there.
A delta that cannot be applied (wrong base, corrupt bytes) is answered by the same version published in full.

The first version a trainer process publishes is full, whatever the mode: a trainer that starts (or restarts after
dying mid-version, `--load`) cannot know what the engines hold (external engines outlive runs). Each later delta's
base is the version before it, whose bytes the source ranks keep in `--hf-checkpoint`'s dtypes.
"""

import logging
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors import SafetensorError
from safetensors.torch import save_file

from slime.backends.megatron_utils.initialize import get_gloo_group
from slime.backends.megatron_utils.lora import merge_for_sync
from slime.backends.megatron_utils.param_utils import expert_parallel_copies, named_parameters, with_parallel_attrs
from slime.utils import disk_delta
from slime.utils.user_errors import user_function

from .common import (
    SentHashes,
    WeightUpdateError,
    engine_urls,
    gather_and_convert,
    is_tied_output_copy,
    local_device,
    log_metrics,
    update_metrics,
    update_timeout,
    wait_engines,
)

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # a blockwise FP8 engine's checkpoint: the deltas are of its e4m3 bytes
}


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A copy: the tensor may be the live parameter itself (TP=1, no conversion), which training changes in place."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().copy()


class UpdateWeightFromDisk:
    def __init__(self, args, model, weights, *, model_name, quantization_config, vocab_size):
        self.args, self.model, self.weights = args, model, weights
        self.model_name, self.quantization_config, self.vocab_size = model_name, quantization_config, vocab_size
        self.weight_version = 0
        self.rollout_engines, self._urls = [], []
        self.delta = args.update_weight_mode == "delta"
        self.root = args.update_weight_disk_dir
        self.local_dir = args.update_weight_local_checkpoint_dir
        # the last version written (a re-push of it after an engine replacement is not rewritten); None: nothing
        # yet, so the next version is full
        self._published = None
        self._base = None  # delta: HF name -> (dtype, shape, bytes) of the last version sent (source ranks)
        self._base_version = 0  # the version `_base` holds once one was sent
        self._post_write = None
        # what this rank wrote in the last version written (a re-push only reloads it: the same tensors)
        self.sent_hashes = SentHashes(args)
        if args.custom_update_weight_post_write_path:
            self._post_write = user_function(
                "--custom-update-weight-post-write-path", args.custom_update_weight_post_write_path
            )

    @property
    def _is_pp_src_rank(self) -> bool:
        return is_pp_src_rank()

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        """No process group to build: the engines only read files (the first version is full: no base to seed)."""
        self.rollout_engines = list(rollout_engines)
        self._urls = engine_urls(self.rollout_engines, update_timeout(self.args))
        if self.delta and self._is_pp_src_rank and self._base is None:  # the dtypes the deltas are encoded in
            self._base = _read_checkpoint_bytes(self.args.hf_checkpoint)

    @torch.no_grad()
    def update_weights(self, weight_version=None) -> dict:
        start = time.perf_counter()
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        timeout = update_timeout(self.args)
        group = get_gloo_group()
        written, full_bytes = 0, 0
        if self._published != self.weight_version:  # a re-push after an engine replacement only reloads
            # a delta only on a version this process published (see the module doc)
            written, full_bytes = self._write_version(self.delta and self._published is not None)
        failed = [self._pull_failure(timeout) if self.local_dir and dist.get_rank() == 0 else None]
        dist.broadcast_object_list(failed, src=0, group=group)
        if failed[0]:  # a delta an engine could not apply: the same version again, in full
            logger.warning("update_weights v%s: %s; publishing it in full", self.weight_version, failed[0])
            written, full_bytes = self._write_version(delta=False)
            if dist.get_rank() == 0 and (failed := self._pull_failure(timeout)):
                raise WeightUpdateError(f"update_weights v{self.weight_version}: {failed}")
        if dist.get_rank() == 0:
            self._reload(timeout)
            if not self.args.update_weight_disk_keep_files:
                disk_delta.remove_versions_before(self.root, self.weight_version)
        totals = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(totals, (written, full_bytes), group=group)
        written, full_bytes = sum(w for w, _ in totals), sum(f for _, f in totals)
        self.sent_hashes.push_done()  # hashed in the background from here: `report` waits
        metrics = update_metrics(time.perf_counter() - start, written, self.weight_version)
        if self.delta and full_bytes:
            metrics["update_weights/delta_ratio"] = written / full_bytes
        if dist.get_rank() == 0:
            log_metrics(metrics)
        return metrics

    # ------------------------------------------------------------------ writing

    def _version_dirs(self):
        name = disk_delta.version_name(self.weight_version)
        return os.path.join(self.root, f".{name}.partial"), os.path.join(self.root, name)

    def _write_version(self, delta: bool):
        """Every rank takes part (TP gathers); the source ranks write. Returns (bytes written, bytes in full)."""
        group = get_gloo_group()
        partial, final = self._version_dirs()
        if dist.get_rank() == 0:  # a writer killed mid-version left this behind: start it afresh
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier(group=group)
        tensors = self._gather_stage()
        weight_map, written, full_bytes, failure, file_sum = {}, 0, 0, None, {}
        algorithm = self.args.update_weight_delta_checksum
        if self._is_pp_src_rank:
            fname = f"pp{mpu.get_pipeline_model_parallel_rank():03d}.safetensors"
            path = os.path.join(partial, fname)
            try:
                if delta:
                    written, full_bytes = self._write_delta(path, tensors)
                else:
                    if self._base is not None:  # delta mode's full version: in the dtypes the deltas are encoded in
                        tensors = {n: t.to(self._base[n][0]) if n in self._base else t for n, t in tensors.items()}
                        self._base.update({n: (t.dtype, list(t.shape), _bytes_of(t)) for n, t in tensors.items()})
                    save_file(tensors, path)
                    written = full_bytes = os.path.getsize(path)
                self.sent_hashes.reset()  # the tensors the engines load: the delta's are in the base's dtypes
                self.sent_hashes.add((n, t.to(self._base[n][0]) if delta else t) for n, t in tensors.items())
                # the file as written (read back, from the page cache): the engines verify it before loading
                file_sum = {fname: disk_delta.file_checksum(algorithm, path)}
            except (OSError, SafetensorError) as e:  # a full or failing disk: every rank raises below
                failure = f"cannot write {path} (--update-weight-disk-dir): {getattr(e, 'strerror', None) or e}"
            weight_map = dict.fromkeys(tensors, fname)
        maps = [None] * dist.get_world_size(group=group)
        dist.all_gather_object(maps, (weight_map, failure, file_sum), group=group)
        if failures := [f for _, f, _ in maps if f]:
            raise WeightUpdateError(
                f"update_weights v{self.weight_version}: {failures[0]}; the engines keep the last version"
            )
        file_sums = {f: c for _, _, sums in maps for f, c in sums.items()}
        maps = [m for m, _, _ in maps]
        if dist.get_rank() == 0:
            metadata = {"version": f"{self.weight_version:06d}", "format": "pt", "checksum_format": algorithm}
            if delta:
                metadata.update(
                    base_version=f"{self._base_version:06d}",
                    delta_encoding=self.args.update_weight_delta_encoding,
                    compression_format="zstd",
                )
            try:
                disk_delta.publish(
                    partial,
                    final,
                    {n: f for m in maps for n, f in m.items()},
                    metadata,
                    self.args.hf_checkpoint,
                    file_checksums=file_sums,
                )
            except OSError as e:
                raise WeightUpdateError(
                    f"update_weights v{self.weight_version}: cannot publish {final} (--update-weight-disk-dir): {e}"
                ) from e
        dist.barrier(group=group)
        self._published = self._base_version = self.weight_version
        if self._post_write is not None:
            self._post_write(self.args, final, list(self.rollout_engines))
            dist.barrier(group=group)
        return written, full_bytes

    def _gather_stage(self) -> dict:
        return gather_stage(
            self.args, self._named_weights(), self.model_name, self.vocab_size, self.quantization_config
        )

    def _named_weights(self):
        """The trainer's shards from its CPU weight dict, which stays valid while the trainer sleeps (--offload-train:
        the parameters' memory is released then), on the device its gathers run on."""
        device, weights = local_device(), self.weights["actor"]
        for name, param in named_parameters(self.args, self.model):
            yield name, with_parallel_attrs(weights[name].to(device, non_blocking=True), param)

    def _write_delta(self, path, tensors):
        """Encode each tensor against the base (cast to the base's dtype: the engines' checkpoint keeps its own)."""
        blobs, sums, full = {}, {}, 0
        algorithm, encoding = self.args.update_weight_delta_checksum, self.args.update_weight_delta_encoding
        for name, t in tensors.items():
            if name not in self._base:
                raise WeightUpdateError(
                    f"update_weights v{self.weight_version}: {name!r} is not in --hf-checkpoint "
                    f"{self.args.hf_checkpoint}, the base of the deltas"
                )
            dtype, shape, old = self._base[name]
            new = _bytes_of(t.to(dtype).reshape(shape))
            blobs[name] = disk_delta.encode(encoding, new, old)
            sums[name] = disk_delta.checksum(algorithm, new)
            self._base[name] = (dtype, shape, new)
            full += new.size
        return disk_delta.save_delta_file(path, blobs, sums), full

    # ------------------------------------------------------------------ engines

    def _pull(self, version, timeout):
        refs = [
            e.pull_weights.remote(version, source_dir=self.root, local_checkpoint_dir=self.local_dir)
            for e in self.rollout_engines
        ]
        return wait_engines(refs, self._urls, f"pull_weights v{version}", timeout)

    def _pull_failure(self, timeout):
        """None, or why an engine could not bring its local checkpoint to this version."""
        try:
            self._pull(self.weight_version, timeout)
        except WeightUpdateError as e:
            return str(e)
        return None

    def _reload(self, timeout):
        path = self.local_dir or self._version_dirs()[1]
        what = f"update_weights_from_disk v{self.weight_version} from {path}"
        for call in ("pause_generation", "flush_cache"):
            wait_engines([getattr(e, call).remote() for e in self.rollout_engines], self._urls, call, timeout)
        refs = [
            e.update_weights_from_disk.remote(path, weight_version=str(self.weight_version))
            for e in self.rollout_engines
        ]
        wait_engines(refs, self._urls, what, timeout)
        refs = [e.continue_generation.remote() for e in self.rollout_engines]
        wait_engines(refs, self._urls, "continue_generation", timeout)


def is_pp_src_rank() -> bool:
    """The rank that writes its pipeline stage's tensors: data-parallel (with context) rank 0, tensor rank 0."""
    return mpu.get_data_parallel_rank(with_context_parallel=True) == 0 and mpu.get_tensor_model_parallel_rank() == 0


def gather_stage(args, named_params, model_name, vocab_size, quantization_config=None) -> dict:
    """This pipeline stage's HF tensors from its `named_params` [(global name, local shard with its TP attributes)]
    (on its source rank; the other ranks only help gather); under --enable-lora the adapted weights merged
    (W + s B A), the adapters themselves left out."""
    tensors, src = {}, is_pp_src_rank()
    for name, param in merge_for_sync(args, named_params):
        if is_tied_output_copy(args, name):
            continue
        for n, p in expert_parallel_copies(args, name, param):
            for hf_name, t in gather_and_convert(args, model_name, n, p, vocab_size, quantization_config):
                if src:
                    tensors[hf_name] = t.cpu()
    return tensors


def _read_checkpoint_bytes(hf_checkpoint) -> dict:
    """HF name -> (dtype, shape, bytes) of every tensor of the checkpoint the engines started from."""
    out = {}
    for name, loc in disk_delta.tensor_locations(hf_checkpoint).items():
        dtype = _SAFETENSORS_DTYPES.get(loc[3])
        if dtype is None:
            raise WeightUpdateError(f"--hf-checkpoint {hf_checkpoint}: tensor {name!r} has dtype {loc[3]}")
        out[name] = (dtype, loc[4], disk_delta.read_bytes(loc))
    return out
