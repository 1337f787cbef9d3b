"""LoRA serving in slime's CPU server, checked against transformers + peft on the same adapter: SGLang's
`/load_lora_adapter_from_tensors`, `/load_lora_adapter`, `/unload_lora_adapter`, per-request `lora_path` (a batch
mixing adapter and base requests), the base left untouched, checksums, and SGLang's refusals."""

import pytest
import torch

from slime.backends.sglang_utils.contract import body_errors
from slime.utils.lora_utils import serialize_by_value, tensor_sha256
from tests.test_cpu_server import SESSION, flush, start_cpu_server, stop_cpu_server

pytestmark = pytest.mark.timeout(300)
PROMPTS = [[3, 17, 5, 9, 11, 4], [8, 2, 14, 6]]


@pytest.fixture(scope="module")
def adapter(tiny_kit, tmp_path_factory):
    """A peft LoRA adapter (rank 4, alpha 8, every projection) with non-zero B, saved as a PEFT directory, and the
    log-probs of PROMPTS under the base model and under base + adapter (transformers + peft, fp32)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_kit[0], dtype=torch.float32).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    path = str(tmp_path_factory.mktemp("adapter"))
    model.save_pretrained(path)

    def log_probs(m):
        with torch.no_grad():
            out = []
            for ids in PROMPTS:
                logp = torch.log_softmax(m(torch.tensor([ids])).logits[0], -1)
                out.append(logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
            return out

    with_adapter = log_probs(model)
    with model.disable_adapter():
        plain = log_probs(model)
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/adapter_model.safetensors")
    config = {"r": 4, "lora_alpha": 8, "target_modules": targets, "peft_type": "LORA"}
    return {"path": path, "tensors": tensors, "config": config, "lora": with_adapter, "base": plain}


@pytest.fixture(scope="module")
def server(tiny_kit):
    proc, url = start_cpu_server(
        tiny_kit[0],
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "all",
        "--max-loras-per-batch",
        "2",
    )
    yield url
    stop_cpu_server(proc)


def _input_log_probs(url, lora_path=None, prompts=PROMPTS):
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    r = SESSION.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [torch.tensor([x[0] for x in o["meta_info"]["input_token_logprobs"][1:]]) for o in r.json()]


def _load_from_tensors(url, name, adapter, checksums=None):
    body = {
        "lora_name": name,
        "config_dict": adapter["config"],
        "serialized_named_tensors": [serialize_by_value(adapter["tensors"])],
        "load_format": "flattened_bucket",
    }
    if checksums is not None:
        body["expected_checksums"] = checksums
    assert body_errors("/load_lora_adapter_from_tensors", body) == []  # the body real SGLang takes
    return SESSION.post(url + "/load_lora_adapter_from_tensors", json=body, timeout=60)


def _close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=0)


def test_adapter_from_tensors_serves_peft_log_probs_and_leaves_the_base(server, adapter):
    before = _input_log_probs(server)
    _close(before, adapter["base"])
    sums = {n: tensor_sha256(t) for n, t in adapter["tensors"].items()}
    r = _load_from_tensors(server, "a", adapter, sums)
    assert r.status_code == 200 and r.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"a": "__tensor__"},
    }, r.text
    _close(_input_log_probs(server, "a"), adapter["lora"])
    _close(_input_log_probs(server), adapter["base"])  # requests without lora_path: the base, untouched
    mixed = _input_log_probs(server, ["a", None])  # one batch, one adapter row and one base row
    _close(mixed[:1], adapter["lora"][:1])
    _close(mixed[1:], adapter["base"][1:])
    assert max((lp - b).abs().max().item() for lp, b in zip(adapter["lora"], adapter["base"])) > 0.05  # it matters

    again = _load_from_tensors(server, "a", adapter)
    assert again.status_code == 400 and "already loaded" in again.json()["error_message"]
    r = SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}, r.text
    gone = SESSION.post(
        server + "/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 1}, "lora_path": "a"},
        timeout=60,
    )
    assert gone.status_code == 400 and "not loaded: a" in gone.text
    r = SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "a"}, timeout=60)
    assert r.status_code == 400 and "does not exist" in r.json()["error_message"]


def test_openai_routes_serve_the_adapter_their_model_or_lora_path_names(server, adapter):
    """SGLang's OpenAI routes pick an adapter by `model: "<served name>:<adapter>"`, which wins, or by `lora_path`;
    without either the base model answers. (They must not answer with the base when an adapter is named.)"""
    assert _load_from_tensors(server, "oai", adapter).status_code == 200
    name = SESSION.get(server + "/server_info", timeout=10).json()["served_model_name"]

    def generate(lora=None):
        body = {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        }
        out = SESSION.post(server + "/generate", json={**body, "lora_path": lora}, timeout=60).json()
        return out["output_ids"], [x[0] for x in out["meta_info"].get("output_token_logprobs", [])] or None

    def completion(**kw):
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        r = SESSION.post(server + "/v1/completions", json={**body, **kw}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with_adapter, base = generate("oai")[0], generate()[0]
    assert with_adapter != base
    assert completion(lora_path="oai") == with_adapter
    assert completion(model=f"{name}:oai", lora_path="not-loaded") == with_adapter
    assert completion(model=name) == completion() == base
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answers = [
        SESSION.post(server + "/v1/chat/completions", json={**chat, **kw}, timeout=60).json()["choices"][0]["message"]
        for kw in ({"model": f"{name}:oai"}, {"lora_path": "oai"}, {})
    ]
    assert answers[0] == answers[1] != answers[2]
    r = SESSION.post(server + "/v1/completions", json={"prompt": "x", "lora_path": "not-loaded"}, timeout=60)
    assert r.status_code == 400 and "not-loaded" in r.json()["message"]


def test_adapter_checksums_and_shape_are_verified(server, adapter):
    sums = {n: tensor_sha256(t) for n, t in adapter["tensors"].items()}
    first = next(iter(sums))
    bad = dict(sums, **{first: "0" * 64})
    r = _load_from_tensors(server, "bad", adapter, bad)
    assert r.status_code == 400 and "MISMATCH" in r.json()["error_message"] and first in r.json()["error_message"]
    pad = {  # the same adapter at rank 16 (zero rows/columns added): above --max-lora-rank 8
        n: torch.cat([t, t.new_zeros(12, t.shape[1])])
        if "lora_A" in n
        else torch.cat([t, t.new_zeros(t.shape[0], 12)], 1)
        for n, t in adapter["tensors"].items()
    }
    big = dict(adapter, config=dict(adapter["config"], r=16), tensors=pad)
    r = _load_from_tensors(server, "big", big)
    assert r.status_code == 400 and "incompatible" in r.json()["error_message"]
    assert "bad" not in r.json()["loaded_adapters"] and "big" not in r.json()["loaded_adapters"]


def test_adapter_from_a_peft_directory(server, adapter):
    r = SESSION.post(
        server + "/load_lora_adapter", json={"lora_name": "disk", "lora_path": adapter["path"]}, timeout=60
    )
    assert r.status_code == 200 and r.json()["loaded_adapters"]["disk"] == adapter["path"], r.text
    _close(_input_log_probs(server, "disk"), adapter["lora"])
    assert SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "disk"}, timeout=60).status_code == 200


def test_the_prefix_cache_keeps_each_adapters_rows_apart(server, adapter):
    """A prompt cached under the base is not reused by an adapter (its K/V differ): each adapter, and the base,
    starts from its own cached rows only, with its own outputs."""
    flush(server)  # earlier tests' base requests cached these prompts
    r = SESSION.post(server + "/load_lora_adapter", json={"lora_name": "c", "lora_path": adapter["path"]}, timeout=60)
    assert r.status_code == 200, r.text

    def generate(lora_path=None):
        body = {"input_ids": PROMPTS[0], "return_logprob": True, "sampling_params": {"max_new_tokens": 3}}
        body["sampling_params"].update(temperature=0, ignore_eos=True)
        out = SESSION.post(server + "/generate", json={**body, "lora_path": lora_path}, timeout=60).json()
        return out["meta_info"]["cached_tokens"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]

    try:
        base, lora, lora_again, base_again = generate(), generate("c"), generate("c"), generate()
    finally:
        assert SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "c"}, timeout=60).status_code == 200
    n = len(PROMPTS[0])
    assert [base[0], lora[0], lora_again[0], base_again[0]] == [0, 0, n - 1, n - 1]
    assert max(abs(a - b) for a, b in zip(lora[1], lora_again[1])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(base[1], base_again[1])) <= 1e-5
    assert max(abs(a - b) for a, b in zip(base[1], lora[1])) > 1e-3  # the adapter changes these outputs


def test_an_unloaded_adapters_cached_rows_go_back_to_the_pool(tiny_kit, adapter):
    """The prefix cache pins the adapter it keys rows by; once the adapter is unloaded, the next step hands those rows
    back (and the adapter with them), while the base model's cached rows stay."""
    from slime.backends.cpu_server.lora import TENSOR_PATH
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req
    from tests.test_cpu_server import _cached_rows, _scheduler, _serve_one

    sched = _scheduler(tiny_kit[0], max_running=4, max_total_tokens=100)
    sched.loras = loras = _registry(dims=sched.model.lora_dims())
    loras.load(loras.new_adapter("c", TENSOR_PATH, adapter["config"], adapter["tensors"]))
    sp = SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}, 512)
    (c,) = loras.acquire(["c"])
    _serve_one(sched, Req(PROMPTS[0], sp, lora=c))
    _serve_one(sched, Req(PROMPTS[1], sp))
    assert set(sched.caches) == {id(c), id(None)} and _cached_rows(sched) == len(PROMPTS[0]) + len(PROMPTS[1]) + 4
    loras.remove("c")
    _serve_one(sched, Req(PROMPTS[1], sp))
    assert set(sched.caches) == {id(None)} and sched.pool.num_free() + _cached_rows(sched) == 100
    assert _cached_rows(sched) == len(PROMPTS[1]) + 2


@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_lora_at_start_up_and_without_enable_lora(tiny_kit, adapter):
    proc, url = start_cpu_server(tiny_kit[0], "--lora-paths", f"pre={adapter['path']}")  # --lora-paths implies it
    try:
        _close(_input_log_probs(url, "pre"), adapter["lora"])
        info = SESSION.get(url + "/server_info", timeout=30).json()
        assert info["enable_lora"] is True and info["max_lora_rank"] == 4
    finally:
        stop_cpu_server(proc)
    proc, url = start_cpu_server(tiny_kit[0])
    try:
        r = SESSION.post(
            url + "/generate", json={"input_ids": PROMPTS[0], "sampling_params": {}, "lora_path": "x"}, timeout=60
        )
        assert r.status_code == 400 and "LoRA is not enabled" in r.text
        r = _load_from_tensors(url, "x", adapter)
        assert r.status_code == 400 and r.json()["error_message"].startswith("LoRA is not enabled")
        assert SESSION.get(url + "/server_info", timeout=30).json()["enable_lora"] is False
    finally:
        stop_cpu_server(proc)
    with pytest.raises(RuntimeError, match="you need to specify both --max-lora-rank and --lora-target-modules"):
        start_cpu_server(tiny_kit[0], "--enable-lora")


def test_adapter_fingerprint_is_the_trainers_and_a_different_adapter_is_refused(server, adapter):
    """`--lora-sync adapter`'s check: `/slime/weights_fingerprint?adapter=NAME` hashes the adapter loaded under NAME
    as its tensors arrived, which is what the trainer computes over what it sends (PEFT names, bf16 here); a
    different adapter under the name (one tensor altered) is refused by the manager's comparison, naming it."""
    from slime.rollout.weight_fingerprints import adapter_mismatch
    from slime.utils.fingerprint import combine, hash_named

    sent = {n: t.to(torch.bfloat16) for n, t in adapter["tensors"].items()}  # as the trainer sends it
    r = _load_from_tensors(server, "fp", dict(adapter, tensors=sent))
    assert r.status_code == 200, r.text
    engine = f"inference engine 0 ({server})"
    try:
        for algorithm in ("xxh3", "tiles32"):
            trainer = hash_named(sent.items(), algorithm=algorithm)
            q = {"algorithm": algorithm, "adapter": "fp"}
            info = SESSION.get(server + "/slime/weights_fingerprint", params=q, timeout=60).json()
            assert info["adapter"] == "fp" and info["algorithm"] == algorithm
            assert info["adapter_tensor_hashes"] == trainer and info["adapter_fingerprint"] == combine(trainer)
            assert adapter_mismatch(trainer, info, info["weight_version"], "fp", engine) is None
        version = info["weight_version"]
        none = SESSION.get(server + "/slime/weights_fingerprint", params={"adapter": "nope"}, timeout=60).json()
        assert none["adapter_tensor_hashes"] is None
        assert adapter_mismatch(trainer, none, version, "nope", engine) == (
            f"{engine} serves no LoRA adapter 'nope' after the push of weight version {version}"
        )
        # the engine serves another adapter under the name: one tensor altered
        assert SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "fp"}, timeout=60).status_code == 200
        altered = sorted(sent)[3]
        other = dict(sent, **{altered: sent[altered] + 0.5})
        assert _load_from_tensors(server, "fp", dict(adapter, tensors=other)).status_code == 200
        info = SESSION.get(server + "/slime/weights_fingerprint", params=q, timeout=60).json()
        served = hash_named(other.items(), algorithm="tiles32")
        assert adapter_mismatch(trainer, info, version, "fp", engine) == (
            f"{engine} serves LoRA adapter 'fp' of weight version {version} with fingerprint {combine(served)}, the "
            f"trainer pushed {combine(trainer)}; first differing tensor: {altered} (trainer {trainer[altered]}, "
            f"engine {served[altered]})"
        )
    finally:
        SESSION.post(server + "/unload_lora_adapter", json={"lora_name": "fp"}, timeout=60)


def test_an_adapter_for_a_projection_the_model_lacks_is_refused_by_name():
    """The served model's projections (the compact decoder's, or the hooked ones of a transformers model) bound what
    an adapter may carry: a layer past the model's, or a projection it does not have, is named in one line."""
    from slime.backends.cpu_server.lora import Adapter
    from slime.backends.cpu_server.weights import WeightError

    dims = {(0, "q_proj"): 8, (0, "o_proj"): 4}  # e.g. a hybrid decoder whose layer 1 has no attention projections
    pair = {"lora_A.weight": torch.ones(2, 4), "lora_B.weight": torch.ones(8, 2)}
    tensors = {f"base_model.model.model.layers.0.self_attn.q_proj.{k}": v for k, v in pair.items()}
    adapter = Adapter("a", "p", {"r": 2, "lora_alpha": 4}, tensors, dims, torch.float32, fuse=False)
    assert torch.equal(adapter.projections[0, "q_proj"][1], torch.full((8, 2), 2.0)) and not adapter.layers
    tensors = {f"base_model.model.model.layers.1.self_attn.q_proj.{k}": v for k, v in pair.items()}
    with pytest.raises(WeightError, match="LoRA adapter a: the served model has no layer 1 q_proj"):
        Adapter("a", "p", {"r": 2, "lora_alpha": 4}, tensors, dims, torch.float32, fuse=False)


def _registry(targets=("all",), max_per_batch=2, max_loaded=None, dims=None):
    """A LoRARegistry as `--enable-lora --max-lora-rank 8 --lora-target-modules ...` builds it, over a model with
    these projection dims (default: one layer whose projections all have 4 outputs)."""
    from types import SimpleNamespace

    from slime.backends.cpu_server.lora import PROJECTIONS, LoRARegistry

    args = SimpleNamespace(
        max_lora_rank=8,
        lora_target_modules=list(targets),
        max_loras_per_batch=max_per_batch,
        max_loaded_loras=max_loaded,
        lora_paths=None,
    )
    return LoRARegistry(args, dims or {(0, p): 4 for p in PROJECTIONS}, torch.float32)


def _tensor_adapter(registry, name, projections=("q_proj",)):
    """A rank-2 adapter loaded from tensors (SGLang's `__tensor__` path) on layer 0's `projections`."""
    tensors = {}
    for p in projections:
        where = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        tensors[f"base_model.model.model.layers.0.{where}.{p}.lora_A.weight"] = torch.ones(2, 4)
        tensors[f"base_model.model.model.layers.0.{where}.{p}.lora_B.weight"] = torch.ones(4, 2)
    from slime.backends.cpu_server.lora import TENSOR_PATH

    return registry.new_adapter(name, TENSOR_PATH, {"r": 2, "lora_alpha": 4}, tensors)


def test_a_batch_holds_at_most_max_loras_per_batch_adapters_the_base_counting_as_one(tiny_kit):
    """`--max-loras-per-batch 2`: base + adapter a are admitted together; b waits (and, in order, the request
    behind it) until the batch has room for it; once the base request is gone, a and b share a batch."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req
    from tests.test_cpu_server import _scheduler

    loras = _registry(max_per_batch=2)
    for name in ("a", "b"):
        loras.load(_tensor_adapter(loras, name))
    a, b = loras.acquire(["a", "b"])
    sched = _scheduler(tiny_kit[0], max_running=8, max_total_tokens=256, lora_registry=loras)  # never started
    sp = SamplingParams.from_dict({"max_new_tokens": 4}, 512)
    base_r, a_r, b_r, a2_r = (Req(p, sp, lora=x) for p, x in zip(PROMPTS * 2, (None, a, b, a)))
    sched.waiting.extend([base_r, a_r, b_r, a2_r])
    assert sched._admit() == [base_r, a_r]
    assert list(sched.waiting) == [b_r, a2_r]
    sched.running = [base_r, a_r]  # base and a running: b would make three
    assert sched._admit() == []
    sched.running = [a_r]  # the base request finished
    assert sched._admit() == [b_r, a2_r] and not sched.waiting


def test_an_unload_waits_for_the_requests_using_the_adapter():
    """`/unload_lora_adapter` takes the adapter out at once (new requests naming it fail) but answers only once the
    requests holding it have released it."""
    import asyncio
    import json

    from slime.backends.cpu_server.weight_api import WeightAPI

    class API(WeightAPI):
        def __init__(self, loras):
            self.loras = loras

        @staticmethod
        async def _body(request):
            return request

    async def scenario():
        api = API(_registry())
        api.loras.load(_tensor_adapter(api.loras, "u"))
        (held,) = api.loras.acquire(["u"])  # a running request using it
        unload = asyncio.ensure_future(api.unload_lora_adapter({"lora_name": "u"}))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not unload.done()
        assert api.loras.loaded() == {}
        with pytest.raises(KeyError, match="not loaded: u"):
            api.loras.acquire(["u"])
        api.loras.release(held)  # the request finished
        reply = await asyncio.wait_for(unload, 30)
        assert reply.status == 200 and json.loads(reply.body)["success"] is True

    asyncio.run(scenario())


def test_an_adapter_on_modules_the_server_was_not_started_for_is_refused_as_incompatible():
    """`--lora-target-modules qkv_proj`: an adapter on q/v loads; one that also targets o_proj is refused."""
    from slime.backends.cpu_server.weights import WeightError

    loras = _registry(targets=("qkv_proj",))
    loras.load(_tensor_adapter(loras, "qv", ("q_proj", "v_proj")))
    with pytest.raises(WeightError, match="LoRA adapter o with rank 2 is incompatible"):
        loras.load(_tensor_adapter(loras, "o", ("q_proj", "o_proj")))
    assert loras.loaded() == {"qv": "__tensor__"}


def test_max_loaded_loras_evicts_the_least_recently_used_adapter():
    """`--max-loaded-loras 2`: loading a third adapter evicts the one least recently loaded or requested; an
    adapter a request still holds is not evicted."""
    from slime.backends.cpu_server.weights import WeightError

    loras = _registry(max_loaded=2)
    loras.load(_tensor_adapter(loras, "a"))
    loras.load(_tensor_adapter(loras, "b"))
    loras.release(*loras.acquire(["a"]))  # a request used a: b is now the least recently used
    loras.load(_tensor_adapter(loras, "c"))
    assert list(loras.loaded()) == ["a", "c"]
    (held,) = loras.acquire(["a"])  # a request holds a
    loras.release(*loras.acquire(["c"]))  # c used since: a is the least recently used, but held
    loras.load(_tensor_adapter(loras, "d"))
    assert list(loras.loaded()) == ["a", "d"]
    # every other adapter held: the new one is refused, not loaded and evicted at once (a tensor adapter is then lost)
    (held_d,) = loras.acquire(["d"])
    with pytest.raises(WeightError, match="Failed to load LoRA adapter e: --max-loaded-loras 2 adapters are loaded"):
        loras.load(_tensor_adapter(loras, "e"))
    assert list(loras.loaded()) == ["a", "d"] and "e" not in loras.evicted
    loras.release(held_d)
    loras.release(held)
