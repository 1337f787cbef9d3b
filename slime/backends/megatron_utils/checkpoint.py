"""Megatron checkpoints in slime's layout, on megatron-core `dist_checkpointing` (torch_dist format).

    {save}/iter_{rollout_id:07d}/          model (+ optimizer, scheduler, RNG) shards + common.pt
    {save}/latest_checkpointed_iteration.txt   the last *complete* iteration (or "release")

The iteration directory is written under a temporary name and renamed when complete. The tracker file is replaced
atomically afterwards: here with `commit=True` (tools, standalone use), or by the driver once the data source's state
is written too (`slime.ray.checkpoint.save`), so a crash mid-save never points `--load` at a partial checkpoint.
Sharded tensors are stored in global (unsharded) coordinates, so loading with a different TP size reshards.

With --async-save the shards are written by a process forked from each trainer (megatron-core's async request, run
by its `AsyncCallsQueue` as Megatron-LM runs it): the fork holds the state as it was when the save was called (device
tensors copied to host first, host memory by copy-on-write), so training goes on meanwhile. `finalize_async_save`
then waits for it, writes the metadata and renames the directory; only after that may the tracker name it.
"""

import argparse
import functools
import multiprocessing
import multiprocessing.queues
import os
import queue
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from slime.utils.checkpoint_tracker import (
    TRACKER,
    checkpoint_dir,
    fsync_path,
    fsync_tree,
    read_tracker,
    write_tracker,
)
from slime.utils.device import dist_backend, rng_state, set_rng_state
from slime.utils.lora_utils import base_identity, check_base

from .megatron_to_hf import hf_to_megatron
from .param_utils import is_lora_param, unwrap_model

# fully_reshardable allows TP/DP resharding of optimizer state. Its gather goes over gloo where the collective backend
# is gloo: the default (NCCL) path calls `tensor.cuda()`, which no CPU shim can redirect.
_OPTIM_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": dist_backend() == "gloo",
}


def _materialize_optimizer_state(optimizer):
    """torch Adam creates its state at the first step; loading into a fresh optimizer needs the state to exist."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))


def _own_adam_steps(optimizer):
    """megatron-core without Apex/TE (torch Adam) loads one "step" tensor into every parameter's state; Adam then
    increments that shared tensor once per parameter, so after a resume the bias correction would run ahead by
    the number of parameters each step. Each parameter gets its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        for state in inner.state.values() if inner is not None else ():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()


def resync_optimizer_main_params(optimizer):
    """After loading model weights in place, refresh fp32 master copies (mixed precision / distributed optimizer)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "reload_model_params"):
            opt.reload_model_params()


def _model_key(i, n):
    return "model" if n == 1 else f"model{i}"


def _model_sharded_state_dict(model, adapters_only=False):
    """Every chunk's sharded state; with `adapters_only` (--enable-lora) just the LoRA adapters: the frozen base
    comes from --hf-checkpoint, which the checkpoint records as `lora_base` (its path and a fingerprint of its weights,
    checked on load)."""
    out = {}
    for i, m in enumerate(model):
        # the DP x CP group spelled out: GPTModel reads it directly for the MTP stage's embedding copy (PP > 1)
        sd = unwrap_model(m).sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
        if adapters_only:
            sd = {k: v for k, v in sd.items() if is_lora_param(k)}
        out[_model_key(i, len(model))] = sd
    return out


def _rng_sharded_object():
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    pp, tp = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    shape = (mpu.get_pipeline_model_parallel_world_size(), mpu.get_tensor_model_parallel_world_size())
    return ShardedObject(
        "rng_state", state, shape, (pp, tp), replica_id=mpu.get_data_parallel_rank(with_context_parallel=True)
    )


def _restore_rng(state):
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    set_rng_state(state.get("cuda_rng_state"))
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _parallel_layout():
    return {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size()}


def _portable_args(args):
    """The run's flags with plain values only, for common.pt (as Megatron-LM keeps `args` there): offline tools such as
    tools/convert_torch_dist_to_hf.py read the architecture from it, and it loads under torch.load(weights_only=True).
    Per-process fields are left out: the common state must be identical on every rank."""
    plain = (bool, int, float, str, type(None))
    ok = lambda v: isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))  # noqa: E731
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if ok(v) and k not in ("rank", "local_rank")})


def save_checkpoint(args, iteration, model, optimizer, opt_param_scheduler, *, with_optimizer=True, commit=True):
    """Write `{args.save}/iter_{iteration:07d}` from every rank (collective); with `commit`, then update the tracker
    (the RL driver passes commit=False and updates it itself once the rest of the run's state is saved). With
    --async-save it returns once the write has started; `finalize_async_save` ends it (a new save first waits for
    the one before)."""
    if args.async_save:
        finalize_async_save()
    root = args.save
    final_dir = checkpoint_dir(root, iteration)
    tmp_dir = final_dir + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
    dist.barrier()

    state = _model_sharded_state_dict(model, adapters_only=args.enable_lora)
    if args.enable_lora:  # the base's path and a fingerprint of its weights, checked by load_checkpoint
        state["lora_base"] = base_identity(args.hf_checkpoint)
    if with_optimizer and not args.no_save_optim:
        # an optimizer that has not stepped yet (the actor during --num-critic-only-steps) has no state: save the
        # zero state a first step would start from (no-op for one that has stepped)
        _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=_OPTIM_METADATA)
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if not args.no_save_rng:
        state["rng_state"] = _rng_sharded_object()
    state["iteration"] = iteration
    state["parallel_layout"] = _parallel_layout()
    state["args"] = _portable_args(args)
    publish = functools.partial(_publish, root, tmp_dir, final_dir, iteration, commit)
    if not args.async_save:
        # The writers' results never leave this process: a plain queue instead of Megatron's cross-process one,
        # whose "spawn" Manager costs seconds on each trainer's first save (and not an async save's pipe, whose
        # items arrive a moment after they are put).
        if not isinstance(filesystem_async._results_queue, queue.Queue):
            filesystem_async._results_queue = queue.Queue()
        dist_checkpointing.save(state, tmp_dir)
        publish()
        return final_dir
    # The forked writer sends its results back through a pipe it inherits (no Manager process to outlive a killed
    # trainer).
    if not isinstance(filesystem_async._results_queue, multiprocessing.queues.Queue):
        filesystem_async._results_queue = multiprocessing.get_context("fork").Queue()
    request = dist_checkpointing.save(state, tmp_dir, async_sharded_save=True)
    request.add_finalize_fn(publish)
    _async_writes.schedule(request, iteration)
    return final_dir


def _publish(root, tmp_dir, final_dir, iteration, commit):
    fsync_tree(tmp_dir)  # each rank: its shards are on disk (not only in the page cache) before the rename below
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(tmp_dir, final_dir)
        fsync_path(root)  # the rename itself is durable before anyone publishes the tracker
        if commit:
            write_tracker(root, iteration)
    dist.barrier()


class _AsyncWrites:
    """This trainer's checkpoint write in flight (one at a time, as Megatron-LM keeps them)."""

    def __init__(self):
        self.queue, self.iteration = None, None

    def schedule(self, request, iteration):
        self.queue = self.queue or AsyncCallsQueue()
        self.queue.schedule_async_request(request)
        self.iteration = iteration

    def finalize(self, blocking):
        if self.iteration is None or not self.queue.maybe_finalize_async_calls(blocking=blocking):
            return None
        iteration, self.iteration = self.iteration, None
        return iteration


_async_writes = _AsyncWrites()


def finalize_async_save(blocking=True):
    """Finish this trainer's --async-save write if it is done (or, `blocking`, once it is): its metadata, then its
    directory under the final name. Collective: every trainer rank calls it. Returns the iteration finished, or
    None (nothing in flight, or not done yet)."""
    return _async_writes.finalize(blocking)


def _drop_unfit_output_layers(state, ckpt):
    """Remove from the model entries of `state` the output-layer tensors the checkpoint lacks or holds in another
    shape (the critic's one-output value head against an actor checkpoint's vocabulary projection), so they keep
    their fresh initialisation. Returns the names dropped."""
    metadata = dist_checkpointing.load_tensors_metadata(ckpt)
    dropped = []
    for key, chunk_state in state.items():
        for name in [n for n in chunk_state if "output_layer." in n]:
            tensor = chunk_state[name]
            shape = getattr(tensor, "global_shape", None)  # None: not a tensor (e.g. a layer's extra state)
            saved = metadata.get(getattr(tensor, "key", None))
            if shape is None or saved is None or tuple(saved.global_shape) != tuple(shape):
                del chunk_state[name]
                dropped.append(f"{key}.{name}")
    return dropped


def load_checkpoint(args, model, optimizer, opt_param_scheduler, keep_unfit_output_layer=False):
    """Load `--load` into `model` (+ optimizer/scheduler/RNG unless --no-load-optim / --no-load-rng / --finetune).

    `keep_unfit_output_layer` (the critic): an output layer the checkpoint lacks or holds in another shape keeps
    its initialisation instead of failing the load; the optimizer state is then not loaded either.

    Returns the last completed rollout id of the checkpoint (training resumes at +1), -1 for a release or
    `--finetune` load (weights only, start from rollout 0), and None when there is nothing to load (no `--load`,
    or no tracker file and no `--ckpt-step`).
    """
    root = args.load
    if not root or not os.path.isdir(root):
        return None
    step = args.ckpt_step
    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        return None
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(
            f"--load {root}: checkpoint directory {ckpt} does not exist (from "
            f"{'--ckpt-step' if step is not None else TRACKER}); pick an existing iteration with --ckpt-step"
        )
    finetune = bool(args.finetune) or iteration == "release"
    common = dist_checkpointing.load_common_state_dict(ckpt)
    if args.enable_lora and "lora_base" in common:  # adapters go on the base they were trained on, or not at all
        if (warning := check_base(common["lora_base"], args.hf_checkpoint, ckpt)) and dist.get_rank() == 0:
            print(f"WARNING: {warning}", flush=True)
    load_optim = not finetune and not args.no_load_optim and "optimizer" in _saved_keys(common, ckpt)
    load_rng = not finetune and not args.no_load_rng and common.get("parallel_layout") == _parallel_layout()

    if args.enable_lora:  # an adapter checkpoint: the frozen base comes from --hf-checkpoint first
        hf_to_megatron(args, model)
    state = _model_sharded_state_dict(model, adapters_only=args.enable_lora)
    dropped = _drop_unfit_output_layers(state, ckpt) if keep_unfit_output_layer else []
    if dropped:
        load_optim = False  # its state has the actor's shapes
        if dist.get_rank() == 0:
            print(f"--load {ckpt}: {', '.join(dropped)} do not fit the checkpoint: newly initialised", flush=True)
    if load_optim:
        _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=_OPTIM_METADATA)
    if load_rng:
        state["rng_state"] = _rng_sharded_object()
    loaded = dist_checkpointing.load(state, ckpt)

    for i, m in enumerate(model):
        result = unwrap_model(m).load_state_dict(
            loaded[_model_key(i, len(model))], strict=not (dropped or args.enable_lora)
        )
        if args.enable_lora:
            if result.unexpected_keys or any(is_lora_param(k) for k in result.missing_keys):
                raise ValueError(
                    f"--load {ckpt} is not a LoRA adapter checkpoint of this model (--enable-lora): missing "
                    f"{[k for k in result.missing_keys if is_lora_param(k)][:3]}, unexpected "
                    f"{result.unexpected_keys[:3]}"
                )
            continue
        missing = [k for k in getattr(result, "missing_keys", []) if "output_layer." not in k]
        if missing or getattr(result, "unexpected_keys", []):
            raise RuntimeError(f"--load {ckpt}: missing {missing}, unexpected {result.unexpected_keys}")
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        _own_adam_steps(optimizer)
        if "opt_param_scheduler" in common and opt_param_scheduler is not None:
            _load_scheduler(args, opt_param_scheduler, common["opt_param_scheduler"], ckpt)
    elif optimizer is not None:
        resync_optimizer_main_params(optimizer)
    if load_rng:
        _restore_rng(loaded["rng_state"])
    dist.barrier()
    return -1 if finetune else int(iteration)


# (attribute, state-dict key, what Megatron calls it) of the schedule values a resume compares
_SCHEDULE_FIELDS = (
    ("max_lr", "max_lr", "learning rate"),
    ("min_lr", "min_lr", "minimum learning rate"),
    ("lr_warmup_steps", "lr_warmup_steps", "warmup iterations"),
    ("lr_decay_steps", "lr_decay_steps", "total number of iterations"),
    ("lr_decay_style", "lr_decay_style", "learning rate decay style"),
    ("start_wd", "start_wd", "start weight decay"),
    ("end_wd", "end_wd", "end weight decay"),
    ("wd_incr_steps", "wd_incr_steps", "total number of weight decay iterations"),
    ("wd_incr_style", "wd_incr_style", "weight decay incr style"),
)


def _load_scheduler(args, scheduler, saved, ckpt):
    """Restore the LR/WD scheduler. When this run's flags give another schedule than the checkpoint's (typically a
    larger --num-rollout to continue a run), Megatron-LM's two flags decide, and the log says which one applied."""
    override = args.override_opt_param_scheduler
    keep = args.use_checkpoint_opt_param_scheduler
    diffs = [
        f"{what}: checkpoint {saved[key]}, this run {getattr(scheduler, attr)}"
        for attr, key, what in _SCHEDULE_FIELDS
        if key in saved and saved[key] != getattr(scheduler, attr)
    ]
    if diffs and not (override or keep):
        raise ValueError(
            f"--load {ckpt}: this run's LR/weight-decay schedule differs from the checkpoint's ({'; '.join(diffs)}); "
            "pass --override-opt_param-scheduler to recompute it from this run's flags, or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )
    scheduler.load_state_dict(saved)
    if diffs and dist.get_rank() == 0:
        how = (
            "recomputed from this run's flags (--override-opt_param-scheduler)"
            if override
            else "kept from the checkpoint (--use-checkpoint-opt_param-scheduler)"
        )
        print(f"optimizer param scheduler {how}: {'; '.join(diffs)}", flush=True)


def _saved_keys(common, ckpt):
    # The optimizer's tensors live in the sharded metadata, its scheduler in common.pt; either proves it was saved.
    if "opt_param_scheduler" in common:
        return {"optimizer"}
    return set()
