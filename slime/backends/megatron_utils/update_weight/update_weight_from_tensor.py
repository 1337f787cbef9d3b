"""Colocated weight sync: trainers hand tensor *handles* to the engine on their own (logical) GPU.

CUDA IPC on GPU, torch shared-memory fds on CPU: the same code through `slime.utils.tensor_serialization`.
Weights are read from the actor's CPU weight dict `weights["actor"]` (so this works while the model is offloaded),
gathered to full HF tensors, and packed per dtype into one flat buffer per bucket (one handle per bucket and
dtype; handles are single-use, so every trainer rank serialises its own copy for its engine TP rank). The first
trainer rank of each engine's group gathers the handles and calls `engine.update_weights_from_tensor`.

On CPU the CPU weight dict itself lives in those shared buffers (its tensors become views into them; the actor
updates them in place), so HF tensors that are views of it (everything at TP=1 except the q/k/v split) are sent
as offsets, without a copy. The engine copies into its own weights during the call, so later writes are harmless.
"""

import logging
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.initialize import get_gloo_group
from slime.backends.megatron_utils.lora import merged_from_dict
from slime.backends.megatron_utils.param_utils import is_lora_param, named_parameters
from slime.utils.device import shared_memory_handles
from slime.utils.tensor_serialization import bucket_payload
from slime.utils.types import ParamInfo

from .common import (
    BucketCuts,
    SentHashes,
    WeightUpdateError,
    by_dtype,
    describe_bucket,
    engine_urls,
    gather_and_convert,
    is_tied_output_copy,
    local_device,
    log_metrics,
    pack_flat,
    update_metrics,
    update_timeout,
    wait_engines,
)

logger = logging.getLogger(__name__)

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode")


def get_param_info_buckets(args, model) -> list:
    """Every parameter of the whole model (all PP stages, all EP ranks) as `ParamInfo`, sorted by name and cut into
    buckets of at most `--update-weight-buffer-size` full (TP-gathered) bytes. Identical on every rank."""
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    ep_size = mpu.get_expert_model_parallel_world_size()
    if pp_size > 1 and ep_size > 1:
        raise WeightUpdateError(
            "colocated weight update (--colocate) with both pipeline and expert parallelism is not supported; "
            "use --expert-model-parallel-size 1 or --pipeline-model-parallel-size 1"
        )
    rank = dist.get_rank()
    infos = {}
    for name, param in named_parameters(args, model):
        if is_tied_output_copy(args, name) or is_lora_param(name):  # adapters travel merged into their base
            continue
        attrs = {k: getattr(param, k) for k in _TP_ATTRS if hasattr(param, k)}
        infos[name] = ParamInfo(
            name, param.dtype, tuple(param.shape), attrs, param.numel() * param.element_size(), rank
        )
    for size, group, only_experts in (
        (pp_size, mpu.get_pipeline_model_parallel_group, False),
        (ep_size, mpu.get_expert_model_parallel_group, True),
    ):
        if size > 1:
            gathered = [None] * size
            dist.all_gather_object(gathered, infos, group=group())
            for other in gathered:
                for name, info in other.items():
                    if not only_experts or ".experts." in name:
                        infos.setdefault(name, info)

    tp_size = mpu.get_tensor_model_parallel_world_size()
    buckets, bucket, bucket_bytes = [], [], 0
    cuts = BucketCuts(infos)
    for name in sorted(infos):
        info = infos[name]
        full = info.size * (tp_size if info.attrs.get("tensor_model_parallel") else 1)
        if bucket and bucket_bytes + full > args.update_weight_buffer_size and cuts.may_cut:
            buckets.append(bucket)
            bucket, bucket_bytes = [], 0
        bucket.append(info)
        bucket_bytes += full
        cuts.add(name)
    if bucket:
        buckets.append(bucket)
    # every rank must walk the same buckets in the same order (the TP gathers are collective)
    names = [[i.name for i in b] for b in buckets]
    all_names = [None] * dist.get_world_size()
    dist.all_gather_object(all_names, names)
    if any(n != names for n in all_names):
        raise WeightUpdateError("colocated weight update: ranks disagree on the parameter list (model chunks differ)")
    return buckets


def _offset_in(buf, limit, t):
    """Element offset of `t` inside `buf[:limit]` when `t` is a contiguous view of it, else None."""
    if buf is None or not t.is_contiguous() or t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    offset = (t.data_ptr() - buf.data_ptr()) // t.element_size()
    return offset if 0 <= offset and offset + t.numel() <= limit else None


class UpdateWeightFromTensor:
    def __init__(self, args, model, weights, *, model_name, quantization_config, vocab_size):
        self.args, self.model, self.weights = args, model, weights
        self.model_name, self.quantization_config, self.vocab_size = model_name, quantization_config, vocab_size
        self.weight_version = 0
        self.param_info_buckets = get_param_info_buckets(args, model)
        self.sent_hashes = SentHashes(args)  # what this rank sent in the last update, per HF tensor
        self.rollout_engines, self._urls = [], []
        self._ipc_gather_src = self._ipc_gather_group = self._ipc_engine = self._ipc_engine_url = None
        # flat shared buffers: with shared-memory handles (CPU) one per (bucket, dtype), holding this rank's CPU
        # weights (see `_allocate`); with CUDA IPC one per dtype on the GPU, reused bucket after bucket and freed
        # after the update
        self._weights_in_buffers = shared_memory_handles()
        self._flat = {}
        if self._weights_in_buffers:
            for index, infos in enumerate(self.param_info_buckets, 1):
                for dtype in {i.dtype for i in infos if i.src_rank == dist.get_rank()}:
                    self._allocate((index, dtype), index, dtype, scratch=0)

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        """One gloo group per engine: trainer ranks [i*g, (i+1)*g) sit on the GPUs of engine i."""
        self.rollout_engines = rollout_engines
        g = self.args.rollout_num_gpus_per_engine
        world = dist.get_world_size()
        if len(rollout_engines) * g != world:
            raise WeightUpdateError(
                f"colocated weight update: {len(rollout_engines)} engines x {g} GPUs (--rollout-num-gpus-per-engine) "
                f"!= {world} training ranks; --colocate needs --rollout-num-gpus equal to the actor GPUs"
            )
        self._urls = engine_urls(rollout_engines, update_timeout(self.args))
        for i, engine in enumerate(rollout_engines):
            ranks = list(range(i * g, (i + 1) * g))
            group = dist.new_group(ranks=ranks, backend="gloo")  # every rank creates every group, in order
            if dist.get_rank() in ranks:
                self._ipc_gather_src, self._ipc_gather_group = ranks[0], group
                self._ipc_engine, self._ipc_engine_url = engine, self._urls[i]

    @torch.no_grad()
    def update_weights(self, weight_version=None) -> dict:
        start = time.perf_counter()
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        timeout = update_timeout(self.args)
        if self._ipc_engine is None:
            raise WeightUpdateError(
                "colocated weight update: connect_rollout_engines() was not called on this trainer"
            )
        # the engines drop their caches while the first bucket is gathered and packed; nothing is sent before that.
        # Each engine's group source opens one weight-update session for the whole update (SGLang needs it).
        flushes = [e.flush_cache.remote() for e in self.rollout_engines] if dist.get_rank() == 0 else []
        is_src = dist.get_rank() == self._ipc_gather_src
        begin = [self._ipc_engine.begin_weight_update.remote()] if is_src else []
        sent = 0
        self.sent_hashes.reset()
        for index, infos in enumerate(self.param_info_buckets, 1):
            named_tensors, handles = self._prepare_bucket(index, infos)
            if index == 1:
                if flushes:
                    wait_engines(flushes, self._urls, "flush_cache", timeout)
                if begin:
                    wait_engines(begin, [self._ipc_engine_url], "begin_weight_update", timeout)
                dist.barrier(group=get_gloo_group())
            sent += self._send_bucket(index, named_tensors, handles, last=index == len(self.param_info_buckets))
        if not self._weights_in_buffers:
            self._flat.clear()  # GPU memory belongs to the engine during rollout
        dist.barrier(group=get_gloo_group())
        self.sent_hashes.push_done()  # hashed in the background from here: `report` waits
        metrics = update_metrics(time.perf_counter() - start, sent * len(self.rollout_engines), self.weight_version)
        if dist.get_rank() == 0:
            log_metrics(metrics)
        return metrics

    def _materialize(self, infos) -> list:
        """This rank's shard of every param of the bucket: from the CPU weight dict where it lives, else received."""
        device, actor_weights, rank = local_device(), self.weights["actor"], dist.get_rank()
        params = []
        for info in infos:
            if info.src_rank == rank:
                if info.name not in actor_weights:
                    raise WeightUpdateError(
                        f"colocated weight update: {info.name!r} is missing from the actor's CPU weight dict"
                    )
                weight = merged_from_dict(self.args, actor_weights, info.name)  # W + s B A under --enable-lora
                params.append(weight.to(device, non_blocking=True).detach())
            else:
                params.append(torch.empty(info.shape, dtype=info.dtype, device=device))
        # params of other PP stages (and experts of other EP ranks) come from the rank that holds them
        for size, group, only_experts in (
            (mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_group, False),
            (mpu.get_expert_model_parallel_world_size(), mpu.get_expert_model_parallel_group, True),
        ):
            if size > 1:
                members = set(dist.get_process_group_ranks(group()))
                works = [
                    dist.broadcast(p, info.src_rank, group=group(), async_op=True)
                    for info, p in zip(infos, params)
                    if info.src_rank in members and (not only_experts or ".experts." in info.name)
                ]
                for w in works:
                    w.wait()
        for info, p in zip(infos, params):
            for k, v in info.attrs.items():
                setattr(p, k, v)
        return params

    def _pack(self, index, named_tensors) -> list:
        """One serialised `FlattenedTensorBucket` per dtype. HF tensors that are plain views of the bucket's shared
        CPU weights travel as offsets into it (no copy); the rest (gathered, split, received) are copied behind."""
        handles = []
        for dtype, items in by_dtype(named_tensors).items():
            key = (index, dtype) if self._weights_in_buffers else dtype
            buf, home_numel = self._flat.get(key, (None, 0))
            offsets = [_offset_in(buf, home_numel, t) for _, t in items]
            scratch = sum(t.numel() for (_, t), off in zip(items, offsets) if off is None)
            if buf is None or buf.numel() < home_numel + scratch:
                buf = self._allocate(key, index, dtype, scratch)
            metadata, end = pack_flat(buf, items, home_numel, offsets)
            handles.append(bucket_payload(buf[:end], metadata))
        return handles

    def _allocate(self, key, index, dtype, scratch):
        """A shared flat buffer for `key`. With shared-memory handles (CPU) it starts with this rank's CPU weights of bucket `index` (the
        weight dict's tensors become views into it, so the actor keeps updating them in place and every update
        sends them without a copy), followed by `scratch` elements for tensors that need one."""
        home = (
            [i.name for i in self.param_info_buckets[index - 1] if i.src_rank == dist.get_rank() and i.dtype == dtype]
            if self._weights_in_buffers
            else []
        )
        actor_weights = self.weights["actor"]
        home_numel = sum(actor_weights[n].numel() for n in home)
        buf = torch.empty(home_numel + scratch, dtype=dtype, device=local_device())
        buf.share_memory_()  # CPU: one shared-memory segment, so a handle carries no copy (no-op for CUDA)
        offset = 0
        for n in home:
            t = actor_weights[n]
            view = buf[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            actor_weights[n] = view
            offset += t.numel()
        self._flat[key] = (buf, home_numel)
        return buf

    def _prepare_bucket(self, index, infos):
        """(HF tensors, serialised handles) of bucket `index` on this rank."""
        params = self._materialize(infos)
        named_tensors = []
        for info, param in zip(infos, params):
            named_tensors += gather_and_convert(
                self.args, self.model_name, info.name, param, self.vocab_size, self.quantization_config
            )
        del params
        return named_tensors, self._pack(index, named_tensors)

    def _send_bucket(self, index, named_tensors, handles, last) -> int:
        """Hand this rank's handles of bucket `index` to its engine; after the `last` bucket the source also closes
        the engine's weight-update session (sent right behind the bucket: the engine actor runs them in order)."""
        is_src = dist.get_rank() == self._ipc_gather_src
        single = dist.get_world_size(self._ipc_gather_group) == 1
        if single:
            gathered = [handles]  # one trainer rank per engine (TP=1 engines): nothing to gather
        else:
            gathered = [None] * dist.get_world_size(self._ipc_gather_group) if is_src else None
            dist.gather_object(
                handles, object_gather_list=gathered, dst=self._ipc_gather_src, group=self._ipc_gather_group
            )
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
        if is_src:
            self.sent_hashes.add(named_tensors)  # every rank of the group sends the same full HF tensors
            what = f"update_weights_from_tensor v{self.weight_version} {describe_bucket(index, named_tensors)}"
            refs = [
                self._ipc_engine.update_weights_from_tensor.remote(
                    serialized_named_tensors=[h[i] for h in gathered],
                    load_format="flattened_bucket",
                    flush_cache=False,
                    weight_version=str(self.weight_version),
                )
                for i in range(len(handles))
            ]
            if last:
                refs.append(self._ipc_engine.end_weight_update.remote())
                what += " / end_weight_update"
            wait_engines(refs, [self._ipc_engine_url] * len(refs), what, update_timeout(self.args))
        # the engine has copied out of every rank's buffer only once the source's call returned
        if not single:
            dist.barrier(group=self._ipc_gather_group)
        return nbytes * len(gathered) if is_src else 0
