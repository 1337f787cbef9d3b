"""Disaggregated weight sync: the session that pushes every weight from the trainers to every engine rank.

Generation pauses (`pause_generation`, `flush_cache`) and one weight-update session (`begin_weight_update` ..
`end_weight_update`) spans every bucket of every pipeline stage. Each stage's source rank (dp 0, tp 0) sends its
stage's HF tensors bucket by bucket under the `Lock` (PP stages must not send into the same engines at once), through
the transport `choose.transport_class` picks at each connect: the collective broadcast (`broadcast.py`) or, on CPU
with every engine on this host, shared memory (`shared_memory.py`). With --use-fault-tolerance an engine that dies
during the push is dropped and the update finishes on the others.

A transport offers `name`, `via` (for messages), `connected`, `connect(timeout)`, `leave(old_engines, old_urls,
timeout)`, `regroup(timeout)` (after engines were dropped), `send_bucket(named_tensors, what, timeout, close)` (True
when it closed the engines' session behind the bucket) and `after_update()`; it reads the engines, their URLs and
the weight version from this session.
"""

import logging
import time

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.initialize import get_gloo_group
from slime.backends.megatron_utils.lora import merge_for_sync
from slime.backends.megatron_utils.param_utils import expert_parallel_copies, named_parameters
from slime.utils.http_utils import get_host_info

from .common import (
    BucketCuts,
    SentHashes,
    WeightUpdateError,
    acquire_lock,
    describe_bucket,
    engine_urls,
    gather_and_convert,
    is_tied_output_copy,
    log_metrics,
    update_metrics,
    update_timeout,
    wait_engines,
)

logger = logging.getLogger(__name__)


def _id(engine) -> str:
    return engine._actor_id.hex()


class UpdateWeightFromDistributed:
    def __init__(self, args, model, weights, *, model_name, quantization_config, vocab_size):
        self.args, self.model, self.weights = args, model, weights
        self.model_name, self.quantization_config, self.vocab_size = model_name, quantization_config, vocab_size
        self.weight_version = 0
        self.rollout_engines, self.rollout_engine_lock = [], None
        self.urls, self._url_by_id = [], {}
        self._lost = set()  # actor ids (hex) of the engines dropped during the current update (--use-fault-tolerance)
        self._lock_releases = []
        self._transport = None  # chosen in connect_rollout_engines
        self._transports = {}  # class -> instance: a transport chosen again keeps its state (group count, shm buffers)
        self._closed = False  # end_weight_update / continue_generation already sent behind the last bucket
        self.sent_hashes = SentHashes(args)  # what this rank sent in the last update, per HF tensor

    @property
    def transport(self):
        """The transport's name, "broadcast" or "shm", once connected (on a pipeline stage's source rank)."""
        return self._transport.name if self._transport is not None else None

    @property
    def _is_pp_src_rank(self) -> bool:
        return (
            mpu.get_data_parallel_rank(with_context_parallel=True) == 0 and mpu.get_tensor_model_parallel_rank() == 0
        )

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        """Connect to the engines; called again after engines were replaced (--use-fault-tolerance), when the
        transport lets go of the old engines (the broadcast group is torn down on the trainer and on the surviving
        engines) and connects again (a new group, under a new name)."""
        from .choose import transport_class  # here: choose.py imports this module to pick the updater class

        old_engines, old_urls = self.rollout_engines, self.urls
        self.rollout_engines, self.rollout_engine_lock = rollout_engines, rollout_engine_lock
        timeout = update_timeout(self.args)
        self.urls = engine_urls(rollout_engines, timeout)
        self._url_by_id = {_id(e): u for e, u in zip(rollout_engines, self.urls)}
        if not self._is_pp_src_rank:
            return
        if self._transport is not None:
            self._transport.leave(old_engines, old_urls, timeout)
        cls = transport_class(self.args, self.urls)
        if cls not in self._transports:
            self._transports[cls] = cls(self)
        self._transport = self._transports[cls]
        print(f"weight sync from {get_host_info()[1]} to {self.urls}: {self.transport}", flush=True)
        self._transport.connect(timeout)

    @torch.no_grad()
    def update_weights(self, weight_version=None) -> dict:
        """Push every weight to every engine. With --use-fault-tolerance an engine found dead meanwhile is dropped:
        the update finishes on the others (the push starts again on a group of the survivors if a bucket failed), and
        the metrics name the dropped engines (`update_weights/lost_engines`, indices into the connected engines) for
        the driver to replace."""
        start = time.perf_counter()
        self.weight_version = self.weight_version + 1 if weight_version is None else int(weight_version)
        timeout = update_timeout(self.args)
        connected = list(self.rollout_engines)
        self._lost = set()  # actor ids (hex) of the engines dropped during this update
        pausing = []
        if dist.get_rank() == 0:
            # an engine actor runs one caller's calls in order: each flush follows its pause, the session's begin
            # follows both, and with one pipeline stage (rank 0 the only sender) every bucket follows all three, so
            # they are awaited only at the end. One begin/end weight-update session spans every bucket of every stage.
            pausing = [
                (e, getattr(e, call).remote())
                for call in ("pause_generation", "flush_cache", "begin_weight_update")
                for e in self.rollout_engines
            ]
            if mpu.get_pipeline_model_parallel_world_size() > 1:
                self.wait(pausing, "pause_generation / flush_cache / begin_weight_update", timeout)
                pausing = []
        dist.barrier(group=get_gloo_group())

        for _attempt in range(len(connected) + 1):
            failed, sent = self._push_all()
            # every rank learns whether a source rank lost an engine mid-push; then all of them push again
            lost_ids = [None] * dist.get_world_size(group=get_gloo_group())
            dist.all_gather_object(lost_ids, sorted(self._lost) if failed else None, group=get_gloo_group())
            if all(x is None for x in lost_ids):
                break
            self._drop({a for x in lost_ids if x for a in x})
            if self._is_pp_src_rank:
                self._transport.regroup(timeout)
        else:
            raise WeightUpdateError(f"update_weights v{self.weight_version}: engines kept failing: {self.urls}")
        if pausing:
            self.wait(pausing, "pause_generation / flush_cache / begin_weight_update", timeout)
        dist.barrier(group=get_gloo_group())
        self._wait_lock_releases()

        if dist.get_rank() == 0 and not self._closed:
            # an engine actor runs each continue after its end: both are sent at once, awaited together
            self.wait(
                [
                    (e, getattr(e, call).remote())
                    for call in ("end_weight_update", "continue_generation")
                    for e in self.rollout_engines
                ],
                "end_weight_update / continue_generation",
                timeout,
            )
        if self._is_pp_src_rank and self._transport is not None:  # None: never connected, no engine to send to
            self._transport.after_update()
        lost_ids = [None] * dist.get_world_size(group=get_gloo_group())
        dist.all_gather_object(lost_ids, sorted(self._lost), group=get_gloo_group())
        self._drop({a for x in lost_ids for a in x})
        self.sent_hashes.push_done()  # hashed in the background from here: `report` waits
        metrics = update_metrics(
            time.perf_counter() - start, sent * max(1, self._num_engine_ranks), self.weight_version
        )
        if self._lost:
            metrics["update_weights/lost_engines"] = [i for i, e in enumerate(connected) if _id(e) in self._lost]
        if dist.get_rank() == 0:
            log_metrics(metrics)
        return metrics

    def _push_all(self):
        """One pass over the parameters, bucket by bucket. Every rank takes part (TP gathers); a source rank whose
        bucket failed because an engine died (--use-fault-tolerance) stops sending and returns failed=True."""
        bucket, bucket_bytes, sent, failed = [], 0, 0, False
        num_buckets, self._closed = 0, False
        self.sent_hashes.reset()  # a push started again (an engine died) hashes again
        cuts = BucketCuts(name for name, _ in named_parameters(self.args, self.model))
        # with --enable-lora the engines get merged weights: W + s B A per shard, no adapter tensors
        for name, param in merge_for_sync(self.args, named_parameters(self.args, self.model)):
            if is_tied_output_copy(self.args, name):
                continue
            # the source rank sends every expert: those of the other EP ranks come to it here
            hf_tensors = [
                t
                for n, p in expert_parallel_copies(self.args, name, param)
                for t in gather_and_convert(
                    self.args, self.model_name, n, p, self.vocab_size, self.quantization_config
                )
            ]
            if not self._is_pp_src_rank or failed:
                continue
            self.sent_hashes.add(hf_tensors)
            size = sum(t.numel() * t.element_size() for _, t in hf_tensors)
            # a tensor larger than the buffer still goes, alone
            if bucket and bucket_bytes + size > self.args.update_weight_buffer_size and cuts.may_cut:
                num_buckets += 1
                failed = not self._send_bucket_surviving(bucket, num_buckets)
                sent += 0 if failed else sum(t.numel() * t.element_size() for _, t in bucket)
                bucket, bucket_bytes = [], 0
            bucket += hf_tensors
            bucket_bytes += size
            cuts.add(name)
        if bucket and not failed:
            num_buckets += 1
            failed = not self._send_bucket_surviving(bucket, num_buckets, last=True)
            sent += 0 if failed else sum(t.numel() * t.element_size() for _, t in bucket)
        return failed, sent

    def _send_bucket_surviving(self, bucket, index, last=False) -> bool:
        """Send one bucket; False if it failed because an engine died (--use-fault-tolerance; else it raises)."""
        if not self.rollout_engines:  # every engine died: nothing to send to until they are replaced
            return True
        try:
            self._send_bucket(bucket, index, last)
            return True
        except WeightUpdateError:
            if not self.args.use_fault_tolerance or not self._find_dead(self.rollout_engines):
                raise
            return False

    def wait(self, engine_refs, what, timeout):
        """Wait for (engine, ref) pairs, naming an engine that fails. With --use-fault-tolerance the calls of an engine
        found dead (now or earlier in this update) are skipped and the engine dropped; a live engine that fails
        still fails the update."""
        live = [(e, r) for e, r in engine_refs if _id(e) not in self._lost]
        try:
            return wait_engines([r for _, r in live], [self.url_of(e) for e, _ in live], what, timeout)
        except WeightUpdateError:
            if not self.args.use_fault_tolerance:
                raise
            dead = self._find_dead(list({_id(e): e for e, _ in live}.values()))
            if not dead:
                raise
            self._drop(dead)
            return self.wait(engine_refs, what, timeout)

    def _find_dead(self, engines, wait_s: float = 5.0) -> set:
        """Actor ids of the engines whose actor or server process is gone (a server's exit is seen within a moment of
        its sockets closing, so this polls for `wait_s`). Records them as lost for this update."""
        deadline = time.monotonic() + wait_s
        while True:
            refs = [(e, e.check_alive.remote()) for e in engines if _id(e) not in self._lost]
            dead = set()
            for e, ref in refs:
                try:
                    ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                    dead.add(_id(e))
                except ray.exceptions.GetTimeoutError:  # alive but slow: not dropped here
                    pass
            if dead or time.monotonic() >= deadline:
                if dead:
                    logger.warning(
                        "update_weights v%s: engine(s) %s died; the update goes on without them",
                        self.weight_version,
                        [self.url_of(e) for e, _ in refs if _id(e) in dead],
                    )
                self._lost |= dead
                return dead
            time.sleep(0.2)

    def _drop(self, actor_ids):
        keep = [i for i, e in enumerate(self.rollout_engines) if _id(e) not in actor_ids]
        self._lost |= set(actor_ids) & {_id(e) for e in self.rollout_engines}
        self.rollout_engines = [self.rollout_engines[i] for i in keep]
        self.urls = [self.urls[i] for i in keep]

    def url_of(self, engine):
        return self._url_by_id.get(_id(engine), "engine ?")

    def _wait_lock_releases(self):
        releases, self._lock_releases = self._lock_releases, []
        if releases:
            ray.get(releases, timeout=update_timeout(self.args))

    @property
    def _num_engine_ranks(self) -> int:
        return len(self.rollout_engines) * self.args.rollout_num_gpus_per_engine

    def _send_bucket(self, named_tensors, index, last=False) -> int:
        transport = self._transport
        via = transport.via if transport is not None else None
        what = (
            f"update_weights_from_distributed v{self.weight_version} {describe_bucket(index, named_tensors)} via {via}"
        )
        timeout = update_timeout(self.args)
        if transport is None or not transport.connected:
            raise WeightUpdateError(f"{what}: connect_rollout_engines() was not called on this trainer")
        # rank 0 the only sender, no retry to make: the session may close right behind the last bucket (shm does)
        close = last and mpu.get_pipeline_model_parallel_world_size() == 1 and not self.args.use_fault_tolerance
        acquire_lock(self.rollout_engine_lock, what, timeout)
        try:
            self._closed = transport.send_bucket(named_tensors, what, timeout, close=close)
        finally:
            # not awaited here: the lock actor runs our next acquire after this release anyway (calls from one
            # caller run in order); `update_weights` checks the releases once at the end
            self._lock_releases.append(self.rollout_engine_lock.release.remote())
        return sum(t.numel() * t.element_size() for _, t in named_tensors)
