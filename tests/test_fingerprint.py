"""Weight fingerprints (slime.utils.fingerprint, slime.rollout.weight_fingerprints): tiles32 against a line-by-line
transcription of SGLang's Triton kernel, the order-free combine, and what the post-push comparison catches."""

import pytest
import torch

from slime.rollout.weight_fingerprints import adapter_mismatch, engine_mismatch, merge_rank_hashes, sglang_disagreement
from slime.utils import fingerprint as fp

M32 = 0xFFFFFFFF


def _fmix32(x):
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _rotl(x, r):
    return ((x << r) & M32) | (x >> (32 - r))


def reference_tiles32(t: torch.Tensor) -> int:
    """SGLang 0.5.23 `gpu_tensor_hash` (hash_tiles32_kernel_blocked, add_tree_reduce, _final_splitmix64), one word
    at a time in plain Python integers."""
    b = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    b += b"\0" * ((-len(b)) % 4)
    n = len(b) // 4
    if n == 0:
        return 0
    seed = 0x243F6A88
    s1, s2 = seed & M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    total = 0
    for base in range(0, n, 8192):
        h1 = h2 = 0
        for i in range(base, min(n, base + 8192)):
            v = int.from_bytes(b[4 * i : 4 * i + 4], "little")
            p1 = ((i * 0x27D4EB2D + s1) & M32) ^ _rotl(i, 15)
            p2 = ((i * 0x165667B1 + s2) & M32) ^ _rotl(i, 13)
            h1, h2 = (h1 + _fmix32(v ^ p1)) & M32, (h2 + _fmix32(v ^ p2)) & M32
        nbytes = (n * 4) & M32
        total = (total + ((_fmix32(h1 ^ nbytes) << 32) | _fmix32(h2 ^ nbytes))) & ((1 << 64) - 1)
    return fp.splitmix64(total)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the last word zero-padded
        torch.randn(7, 5, generator=g),
        torch.randint(0, 255, (8193 * 4 + 1,), dtype=torch.uint8, generator=g),  # a ragged last tile
        torch.randn(64, 300, generator=g).to(torch.bfloat16),
        torch.randn(3 * 8192 + 5, generator=g),  # several tiles, several chunks (with the chunk set to one tile)
    ]


@pytest.mark.parametrize("chunk_tiles", [1, 256])
def test_tiles32_equals_sglang_kernel_transcription(monkeypatch, chunk_tiles):
    monkeypatch.setattr(fp, "_CHUNK_TILES", chunk_tiles)
    for t in _inputs():
        want = reference_tiles32(t)
        assert fp._tensor_hash_np(t) == want, (t.dtype, tuple(t.shape))
        assert fp._tensor_hash_torch(t) == want, (t.dtype, tuple(t.shape))  # the device path, run on CPU here
        assert fp.tensor_hash(t) == want
    assert fp.tensor_hash(torch.empty(0)) == 0


def test_xxh3_is_xxh3_64_of_the_row_major_bytes_and_cpu_trainers_use_it():
    import xxhash

    t = torch.randn(5, 7).to(torch.bfloat16)
    want = xxhash.xxh3_64_intdigest(t.contiguous().view(torch.int16).numpy().tobytes())
    assert fp.tensor_hash(t, "xxh3") == want and fp.tensor_hash(t.t().contiguous().t(), "xxh3") == want
    assert fp.default_algorithm("cpu") == "xxh3" and fp.default_algorithm("cuda") == "tiles32"
    with pytest.raises(ValueError, match="unknown tensor hash algorithm 'md5' \\(known: tiles32, xxh3\\)"):
        fp.tensor_hash(t, "md5")


@pytest.mark.parametrize("algorithm", fp.ALGORITHMS)
def test_each_hash_sees_a_transpose_a_permutation_and_one_changed_byte(algorithm):
    w = torch.randn(64, 64)
    h = fp.tensor_hash(w, algorithm)
    assert fp.tensor_hash(w.t().contiguous(), algorithm) != h  # same bytes, other order
    assert fp.tensor_hash(w.t(), algorithm) != h  # a strided view is hashed in its logical (row-major) order
    assert fp.tensor_hash(torch.cat([w[32:], w[:32]]), algorithm) != h  # two halves swapped (e.g. gate/up)
    bumped = w.clone()
    bumped.view(torch.uint8).view(-1)[12345] ^= 1
    assert fp.tensor_hash(bumped, algorithm) != h
    assert fp.tensor_hash(w.clone(), algorithm) == h


def test_combine_is_order_free_adds_up_over_ranks_and_sees_names():
    g = torch.Generator().manual_seed(1)
    tensors = {
        f"model.layers.{i}.mlp.{p}_proj.weight": torch.randn(16, 8, generator=g) for i in range(3) for p in "gu"
    }
    hashes = fp.hash_named(tensors.items())
    fingerprint = fp.combine(hashes)
    assert fp.combine(dict(reversed(list(hashes.items())))) == fingerprint
    # parts hashed on different ranks (and one tensor sent by two ranks) give the same version map
    names = list(hashes)
    parts = [{n: hashes[n] for n in names[:4]}, {n: hashes[n] for n in names[3:]}]
    assert fp.combine(merge_rank_hashes(parts, 1)) == fingerprint
    # the same tensors under swapped names
    a, b = "model.layers.0.mlp.g_proj.weight", "model.layers.0.mlp.u_proj.weight"
    swapped = dict(hashes, **{a: hashes[b], b: hashes[a]})
    assert fp.combine(swapped) != fingerprint
    assert fp.first_difference(hashes, swapped).startswith(a)


def test_ranks_that_sent_one_name_with_different_bytes_are_refused():
    with pytest.raises(RuntimeError, match=r"weight version 3: two trainer ranks sent 'x' with different bytes"):
        merge_rank_hashes([{"x": "00000000000000aa"}, {"x": "00000000000000bb"}], 3)


def _report(hashes, version="4"):
    return {"weight_version": version, "weights_fingerprint": fp.combine(hashes), "tensor_hashes": hashes}


def test_engine_mismatch_names_the_engine_version_fingerprints_and_first_tensor():
    trainer = {"a.weight": "0000000000000001", "b.weight": "0000000000000002", "mtp.weight": "0000000000000003"}
    served = {"a.weight": "0000000000000001", "b.weight": "0000000000000002"}
    # a tensor the engine ignores by design (not served) is left out
    assert engine_mismatch(trainer, _report(served), 4, "engine 0 (http://127.0.0.1:1)") is None
    bad = dict(served, **{"b.weight": "00000000000000ff"})
    msg = engine_mismatch(trainer, _report(bad), 4, "engine 0 (http://127.0.0.1:1)")
    want = fp.combine({"a.weight": trainer["a.weight"], "b.weight": trainer["b.weight"]})
    assert msg == (
        f"engine 0 (http://127.0.0.1:1) serves weight version 4 with fingerprint {fp.combine(bad)}, the trainer "
        f"pushed {want}; first differing tensor: b.weight (trainer 0000000000000002, engine 00000000000000ff)"
    )
    kept = dict(served, **{"vision.weight": "0000000000000009"})  # served from the checkpoint, no trainer sends it
    assert engine_mismatch(trainer, _report(kept), 4, "e") is None
    assert "no hash of any tensor the trainer pushed" in engine_mismatch(trainer, _report({}), 4, "e")
    assert "reports weight version '3' after the push of version 4" in engine_mismatch(
        trainer, _report(served, "3"), 4, "e"
    )


def test_adapter_mismatch_names_the_engine_version_adapter_fingerprints_and_first_tensor():
    a, b = (
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight",
    )
    trainer = {a: "0000000000000001", b: "0000000000000002"}
    info = {"weight_version": "3", "adapter": "slime_policy", "adapter_tensor_hashes": dict(trainer)}
    assert adapter_mismatch(trainer, info, 3, "slime_policy", "e") is None
    # every tensor counts: the adapter is pushed whole
    short = dict(info, adapter_tensor_hashes={a: trainer[a]})
    assert adapter_mismatch(trainer, short, 3, "slime_policy", "engine 1 (http://h:2)") == (
        f"engine 1 (http://h:2) serves LoRA adapter 'slime_policy' of weight version 3 with fingerprint "
        f"{fp.combine({a: trainer[a]})}, the trainer pushed {fp.combine(trainer)}; first differing tensor: {b} "
        "(trainer 0000000000000002, engine not served)"
    )
    none = dict(info, adapter_tensor_hashes=None)
    assert adapter_mismatch(trainer, none, 3, "slime_policy", "e") == (
        "e serves no LoRA adapter 'slime_policy' after the push of weight version 3"
    )
    assert "reports weight version '2' after the push of version 3" in adapter_mismatch(
        trainer, dict(info, weight_version="2"), 3, "slime_policy", "e"
    )


def test_sglang_engines_must_agree_rank_by_rank():
    def body(*ranks):  # ranks arrive in any order (zmq)
        return {
            "ranks": [{"checksums": c, "parallelism_info": [{"rank": r}]} for r, c in ranks],
            "per_engine_checksum": "x",
        }

    a = body((1, {"qkv_proj": "b"}), (0, {"qkv_proj": "a"}))
    b = body((0, {"qkv_proj": "a"}), (1, {"qkv_proj": "b"}))
    assert sglang_disagreement({"e0": a, "e1": b}) is None
    c = body((0, {"qkv_proj": "a"}), (1, {"qkv_proj": "z"}))
    assert sglang_disagreement({"e0": a, "e1": c}) == "e1 and e0 differ on rank 1 parameter 'qkv_proj' (z vs b)"


def test_the_opt_out_flag_skips_the_check_with_one_warning(caplog):
    import threading

    from slime.ray.engine_group import EngineGroup
    from slime.ray.rollout import RolloutManager
    from tests._args import make_args

    args = make_args("--no-check-weight-fingerprints")
    assert args.check_weight_fingerprints is False and make_args().check_weight_fingerprints is True
    manager = RolloutManager.__new__(RolloutManager)
    manager.args, manager.policy = args, EngineGroup(None, args, None)
    manager.policy.engines, manager.policy.urls = [object()], ["http://127.0.0.1:1"]
    manager.trainer_tensor_hashes, manager._warned, manager._lock = {}, set(), threading.RLock()
    bad = {"update_weights/weight_version": 2, "update_weights/tensor_hashes": {"x": "0000000000000001"}}
    for _ in range(2):
        metrics = [dict(bad)]
        manager.check_weight_fingerprints(metrics)  # an engine object without the method: never called
        assert "update_weights/tensor_hashes" not in metrics[0]  # the map never reaches the logged metrics
        # --lora-sync adapter's check, off by the same flag
        metrics = [{"update_weights/weight_version": 2, "update_weights/adapter_tensor_hashes": {"x": "01"}}]
        manager.check_adapter_fingerprints(metrics)
        assert "update_weights/adapter_tensor_hashes" not in metrics[0]
    assert sum("--no-check-weight-fingerprints" in r.getMessage() for r in caplog.records) == 1


def test_a_cpu_trainer_hashes_what_it_sent_in_a_worker_thread_after_the_push(monkeypatch):
    """SentHashes with xxh3: during the push `add` only queues (the hash does not compete with the push); `push_done`
    hands the queue to a worker thread and `report` waits for it. More than about one bucket's bytes queued start the
    worker during the push and hold the push until no more than that wait. Lists and generators give the same map; a
    job of a failed push does not leak into the next."""
    import threading
    from types import SimpleNamespace

    from slime.backends.megatron_utils.update_weight import common

    gate, seen = threading.Event(), []

    def slow_hash(pairs, out, algorithm):
        seen.append(threading.current_thread().name)
        assert gate.wait(60)
        return fp.hash_named(pairs, out, algorithm)

    monkeypatch.setattr(common, "hash_named", slow_hash)
    args = SimpleNamespace(check_weight_fingerprints=True, update_weight_buffer_size=1000)
    sent = common.SentHashes(args)
    assert sent.algorithm == "xxh3"
    tensors = [(f"w{i}", torch.randn(100)) for i in range(4)]  # 400 bytes each
    sent.add(tensors[:2])  # 800 bytes: within the bound
    sent.add(t for t in tensors[2:])  # a generator (the disk path's casts): its bytes are not counted
    assert not seen and not sent._jobs  # nothing hashed while the push goes on
    sent.push_done()
    assert len(sent._jobs) == 2 and not sent.hashes
    gate.set()
    report = sent.report(3)
    assert report["update_weights/tensor_hashes"] == fp.hash_named(tensors, None, "xxh3")
    assert (report["update_weights/weight_version"], report["update_weights/tensor_hash_algorithm"]) == (3, "xxh3")
    assert seen and set(seen) == {seen[0]} != threading.current_thread().name  # one worker, not the caller

    gate.clear()
    sent.reset()
    sent.add([("w0", torch.randn(200))])  # 800 bytes: queued
    blocked = threading.Thread(target=sent.add, args=([("w1", torch.randn(100))],))
    blocked.start()  # 1200 bytes: over the bound, the worker starts and this add waits until w0 is hashed
    blocked.join(0.5)
    assert blocked.is_alive() and sent._jobs
    gate.set()
    blocked.join(30)
    assert set(sent.report(4)["update_weights/tensor_hashes"]) == {"w0", "w1"}

    monkeypatch.setattr(common, "hash_named", lambda *a: 1 / 0)  # a push that failed mid-hash
    sent.add(tensors[:1])
    sent.push_done()
    sent.reset()
    monkeypatch.setattr(common, "hash_named", fp.hash_named)
    sent.add(tensors[1:2])
    assert sent.report(5)["update_weights/tensor_hashes"] == fp.hash_named(tensors[1:2], None, "xxh3")


def test_a_trainer_hashes_after_its_push_returns_and_waits_for_it_before_it_trains_or_offloads(monkeypatch):
    """The push returns while what it sent is still being hashed (the driver checks it before the version's samples
    train); the worker reads the trainer's tensors, so `train` and `sleep` (which change or free them) wait for it,
    and `sent_weight_hashes` hands the finished map with the push's version."""
    import threading
    from types import SimpleNamespace

    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.update_weight import common

    gate = threading.Event()

    def slow_hash(pairs, out, algorithm):
        assert gate.wait(60)
        return fp.hash_named(pairs, out, algorithm)

    monkeypatch.setattr(common, "hash_named", slow_hash)
    args = SimpleNamespace(check_weight_fingerprints=True, update_weight_buffer_size=1 << 20, debug_rollout_only=True)
    trainer = MegatronTrainRayActor.__new__(MegatronTrainRayActor)
    trainer.args, trainer.role, trainer._offload_backup = args, "actor", None
    trainer._offload_storages = list  # nothing to move: what matters is when `sleep` starts
    trainer.weight_updator = SimpleNamespace(sent_hashes=common.SentHashes(args), weight_version=4)
    tensor = torch.randn(64)
    for call in (lambda: trainer.train(0, None), lambda: trainer.sleep(), trainer.sent_weight_hashes):
        gate.clear()
        trainer._offload_backup = None
        trainer.weight_updator.sent_hashes.reset()
        trainer.weight_updator.sent_hashes.add([("w", tensor)])  # what a push sent; the push has returned
        result = []
        worker = threading.Thread(target=lambda: result.append(call()))
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not result  # waits for the hash
        gate.set()
        worker.join(30)
        assert result and not worker.is_alive()
    assert result[0] == {
        "update_weights/weight_version": 4,
        "update_weights/tensor_hashes": fp.hash_named([("w", tensor)], None, "xxh3"),
        "update_weights/tensor_hash_algorithm": "xxh3",
    }


def test_the_trainers_background_hash_runs_at_the_lowest_cpu_priority(monkeypatch):
    """The hash after a push runs at nice 19 (Linux sets it per thread): it takes only the cores that generation and
    the next steps leave idle."""
    import os
    import threading
    from types import SimpleNamespace

    from slime.backends.megatron_utils.update_weight import common

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = []
    monkeypatch.setattr(common, "hash_named", lambda *a: seen.append(nice()))
    sent = common.SentHashes(SimpleNamespace(check_weight_fingerprints=True, update_weight_buffer_size=1 << 20))
    sent.add([("w", torch.randn(4))])
    sent.push_done()
    sent.wait()
    assert seen == [19]
