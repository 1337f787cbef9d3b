"""Disaggregated weight sync: trainer -> every engine rank by collective broadcast (NCCL on GPU, gloo on CPU).

Each pipeline stage's source rank (dp 0, tp 0) owns a dedicated group `slime-pp_{pp_rank}` = itself (rank 0) + every
engine rank, separate from the training groups. Per bucket: take the `Lock` (PP stages must not broadcast into the
same engines at once), tell every engine what arrives (names, dtypes, shapes), broadcast, wait for the engines.

On CPU with every engine on this host, gloo's TCP loopback caps the transfer at a fraction of memory bandwidth, so
(`--update-weight-transport auto|shm`) buckets go through shared memory instead, handles to every engine through
`/update_weights_from_tensor`. After the first update the source rank's parameters themselves move into shared
memory (see `_share_params`), so every HF tensor that is a view of a parameter (all but the q/k/v split at TP=1)
travels as an offset into it: the engine copies it straight into its weights, the only copy. The rest (TP-gathered,
converted, LoRA-merged tensors) is packed into room reserved at the start of that buffer (sized by the first update),
or else into a reused shared buffer per dtype: one copy on each side.
"""

import logging
import threading
import time
from collections import defaultdict
from urllib.parse import urlparse

import ray
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.initialize import get_gloo_group
from slime.backends.megatron_utils.lora import merge_for_sync
from slime.backends.megatron_utils.param_utils import expert_parallel_copies, named_parameters
from slime.utils.device import dist_backend, shared_memory_handles
from slime.utils.distributed_utils import init_process_group, seconds
from slime.utils.http_utils import free_port, get_host_info
from slime.utils.tensor_serialization import FlattenedTensorMetadata, bucket_payload

from .common import (
    SentHashes,
    WeightUpdateError,
    acquire_lock,
    by_dtype,
    describe_bucket,
    engine_urls,
    gather_and_convert,
    is_tied_output_copy,
    log_metrics,
    pack_flat,
    update_metrics,
    update_timeout,
    wait_engines,
)

logger = logging.getLogger(__name__)


def _id(engine) -> str:
    return engine._actor_id.hex()


def gloo_safe(t: torch.Tensor, group=None) -> torch.Tensor:
    """gloo cannot broadcast float8 ("Invalid scalar type"): over gloo an FP8 tensor travels as its uint8 view (the
    same bytes; the engine receives into the same view of its buffer). NCCL takes FP8 as it is."""
    if t.dtype == torch.float8_e4m3fn and dist.get_backend(group) == "gloo":
        return t.view(torch.uint8)
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class UpdateWeightFromDistributed:
    def __init__(self, args, model, weights, *, model_name, quantization_config, vocab_size):
        self.args, self.model, self.weights = args, model, weights
        self.model_name, self.quantization_config, self.vocab_size = model_name, quantization_config, vocab_size
        self.weight_version = 0
        self.rollout_engines, self.rollout_engine_lock = [], None
        self._group, self._group_name, self._urls, self._url_by_id = None, None, [], {}
        self._lost = set()  # actor ids (hex) of the engines dropped during the current update (--use-fault-tolerance)
        self._connections = 0  # weight-update groups built so far (one more after each engine replacement)
        self._lock_releases = []
        self.transport = None  # "broadcast" or "shm", chosen in connect_rollout_engines
        self._shm_buffers = {}  # dtype -> shared flat buffer, reused bucket after bucket (see module docstring)
        self._param_homes = None  # shared storage data_ptr -> 1-D tensor over it (`_share_params`)
        self._scratch = {}  # dtype -> (home buffer, elements reserved at its start for copied tensors)
        self._scratch_need = defaultdict(int)  # dtype -> most elements one bucket copied
        self._closed = False  # end_weight_update / continue_generation already sent behind the last bucket
        self.sent_hashes = SentHashes(args)  # what this rank sent in the last update, per HF tensor

    @property
    def _is_pp_src_rank(self) -> bool:
        return (
            mpu.get_data_parallel_rank(with_context_parallel=True) == 0 and mpu.get_tensor_model_parallel_rank() == 0
        )

    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock):
        """Connect to the engines; called again after engines were replaced (--use-fault-tolerance), when the old
        group is torn down on the trainer and on the surviving engines and a new one, under a new name, is built."""
        old_engines, old_urls = self.rollout_engines, self._urls
        self.rollout_engines, self.rollout_engine_lock = rollout_engines, rollout_engine_lock
        timeout = update_timeout(self.args)
        self._urls = engine_urls(rollout_engines, timeout)
        self._url_by_id = {_id(e): u for e, u in zip(rollout_engines, self._urls)}
        if not self._is_pp_src_rank:
            return
        if self._group is not None:
            self._leave_group(old_engines, old_urls, timeout)
        self._connections += 1
        self._group_name = f"slime-pp_{mpu.get_pipeline_model_parallel_rank()}" + (
            f"-{self._connections}" if self._connections > 1 else ""
        )
        self.transport = self._choose_transport()
        print(f"weight sync from {get_host_info()[1]} to {self._urls}: {self.transport}", flush=True)
        if self.transport == "shm":
            return
        self._join_group(rollout_engines, timeout)

    def _join_group(self, rollout_engines, timeout):
        """Build the broadcast group `self._group_name`: this trainer (rank 0) and every rank of `rollout_engines`."""
        gpus_per_engine = self.args.rollout_num_gpus_per_engine
        world_size = len(rollout_engines) * gpus_per_engine + 1
        master_address = get_host_info()[1]
        master_port = free_port()  # drawn at random: concurrent runs on one machine do not race for one number
        backend = dist_backend()
        refs = [
            engine.init_process_group.remote(
                master_address, master_port, i * gpus_per_engine + 1, world_size, self._group_name, backend=backend
            )
            for i, engine in enumerate(rollout_engines)
        ]
        # The trainer's side blocks until every engine rank joined; run it aside so a failing engine is reported at once.
        joined = {}

        def join():
            try:
                joined["group"] = init_process_group(
                    backend=backend,
                    init_method=f"tcp://{master_address}:{master_port}",
                    world_size=world_size,
                    rank=0,
                    group_name=self._group_name,
                    timeout=seconds(timeout),
                )
            except Exception as e:  # reported by the waiting thread below
                joined["error"] = e

        thread = threading.Thread(target=join, name=f"{self._group_name}-init", daemon=True)
        thread.start()
        what = f"joining weight-update group {self._group_name} at {master_address}:{master_port}"
        wait_engines(refs, [self._url_of(e) for e in rollout_engines], what, timeout)
        thread.join(timeout)
        if "error" in joined or thread.is_alive():
            raise WeightUpdateError(f"{what}: the trainer side failed: {joined.get('error', 'timed out')}")
        self._group = joined["group"]

    def _leave_group(self, old_engines, old_urls, timeout):
        """Destroy the current weight-update group on the engines that stay and on this trainer."""
        current = {e._actor_id for e in self.rollout_engines}
        stay = [(e, u) for e, u in zip(old_engines, old_urls) if e._actor_id in current]
        refs = [e.destroy_weights_update_group.remote(self._group_name) for e, _ in stay]
        wait_engines(refs, [u for _, u in stay], f"destroy_weights_update_group {self._group_name}", timeout)
        try:
            dist.destroy_process_group(self._group)
        except Exception as e:  # noqa: BLE001  (a group whose peers died may fail to tear down; it is dropped anyway)
            logger.warning("destroying weight-update group %s on the trainer: %s", self._group_name, e)
        self._group = None

    def _choose_transport(self) -> str:
        wanted = self.args.update_weight_transport or "auto"
        host = get_host_info()[1]
        # loopback names mean this host only where this host is the loopback address: with several Ray nodes on one
        # machine (127.0.0.2, 127.0.0.3, ...) an engine on another node's address is remote and gets the broadcast
        local = {host} | ({"127.0.0.1", "localhost", "::1"} if host in ("127.0.0.1", "localhost", "::1") else set())
        shm_possible = shared_memory_handles() and all(urlparse(u).hostname in local for u in self._urls)
        if wanted == "auto" and self.args.rollout_external:
            return "broadcast"  # a server slime did not start may not open this run's shared-memory handles
        if wanted == "shm" and not shm_possible:
            raise WeightUpdateError(
                f"--update-weight-transport shm needs a CPU run with every engine on this host ({host}); "
                f"engines: {self._urls}"
            )
        return "shm" if wanted == "shm" or (wanted == "auto" and shm_possible) else "broadcast"

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
                self._wait(pausing, "pause_generation / flush_cache / begin_weight_update", timeout)
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
            if self._is_pp_src_rank and self.transport != "shm":
                self._regroup_survivors(timeout)
        else:
            raise WeightUpdateError(f"update_weights v{self.weight_version}: engines kept failing: {self._urls}")
        if pausing:
            self._wait(pausing, "pause_generation / flush_cache / begin_weight_update", timeout)
        dist.barrier(group=get_gloo_group())
        self._wait_lock_releases()

        if dist.get_rank() == 0 and not self._closed:
            # an engine actor runs each continue after its end: both are sent at once, awaited together
            self._wait(
                [
                    (e, getattr(e, call).remote())
                    for call in ("end_weight_update", "continue_generation")
                    for e in self.rollout_engines
                ],
                "end_weight_update / continue_generation",
                timeout,
            )
        if self.transport == "shm" and self._is_pp_src_rank:
            self._share_params()  # once, after the first update measured what needs copying (generation goes on)
        lost_ids = [None] * dist.get_world_size(group=get_gloo_group())
        dist.all_gather_object(lost_ids, sorted(self._lost), group=get_gloo_group())
        self._drop({a for x in lost_ids for a in x})
        metrics = update_metrics(
            time.perf_counter() - start, sent * max(1, self._num_engine_ranks), self.weight_version
        )
        self.sent_hashes.into(metrics)
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
            if bucket and bucket_bytes + size > self.args.update_weight_buffer_size:
                num_buckets += 1
                failed = not self._send_bucket_surviving(bucket, num_buckets)
                sent += 0 if failed else sum(t.numel() * t.element_size() for _, t in bucket)
                bucket, bucket_bytes = [], 0
            bucket += hf_tensors
            bucket_bytes += size
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

    def _wait(self, engine_refs, what, timeout):
        """Wait for (engine, ref) pairs, naming an engine that fails. With --use-fault-tolerance the calls of an engine
        found dead (now or earlier in this update) are skipped and the engine dropped; a live engine that fails
        still fails the update."""
        live = [(e, r) for e, r in engine_refs if _id(e) not in self._lost]
        try:
            return wait_engines([r for _, r in live], [self._url_of(e) for e, _ in live], what, timeout)
        except WeightUpdateError:
            if not self.args.use_fault_tolerance:
                raise
            dead = self._find_dead(list({_id(e): e for e, _ in live}.values()))
            if not dead:
                raise
            self._drop(dead)
            return self._wait(engine_refs, what, timeout)

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
                        [self._url_of(e) for e, _ in refs if _id(e) in dead],
                    )
                self._lost |= dead
                return dead
            time.sleep(0.2)

    def _drop(self, actor_ids):
        keep = [i for i, e in enumerate(self.rollout_engines) if _id(e) not in actor_ids]
        self._lost |= set(actor_ids) & {_id(e) for e in self.rollout_engines}
        self.rollout_engines = [self.rollout_engines[i] for i in keep]
        self._urls = [self._urls[i] for i in keep]

    def _url_of(self, engine):
        return self._url_by_id.get(_id(engine), "engine ?")

    def _regroup_survivors(self, timeout):
        """A bucket failed with a dead member in the group: drop the old group and build one of the survivors."""
        try:
            dist.destroy_process_group(self._group)
        except Exception as e:  # noqa: BLE001  (its dead peer may fail the teardown; it is dropped anyway)
            logger.warning("destroying weight-update group %s on the trainer: %s", self._group_name, e)
        self._group = None
        survivors = list(self.rollout_engines)
        self._wait(
            [(e, e.destroy_weights_update_group.remote(self._group_name)) for e in survivors],
            f"destroy_weights_update_group {self._group_name}",
            timeout,
        )
        self._connections += 1
        self._group_name = f"slime-pp_{mpu.get_pipeline_model_parallel_rank()}-{self._connections}"
        if self.rollout_engines:
            self._join_group(list(self.rollout_engines), timeout)

    def _wait_lock_releases(self):
        releases, self._lock_releases = self._lock_releases, []
        if releases:
            ray.get(releases, timeout=update_timeout(self.args))

    @property
    def _num_engine_ranks(self) -> int:
        return len(self.rollout_engines) * self.args.rollout_num_gpus_per_engine

    def _send_bucket(self, named_tensors, index, last=False) -> int:
        via = "shared memory" if self.transport == "shm" else self._group_name
        what = (
            f"update_weights_from_distributed v{self.weight_version} {describe_bucket(index, named_tensors)} via {via}"
        )
        timeout = update_timeout(self.args)
        if self._group is None and self.transport != "shm":
            raise WeightUpdateError(f"{what}: connect_rollout_engines() was not called on this trainer")
        acquire_lock(self.rollout_engine_lock, what, timeout)
        try:
            if self.transport == "shm":
                # rank 0 the only sender, no retry to make: the session closes right behind the last bucket
                close = (
                    last and mpu.get_pipeline_model_parallel_world_size() == 1 and not self.args.use_fault_tolerance
                )
                self._send_bucket_shm(named_tensors, what, timeout, close)
            else:
                self._send_bucket_broadcast(named_tensors, what, timeout)
        finally:
            # not awaited here: the lock actor runs our next acquire after this release anyway (calls from one
            # caller run in order); `update_weights` checks the releases once at the end
            self._lock_releases.append(self.rollout_engine_lock.release.remote())
        return sum(t.numel() * t.element_size() for _, t in named_tensors)

    def _send_bucket_broadcast(self, named_tensors, what, timeout):
        refs = [
            engine.update_weights_from_distributed.remote(
                names=[n for n, _ in named_tensors],
                dtypes=[_dtype_name(t.dtype) for _, t in named_tensors],
                shapes=[list(t.shape) for _, t in named_tensors],
                group_name=self._group_name,
                weight_version=str(self.weight_version),
            )
            for engine in self.rollout_engines
        ]
        works = [
            dist.broadcast(gloo_safe(t, self._group), 0, group=self._group, async_op=True) for _, t in named_tensors
        ]

        def check_broadcast(all_works=False):
            # a peer that vanished mid-transfer fails the work; name the engine that died if it says so in time
            for w in works:
                if all_works or w.is_completed():
                    try:
                        w.wait()
                    except Exception as e:
                        wait_engines(refs, self._urls, what, timeout=5)
                        raise WeightUpdateError(f"{what}: broadcast to engines {self._urls} failed: {e}") from e

        wait_engines(refs, self._urls, what, timeout, on_poll=check_broadcast)
        check_broadcast(all_works=True)

    @torch.no_grad()
    def _share_params(self):
        """Put this source rank's parameters in shared memory, once: a parameter with a storage of its own moves into
        one shared flat buffer per dtype (`param.data` becomes a view of it; the optimizer and DDP keep the same
        Parameter objects), a storage holding several (DDP's param buffers under the distributed optimizer) is shared
        in place (torch swaps the memory under its views). The engines then read the weights where they are.
        Each flat buffer starts with room for the tensors one bucket copies (the most the first update copied), so a
        bucket is one handle per dtype. Skipped under --offload-train: sleeping frees storages by resizing them,
        which shared memory refuses."""
        if self._param_homes is not None or self.args.offload_train:
            return
        homes, own, seen = {}, defaultdict(list), set()
        for _, p in named_parameters(self.args, self.model):
            if not isinstance(p, torch.nn.Parameter) or id(p) in seen:  # a shared Parameter moves once
                continue
            seen.add(id(p))
            storage = p.untyped_storage()
            if p.is_contiguous() and p.storage_offset() == 0 and storage.nbytes() == p.numel() * p.element_size():
                own[p.dtype].append(p)
            elif storage.data_ptr() not in homes:
                storage.share_memory_()
                homes[storage.data_ptr()] = torch.empty(0, dtype=p.dtype).set_(storage)
        for dtype, params in own.items():
            room = self._scratch_need[dtype]
            buf = torch.empty(room + sum(p.numel() for p in params), dtype=dtype).share_memory_()
            offset = room
            for p in params:
                view = buf[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
            homes[buf.data_ptr()] = buf
            self._scratch[dtype] = (buf, room)
            self._shm_buffers.pop(dtype, None)  # a later bucket copying more than `room` allocates it again
        self._param_homes = homes

    def _home_offset(self, t):
        """(home tensor, element offset) of `t` when it is a contiguous view of a shared parameter storage, else None."""
        home = (self._param_homes or {}).get(t.untyped_storage().data_ptr())
        if home is None or home.dtype != t.dtype or not t.is_contiguous():
            return None
        offset, rest = divmod(t.data_ptr() - home.data_ptr(), t.element_size())
        return (home, offset) if rest == 0 and 0 <= offset and offset + t.numel() <= home.numel() else None

    def _send_bucket_shm(self, named_tensors, what, timeout, close=False):
        """Tensors in a shared parameter storage go as offsets into it (one flattened bucket per storage); the others
        are packed into the room at the start of their dtype's parameter buffer, else into one shared buffer per
        dtype. Every engine (each TP rank) gets its own handle of each. `close`: end the engines' weight-update
        session and continue generation right behind this bucket (an engine actor runs the calls in order)."""
        flats, by_flat = {}, defaultdict(list)  # data_ptr -> flat 1-D shared tensor, its FlattenedTensorMetadata
        for dtype, items in by_dtype(named_tensors).items():
            copied = []
            for name, t in items:
                found = self._home_offset(t)
                if found is None:
                    copied.append((name, t))
                    continue
                home, off = found
                flats[home.data_ptr()] = home
                by_flat[home.data_ptr()].append(
                    FlattenedTensorMetadata(
                        name=name,
                        shape=t.shape,
                        dtype=t.dtype,
                        start_idx=off,
                        end_idx=off + t.numel(),
                        numel=t.numel(),
                    )
                )
            if not copied:
                continue
            numel = sum(t.numel() for _, t in copied)
            self._scratch_need[dtype] = max(self._scratch_need[dtype], numel)
            buf, room = self._scratch.get(dtype, (None, 0))
            if numel > room:
                buf = self._shm_buffers.get(dtype)
                if buf is None or buf.numel() < numel:
                    buf = torch.empty(numel, dtype=dtype).share_memory_()
                    self._shm_buffers[dtype] = buf
            flats[buf.data_ptr()] = buf
            by_flat[buf.data_ptr()] += pack_flat(buf, copied)[0]
        refs, urls = [], []
        for key, metadata in by_flat.items():
            for engine, url in zip(self.rollout_engines, self._urls):  # a handle can be opened once: one per TP rank
                handles = [bucket_payload(flats[key], metadata) for _ in range(self.args.rollout_num_gpus_per_engine)]
                refs.append(
                    engine.update_weights_from_tensor.remote(
                        serialized_named_tensors=handles,
                        load_format="flattened_bucket",
                        weight_version=str(self.weight_version),
                    )
                )
                urls.append(url)
        if close:
            for call in ("end_weight_update", "continue_generation"):
                refs += [getattr(e, call).remote() for e in self.rollout_engines]
                urls += self._urls
            what += " / end_weight_update / continue_generation"
        # engines answer after copying out of the buffers, so the next bucket may overwrite them and training may
        # change the parameters
        wait_engines(refs, urls, what, timeout)
        self._closed = close
