"""Weight sync Megatron -> inference engines, on CPU: gloo broadcast (disaggregated) and shared-memory handles (colocated).

Real pieces end to end: Megatron GPTModel trainers as Ray actors (TP=1 and TP=2, gloo), real CPU inference servers
behind `SGLangEngine` actors. The reference for "the engine holds the trainer's weights" is the trainer's own Megatron
forward (its own greedy decode and log-probs), which does not go through the HF conversion being tested.
"""

import itertools
import json
import os
import time
import urllib.request

import pytest
import ray
import torch

from slime.ray.train_actor import TrainRayActor
from slime.utils.http_utils import free_port
from tests._args import make_args
from tests._megatron_helpers import causal_mask, megatron_args

PROMPTS = [[1, 20, 57, 3, 88, 140, 9], [1, 300, 12, 12, 45]]
NEW_TOKENS = 6


class WeightSyncTrainer(TrainRayActor):
    """A Megatron trainer rank: the tiny Qwen3 from HF, nudged away from the checkpoint, with a CPU weight dict."""

    def setup(self, args, colocate, noise_seed, noise=0.02):
        torch.set_num_threads(1)
        super().init(args, "actor")
        from slime.backends.megatron_utils import initialize
        from slime.backends.megatron_utils.lora import apply_lora
        from slime.backends.megatron_utils.megatron_to_hf import hf_to_megatron
        from slime.backends.megatron_utils.model_provider import get_model_provider_func
        from slime.backends.megatron_utils.param_utils import named_parameters
        from slime.backends.megatron_utils.update_weight.choose import updater_class

        initialize.init(args)
        self.model = [get_model_provider_func(args)()]
        if args.enable_lora:  # adapters (nudged non-zero below) that the engines must receive merged
            apply_lora(args, self.model[0])
        hf_to_megatron(args, self.model)
        # same noise on every TP rank keeps replicated params identical; a new seed per test, since the
        # shared engines keep what the previous test sent
        gen = torch.Generator().manual_seed(noise_seed)
        adapter_sync = args.enable_lora and args.lora_sync == "adapter"
        with torch.no_grad():
            for name, p in named_parameters(args, self.model):
                if not adapter_sync or ".lora_" in name:  # adapter sync: the base stays the engines' checkpoint
                    p.add_(torch.randn(p.shape, generator=gen) * noise)
        # slime's actor keeps this CPU copy (weights["actor"]) and the colocated path must read from it
        self.weights = {"actor": {n: p.detach().clone() for n, p in named_parameters(args, self.model)}}
        args.colocate = colocate  # the rule slime's actor follows (`updater_class`) picks the updater
        self.updater = updater_class(args)(
            args,
            self.model,
            self.weights,
            model_name=args.model_name,
            quantization_config=None,
            vocab_size=args.vocab_size,
        )

    def param_counts(self):
        """(all parameters, trainable ones) of this rank's model: what a LoRA run's optimizer holds state for."""
        params = list(self.model[0].parameters())
        return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)

    def connect(self, engines, lock):
        self.updater.connect_rollout_engines(engines, lock)

    def push(self, weight_version=None):
        """The push alone, as the actor's `update_weights`: it returns while what it sent is still being hashed."""
        return self.updater.update_weights(weight_version)

    def sent_weight_hashes(self):
        from slime.backends.megatron_utils.update_weight.common import sent_weight_hashes

        return sent_weight_hashes(self.updater)

    def update_weights(self, weight_version=None):
        """The push's metrics with the hashes of what it sent, merged as the driver merges them for its check."""
        return {**self.push(weight_version), **self.sent_weight_hashes()}

    @torch.no_grad()
    def adam_like_step(self, lr, seed):
        """Move every weight by +-lr, as one Adam step of learning rate lr does (benchmarks' delta size)."""
        from slime.backends.megatron_utils.param_utils import named_parameters

        gen = torch.Generator().manual_seed(seed)
        for n, p in named_parameters(self.args, self.model):
            p.add_(torch.randint(0, 2, p.shape, generator=gen).to(p.dtype).mul_(2).sub_(1) * lr)
            self.weights["actor"][n].copy_(p)  # as slime's actor refreshes its CPU copy after a train step

    def limit_file_size(self, nbytes):
        """RLIMIT_FSIZE on this process: a write past `nbytes` fails with EFBIG, as a full disk fails with ENOSPC."""
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    def shared_param_bytes(self):
        """(bytes of the parameters held in shared memory, bytes of all parameters)."""
        from slime.backends.megatron_utils.param_utils import named_parameters

        params = [p for _, p in named_parameters(self.args, self.model)]
        nbytes = [p.numel() * p.element_size() for p in params]
        return sum(n for p, n in zip(params, nbytes) if p.untyped_storage().is_shared()), sum(nbytes)

    def offload(self):
        """Free the live parameters as an offloaded actor would: the update must come from the CPU dict."""
        for chunk in self.model:
            for p in chunk.parameters():
                p.data.untyped_storage().resize_(0)

    @torch.no_grad()
    def greedy(self, prompts, n):
        """The trainer's own greedy continuation of each prompt from its Megatron forward: (token ids, log-probs)."""
        from megatron.core import tensor_parallel

        out = []
        for prompt in prompts:
            seq, lps = list(prompt), []
            for _ in range(n):
                logits = self.model[0](
                    torch.tensor([seq]), torch.arange(len(seq))[None], attention_mask=causal_mask(len(seq))
                )
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[
                    0, -1, : self.args.vocab_size
                ]
                logp = torch.log_softmax(logits.float(), dim=-1)
                seq.append(int(logp.argmax()))
                lps.append(float(logp[seq[-1]]))
            out.append((seq[len(prompt) :], lps))
        return out


# ------------------------------------------------------------------ helpers


def _post(url, payload, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def generate(url, prompt, **fields):
    out = _post(
        f"{url}/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            **fields,
        },
    )
    meta = out["meta_info"]
    return out["output_ids"], [lp for lp, _, _ in meta["output_token_logprobs"]], meta["weight_version"]


def trainer_greedy(trainers):
    # the forward is collective over the TP group: every rank runs it
    return ray.get([t.greedy.remote(PROMPTS, NEW_TOKENS) for t in trainers], timeout=300)[0]


def max_logprob_diff(url, reference, **fields):
    """Max |log-prob difference| between the engine's greedy continuations and the trainer's `reference`
    (from `greedy`), after checking the engine picked the same tokens. Also returns the engine's weight version."""
    diff, version = 0.0, None
    for prompt, (ref_ids, ref_lps) in zip(PROMPTS, reference):
        ids, lps, version = generate(url, prompt, **fields)
        if ids != ref_ids:
            return float("inf"), version
        diff = max(diff, max(abs(a - b) for a, b in zip(lps, ref_lps)))
    return diff, version


def hf_checkpoint_bytes(model_dir):
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def _args(model_dir, tp, **kw):
    return megatron_args(
        model_dir,
        tensor_model_parallel_size=tp,
        rollout_num_gpus_per_engine=1,
        rollout_num_gpus_per_node=4,
        inference_server="cpu",
        update_weight_buffer_size=kw.pop("update_weight_buffer_size", 64 << 10),
        update_weight_timeout=kw.pop("update_weight_timeout", 120),
        check_weight_update_equal=True,
        **kw,
    )


def start_engines(args, n):
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    Engine = ray.remote(num_cpus=0.2, num_gpus=0.2)(SGLangEngine)
    engines = [Engine.remote(args, rank=i) for i in range(n)]
    ports = [free_port() for _ in range(n)]
    ray.get([e.init.remote(None, port, None, host="127.0.0.1") for e, port in zip(engines, ports)], timeout=300)
    return engines


def stop(actors):
    for a in actors:
        try:
            if hasattr(a, "shutdown"):
                ray.get(a.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001  (already dead: that is what some tests do)
            pass
        ray.kill(a)


_NOISE_SEEDS = itertools.count(1)


def start_trainers(args, colocate):
    Trainer = ray.remote(num_cpus=0.4, num_gpus=0.3)(WeightSyncTrainer)
    tp = args.tensor_model_parallel_size
    first = Trainer.remote(tp, 0, None, None)
    addr, port = ray.get(first.get_master_addr_and_port.remote(), timeout=120)
    trainers = [first] + [Trainer.remote(tp, r, addr, port) for r in range(1, tp)]
    seed = next(_NOISE_SEEDS)
    ray.get([t.setup.remote(args, colocate, seed) for t in trainers], timeout=300)
    return trainers


@pytest.fixture(scope="module")
def engines(ray_session, tiny_kit):
    """Two CPU inference servers on the tiny Qwen3 checkpoint, shared by the module's tests."""
    engines = start_engines(_args(tiny_kit[0], 1), 2)
    urls = ray.get([e.get_url.remote() for e in engines])
    yield list(zip(engines, urls))
    stop(engines)


@pytest.fixture
def lock(ray_session):
    from slime.ray.utils import Lock

    lock = Lock.remote()
    yield lock
    ray.kill(lock)


@pytest.fixture
def cleanup(engines):
    """Trainers a test starts are killed after it; their weight-update groups are dropped on the engines."""
    started = []
    yield started
    stop(started)
    for _, url in engines:
        try:
            _post(f"{url}/destroy_weights_update_group", {"group_name": "slime-pp_0"}, timeout=30)
        except Exception:  # noqa: BLE001  (colocated tests create no group)
            pass


def check_fingerprints(args, engines, metrics):
    """RolloutManager.check_weight_fingerprints (the check run after every push; check_adapter_fingerprints under
    --lora-sync adapter) on these engines and the trainers' real update results; returns the trainers' merged
    per-tensor map."""
    import threading

    from slime.ray.engine_group import EngineGroup
    from slime.ray.rollout import RolloutManager

    manager = RolloutManager.__new__(RolloutManager)  # the check only: no router, no controller
    manager.args, manager.policy = args, EngineGroup(None, args, None)
    manager.policy.engines, manager.policy.urls = [e for e, _ in engines], [u for _, u in engines]
    manager.trainer_tensor_hashes, manager._warned, manager._lock = {}, set(), threading.RLock()
    manager.check_weight_fingerprints([dict(m) for m in metrics])
    return manager.trainer_tensor_hashes


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("tp,transport", [(1, "broadcast"), (1, "shm"), (2, "broadcast"), (2, "shm")])
def test_disaggregated_update_gives_engine_the_trainer_weights(tiny_kit, engines, lock, cleanup, tp, transport):
    """gloo broadcast, and the same-host shared-memory transport `auto` picks on CPU."""
    # 64 KiB buckets: smaller than the embedding (512 x 128 fp32 = 256 KiB), which must still go (alone)
    args = _args(tiny_kit[0], tp, update_weight_transport=transport)
    engine, url = engines[0]
    cleanup += start_trainers(args, colocate=False)
    reference = trainer_greedy(cleanup)
    assert max_logprob_diff(url, reference)[0] > 1e-3, "trainer weights must differ from the checkpoint"

    ray.get([t.connect.remote([engine], lock) for t in cleanup], timeout=120)
    all_metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    metrics = all_metrics[0]
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4, f"engine differs from the trainer after the update: max |d logp| {diff}"
    assert version == "1" == str(metrics["update_weights/weight_version"])
    # the engine's fingerprint equals the trainers' (only the source rank hashes: TP=2's other rank reports none)
    pushed = check_fingerprints(args, [engines[0]], all_metrics)
    assert ["update_weights/tensor_hashes" in m for m in all_metrics] == [True] + [False] * (tp - 1)
    assert len(pushed) == len(ray.get(engine.get_weights_fingerprint.remote(), timeout=60)["tensor_hashes"]) > 10
    # every HF tensor crossed once to the single engine rank: the checkpoint's byte count (tied lm_head not resent)
    assert metrics["perf/update_weights_bytes"] == hf_checkpoint_bytes(tiny_kit[0])
    assert metrics["perf/update_weights_time"] > 0 and metrics["perf/update_weights_gbps"] > 0

    all_metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    assert max_logprob_diff(url, reference)[1] == "2"
    if tp == 1 and transport == "broadcast":
        check_fingerprints(args, [engines[0]], all_metrics)
        # one engine's served tensors overwritten after the push (SGLang's reset_tensors): named, with the version
        ray.get(engine.check_weights.remote("reset_tensors"), timeout=120)
        with pytest.raises(RuntimeError) as err:
            check_fingerprints(args, [engines[0]], all_metrics)
        msg = str(err.value)
        assert msg.startswith(f"inference engine 0 ({url}) serves weight version 2 with fingerprint "), msg
        assert (
            "the trainer pushed" in msg
            and "first differing tensor: " in msg
            and "--no-check-weight-fingerprints" in msg
        )
        off = _args(tiny_kit[0], tp, check_weight_fingerprints=False)
        check_fingerprints(off, [engines[0]], all_metrics)  # the opt-out: no check
        ray.get([t.update_weights.remote() for t in cleanup], timeout=300)  # the engine serves trainer weights again


@pytest.mark.parametrize("offload_train", [False, True])
def test_shm_transport_sends_the_live_parameters_from_shared_memory(tiny_kit, engines, lock, cleanup, offload_train):
    """TP=1 shm: after the first update the trainer's parameters move into shared memory (the engine reads them in
    place); the model still trains on them, and what a step changes reaches the engine at the next update. Under
    --offload-train (sleep resizes storages, which shared memory refuses) they stay where they are and every tensor
    is copied."""
    args = _args(tiny_kit[0], 1, update_weight_transport="shm", offload_train=offload_train)
    engine, url = engines[0]
    cleanup += start_trainers(args, colocate=False)
    ray.get([t.connect.remote([engine], lock) for t in cleanup], timeout=120)
    assert ray.get(cleanup[0].shared_param_bytes.remote(), timeout=60)[0] == 0
    ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    assert max_logprob_diff(url, trainer_greedy(cleanup))[0] < 1e-4
    # every parameter (Megatron at TP=1 keeps the norms, q/k/v, fc1, fc2, embedding as plain Parameters)
    shared, total = ray.get(cleanup[0].shared_param_bytes.remote(), timeout=60)
    assert shared == (0 if offload_train else total) and total > 0

    ray.get(cleanup[0].adam_like_step.remote(0.01, 0), timeout=60)  # in place, as the optimizer does
    reference = trainer_greedy(cleanup)
    assert max_logprob_diff(url, reference)[0] > 1e-3, "the step must change the trainer's outputs"
    metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)[0]
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4 and version == "2", (diff, version)
    assert metrics["perf/update_weights_bytes"] == hf_checkpoint_bytes(tiny_kit[0])


def test_colocated_update_from_cpu_weights_gives_engines_the_trainer_weights(tiny_kit, engines, lock, cleanup):
    # TP=2 trainers, two engines: each trainer rank hands its own handles to the engine on its GPU
    args = _args(tiny_kit[0], 2)
    cleanup += start_trainers(args, colocate=True)
    reference = trainer_greedy(cleanup)
    for _, url in engines:
        assert max_logprob_diff(url, reference)[0] > 1e-3, "trainer weights must differ from the checkpoint"
    ray.get([t.connect.remote([e for e, _ in engines], lock) for t in cleanup], timeout=120)

    # free the live params as offload does: the update must come from the actor's CPU weight dict
    ray.get([t.offload.remote() for t in cleanup], timeout=60)
    all_metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    metrics = all_metrics[0]
    check_fingerprints(args, engines, all_metrics)  # both engines serve what the two group sources hashed
    for _, url in engines:
        diff, version = max_logprob_diff(url, reference)
        assert diff < 1e-4, f"engine {url} differs from the trainer after the update: max |d logp| {diff}"
        assert version == "1"
    # each of the two engines received the whole checkpoint once
    assert metrics["perf/update_weights_bytes"] == hf_checkpoint_bytes(tiny_kit[0]) * 2


@pytest.mark.slow
@pytest.mark.parametrize("colocate,transport", [(False, "auto"), (True, "auto"), (False, "disk")])
def test_lora_merged_update_gives_engines_the_trainer_with_adapters(
    tiny_kit, engines, lock, cleanup, colocate, transport, tmp_path
):
    """--enable-lora --lora-sync merged: the engines serve W + s B A, which is what the trainer's forward (base plus
    adapter branch) computes; the adapters themselves never reach the engine, so the bytes are the checkpoint's."""
    disk = {"update_weight_disk_dir": str(tmp_path / "versions")} if transport == "disk" else {}
    args = _args(
        tiny_kit[0], 2, enable_lora=True, lora_rank=4, lora_alpha=8.0, update_weight_transport=transport, **disk
    )
    targets = [e for e, _ in engines] if colocate else [engines[0][0]]
    cleanup += start_trainers(args, colocate=colocate)
    reference = trainer_greedy(cleanup)
    ray.get([t.connect.remote(targets, lock) for t in cleanup], timeout=120)
    metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)[0]
    for _, url in engines[: len(targets)]:
        diff, _ = max_logprob_diff(url, reference)
        assert diff < 1e-4, f"engine {url} differs from the LoRA trainer after the update: max |d logp| {diff}"
    moved, full = metrics["perf/update_weights_bytes"], hf_checkpoint_bytes(tiny_kit[0]) * len(targets)
    assert moved == full if transport != "disk" else full < moved < full * 1.01  # disk: the file's header on top


@pytest.mark.slow
def test_lora_adapter_update_sends_only_adapters_and_engines_serve_base_plus_adapter(tiny_kit, lock, ray_session):
    """--lora-sync adapter: the engine keeps its checkpoint base (requests without `lora_path` are unchanged) and
    serves the trainer's base + adapter under the policy's adapter name; a second update (TP=2 trainers) replaces
    the adapter in place. Only the adapters travel: a small fraction of the checkpoint's bytes."""
    from slime.utils.lora_utils import generate_fields

    def lora_args(tp):
        a = _args(tiny_kit[0], tp, enable_lora=True, lora_rank=4, lora_alpha=8.0, lora_sync="adapter")
        a.check_weight_update_equal = False  # refused with adapter sync: the engine checks each adapter's sha256
        return a

    args = lora_args(1)
    (engine,) = started = start_engines(args, 1)
    try:
        url = ray.get(engine.get_url.remote())
        base = [generate(url, p)[:2] for p in PROMPTS]
        for tp in (1, 2):
            trainers = start_trainers(lora_args(tp), colocate=False)
            started += trainers
            reference = trainer_greedy(trainers)
            assert max_logprob_diff(url, reference)[0] > 1e-3, "the adapters must change the trainer's output"
            ray.get([t.connect.remote([engine], lock) for t in trainers], timeout=120)
            all_metrics = ray.get([t.update_weights.remote() for t in trainers], timeout=300)
            metrics = all_metrics[0]
            # the adapter the engine loaded hashes as what the trainer sent (rank 0 sends it and reports the hashes)
            pushed = check_fingerprints(lora_args(tp), [(engine, url)], all_metrics)
            assert len(pushed) > 10 and all(".lora_" in n for n in pushed)
            assert ["update_weights/adapter_tensor_hashes" in m for m in all_metrics] == [True] + [False] * (tp - 1)
            diff, version = max_logprob_diff(url, reference, **generate_fields(args))
            assert diff < 1e-4, f"TP={tp}: the engine's base + adapter differs from the trainer: max |d logp| {diff}"
            assert version == "1" == str(metrics["update_weights/weight_version"])
            assert [generate(url, p)[:2] for p in PROMPTS] == base  # the base is untouched
            assert 0 < metrics["perf/update_weights_bytes"] < hf_checkpoint_bytes(tiny_kit[0]) / 10
            stop(trainers)
    finally:
        stop(started)


@pytest.mark.slow
def test_check_weight_update_equal_protocol_passes_for_the_checkpoint_and_names_a_differing_tensor(
    tiny_kit, engines, lock, cleanup
):
    """--check-weight-update-equal as slime runs it on SGLang: the engine snapshots what it loaded and scrambles it;
    a push of the checkpoint's weights (noise 0) must restore the snapshot exactly, a push of other weights fails the
    compare naming the engine and a tensor."""
    args = _args(tiny_kit[0], 1)
    engine, url = engines[0]
    ray.get(engine.update_weights_from_disk.remote(tiny_kit[0]), timeout=120)  # earlier tests pushed other weights
    for action in ("snapshot", "reset_tensors"):
        ray.get(engine.check_weights.remote(action), timeout=120)
    Trainer = ray.remote(num_cpus=0.4, num_gpus=0.3)(WeightSyncTrainer)
    cleanup.append(Trainer.remote(1, 0, None, None))
    ray.get(cleanup[-1].setup.remote(args, True, next(_NOISE_SEEDS), 0.0), timeout=300)
    ray.get(cleanup[-1].connect.remote([engine], lock), timeout=120)
    ray.get(cleanup[-1].update_weights.remote(), timeout=300)
    assert ray.get(engine.check_weights.remote("compare"), timeout=120)["success"] is True

    for action in ("snapshot", "reset_tensors"):
        ray.get(engine.check_weights.remote(action), timeout=120)
    noisy = start_trainers(args, colocate=True)
    cleanup += noisy
    ray.get(noisy[0].connect.remote([engine], lock), timeout=120)
    ray.get(noisy[0].update_weights.remote(), timeout=300)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(engine.check_weights.remote("compare"), timeout=120)
    msg = str(err.value)
    assert url in msg and "check tensor equality failed" in msg and "name=model.embed_tokens.weight " in msg, msg


@pytest.mark.slow
def test_one_weight_update_session_per_update_not_per_bucket(tiny_kit, lock, cleanup, ray_session):
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    class Counting(SGLangEngine):
        calls = []

        def _make_request(self, endpoint, payload=None, timeout=None, method="POST"):
            type(self).calls.append(endpoint)
            return super()._make_request(endpoint, payload, timeout, method)

        def endpoints(self):
            return type(self).calls

    args = _args(tiny_kit[0], 1, update_weight_transport="broadcast")
    Engine = ray.remote(num_cpus=0.2, num_gpus=0.2)(Counting)
    engine = Engine.remote(args, rank=0)
    cleanup.append(engine)
    ray.get(engine.init.remote(None, free_port(), None, host="127.0.0.1"), timeout=300)
    trainers = start_trainers(args, colocate=False)
    cleanup += trainers
    ray.get(trainers[0].connect.remote([engine], lock), timeout=120)
    for _ in range(2):
        ray.get(trainers[0].update_weights.remote(), timeout=300)
    calls = [c for c in ray.get(engine.endpoints.remote()) if "weight" in c]
    buckets = calls.count("update_weights_from_distributed")
    assert buckets >= 8  # 64 KiB buckets
    one = ["begin_weight_update"] + ["update_weights_from_distributed"] * (buckets // 2) + ["end_weight_update"]
    assert calls == ["init_weights_update_group"] + one + one, calls


@pytest.mark.slow
def test_dead_engine_fails_the_update_fast_naming_its_url(ray_session, tiny_kit, lock):
    from slime.backends.megatron_utils.update_weight import WeightUpdateError

    timeout = 300
    args = _args(tiny_kit[0], 1, update_weight_timeout=timeout, update_weight_transport="broadcast")
    own = start_engines(args, 1)  # killed below, so not a shared one
    trainers = []
    try:
        url = ray.get(own[0].get_url.remote())
        trainers = start_trainers(args, colocate=False)
        ray.get(trainers[0].connect.remote(own, lock), timeout=120)
        ray.get(trainers[0].update_weights.remote(), timeout=300)
        ray.kill(own[0])
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError) as err:
            ray.get(trainers[0].update_weights.remote(), timeout=timeout)
        assert time.monotonic() - start < timeout / 3, "the update waited for its timeout instead of failing fast"
        assert isinstance(err.value.cause, WeightUpdateError)
        assert url in str(err.value.cause) and "dead" in str(err.value.cause), str(err.value.cause)
    finally:
        stop(trainers + own)


def test_transport_choice_and_shm_refused_for_a_remote_engine():
    """auto = shared memory when every engine is on this host (CPU), broadcast otherwise; shm for a remote engine is
    a clear error naming it."""
    from slime.backends.megatron_utils.update_weight import WeightUpdateError
    from slime.backends.megatron_utils.update_weight.choose import transport_class

    def choose(transport, urls):
        return transport_class(make_args("--update-weight-transport", transport), urls).name

    # 127.0.2.87 is another loopback address: another Ray node on this machine (this host is 127.0.0.1), so remote
    local, remote = ["http://127.0.0.1:30000"], ["http://127.0.0.1:30000", "http://127.0.2.87:30000"]
    assert choose("auto", local) == "shm" and choose("auto", remote) == "broadcast"
    assert choose("broadcast", local) == "broadcast"
    with pytest.raises(WeightUpdateError, match=r"127\.0\.2\.87"):
        choose("shm", remote)


# ------------------------------------------------------------------ disk transport


@pytest.mark.slow
def record_post_write(args, version_dir, engines):
    """--custom-update-weight-post-write-path of the disk test: what each trainer rank sees when it is called."""
    import torch.distributed as dist

    record = {
        "rank": dist.get_rank(),
        "dir": version_dir,
        "published": os.path.isfile(os.path.join(version_dir, "config.json")),
        "partial": sorted(n for n in os.listdir(args.update_weight_disk_dir) if n.startswith(".")),
        "served": ray.get(engines[0].get_weight_version.remote(), timeout=60),
    }
    with open(os.path.join(os.path.dirname(args.update_weight_disk_dir), "post_write.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def test_disk_full_versions_reach_the_engines_and_old_ones_are_removed(tiny_kit, engines, lock, cleanup, tmp_path):
    """TP=2 trainers write one HF checkpoint per version; the engine loads it with update_weights_from_disk. The
    post-write hook runs on every rank once the version is published, before the engine reads it."""
    root = tmp_path / "versions"
    args = _args(
        tiny_kit[0],
        2,
        update_weight_transport="disk",
        update_weight_disk_dir=str(root),
        custom_update_weight_post_write_path=f"{__name__}.record_post_write",
    )
    engine, url = engines[0]
    cleanup += start_trainers(args, colocate=False)
    reference = trainer_greedy(cleanup)
    ray.get([t.connect.remote([engine], lock) for t in cleanup], timeout=120)
    served_before = ray.get(engine.get_weight_version.remote(), timeout=60)
    all_metrics = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    with open(tmp_path / "post_write.jsonl") as f:
        calls = sorted((json.loads(line) for line in f), key=lambda r: r["rank"])
    assert calls == [
        {"rank": r, "dir": str(root / "weight_v000001"), "published": True, "partial": [], "served": served_before}
        for r in (0, 1)
    ]
    metrics = all_metrics[0]
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4 and version == "1"
    check_fingerprints(args, [engines[0]], all_metrics)
    v1 = root / "weight_v000001"
    assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(v1))
    # the whole model, once: the bytes of the HF checkpoint's tensors plus one safetensors header
    assert 0 < metrics["perf/update_weights_bytes"] - hf_checkpoint_bytes(tiny_kit[0]) < 64 << 10
    ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    assert max_logprob_diff(url, reference)[1] == "2"
    assert sorted(os.listdir(root)) == ["weight_v000002"]

    # a disk that cannot take the version: every rank fails naming the file, the engine keeps serving version 2
    ray.get([t.limit_file_size.remote(1 << 20) for t in cleanup], timeout=60)
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    assert f"update_weights v3: cannot write {root}/.weight_v000003.partial/pp000.safetensors" in str(e.value)
    assert "(--update-weight-disk-dir): " in str(e.value) and "File too large" in str(e.value)
    assert max_logprob_diff(url, reference) == (pytest.approx(0, abs=1e-4), "2")
    assert "weight_v000003" not in os.listdir(root)


@pytest.mark.slow
def test_disk_delta_versions_are_small_verified_and_a_corrupt_base_gets_a_full_version(
    tiny_kit, engines, lock, cleanup, tmp_path
):
    from slime.utils import disk_delta

    root, local = tmp_path / "versions", tmp_path / "local"
    args = _args(
        tiny_kit[0],
        1,
        update_weight_transport="disk",
        update_weight_disk_dir=str(root),
        update_weight_mode="delta",
        update_weight_local_checkpoint_dir=str(local),
        update_weight_disk_keep_files=True,
    )
    engine, url = engines[1]
    cleanup += start_trainers(args, colocate=False)
    reference = trainer_greedy(cleanup)
    ray.get([t.connect.remote([engine], lock) for t in cleanup], timeout=120)
    assert disk_delta.held_version(str(local)) is None  # nothing to seed: the first version is full

    first = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)[0]
    assert first["update_weights/delta_ratio"] == 1.0  # a trainer's first version is full
    index = json.load(open(root / "weight_v000001" / "model.safetensors.index.json"))
    assert "delta_encoding" not in index["metadata"]
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4 and version == "1" and disk_delta.held_version(str(local)) == 1
    # one Adam-like step (every weight moved by 1e-6): the low bytes of each fp32 change, the high ones do not
    ray.get([t.adam_like_step.remote(1e-6, 0) for t in cleanup], timeout=120)
    reference = trainer_greedy(cleanup)
    stepped = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)[0]
    assert 0.2 < stepped["update_weights/delta_ratio"] < 0.8
    index = json.load(open(root / "weight_v000002" / "model.safetensors.index.json"))
    assert index["metadata"]["delta_encoding"] == "xor" and index["metadata"]["base_version"] == "000001"
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4 and version == "2" and disk_delta.held_version(str(local)) == 2
    # nothing trained between two pushes: the delta is all zero bytes, compressed to almost nothing
    idle = ray.get([t.update_weights.remote() for t in cleanup], timeout=300)[0]
    assert idle["update_weights/delta_ratio"] < 0.01

    # damage the engine host's checkpoint: the next delta fails its checksum, and the version is sent in full
    shard = next(p for p in local.iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-64:] = bytes(64)
    shard.write_bytes(bytes(data))
    ray.get([t.update_weights.remote() for t in cleanup], timeout=300)
    index = json.load(open(root / "weight_v000004" / "model.safetensors.index.json"))
    assert "delta_encoding" not in index["metadata"]
    diff, version = max_logprob_diff(url, reference)
    assert diff < 1e-4 and version == "4" and disk_delta.held_version(str(local)) == 4
