"""Pieces both weight-update transports share: Megatron params -> HF tensors, packing them into flat same-dtype
buffers (`load_format="flattened_bucket"`), engine calls that time out and name the engine, and the metrics dict
`update_weights()` returns.
"""

import logging
import os
import sys
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor

import ray
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
from slime.backends.megatron_utils.param_utils import PREFIX, all_gather_param, remove_padding
from slime.utils.device import get_device
from slime.utils.fingerprint import default_algorithm, hash_named
from slime.utils.tensor_serialization import FlattenedTensorMetadata

logger = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """A weight update failed: the message names the engine URL and the step (bucket, group init, check)."""


def local_device():
    """This trainer's device (TrainRayActor sets LOCAL_RANK)."""
    return get_device(int(os.environ.get("LOCAL_RANK", "0")))


def update_timeout(args) -> float:
    return float(args.update_weight_timeout or 300)


def is_tied_output_copy(args, name) -> bool:
    """A later pipeline stage's copy of the embedding: the last stage's tied output layer, or the MTP stage's
    embedding (Megatron keeps one beside the MTP block). Engines take it from the first stage's embedding, so it is
    not sent (at PP=1 Megatron has no such parameter; sending a tied copy would also fail
    `--check-weight-update-equal`)."""
    if name == PREFIX + "output_layer.weight" and not args.untie_embeddings_and_output_weights:
        return True
    return (
        name == PREFIX + "embedding.word_embeddings.weight"
        and args.pipeline_model_parallel_size > 1
        and mpu.get_pipeline_model_parallel_rank() > 0
    )


def gather_and_convert(args, model_name, name, param, vocab_size, quantization_config=None):
    """One Megatron param (a TP shard) -> its HF tensors. Collective over the TP group: every TP rank must call it."""
    full = all_gather_param(name, param, gated_linear_unit=args.swiglu)
    full = remove_padding(name, full, vocab_size)
    return to_hf(args, model_name, name, full, quantization_config)


def to_hf(args, model_name, name, param, quantization_config=None):
    try:
        converted = convert_to_hf(args, model_name, name, param, quantization_config)
    except Exception as e:  # a converter that does not know the param: name it, the model and the flag
        raise WeightUpdateError(
            f"weight update: cannot convert Megatron parameter {name!r} (shape {tuple(param.shape)}) to HF for "
            f"--model-name {model_name!r}: {e}"
        ) from e
    if not converted:
        raise WeightUpdateError(
            f"weight update: no HF tensor for Megatron parameter {name!r} (--model-name {model_name!r})"
        )
    # gloo/IPC want dense tensors; conversion may return strided views (q/k/v and gate/up splits)
    return [(hf_name, t.detach().contiguous()) for hf_name, t in converted]


def by_dtype(named_tensors) -> dict:
    """`[(name, tensor)]` grouped by dtype (one flat buffer per dtype), in the given order."""
    groups = defaultdict(list)
    for name, t in named_tensors:
        groups[t.dtype].append((name, t))
    return groups


def pack_flat(buf, items, start=0, offsets=None):
    """Copy the same-dtype `items` `[(name, tensor)]` into the flat `buf` from element `start` on, except those whose
    entry in `offsets` is not None (already in `buf` there: no copy). Returns (FlattenedTensorMetadata of every item,
    the end of the copied part)."""
    metadata, cursor = [], start
    for i, (name, t) in enumerate(items):
        offset = offsets[i] if offsets else None
        if offset is None:  # view(shape).copy_: a strided tensor is copied once, straight into place
            buf[cursor : cursor + t.numel()].view(t.shape).copy_(t)
            offset, cursor = cursor, cursor + t.numel()
        metadata.append(
            FlattenedTensorMetadata(
                name=name, shape=t.shape, dtype=t.dtype, start_idx=offset, end_idx=offset + t.numel(), numel=t.numel()
            )
        )
    return metadata, cursor


def engine_urls(engines, timeout) -> list:
    refs = [e.get_url.remote() for e in engines]
    return wait_engines(refs, [f"engine #{i}" for i in range(len(engines))], "get_url", timeout)


def wait_engines(refs, urls, what, timeout, on_poll=None):
    """`ray.get(refs)` that fails as soon as one engine fails (naming its URL) and after `timeout` seconds at most.

    `on_poll()` runs between waits (the broadcast loop uses it to notice a failed collective early).
    """
    results, pending = [None] * len(refs), {ref: i for i, ref in enumerate(refs)}
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = ", ".join(urls[i] for i in sorted(pending.values()))
            raise WeightUpdateError(
                f"{what}: no answer from engine(s) {late} within {timeout:.0f}s (--update-weight-timeout); "
                "check that those inference servers are alive and not blocked"
            )
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, 0.05 if on_poll else 1.0))
        for ref in ready:
            i = pending.pop(ref)
            results[i] = get_engine_result(ref, urls[i], what)
        if on_poll is not None:
            on_poll()
    return results


def get_engine_result(ref, url, what):
    try:
        result = ray.get(ref)
    except ray.exceptions.RayActorError as e:
        raise WeightUpdateError(
            f"{what}: engine {url} is dead ({type(e).__name__}); restart the rollout engines"
        ) from e
    except Exception as e:
        raise WeightUpdateError(f"{what}: engine {url} failed: {_first_line(e)}") from e
    if isinstance(result, dict) and result.get("success") is False:
        raise WeightUpdateError(f"{what}: engine {url} refused: {result.get('message') or result}")
    return result


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    # RayTaskError puts the remote traceback first; the cause is at the end
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def acquire_lock(lock, what, timeout):
    """Spin on the `Lock` actor (non-blocking acquire), as slime does, but give up after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ray.get(lock.acquire.remote(), timeout=timeout):
        if time.monotonic() > deadline:
            raise WeightUpdateError(
                f"{what}: the rollout-engine lock stayed held for {timeout:.0f}s (another source rank is stuck mid-update)"
            )
        time.sleep(0.1)


def _lowest_priority():
    """The trainer's hash thread yields every core to what follows a push (generation, the engines' replies): the
    driver waits for it only before the version's samples train. Linux gives each thread its own nice value."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # a sandbox that forbids it: the hash runs at the process's priority
            pass


class SentHashes:
    """The hash of every HF tensor this rank sent in the current update (`slime.utils.fingerprint`: tiles32 on a GPU,
    on the device; xxh3 on a CPU), in the dtype it travels in (quantised tensors as sent). The trainer keeps the map of
    the last version; the rollout manager combines the ranks' maps and checks each engine's fingerprint against it.

    xxh3 hashes on the host without the GIL, in a worker thread, after the push: `add` queues what was sent and
    `push_done` (the push's last step) starts the worker, at the lowest CPU priority, so the hash never competes with
    the push for cores or memory bandwidth; the update returns without waiting, and `report` (the driver's check, before any sample of the
    version trains) waits. Only when more than about one bucket's bytes are queued does the worker start during the
    push, so that it keeps no more tensors alive than that. The tensors must not change until they are hashed: the
    trainer calls `wait` before it trains or offloads. tiles32 runs inline: its kernels queue on the device behind
    the sync's own."""

    def __init__(self, args):
        self.enabled = getattr(args, "check_weight_fingerprints", True)
        self.algorithm = default_algorithm(local_device())
        self.hashes = {}
        self._async = self.enabled and self.algorithm == "xxh3"
        self._max_waiting = getattr(args, "update_weight_buffer_size", None) or 512 << 20
        self._pool, self._jobs, self._waiting = None, deque(), 0  # worker (made at the first add), (Future, bytes)
        self._queued = []  # named tensors added but not handed to the worker yet

    def _start(self):
        if self._queued and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sent-hashes", initializer=_lowest_priority)
        for named, nbytes in self._queued:
            self._jobs.append((self._pool.submit(hash_named, named, self.hashes, self.algorithm), nbytes))
        self._queued = []

    def _wait(self, max_bytes=None):
        """Until no more than `max_bytes` (None: nothing) wait to be hashed, the oldest first; drops finished jobs."""
        self._start()
        while self._jobs and (max_bytes is None or self._jobs[0][0].done() or self._waiting > max_bytes):
            job, nbytes = self._jobs.popleft()
            self._waiting -= nbytes
            job.result()

    def reset(self):
        for job, _ in self._jobs:  # an earlier (failed) push's job must not write into the new map
            job.exception()
        self._jobs, self._queued, self._waiting, self.hashes = deque(), [], 0, {}

    def add(self, named_tensors):
        if not self.enabled:
            return
        if not self._async:
            hash_named(named_tensors, self.hashes, self.algorithm)
            return
        # a generator (the disk path's dtype casts) is consumed in the worker, one tensor at a time
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors) if isinstance(named_tensors, list) else 0
        self._queued.append((named_tensors, nbytes))
        self._waiting += nbytes
        if self._waiting > self._max_waiting:
            self._wait(self._max_waiting)

    def push_done(self):
        """The push sent everything: hash what is queued, in the background."""
        self._start()

    def wait(self):
        """Until every tensor of the last update is hashed (the worker reads them: nothing may change them before)."""
        self._wait()

    def report(self, weight_version) -> dict:
        """The last update's hashes, `{}` when the check is off or nothing was sent; waits for them."""
        self._wait()
        if not (self.enabled and self.hashes):
            return {}
        return {
            "update_weights/weight_version": weight_version,
            "update_weights/tensor_hashes": dict(self.hashes),
            "update_weights/tensor_hash_algorithm": self.algorithm,
        }


def sent_weight_hashes(updater) -> dict:
    """What `updater`'s last push sent, hashed (waits for it): `SentHashes.report` with the push's version; {} for an
    updater that hashes nothing (the LoRA adapter's push reports its own hashes with the push)."""
    hashes = getattr(updater, "sent_hashes", None)
    return {} if hashes is None else hashes.report(updater.weight_version)


def update_metrics(seconds: float, bytes_moved: int, weight_version: int) -> dict:
    """`bytes_moved` counts every byte delivered to every engine rank."""
    return {
        "perf/update_weights_time": seconds,
        "perf/update_weights_bytes": bytes_moved,
        "perf/update_weights_gbps": bytes_moved / seconds / 1e9 if seconds > 0 else 0.0,
        "update_weights/weight_version": weight_version,
    }


def log_metrics(metrics: dict) -> None:
    logger.info(
        "update_weights v%s: %.3fs, %.1f MB, %.2f GB/s",
        metrics["update_weights/weight_version"],
        metrics["perf/update_weights_time"],
        metrics["perf/update_weights_bytes"] / 1e6,
        metrics["perf/update_weights_gbps"],
    )


def describe_bucket(index: int, named_tensors) -> str:
    nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
    return f"bucket {index} ({len(named_tensors)} tensors, {nbytes / 1e6:.1f} MB, first {named_tensors[0][0]})"


# Megatron tensors whose HF ones SGLang loads only together: its DeepSeek loader fuses q_a_proj and
# kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa once both arrived in one load, and drops one that came alone
_LOADED_TOGETHER = (("linear_q_down_proj", "linear_kv_down_proj"),)


class BucketCuts:
    """Where a bucket may end: never while it holds one of a layer's `_LOADED_TOGETHER` pair whose partner is still
    to come (the bucket then grows past the buffer size until it does). `names`: every parameter name the buckets
    will hold."""

    def __init__(self, names):
        names = set(names)
        self.partner, self.waiting = {}, set()
        for a, b in _LOADED_TOGETHER:
            for n in names:
                m = n.replace(f".{a}.", f".{b}.")
                if m != n and m in names:
                    self.partner[n], self.partner[m] = m, n

    def add(self, name) -> None:
        partner = self.partner.get(name)
        if partner in self.waiting:
            self.waiting.discard(partner)
        elif partner is not None:
            self.waiting.add(name)

    @property
    def may_cut(self) -> bool:
        return not self.waiting
