"""Weight and memory API of slime's CPU server: the update_weights_* family, weight-update groups and sessions,
the weight checker, and memory release/resume (SGLang's memory tags)."""

import asyncio
import hashlib
import os

import torch
import torch.distributed as dist
from aiohttp import web

from slime.backends.sglang_utils.contract import load_contract
from slime.utils.disk_delta import PullError, pull_version
from slime.utils.distributed_utils import init_process_group, seconds
from slime.utils.lora_utils import tensor_sha256
from slime.utils.tensor_serialization import FlattenedTensorBucket, MultiprocessingSerializer

from .lora import TENSOR_PATH, read_peft_dir
from .sampling import RequestError
from .weight_checker import WeightCheckError
from .weights import WeightError, parse_dtype


class WeightAPI:
    """SGLang's weight-update and memory-occupation endpoints over the server's WeightStore."""

    @staticmethod
    def _tags(body):
        tags = body.get("tags")
        known = set(load_contract()["memory_tags"])  # kv_cache, weights, cuda_graph
        if tags is None:
            return known
        if not isinstance(tags, list) or not set(tags) <= known:
            raise RequestError(f"tags must be a list drawn from {sorted(known)} or null, got {tags!r}")
        return set(tags)

    async def release_memory(self, request):
        tags = self._tags(await self._body(request))

        def release():
            if not self.scheduler.is_idle():
                raise RequestError("release_memory_occupation should be called only when server is idle.")
            if "kv_cache" in tags:
                self.pool.release()
            if "weights" in tags:
                self.weights.release()
                self.received.clear()
            self.released_tags.update(tags)  # cuda_graph: no graphs here, but the tag is held released all the same

        await self._weights_control(release)
        return web.Response(text="")

    async def resume_memory(self, request):
        tags = self._tags(await self._body(request))

        def resume():
            if "weights" in tags:
                self.weights.resume()
            if "kv_cache" in tags and not self.pool.allocated:
                self.pool.allocate()
            self.released_tags.difference_update(tags)

        await self._weights_control(resume)
        self.scheduler.wakeup.set()
        return web.Response(text="")

    async def init_weights_update_group(self, request):
        b = await self._body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in b]
        if missing:
            raise RequestError(f"init_weights_update_group: missing field(s) {missing}")
        name, backend = b.get("group_name", "weight_update_group"), b.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # same call from trainer code written for GPUs; CPU machines use gloo
        url = f"tcp://{b['master_address']}:{b['master_port']}"
        timeout = float(b.get("timeout", 300))

        def join():
            return init_process_group(
                backend=backend,
                init_method=url,
                world_size=int(b["world_size"]),
                rank=int(b["rank_offset"]),
                group_name=name,
                timeout=seconds(timeout),
            )

        old = self.groups.pop(name, None)
        if old is not None:
            # a restarted trainer joins under the same name again: leave the old group first (torch refuses a group
            # name twice; its peers are gone). On the scheduler thread, so no update is receiving on it meanwhile.
            await self._control(lambda: dist.destroy_process_group(old))
        try:
            self.groups[name] = await asyncio.get_running_loop().run_in_executor(None, join)
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": f"failed to join {name} at {url}: {e}"}, status=400)
        return web.json_response({"success": True, "message": f"joined weight update group {name}"})

    async def destroy_weights_update_group(self, request):
        name = (await self._body(request)).get("group_name", "weight_update_group")
        g = self.groups.pop(name, None)
        if g is None:
            return web.json_response({"success": False, "message": f"no weight update group {name!r}"}, status=400)
        dist.destroy_process_group(g)
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    async def update_weights_from_distributed(self, request):
        b = await self._body(request)
        names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise RequestError("update_weights_from_distributed needs lists names, dtypes and shapes of equal length")
        self._require_session("update_weights_from_distributed")
        name = b.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise WeightError(f"no weight update group {name!r}: call /init_weights_update_group first")
        dts = [parse_dtype(d) for d in dtypes]

        def receive_and_load():
            # receive straight into the live weight when it matches (no extra copy), else into a buffer then load;
            # always consume every broadcast, so a rejected update never leaves the trainer blocked in the collective.
            # All receives are posted at once (the trainer posts all its sends), then awaited.
            landed = self.served_fingerprint.landing(self.weights.generation)
            self.weights.generation += 1  # written in place below even if the update is then refused
            received, unknown, works, released = [], [], [], self.weights.released
            named = {} if released else self.weights.named
            for n, dt, shape in zip(names, dts, shapes):
                dst = named.get(n)
                if dst is None or dst.dtype != dt or list(dst.shape) != list(shape) or not dst.is_contiguous():
                    if dst is None and not self.weights.is_ignored(n) and not released:
                        unknown.append(n)
                    dst = torch.empty(shape, dtype=dt)
                    received.append((n, dst))
                # gloo cannot broadcast float8: the sender sends its uint8 view, received into this one
                wire = dst.view(torch.uint8) if dst.dtype == torch.float8_e4m3fn else dst
                works.append(dist.broadcast(wire, src=0, group=group, async_op=True))
            for w in works:
                w.wait()
            if released:
                raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
            if unknown:
                raise WeightError(f"update_weights_from_distributed: unknown parameter(s) {unknown[:5]}")
            self.weights.load(received, "update_weights_from_distributed")
            # those received in place came in the served dtype: the fingerprint hashes each as it came
            self.weights.sent_dtypes.update((n, dt) for n, dt in zip(names, dts) if n in named)
            if getattr(self.weights, "quant", None) is not None:  # received in place: still to be dequantised
                self.weights.note_loaded(names)
            if landed is not None:
                landed(names)
            self.state.bump_version(b.get("weight_version"))

        await self._weights_control(receive_and_load)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weights_from_tensor(self, request):
        b = await self._body(request)
        self._require_session("update_weights_from_tensor")
        items = b.get("serialized_named_tensors")
        if not isinstance(items, list) or not items or not isinstance(items[0], str):
            raise RequestError("serialized_named_tensors must be a non-empty list of strings (one per TP rank)")
        fmt = b.get("load_format")
        if fmt not in (None, "flattened_bucket", "direct"):
            raise RequestError(f"load_format {fmt!r} is not supported (use null or 'flattened_bucket')")

        def unpack():  # blocking: fetches the shared-memory handles from the sender
            obj = MultiprocessingSerializer.deserialize(items[0])  # this server is TP rank 0
            if fmt == "flattened_bucket":
                return FlattenedTensorBucket(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                ).reconstruct_tensors()
            return list(obj)

        named = await asyncio.get_running_loop().run_in_executor(None, unpack)

        def load():
            landed = self.served_fingerprint.landing(self.weights.generation)
            self.weights.load(named, "update_weights_from_tensor", on_copied=landed)
            self.state.bump_version(b.get("weight_version"))
            self.received.keep(b.get("weight_version"), [t for _, t in named])

        await self._weights_control(load)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weights_from_disk(self, request):
        b = await self._body(request)
        path = b.get("model_path")

        def load():
            self.weights.load_from_dir(path)
            self.state.bump_version(b.get("weight_version"))

        try:
            if not isinstance(path, str) or not os.path.isdir(path):
                raise WeightError(f"update_weights_from_disk: model_path {path!r} is not a directory")
            await self._weights_control(load)
        except WeightError as e:  # SGLang's body, failure or not, counts the requests the update paused
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def pull_weights(self, request):
        """slime's `/pull_weights` (its patched SGLang's endpoint): bring the host-local checkpoint to a published
        version; `update_weights_from_disk` then loads it. Files only: generation goes on meanwhile."""
        b = await self._body(request)
        src, local, version = b.get("source_dir"), b.get("local_checkpoint_dir"), b.get("target_version")
        if not isinstance(local, str) or not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("pull_weights needs local_checkpoint_dir (a path) and target_version (an integer >= 0)")
        if version > 0 and not isinstance(src, str):
            raise RequestError("pull_weights needs source_dir (the published versions) for a target_version > 0")
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(None, pull_version, src, local, version, self.model_path)
        except PullError as e:
            raise WeightError(f"pull_weights v{version}: {e}") from None
        return web.json_response({"success": True, "message": f"local checkpoint at version {version}", **result})

    def _require_session(self, what):
        if not self.weight_session_open:
            raise WeightError(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def begin_weight_update(self, request):
        await self._body(request)
        if self.weight_session_open:
            raise WeightError("a weight-update session is already open; call end_weight_update() first")
        self.weight_session_open = True
        getattr(self.weights, "pending", set()).clear()
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await self._body(request)
        if not self.weight_session_open:
            raise WeightError("no weight-update session is open; call begin_weight_update() first")
        self.weight_session_open = False
        if getattr(self.weights, "quant", None) is not None:  # SGLang's process_weights_after_loading
            await self._weights_control(lambda: self.weights.finish_quantized("end_weight_update"))
        return web.json_response({"success": True, "message": "Success"})

    async def update_weight_version(self, request):
        b = await self._body(request)
        if not isinstance(b.get("new_version"), str):
            raise RequestError("update_weight_version needs new_version (a string)")
        # on the scheduler thread, between steps: live requests record the change in their version spans
        await self._weights_control(lambda: self.state.set_version(b["new_version"]))
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {b['new_version']}",
                "new_version": b["new_version"],
            }
        )

    # ---- LoRA adapters (SGLang's LoRAUpdateOutput replies: 200 on success, 400 with error_message otherwise)
    def _lora_reply(self, error=None):
        loaded = None if self.loras is None else self.loras.loaded()
        body = {"success": error is None, "error_message": error, "loaded_adapters": loaded}
        return web.json_response(body, status=200 if error is None else 400)

    def _lora_enabled(self):
        if self.loras is None:
            raise WeightError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    async def load_lora_adapter(self, request):
        b = await self._body(request)
        try:
            self._lora_enabled()
            config, tensors = await asyncio.get_running_loop().run_in_executor(None, read_peft_dir, b["lora_path"])
            self.loras.load(
                self.loras.new_adapter(b["lora_name"], b["lora_path"], config, tensors, b.get("pinned", False))
            )
        except WeightError as e:
            return self._lora_reply(str(e))
        return self._lora_reply()

    async def load_lora_adapter_from_tensors(self, request):
        b = await self._body(request)
        fmt = b.get("load_format")
        try:
            self._lora_enabled()
            if fmt not in (None, "flattened_bucket"):
                raise WeightError(f"load_format {fmt!r} is not supported (use null or 'flattened_bucket')")

            def unpack():  # this server is TP rank 0: its copy is the first
                obj = MultiprocessingSerializer.deserialize(b["serialized_named_tensors"][0])
                if fmt == "flattened_bucket":
                    obj = FlattenedTensorBucket(
                        flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                    ).reconstruct_tensors()
                return dict(obj)

            tensors = await asyncio.get_running_loop().run_in_executor(None, unpack)
            expected = b.get("expected_checksums")
            if expected is not None:  # as SGLang's TP worker: every expected tensor present and equal, no extra
                bad = [n for n, want in expected.items() if n not in tensors or tensor_sha256(tensors[n]) != want]
                extra = [n for n in tensors if n not in expected]
                if bad or extra:
                    raise WeightError(
                        f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(expected)} expected: {len(bad)} missing or "
                        f"value-diff {bad[:5]}, {len(extra)} extra {extra[:5]}"
                    )
            adapter = self.loras.new_adapter(
                b["lora_name"], TENSOR_PATH, b["config_dict"], tensors, b.get("pinned", False)
            )
            self.loras.load(adapter)
        except WeightError as e:
            return self._lora_reply(str(e))
        return self._lora_reply()

    async def unload_lora_adapter(self, request):
        b = await self._body(request)
        try:
            self._lora_enabled()
            adapter = self.loras.remove(b["lora_name"])  # new requests naming it fail from here on
        except WeightError as e:
            return self._lora_reply(str(e))
        while self.loras.busy(adapter):  # as SGLang: the unload completes once the requests using it finish
            await asyncio.sleep(0.01)
        return self._lora_reply()

    async def weights_checker(self, request):
        b = await self._body(request)

        def check():
            return self.weight_checker.handle(
                b.get("action", "checksum"), bool(b.get("allow_quant_error", False)), b.get("skip_tensor_list")
            )

        try:
            ranks = await self._weights_control(check)
        except (WeightCheckError, WeightError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        body = {"success": True, "message": "Success."}
        if ranks is not None:  # SGLang: one entry per rank, and a hash over their per-rank checksums
            body["ranks"] = ranks
            body["per_engine_checksum"] = hashlib.sha256(
                "".join(r["per_gpu_checksum"] for r in ranks).encode()
            ).hexdigest()
        return web.json_response(body)

    async def get_weights_by_name(self, request):
        b = await self._body(request)
        t = self.weights.named.get(b.get("name"))
        if t is None:
            raise RequestError(f"get_weights_by_name: unknown parameter {b.get('name')!r}")
        return web.json_response(t.float().reshape(-1)[: int(b.get("truncate_size", 100))].tolist())


class ReceivedBuffers:
    """The shared-memory buffers `update_weights_from_tensor` received, held until an update no longer sends them.

    Trainers send the same shared buffers on every update. While this server holds one, torch's sharing cache
    resolves the next handle of it to the mapping it already has: no new mmap, no page faults while copying, no
    munmap afterwards (together these cost more than the copy itself). Held: the buffers of the previous update
    and of the current one (calls with the same `weight_version` belong to one update).
    """

    def __init__(self):
        self._version, self._current, self._previous = object(), {}, {}

    def keep(self, version, tensors):
        if version is None or version != self._version:
            self._version, self._previous, self._current = version, self._current, {}
        for t in tensors:
            storage = t.untyped_storage()
            self._current[storage.data_ptr()] = storage
            self._previous.pop(storage.data_ptr(), None)

    def clear(self):
        self._current, self._previous = {}, {}
