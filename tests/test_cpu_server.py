"""slime's CPU inference server against a transformers reference on the same weights (real server process)."""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
import requests
import torch

from slime.backends.sglang_utils.contract import load_contract
from slime.utils.http_utils import free_port
from slime.utils.process_utils import die_with_parent
from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey
from tests import _ray_zygote
from tests.test_sglang_contract import needs_side_venv, run_side

pytestmark = pytest.mark.timeout(300)
SESSION = requests.Session()
SESSION.trust_env = False


def start_cpu_server(model_dir, *extra, timeout=120, env=None):
    """Launch `python -m slime.backends.cpu_server` on a free 127.0.0.1 port, forked from the session's pre-imported
    interpreter (tests/_ray_zygote.py); returns (process, url). Caller stops it. A port taken between choosing and
    binding it (by a process of the other test worker) is chosen again, twice."""
    for attempt in range(3):
        port = free_port()  # bound seconds later by the new process: never an ephemeral port
        cmd = [
            *_ray_zygote.command(_ray_zygote.shared()[1]),
            *["-m", "slime.backends.cpu_server", "--model-path", model_dir],
            *["--host", "127.0.0.1", "--port", str(port), *extra],
        ]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
            env=env,
            preexec_fn=die_with_parent,  # a killed test run leaves no server behind
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read()[-3000:]
                if "address already in use" in err.lower() and attempt < 2:
                    break
                raise RuntimeError(f"cpu server exited with {proc.returncode}: {err}")
            try:
                if SESSION.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except requests.RequestException:
                pass
            if time.time() > deadline:
                stop_cpu_server(proc)
                raise TimeoutError(f"cpu server at {url} not healthy within {timeout}s")
            time.sleep(0.2)


def stop_cpu_server(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture(scope="module")
def server(tiny_kit):
    proc, url = start_cpu_server(
        tiny_kit[0], "--max-running-requests", "16", "--random-seed", "1", "--sampling-mask-max-tokens", "100"
    )
    yield url
    stop_cpu_server(proc)


def test_sampling_mask_cap_is_the_servers_flag(server):
    """`--sampling-mask-max-tokens` (slime passes `--sglang-sampling-mask-max-tokens`) bounds the top-k a request
    that asks for its sampling masks may use, as SGLang's: 100 here, not the default 4096."""
    body = {"input_ids": PROMPTS[0], "return_sampling_mask": True}
    sp = {"temperature": 0.7, "max_new_tokens": 2, "ignore_eos": True}
    r = SESSION.post(server + "/generate", json={**body, "sampling_params": {**sp, "top_k": 101}})
    assert r.status_code == 400 and "1 < top_k <= 100; got top_k=101" in r.text
    ok = gen(server, {**body, "sampling_params": {**sp, "top_k": 100}})
    assert len(ok["meta_info"]["output_token_sampling_mask"]) == 2


@pytest.fixture(scope="module")
def reporting_server(tiny_kit):
    """A second server, with SGLang's --enable-cache-report and a tool-call parser."""
    proc, url = start_cpu_server(tiny_kit[0], "--enable-cache-report", "--tool-call-parser", "qwen25")
    yield url
    stop_cpu_server(proc)


@pytest.fixture(scope="module")
def thinking_server(tiny_kit):
    """A server with SGLang's --reasoning-parser qwen3."""
    proc, url = start_cpu_server(tiny_kit[0], "--reasoning-parser", "qwen3")
    yield url
    stop_cpu_server(proc)


@pytest.fixture()
def own_server(tiny_kit):
    """A server of the test's own, as `server` starts it: the weights and weight version a test updates do not reach
    the tests that check the start-up state (which then pass in any order)."""
    proc, url = start_cpu_server(tiny_kit[0], "--max-running-requests", "16", "--random-seed", "1")
    yield url
    stop_cpu_server(proc)


@pytest.fixture(scope="module")
def hf(tiny_kit):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_kit[0], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_kit[0])


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """A second tiny Qwen3 (different init seed, same shapes and tokenizer): the 'new' weights of an update."""
    from transformers import AutoModelForCausalLM

    from tools.build_tiny_kit import build_model

    d = str(tmp_path_factory.mktemp("other") / "qwen3-tiny-seed1")
    build_model(d, seed=1)
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def gen(url, payload, status=200):
    r = SESSION.post(url + "/generate", json=payload, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def refusal(r, shape):
    """The message of a 400 whose body has the shape SGLang 0.5.23 gives that refusal: "check" for /generate's own
    request checks (`{"error": {"message"}}`), "contract" for /generate's schema check (`{"error": message}`),
    "BadRequestError" for the OpenAI routes' checks, "Bad Request" for a body FastAPI cannot parse or validate
    (both SGLang's `ErrorResponse`)."""
    body = r.json()
    assert r.status_code == 400, r.text
    if shape == "check":
        assert list(body) == ["error"] and list(body["error"]) == ["message"], r.text
        return body["error"]["message"]
    if shape == "contract":
        assert list(body) == ["error"] and isinstance(body["error"], str), r.text
        return body["error"]
    assert body == {"object": "error", "message": body["message"], "type": shape, "param": None, "code": 400}, r.text
    return body["message"]


PROMPTS = [[1, 87, 198, 54, 104, 105, 115], [40, 41, 42], [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310]]


@torch.no_grad()
def hf_greedy(model, prompt, n):
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        t = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return ids[len(prompt) :], lps


@torch.no_grad()
def hf_logprobs(model, prompt, output, temperature=1.0):
    logits = model(torch.tensor([prompt + output])).logits[0].float() / temperature
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def test_health_and_info(server, tiny_kit):
    assert SESSION.get(server + "/health").status_code == 200
    assert SESSION.get(server + "/health_generate", timeout=60).status_code == 200
    info = SESSION.get(server + "/model_info").json()
    sglang_keys = "model_path served_model_name tokenizer_path is_generation preferred_sampling_params weight_version "
    sglang_keys += "load_format reasoning_parser tool_call_parser disaggregation_mode has_image_understanding "
    sglang_keys += "has_audio_understanding model_type architectures"  # SGLang 0.5.23's /model_info for a text LM
    assert set(sglang_keys.split()) <= set(info), set(sglang_keys.split()) - set(info)
    assert (info["reasoning_parser"], info["tool_call_parser"], info["disaggregation_mode"]) == (None, None, "null")
    assert info["model_type"] == "qwen3" and info["architectures"] == ["Qwen3ForCausalLM"]
    assert os.path.samefile(info["model_path"], tiny_kit[0]) and info["weight_version"] == "default"
    assert SESSION.get(server + "/get_model_info").json() == info
    # the weights' fingerprint: tiles32 of every served HF tensor as the checkpoint stores it, combined
    from safetensors.torch import load_file

    from slime.utils.fingerprint import combine, hash_named

    stored = {}
    for f in sorted(os.listdir(tiny_kit[0])):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(tiny_kit[0], f)))
    served = SESSION.get(server + "/slime/weights_fingerprint").json()
    info = SESSION.get(server + "/model_info").json()  # reports it once computed, never computing it itself
    assert set(served["tensor_hashes"]) <= set(stored) and len(served["tensor_hashes"]) > 10
    want = hash_named((n, stored[n]) for n in served["tensor_hashes"])
    assert served["tensor_hashes"] == want and info["weights_fingerprint"] == combine(want)
    assert info["weights_fingerprint_algorithm"] == served["algorithm"] == "tiles32"
    # a CPU trainer's hash (xxh3), asked by name; an unknown one is a 400 naming it
    fast = SESSION.get(server + "/slime/weights_fingerprint", params={"algorithm": "xxh3"}).json()
    assert fast["tensor_hashes"] == hash_named(((n, stored[n]) for n in fast["tensor_hashes"]), algorithm="xxh3")
    assert set(fast["tensor_hashes"]) == set(want)
    bad = SESSION.get(server + "/slime/weights_fingerprint", params={"algorithm": "md5"})
    assert bad.status_code == 400 and "algorithm 'md5' is not one of ['tiles32', 'xxh3']" in bad.text
    si = SESSION.get(server + "/server_info").json()
    assert si["tp_size"] == 1 and si["dp_size"] == 1 and si["max_running_requests"] == 16
    assert SESSION.get(server + "/get_server_info").json()["served_model_name"] == si["served_model_name"]
    assert SESSION.get(server + "/v1/models").json()["data"][0]["id"] == si["served_model_name"]
    assert SESSION.get(server + "/get_load").json()[0]["num_reqs"] == 0


def flush(url):
    """SGLang's /flush_cache: the prefix cache emptied, so the next requests prefill their whole prompts."""
    r = SESSION.post(url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text


def test_greedy_and_logprobs_match_transformers(server, hf):
    flush(server)  # earlier tests' prompts cached: these would start from their rows
    for prompt in PROMPTS:
        out = gen(
            server,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            },
        )
        ref_ids, ref_lps = hf_greedy(hf[0], prompt, 12)
        assert out["output_ids"] == ref_ids
        lps = out["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == ref_ids and all(x is None for _, _, x in lps)
        assert max(abs(a[0] - b) for a, b in zip(lps, ref_lps)) <= 1e-4
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == 12 and meta["cached_tokens"] == 0
        assert meta["weight_version"] == "default" and meta["id"]


def test_sampled_logprobs_are_temperature_scaled(server, hf):
    prompt = PROMPTS[0]
    for temp in (0.7, 1.3):
        out = gen(
            server,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {
                    "temperature": temp,
                    "top_p": 0.9,
                    "top_k": 50,
                    "max_new_tokens": 16,
                    "ignore_eos": True,
                },
            },
        )
        ref = hf_logprobs(hf[0], prompt, out["output_ids"], temp)
        got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref)) <= 1e-4


def test_top_k_1_equals_greedy_and_batch_equals_single(server):
    sp = {"max_new_tokens": 8, "ignore_eos": True}
    greedy = [gen(server, {"input_ids": p, "sampling_params": dict(sp, temperature=0)})["output_ids"] for p in PROMPTS]
    topk1 = [
        gen(server, {"input_ids": p, "sampling_params": dict(sp, temperature=1.0, top_k=1)})["output_ids"]
        for p in PROMPTS
    ]
    assert topk1 == greedy
    # a tiny top_p or min_p=1 keeps only the most likely token: greedy again, while the log-prob stays the full softmax's
    tiny_p = [
        gen(server, {"input_ids": p, "sampling_params": dict(sp, temperature=1.0, top_p=1e-6)})["output_ids"]
        for p in PROMPTS
    ]
    min_p1 = [
        gen(server, {"input_ids": p, "sampling_params": dict(sp, temperature=1.0, min_p=1.0)})["output_ids"]
        for p in PROMPTS
    ]
    assert tiny_p == greedy and min_p1 == greedy
    batch = gen(server, {"input_ids": PROMPTS, "sampling_params": [dict(sp, temperature=0)] * 3})
    assert isinstance(batch, list) and [o["output_ids"] for o in batch] == greedy


def test_seeded_sampling_is_reproducible_under_load(server):
    sp = {"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 1234}
    first = gen(server, {"input_ids": PROMPTS[1], "sampling_params": sp})["output_ids"]
    # the same seed in a busy batch (other requests joining and leaving) still gives the same tokens
    noise = {
        "input_ids": PROMPTS * 3,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 9, "ignore_eos": True},
    }
    t = threading.Thread(target=gen, args=(server, noise))
    t.start()
    again = gen(server, {"input_ids": PROMPTS[1], "sampling_params": sp})["output_ids"]
    t.join(60)
    assert again == first
    other = gen(server, {"input_ids": PROMPTS[1], "sampling_params": dict(sp, sampling_seed=99)})["output_ids"]
    assert other != first


def _seeded(server, prompt, **extra):
    sp = {
        "temperature": 1.0,
        "max_new_tokens": 24,
        "ignore_eos": True,
        "sampling_seed": 7,
        "skip_special_tokens": True,
    }
    sp.update(extra)
    return gen(server, {"input_ids": prompt, "sampling_params": sp})


def test_stop_strings_trimmed_or_kept(server, hf):
    tok = hf[1]
    base = _seeded(server, PROMPTS[0])
    text = base["text"]
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.find(stop)
    trimmed = _seeded(server, PROMPTS[0], stop=[stop, "@@never@@"])
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert trimmed["text"] == text[:cut]
    ids = trimmed["output_ids"]
    assert ids == base["output_ids"][: len(ids)] and stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    kept = _seeded(server, PROMPTS[0], stop=stop, no_stop_trim=True)
    assert kept["text"] == tok.decode(ids) and kept["text"].startswith(text[:cut] + stop)


def test_stop_token_ids_eos_min_new_tokens_ignore_eos(server, hf):
    tok = hf[1]
    base = _seeded(server, PROMPTS[2])
    ids = base["output_ids"]
    j = 5
    stop_id = ids[j]
    j = ids.index(stop_id)
    out = _seeded(server, PROMPTS[2], stop_token_ids=[stop_id], ignore_eos=False)
    assert out["output_ids"] == ids[: j + 1] and out["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": stop_id,
    }
    assert out["text"] == tok.decode(ids[:j], skip_special_tokens=True)
    # EOS (<|im_end|> = 2) forced by logit_bias: stops at once; ignore_eos keeps going; min_new_tokens delays it
    sp = {"temperature": 0, "max_new_tokens": 6, "logit_bias": {"2": 100.0}}
    eos = gen(server, {"input_ids": PROMPTS[0], "sampling_params": sp})
    assert (
        eos["output_ids"] == [2]
        and eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        and eos["text"] == ""
    )
    ign = gen(server, {"input_ids": PROMPTS[0], "sampling_params": dict(sp, ignore_eos=True)})
    assert ign["output_ids"] == [2] * 6 and ign["meta_info"]["finish_reason"]["type"] == "length"
    mn = gen(server, {"input_ids": PROMPTS[0], "sampling_params": dict(sp, min_new_tokens=3)})
    assert len(mn["output_ids"]) == 4 and 2 not in mn["output_ids"][:3] and mn["output_ids"][3] == 2
    # generation_config's extra eos id (0 = <|endoftext|>) also stops
    pad = gen(
        server,
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "logit_bias": {"0": 100.0}},
        },
    )
    assert pad["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}


def test_n_and_text_input(server, hf):
    outs = gen(
        server,
        {
            "text": "What is 3+4?",
            "sampling_params": {"n": 3, "temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True},
        },
    )
    assert isinstance(outs, list) and len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert all(o["meta_info"]["prompt_tokens"] == len(hf[1].encode("What is 3+4?")) for o in outs)
    batch = gen(server, {"text": ["What is 1+1?", "Hello"], "sampling_params": {"n": 2, "max_new_tokens": 3}})
    assert len(batch) == 4


def test_stream(server):
    r = SESSION.post(
        server + "/generate",
        json={
            "input_ids": PROMPTS[1],
            "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
        },
        stream=True,
        timeout=60,
    )
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
    assert (
        chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        and chunks[0]["meta_info"]["finish_reason"] is None
    )
    full = gen(
        server,
        {"input_ids": PROMPTS[1], "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}},
    )
    assert chunks[-1]["output_ids"] == full["output_ids"] and chunks[-1]["text"] == full["text"]


def test_openai_endpoints(server, hf):
    r = SESSION.post(
        server + "/v1/chat/completions",
        json={
            "model": "x",
            "messages": [{"role": "user", "content": "What is 3+4?"}],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
        },
    ).json()
    prompt = hf[1].apply_chat_template(
        [{"role": "user", "content": "What is 3+4?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ref = gen(server, {"input_ids": list(prompt), "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["content"] == ref["text"]
    assert "tool_calls" not in r["choices"][0]["message"]  # SGLang leaves a null tool_calls out
    assert r["usage"]["prompt_tokens"] == len(prompt) and r["choices"][0]["finish_reason"] in ("stop", "length")
    assert len(r["choices"][0]["logprobs"]["content"]) == r["usage"]["completion_tokens"]
    # as SGLang answers: the request's model echoed, its UsageInfo, and the weights that generated it
    assert r["model"] == "x" and r["metadata"] == {
        "weight_version": "default",
        "weight_versions": [{"version": "default", "start": 0, "end": r["usage"]["completion_tokens"]}],
    }
    assert r["usage"]["reasoning_tokens"] == 0 and r["usage"]["prompt_tokens_details"] is None
    c = SESSION.post(server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}).json()
    ref = gen(server, {"text": "Hello", "sampling_params": {"temperature": 0, "max_new_tokens": 4}})
    assert c["object"] == "text_completion" and c["choices"][0]["text"] == ref["text"]
    assert c["model"] == "default" and c["metadata"]["weight_version"] == "default"
    assert c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + 4


def test_openai_top_logprobs_are_the_models_most_likely_tokens(server, hf):
    """Chat's `top_logprobs` and completions' `logprobs: N` answer, per generated token, the N most likely tokens
    and their log-probs, as transformers' forward gives them; `logprobs: 0` still answers the tokens' own."""
    model, tok = hf
    prompt = tok.encode("What is 3+4?")
    with torch.no_grad():
        top = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1).topk(3)
    want = [(tok.decode([int(t)]), float(v)) for v, t in zip(top.values, top.indices)]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 3}
    lp = SESSION.post(server + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert list(lp["top_logprobs"][0]) == [t for t, _ in want] and lp["text_offset"] == [-1]
    assert all(abs(lp["top_logprobs"][0][t] - v) < 1e-4 for t, v in want)
    lp = SESSION.post(server + "/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [] and abs(lp["token_logprobs"][0] - want[0][1]) < 1e-4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True}
    content = SESSION.post(server + "/v1/chat/completions", json={**chat, "top_logprobs": 2}).json()["choices"][0]
    for item in content["logprobs"]["content"]:
        alts = item["top_logprobs"]
        assert len(alts) == 2 and alts[0]["token"] == item["token"] and alts[0]["logprob"] == item["logprob"]
        assert alts[0]["logprob"] >= alts[1]["logprob"] and alts[1]["bytes"] == list(alts[1]["token"].encode())


def test_openai_requests_are_read_as_sglang_reads_them(server):
    chat = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    # max_completion_tokens or max_tokens: a null one does not hide the other
    r = SESSION.post(server + "/v1/chat/completions", json={**chat, "max_tokens": 3, "max_completion_tokens": None})
    assert r.json()["usage"]["completion_tokens"] == 3
    # /v1/completions: 16 tokens unless asked, and a budget must be positive
    r = SESSION.post(server + "/v1/completions", json={"prompt": [1, 2], "temperature": 0, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 16
    r = SESSION.post(server + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 0})
    assert "max_tokens must be positive" in refusal(r, "BadRequestError")
    # what SGLang refuses on a streamed chat
    r = SESSION.post(server + "/v1/chat/completions", json={**chat, "stream": True, "return_token_ids": True})
    assert "return_token_ids is not supported with streaming on /v1/chat/completions" in refusal(r, "BadRequestError")
    # logit_bias is applied: +100 on token 5 makes it the greedy choice every step
    body = {"prompt": [1, 2], "max_tokens": 3, "temperature": 0, "logit_bias": {"5": 100}, "return_token_ids": True}
    assert SESSION.post(server + "/v1/completions", json=body).json()["choices"][0]["token_ids"] == [5, 5, 5]
    # roles outside SGLang's set, and grammars this server cannot run, are refused
    r = SESSION.post(server + "/v1/chat/completions", json={**chat, "messages": [{"role": "bogus", "content": "a"}]})
    assert "'role' must be one of" in refusal(r, "BadRequestError")
    r = SESSION.post(server + "/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
    assert "json_schema is not supported" in refusal(r, "BadRequestError")
    r = SESSION.post(
        server + "/v1/chat/completions",
        json={
            **chat,
            "max_tokens": 1,
            "messages": [{"role": "System", "content": "a"}, {"role": "user", "content": "b"}],
        },
    )
    assert r.status_code == 200


def test_a_chat_answers_qwen3_coder_calls_as_sglang_does():
    """`--tool-call-parser qwen3_coder` (Qwen3-Coder's and Qwen3.5's XML calls): the chat message a finished choice
    gets, as SGLang's server builds it: the text before the first call as the content, unstripped; each call with
    its values typed by the tool's schema, an undeclared tool's call kept (SGLang's qwen3_coder keeps it, where its
    JSON formats drop it); a stop that made calls reported as "tool_calls", a length cut as "length"."""
    from types import SimpleNamespace

    from slime.backends.cpu_server.openai_api import _tool_calls

    tools = [
        {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {"type": "integer"}}}}}
    ]
    text = (
        "Let me add.\n\n<tool_call>\n<function=add>\n<parameter=a>\n 7\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=rm>\n<parameter=path>\n/tmp\n</parameter>\n</function>\n</tool_call>"
    )
    for reason, finish in (("stop", "tool_calls"), ("length", "length")):
        r = SimpleNamespace(text=text, finish_reason={"type": reason})
        message, got = _tool_calls(r, "qwen3_coder", tools, text)
        assert got == finish and message["content"] == "Let me add.\n\n"
        calls = [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        assert calls == [(0, "add", '{"a": 7}'), (1, "rm", '{"path": "/tmp"}')]
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])


def test_chat_prompts_tools_and_request_fields_are_taken_as_sglang_takes_them(server):
    """The chat prompt is built as SGLang builds it (tests/test_chat_prompt.py holds its rules to SGLang's code): a
    trailing assistant message is rendered as a user's; with tools in play the output's text keeps special tokens
    (here <|im_start|>, forced), which it drops without; `rid` names the request (the response's id); fields SGLang
    serves and this server does not are refused by name."""
    turn = {"model": "m", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_prompt_token_ids": True}
    asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "What is 3+4?"}]
    as_user = [{"role": "user", "content": "hi"}, {"role": "user", "content": "What is 3+4?"}]
    ids = [
        SESSION.post(server + "/v1/chat/completions", json={**turn, "messages": m}).json()["choices"][0]
        for m in (asked, as_user)
    ]
    assert ids[0]["prompt_token_ids"] == ids[1]["prompt_token_ids"]
    forced = {**turn, "messages": as_user, "logit_bias": {"1": 100}, "rid": "turn-7"}
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    out = SESSION.post(server + "/v1/chat/completions", json={**forced, "tools": [tool]}).json()
    assert out["id"] == "turn-7" and out["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    out = SESSION.post(server + "/v1/chat/completions", json={**forced, "tools": [tool], "tool_choice": "none"})
    assert out.json()["choices"][0]["message"]["content"] == ""
    for field, value in [("return_hidden_states", True), ("session_id", "s"), ("stop_regex", "x")]:
        r = SESSION.post(server + "/v1/chat/completions", json={**turn, "messages": as_user, field: value})
        assert f"{field}: not supported by slime's CPU server" in refusal(r, "BadRequestError")
    r = SESSION.post(
        server + "/v1/chat/completions", json={**turn, "messages": as_user, "tools": [tool], "tool_choice": "required"}
    )
    assert "a grammar slime's CPU server does not run" in refusal(r, "BadRequestError")


def test_tokenize_and_detokenize_as_sglang(server, hf):
    """/tokenize (and /v1/tokenize): text encoded as the tokenizer encodes it, a list per text; a chat's messages to
    the very ids its chat completion is prompted with, or (add_generation_prompt given) rendered as given; exactly
    one of prompt and messages. /detokenize: ids, or lists of them, decoded."""
    tok = hf[1]
    out = SESSION.post(server + "/tokenize", json={"prompt": "What is 3+4?"}).json()
    assert out["tokens"] == tok.encode("What is 3+4?") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == tok.model_max_length == 512  # the tokenizer's, as SGLang answers
    out = SESSION.post(server + "/v1/tokenize", json={"prompt": ["a b", "c"]}).json()
    assert out["tokens"] == [tok.encode("a b"), tok.encode("c")] and out["count"] == [len(tok.encode("a b")), 1]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "What is 3+4?"}]
    chat = SESSION.post(
        server + "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 1, "return_prompt_token_ids": True},
    ).json()
    out = SESSION.post(server + "/tokenize", json={"messages": msgs}).json()
    assert out["tokens"] == chat["choices"][0]["prompt_token_ids"]
    out = SESSION.post(server + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}).json()
    assert out["tokens"] == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    r = SESSION.post(server + "/tokenize", json={"prompt": "a", "messages": msgs})
    assert "Exactly one of 'prompt' or 'messages' must be provided." in refusal(r, "Bad Request")
    r = SESSION.post(server + "/tokenize", json={"prompt": 5})
    assert "Invalid prompt type" in refusal(r, "Bad Request")  # SGLang's schema refuses it
    ids = tok.encode("What is 3+4?")
    assert SESSION.post(server + "/detokenize", json={"tokens": ids}).json() == {"text": "What is 3+4?"}
    assert SESSION.post(server + "/v1/detokenize", json={"tokens": [ids, ids[:2]]}).json() == {
        "text": ["What is 3+4?", tok.decode(ids[:2])]
    }
    assert SESSION.post(server + "/detokenize", json={"tokens": []}).json() == {"text": ""}


def test_completions_take_batch_prompts_and_echo_them_as_sglang_does(server, hf):
    """/v1/completions with several prompts (strings, or lists of ids) and n: choices prompt by prompt, each the
    /generate answer of its prompt, usage counting each prompt once; `echo` puts the prompt's text (ids decoded
    without special tokens) before each choice's, and with `logprobs: N` the prompt's tokens and log-probs (the first
    without one) before the output's, as /generate's input log-probs give them; a stream sends the echo first."""
    texts = ["What is 3+4?", "Hello"]
    body = {"prompt": texts, "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    out = SESSION.post(server + "/v1/completions", json=body, timeout=120).json()
    want = [
        gen(server, {"text": t, "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}})
        for t in texts
    ]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [want[0]["text"]] * 2 + [want[1]["text"]] * 2
    ids = [c["prompt_token_ids"] for c in out["choices"][::2]]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids)) and out["usage"]["completion_tokens"] == 12

    def hf_text(ids):
        return hf[1].decode(ids, skip_special_tokens=True)

    prompt = [PROMPTS[1], PROMPTS[0]]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0.7, "seed": 4, "echo": True, "logprobs": 2}
    out = SESSION.post(server + "/v1/completions", json=body, timeout=120).json()
    for p, choice in zip(prompt, out["choices"]):
        ref = gen(
            server,
            {
                "input_ids": p,
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 2,
                "sampling_params": {"temperature": 0.7, "sampling_seed": 4, "max_new_tokens": 3},
            },
        )
        meta, lp = ref["meta_info"], choice["logprobs"]
        assert choice["text"] == hf_text(p) + ref["text"]
        # (a batch of two prefills packed together: within float error of one prefilled alone)
        entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
        assert lp["token_logprobs"][1:] == pytest.approx([x[0] for x in entries[1:]], abs=1e-5)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(p) + 3
        tops = [[x[0] for x in row] for row in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]]
        assert [list(row.values()) for row in lp["top_logprobs"][1:]] == [pytest.approx(t, abs=1e-5) for t in tops]
    chunks = _events(server, "/v1/completions", body)
    for i, choice in enumerate(out["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["text"].startswith(hf_text(prompt[i])) and "".join(c["text"] for c in mine) == choice["text"]
        assert sum((c["logprobs"]["token_logprobs"] for c in mine), []) == choice["logprobs"]["token_logprobs"]
    for bad, needle in [("", "Prompt cannot be empty"), (["a", [1, 2]], "a batch is all strings or all lists")]:
        r = SESSION.post(server + "/v1/completions", json={"prompt": bad})
        assert needle in refusal(r, "BadRequestError")


def _events(url, path, body):
    """The JSON events of a streamed OpenAI answer, up to its `[DONE]`."""
    with SESSION.post(url + path, json={**body, "stream": True}, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_openai_streams_add_up_to_the_plain_answer(server):
    """stream=true on the chat route, read with the OpenAI SDK (temperature 0.8, two choices, top log-probs): per
    choice a first chunk with the role, text that joins into the plain answer's, each text chunk with its one new
    token's log-probs (a subsequence of the plain answer's: an update that adds no text sends none, as SGLang's), then
    the finish reasons, then the usage SGLang counts."""
    import openai

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "What is 3+4?"}],
        "max_tokens": 8,
        "temperature": 0.8,
        "seed": 5,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    flush(server)  # both answers prefill the whole prompt: log-probs to the bit, whatever ran before
    plain = SESSION.post(server + "/v1/chat/completions", json=body, timeout=120).json()
    flush(server)
    client = openai.OpenAI(api_key="x", base_url=server + "/v1", max_retries=0)
    chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    *chunks, usage = chunks
    assert usage.choices == [] and usage.usage.model_dump() == plain["usage"]
    ends = [c for c in chunks if c.choices[0].finish_reason]
    assert chunks[-len(ends) :] == ends and sorted(c.choices[0].index for c in ends) == [0, 1]
    for i, want in enumerate(plain["choices"]):
        mine = [c.choices[0] for c in chunks[: -len(ends)] if c.choices[0].index == i]
        assert (mine[0].delta.role, mine[0].delta.content) == ("assistant", "")
        assert "".join(c.delta.content for c in mine) == want["message"]["content"]
        assert next(c for c in ends if c.choices[0].index == i).choices[0].finish_reason == want["finish_reason"]
        streamed = [c.logprobs.model_dump()["content"] for c in mine[1:]]
        assert all(len(items) == 1 for items in streamed)
        rest = iter(want["logprobs"]["content"])
        assert all(any(items[0] == item for item in rest) for items in streamed)  # in order, none made up
        assert len(streamed) >= 1


def test_openai_streams_hold_a_split_character_back_and_report_its_bytes(server):
    """A character split over two tokens (é: bytes C3 A9, forced as A, B, A, B by logit_bias and a frequency
    penalty): a stream shows it once both arrived, never its half as U+FFFD; log-probs name each token's own bytes
    (chat), or render a fragment as latin-1 (completions), as SGLang does. A streamed completion's chunks carry each
    update's tokens, its log-probs and text, and join into the plain answer."""
    tok_a, tok_b = 130, 105  # the tiny tokenizer's byte-level pieces "Ã" (0xC3) and "©" (0xA9)
    force = {
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(tok_a): 100, str(tok_b): 99},
        "frequency_penalty": 2,
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, **force}
    chunks = _events(server, "/v1/chat/completions", chat)
    text = [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert text == ["é", "é"]  # without the hold-back: "\ufffd", then nothing new
    items = [c["choices"][0]["logprobs"]["content"][0] for c in chunks if c["choices"][0]["logprobs"]]
    assert [(x["token"], x["bytes"]) for x in items] == [("\ufffd", [0xA9])] * 2
    plain = SESSION.post(server + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    assert plain["message"]["content"] == "éé"
    assert [x["bytes"] for x in plain["logprobs"]["content"]] == [[0xC3], [0xA9]] * 2

    completion = {"prompt": "hi", "logprobs": 0, "return_token_ids": True, **force}
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, usage = _events(server, "/v1/completions", {**completion, "stream_options": options})
    choices = [c["choices"][0] for c in chunks]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert [c["text"] for c in choices] == ["", "é", "", "é"] and [c["token_ids"] for c in choices] == [
        [tok_a],
        [tok_b],
    ] * 2
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    assert ["prompt_token_ids" in c for c in choices] == [True, False, False, False]
    plain = SESSION.post(server + "/v1/completions", json=completion, timeout=120).json()
    want = plain["choices"][0]["logprobs"]
    assert want["tokens"] == ["Ã", "©", "Ã", "©"]  # latin-1 of each fragment's byte
    assert {k: sum((c["logprobs"][k] for c in choices), []) for k in want} == want
    assert choices[0]["prompt_token_ids"] == plain["choices"][0]["prompt_token_ids"]
    assert usage["choices"] == [] and usage["usage"] == {k: v for k, v in plain["usage"].items() if v is not None}


def test_with_a_tool_call_parser_log_probs_no_text_carried_come_in_a_chunk_alone(reporting_server):
    """SGLang's server with a tool-call parser (here one without tools in the request): an update whose token adds no
    text (half of é) sends its log-probs in a chunk of their own with an empty delta, where a server without a parser
    sends none (the test above)."""
    force = {"max_tokens": 4, "temperature": 0, "logit_bias": {"130": 100, "105": 99}, "frequency_penalty": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, **force}
    chunks = [c["choices"][0] for c in _events(reporting_server, "/v1/chat/completions", chat)]
    with_lps = [(c["delta"], [x["bytes"] for x in c["logprobs"]["content"]]) for c in chunks if c["logprobs"]]
    alone, with_text = {"reasoning_content": None}, {"reasoning_content": None, "content": "é"}
    assert with_lps == [(alone, [[0xC3]]), (with_text, [[0xA9]])] * 2


def test_a_reasoning_parser_splits_chats_and_counts_their_thinking_as_sglang_does(thinking_server, server):
    """--reasoning-parser qwen3 with a template that has no reasoning toggle (the tiny kit's; SGLang then thinks
    unless chat_template_kwargs.enable_thinking is false): the output, which never closes a </think>, is all
    reasoning_content, counted in usage.reasoning_tokens and completion_tokens_details; with enable_thinking false it
    is the content, uncounted; with separate_reasoning false whole, still counted; streamed, its reasoning_content
    chunks join into it, with the same usage; a continued assistant message whose thinking closed makes the output
    content (its tokens still counted as thinking: SGLang counts a thinking-mode output's tokens up to its own
    </think>). The text is the parser-less server's every time."""
    hi = {"role": "user", "content": "What is 3+4?"}
    body = {"model": "m", "messages": [hi], "max_tokens": 6, "temperature": 0}
    plain = SESSION.post(server + "/v1/chat/completions", json=body, timeout=120).json()
    text, n = plain["choices"][0]["message"]["content"], plain["usage"]["completion_tokens"]
    assert text and "<think>" not in text and "</think>" not in text

    def ask(url=thinking_server, **kw):
        answer = SESSION.post(url + "/v1/chat/completions", json={**body, **kw}, timeout=120).json()
        m = answer["choices"][0]["message"]
        return m["reasoning_content"], m["content"], answer["usage"]

    think, content, usage = ask()
    assert (think, content, usage["reasoning_tokens"]) == (text, "", n)
    assert usage["completion_tokens_details"] == {"reasoning_tokens": n}
    assert ask(chat_template_kwargs={"enable_thinking": False}) == (None, text, plain["usage"])
    think, content, whole = ask(separate_reasoning=False)
    assert (think, content, whole) == (None, text, usage)
    *chunks, last = _events(
        thinking_server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == text and not any(
        d.get("content") for d in deltas
    )
    assert last["usage"] == usage
    closed = {"messages": [hi, {"role": "assistant", "content": "<think>x</think>"}], "continue_final_message": True}
    think, content, usage = ask(**closed)
    assert (think, content) == (None, ask(server, **closed)[1])
    assert usage["reasoning_tokens"] == usage["completion_tokens"]  # as SGLang: a thinking-mode output's, unclosed
    assert SESSION.get(thinking_server + "/model_info", timeout=30).json()["reasoning_parser"] == "qwen3"


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
def test_a_client_that_leaves_a_stream_aborts_its_requests(server, path):
    """A streaming client that closes its connection after the first chunk: its requests leave the running batch
    at once, long before the 4 x 490 tokens they asked for (about a second of decoding here)."""
    if path == "/generate":
        body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 490, "ignore_eos": True, "n": 4}}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 490, "ignore_eos": True, "n": 4}
    with SESSION.post(server + path, json={**body, "stream": True}, stream=True, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith(b"data: "))
    seen, deadline = [], time.time() + 30
    while (load := SESSION.get(server + "/get_load", timeout=10).json()[0])["num_reqs"]:
        seen.append(load["num_tokens"])
        assert time.time() < deadline, "the requests of a stream its client left are still running after 30 s"
    assert max(seen, default=0) < 2 * 490, seen  # they would hold 4 x (prompt + 490) rows had they gone on


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_openai_answers_are_what_sglangs_own_classes_serialise(server, reporting_server, thinking_server, tmp_path):
    """Every OpenAI answer (chat and completion, plain and each chunk of a stream: n = 2, log-probs with
    alternatives, token ids, an echoed batch, usage in each chunk and at the end; with --enable-cache-report,
    cached-token details; with --reasoning-parser, reasoning content, its chunks and thinking-token counts) parsed by
    SGLang's own response classes and serialised again is unchanged: no field missing, extra, mistyped or (where
    SGLang leaves it out) present."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": "m", "max_tokens": 5, "temperature": 0.8, "seed": 1, "n": 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2, **common}
    completion = {"prompt": ["hi", "ho"], "echo": True, "logprobs": 2, "return_token_ids": True, **common}

    def answers_of(url):
        return {
            "chat": SESSION.post(url + "/v1/chat/completions", json={**chat, "return_token_ids": True}).json(),
            "completion": SESSION.post(url + "/v1/completions", json=completion).json(),
            "chat_chunks": _events(url, "/v1/chat/completions", {**chat, "stream_options": options}),
            "completion_chunks": _events(url, "/v1/completions", {**completion, "stream_options": options}),
        }

    answers = [answers_of(server), answers_of(reporting_server), answers_of(thinking_server)]
    assert answers[1]["chat"]["usage"]["prompt_tokens_details"] is not None
    assert (
        answers[2]["chat"]["usage"]["completion_tokens_details"]
        and answers[2]["chat"]["choices"][0]["message"]["reasoning_content"]
    )
    path = tmp_path / "answers.json"
    path.write_text(json.dumps(answers))
    code = """
import json, sys
import msgspec
from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse, ChatCompletionStreamResponse,
    ChoiceLogprobs, CompletionResponse, CompletionStreamResponse)
from sglang.srt.entrypoints.openai.sse_utils import StreamChunk

def same(cls, obj, **kw):
    again = json.loads(cls.model_validate(obj).model_dump_json(**kw))
    assert again == obj, (obj, again)

for a in json.load(open(sys.argv[1])):
    same(ChatCompletionResponse, a["chat"])
    same(CompletionResponse, a["completion"])
    for c in a["chat_chunks"]:
        if c["choices"]:  # SGLang's chunks of a choice (sse_utils, msgspec); their log-probs a ChoiceLogprobs dump
            again = json.loads(msgspec.json.encode(msgspec.convert(c, StreamChunk)))
            assert again == c, (c, again)
            lp = c["choices"][0]["logprobs"]
            assert lp is None or ChoiceLogprobs.model_validate(lp).model_dump() == lp, lp
        else:  # the usage chunk
            same(ChatCompletionStreamResponse, c)
    *chunks, usage = a["completion_chunks"]
    for c in chunks:
        same(CompletionStreamResponse, c)
    same(CompletionStreamResponse, usage, exclude_none=True)
print("unchanged")
"""
    run = run_side(code, str(path))
    assert run.returncode == 0 and "unchanged" in run.stdout, run.stderr[-3000:]


def test_abort_returns_partial_output(server):
    result = {}
    payload = {
        "input_ids": PROMPTS[0],
        "rid": "long-one",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 490, "ignore_eos": True},
    }
    t = threading.Thread(target=lambda: result.update(gen(server, payload)))
    t.start()
    deadline = time.time() + 30
    while SESSION.get(server + "/get_load").json()[0]["num_reqs"] == 0:
        assert time.time() < deadline, "the long request never started running"
        time.sleep(0.01)
    t0 = time.time()
    assert SESSION.post(server + "/abort_request", json={"abort_all": True}).status_code == 200
    t.join(30)
    assert not t.is_alive() and time.time() - t0 < 10
    meta = result["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == "long-one"
    assert 0 < meta["completion_tokens"] < 490 and len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    # by rid
    t = threading.Thread(target=lambda: result.update(gen(server, payload)))
    t.start()
    deadline = time.time() + 30
    while SESSION.get(server + "/get_load").json()[0]["num_reqs"] == 0:
        assert time.time() < deadline, "the second long request never started running"
        time.sleep(0.01)
    SESSION.post(server + "/abort_request", json={"rid": "long-one"})
    t.join(30)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    "body,shape,needle",
    [
        ({"input_ids": [1, 2], "sampling_params": {"foo": 1}}, "contract", "unknown field 'foo'"),
        ({"input_ids": [1, 2], "text": "hi"}, "check", "Either text or input_ids"),
        ({}, "check", "Either text or input_ids"),
        ({"input_ids": "abc"}, "contract", "field 'input_ids' = 'abc' is not"),
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
            "check",
            "temperature must be a non-negative finite",
        ),
        # SGLang 0.5.23's other request checks (io_struct.py normalisation, SamplingParams.verify / normalize)
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": float("nan")}},
            "check",
            "non-negative finite number",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"temperature": float("inf")}},
            "check",
            "non-negative finite number",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**64}},
            "check",
            "sampling_seed must be in [-2**63",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"stop": ["x"] * 33}},
            "check",
            "at most 32 stop strings are allowed",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"beam_width": 0}}, "check", "beam_width must be at least 1"),
        ({"input_ids": [1, 2], "session_id": "s", "session_params": {"id": "s"}}, "check", "cannot both be set"),
        ({"input_ids": [1, 2], "return_hidden_states": True}, "check", "not configured to return hidden states"),
        (
            {"input_ids": [[1, 2], [3]], "rid": ["a", "a"]},
            "check",
            "Duplicate request IDs detected within the request: ['a']",
        ),
        ({"input_ids": [[1, 2], [3]], "rid": ["a"]}, "check", "rids length mismatch with the batch_size"),
        ({"input_ids": [[1, 2], [3]], "return_logprob": [True]}, "check", "return_logprob is a list of 1"),
        (
            {"input_ids": [[1, 2], [3]], "sampling_params": [{"n": 2}, {"n": 1}]},
            "check",
            "The parallel_sample_num should be the same",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"n": 2}, "return_logprob": [True]},
            "check",
            "Cannot use list return_logprob with parallel_sample_num > 1",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "check", "top_p"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "ten"}},
            "contract",
            "'ten' is not Optional[int]",
        ),
        ({"input_ids": [1, 999999]}, "check", "outside the vocabulary"),
        ({"input_ids": [5] * 600}, "check", "longer than the model's context length"),
        (
            {"input_ids": [5] * 500, "sampling_params": {"max_new_tokens": 100}},
            "check",
            "exceeds the model's maximum context length",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "check", "not supported"),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
            "check",
            "req.logprob_start_len=3 is higher than the number of input tokens len(req.origin_input_ids)=2",
        ),
        ({"input_ids": [1, 2], "token_ids_logprob": [5, 512]}, "check", "512 is not a token id of this model"),
        (
            {"input_ids": [1, 2], "return_entropy": True, "max_thinking_tokens": 8},
            "check",
            "return_entropy, max_thinking_tokens: not supported by slime's CPU server",
        ),
        (
            {"input_ids": [1, 2], "token_ids_logprob": [[5]], "sampling_params": {"n": 2}},
            "check",
            "Cannot use list token_ids_logprob with parallel_sample_num > 1",
        ),
    ],
)
def test_bad_requests_get_400(server, body, shape, needle):
    # NaN and Infinity as Python's (and SGLang's) JSON parser reads them, which requests' json= refuses to write
    headers = {"Content-Type": "application/json"}
    r = SESSION.post(server + "/generate", data=json.dumps(body), headers=headers)
    assert needle in refusal(r, shape)


def test_a_streamed_request_is_refused_inside_its_stream_as_sglang_does(server):
    """SGLang checks a streamed /generate request once its stream has begun: 200, one error event, [DONE]; slime's
    stream reader raises it as the HTTP error it stands for."""
    import asyncio

    from slime.utils.http_utils import HTTPStatusError, post_stream

    body = {"input_ids": [1, 2], "stream": True, "sampling_params": {"temperature": -1}}
    r = SESSION.post(server + "/generate", json=body)
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]" and len(events) == 2, r.text
    error = json.loads(events[0])["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400 and error["retryable"] is False
    assert "temperature must be a non-negative finite" in error["message"]

    async def read():
        return [e async for e in post_stream(server + "/generate", body, timeout=60)]

    with pytest.raises(HTTPStatusError, match="temperature must be a non-negative finite") as e:
        asyncio.run(read())
    assert e.value.status == 400


def test_what_sglang_accepts_is_served_as_sglang_serves_it(server, hf):
    # an explicit null budget is no limit (the context caps it), not the default 128
    out = gen(server, {"input_ids": [5] * 300, "sampling_params": {"ignore_eos": True, "max_new_tokens": None}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 210}  # 512 - 1 - 300 - 1
    # grammars left empty are unset; an empty stop string is a stop string
    out = gen(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "json_schema": "", "choice": []}})
    assert out["meta_info"]["completion_tokens"] == 3
    out = gen(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "stop": [""]}})
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # a batch's string rid names its prompts R_0, R_1; parallel samples get ids of their own
    outs = gen(server, {"input_ids": [[1, 2], [3]], "rid": "R", "sampling_params": {"max_new_tokens": 1}})
    assert [o["meta_info"]["id"] for o in outs] == ["R_0", "R_1"]
    outs = gen(server, {"input_ids": [1, 2], "rid": "R", "sampling_params": {"max_new_tokens": 1, "n": 2}})
    assert len({o["meta_info"]["id"] for o in outs} | {"R"}) == 3
    # top_logprobs_num per prompt
    outs = gen(
        server,
        {
            "input_ids": [[1, 2], [3]],
            "return_logprob": True,
            "top_logprobs_num": [1, 2],
            "sampling_params": {"max_new_tokens": 1},
        },
    )
    assert [len(o["meta_info"]["output_top_logprobs"][0]) for o in outs] == [1, 2]
    # with return_text_in_logprobs the alternatives carry their text too
    one = gen(
        server, {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    )
    assert all(text == hf[1].decode([t]) for _, t, text in one["meta_info"]["output_top_logprobs"][0])
    # meta_info's keys SGLang always sends (no reasoning parser: 0), and the logprob count with return_logprob
    assert all(o["meta_info"]["reasoning_tokens"] == 0 for o in outs)
    assert [o["meta_info"]["output_token_logprobs_length"] for o in outs] == [1, 1]
    # return_prompt_token_ids: the prompt's ids beside the answer, and nothing unless asked
    outs = gen(
        server, {"text": ["1+1=", "hi"], "return_prompt_token_ids": True, "sampling_params": {"max_new_tokens": 1}}
    )
    assert [o["prompt_token_ids"] for o in outs] == [hf[1].encode("1+1="), hf[1].encode("hi")]
    assert "prompt_token_ids" not in gen(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})


def test_budgets_are_capped_to_the_context_as_sglang_does(server):
    # SGLang 0.5.23: a default budget is not checked; an explicit one may fill the context exactly (prompt + budget
    # = 512); then the scheduler caps both to its request limit (context - 1) minus the prompt minus 1
    out = gen(server, {"input_ids": [5] * 500, "sampling_params": {"ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}  # 512 - 1 - 500 - 1
    out = gen(server, {"input_ids": [5] * 500, "sampling_params": {"ignore_eos": True, "max_new_tokens": 12}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    out = gen(server, {"input_ids": [5] * 500, "sampling_params": {"ignore_eos": True, "max_new_tokens": 4}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_malformed_json_then_still_serving(server):
    r = SESSION.post(server + "/generate", data="{not json", headers={"Content-Type": "application/json"})
    assert "not valid JSON" in refusal(r, "Bad Request")
    r = SESSION.post(server + "/generate", data="[1, 2]")
    assert "must be a JSON object" in refusal(r, "Bad Request")
    # the Content-Type as SGLang's FastAPI reads it: none or a JSON one is JSON; a form (plain `curl -d`) is not; the
    # OpenAI routes take application/json only
    ok = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    for content_type in (None, "application/json; charset=utf-8", "application/vnd.api+json"):
        headers = {"Content-Type": content_type} if content_type else {}
        assert SESSION.post(server + "/generate", data=ok, headers=headers).status_code == 200, content_type
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    r = SESSION.post(server + "/generate", data=ok, headers=form)
    assert "only 'application/json' is allowed" in refusal(r, "Bad Request")
    r = SESSION.post(server + "/v1/completions", data=json.dumps({"prompt": [1, 2], "max_tokens": 1}))
    assert "only 'application/json' is allowed" in refusal(r, "Bad Request")
    assert (
        gen(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})["meta_info"]["completion_tokens"]
        == 2
    )


def test_unparsable_requests_are_one_warning_line(tiny_kit):
    """sglang-router probes each worker with HTTP/2's preface first: the 400 it gets is logged as SGLang's uvicorn
    logs a bad request, one warning line, not an ERROR with a traceback, and the server serves on."""
    proc, url = start_cpu_server(tiny_kit[0])
    try:
        for raw in (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET /health HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as s:
                s.sendall(raw)
                assert s.recv(100).startswith(b"HTTP/1.0 400 Bad Request")
        assert SESSION.get(url + "/health", timeout=10).status_code == 200
    finally:
        stop_cpu_server(proc)
    err = proc.stderr.read()
    warnings = [line.split(" WARNING ")[1] for line in err.splitlines() if " WARNING " in line]
    assert warnings == [
        "Invalid HTTP request received from 127.0.0.1: Pause on PRI/Upgrade",
        "Invalid HTTP request received from 127.0.0.1: Invalid character in Content-Length",
    ], err
    assert "Traceback" not in err and " ERROR " not in err, err


def test_pause_and_continue(server):
    assert SESSION.post(server + "/pause_generation", json={}).json()["status"] == "ok"
    result = {}
    t = threading.Thread(
        target=lambda: result.update(gen(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}))
    )
    t.start()
    # the request has reached the scheduler and is held there, not admitted (a fixed sleep could pass before it
    # was even sent)
    deadline = time.time() + 30
    while SESSION.get(server + "/get_load").json()[0]["num_waiting_reqs"] == 0:
        assert time.time() < deadline, "the request never reached the paused server"
        time.sleep(0.01)
    assert SESSION.get(server + "/get_load").json()[0]["num_reqs"] == 0 and t.is_alive()
    # held requests do not block the weight-update dance: flush, release and resume all succeed while paused
    flushed = SESSION.get(server + "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.\nPlease check backend logs")
    assert SESSION.post(server + "/release_memory_occupation", json={}).status_code == 200
    assert SESSION.post(server + "/resume_memory_occupation", json={}).status_code == 200
    assert SESSION.post(server + "/continue_generation", json={}).json()["status"] == "ok"
    t.join(30)
    assert result["meta_info"]["completion_tokens"] == 3


def test_health_probe_aborted_by_abort_all_is_healthy(tiny_kit):
    """SGLang's /health_generate is healthy once the scheduler answers its probe, an abort included: a rollout's
    abort-all (or a weight update's pause) that catches the probe must not make the health monitor fail the run."""
    proc, url = start_cpu_server(tiny_kit[0], "--max-running-requests", "1")
    try:
        payload = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 490, "ignore_eos": True}}
        long_one = threading.Thread(target=lambda: gen(url, payload))
        long_one.start()
        status = {}
        probe = threading.Thread(target=lambda: status.update(code=SESSION.get(url + "/health_generate").status_code))
        deadline = time.time() + 30
        while SESSION.get(url + "/get_load").json()[0]["num_reqs"] == 0:
            assert time.time() < deadline, "the long request never started running"
            time.sleep(0.01)
        probe.start()
        while SESSION.get(url + "/get_load").json()[0]["num_waiting_reqs"] == 0:  # the probe queues behind it
            assert time.time() < deadline, "the probe never reached the scheduler"
            time.sleep(0.01)
        assert SESSION.post(url + "/abort_request", json={"abort_all": True}).status_code == 200
        probe.join(30)
        long_one.join(30)
        assert status == {"code": 200}
    finally:
        stop_cpu_server(proc)


def test_server_stops_when_the_engine_actor_that_started_it_dies(tiny_kit):
    """SLIME_PARENT_PID names the engine actor: the server serves while that process lives, even when it is not the
    server's parent (here the server is forked by the test session's fork server), and shuts down once it died,
    unreaped (a zombie) included."""
    actor, proc = subprocess.Popen(["sleep", "600"]), None
    try:
        proc, url = start_cpu_server(tiny_kit[0], env=dict(os.environ, SLIME_PARENT_PID=str(actor.pid)))
        time.sleep(2.5)  # the watchdog looks every second
        assert proc.poll() is None and SESSION.get(url + "/health", timeout=5).status_code == 200
        actor.kill()  # not waited for: a zombie until the end of the test
        proc.wait(30)
    finally:
        actor.kill()
        actor.wait()
        if proc is not None:
            stop_cpu_server(proc)


def test_release_and_resume_memory(server):
    sp = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    before = gen(server, sp)["output_ids"]
    assert SESSION.get(server + "/flush_cache").status_code == 200
    assert SESSION.post(server + "/release_memory_occupation", json={}).status_code == 200
    r = SESSION.post(server + "/generate", json=sp)
    assert r.status_code == 503 and "resume_memory_occupation" in r.json()["error"]
    assert SESSION.get(server + "/health_generate").status_code == 503
    assert SESSION.post(server + "/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
    assert SESSION.post(server + "/generate", json=sp).status_code == 503  # kv cache still released
    assert SESSION.post(server + "/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    # SGLang's release with no tags also frees the CUDA graphs: generating before they are back is refused
    r = SESSION.post(server + "/generate", json=sp)
    assert r.status_code == 503 and "cuda_graph" in r.json()["error"]
    assert SESSION.get(server + "/health_generate").status_code == 503
    assert SESSION.post(server + "/resume_memory_occupation", json={"tags": ["cuda_graph"]}).status_code == 200
    assert gen(server, sp)["output_ids"] == before
    bad = SESSION.post(server + "/release_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400


def _sha(t):
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _hf_named(model):
    return [(n, p.detach().clone()) for n, p in model.state_dict().items() if n != "lm_head.weight"]


def _assert_serves(server, model, version):
    for prompt in PROMPTS[:2]:
        out = gen(
            server,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            },
        )
        ref_ids, ref_lps = hf_greedy(model, prompt, 8)
        assert out["output_ids"] == ref_ids and out["meta_info"]["weight_version"] == version
        assert max(abs(a[0] - b) for a, b in zip(out["meta_info"]["output_token_logprobs"], ref_lps)) <= 1e-4


def _checksums(url):
    r = SESSION.post(url + "/weights_checker", json={"action": "checksum"})
    assert r.status_code == 200, r.text
    return r.json()


def test_weights_checker_answers_as_sglang(server, tiny_kit):
    """SGLang's checksum shape: per rank, each served tensor's hash (SGLang's CPU tensor_hash: the first 8 bytes of
    the sha256 of its bytes) and a sha256 over the sorted (name, hash) pairs; per engine, a sha256 over the ranks."""
    from safetensors.torch import load_file

    sd = load_file(os.path.join(tiny_kit[0], "model.safetensors"))
    body = _checksums(server)
    assert set(body) == set(load_contract()["routes"]["/weights_checker"]["response_keys"])
    (rank,) = body["ranks"]
    assert set(rank) == set(load_contract()["classes"]["ChecksumInfo"])
    assert set(rank["parallelism_info"][0]) == set(load_contract()["classes"]["ParallelismInfo"])
    assert rank["checksums"]["model.embed_tokens.weight"] == _sha(sd["model.embed_tokens.weight"])[:16]
    q, k = sd["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    v = sd["model.layers.1.self_attn.v_proj.weight"]
    assert rank["checksums"]["model.layers.1.self_attn.qkv_proj.weight"] == _sha(torch.cat([q, k, v]))[:16]  # fused
    # the names are SGLang's Qwen3ForCausalLM parameters (tied embeddings: no lm_head of its own)
    attn = ["qkv_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight"]
    layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_up_proj.weight"]
    layer += ["mlp.down_proj.weight"] + [f"self_attn.{n}" for n in attn]
    names = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}" for i in range(4) for n in layer
    }
    assert set(rank["checksums"]) == names
    h = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        h.update(name.encode() + rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == h.hexdigest()
    assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()


def test_weights_checker_snapshot_reset_compare(own_server, tiny_kit):
    """--check-weight-update-equal's protocol: snapshot, scramble, restore by an update, compare; a tensor that is not
    restored fails the compare with 400 naming it."""
    server = own_server

    def check(action):
        return SESSION.post(server + "/weights_checker", json={"action": action})

    sp = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}
    before = gen(server, sp)["output_ids"]
    assert check("snapshot").json() == {"success": True, "message": "Success."}
    assert check("reset_tensors").status_code == 200
    assert _checksums(server)["ranks"][0]["checksums"]["model.embed_tokens.weight"] != _sha(torch.zeros(1))[:16]
    assert SESSION.post(server + "/update_weights_from_disk", json={"model_path": tiny_kit[0]}).status_code == 200
    assert check("compare").json() == {"success": True, "message": "Success."}
    assert gen(server, sp)["output_ids"] == before
    # a compare needs a new snapshot; this time one tensor stays scrambled
    assert check("compare").status_code == 400
    check("snapshot")
    check("reset_tensors")
    SESSION.post(server + "/update_weights_from_disk", json={"model_path": tiny_kit[0]})
    begin_update(server)
    set_shared_authkey()
    noise = MultiprocessingSerializer.serialize(
        [("model.layers.0.mlp.down_proj.weight", torch.ones(_down_shape(tiny_kit[0])) * 3)], output_str=True
    )
    r = SESSION.post(server + "/update_weights_from_tensor", json={"serialized_named_tensors": [noise]})
    end_update(server)
    assert r.status_code == 200, r.text
    r = check("compare")
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"].startswith("check tensor equality failed:\nname=model.layers.0.mlp.down_proj.weight ")
    SESSION.post(server + "/update_weights_from_disk", json={"model_path": tiny_kit[0]})
    assert check("bogus").json() == {"success": False, "message": "Unsupported action='bogus'"}


def _down_shape(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return [cfg["hidden_size"], cfg["intermediate_size"]]


def begin_update(url):
    r = SESSION.post(url + "/begin_weight_update", json={})
    assert r.json() == {"success": True, "message": "Success"}, r.text


def end_update(url):
    r = SESSION.post(url + "/end_weight_update", json={})
    assert r.json() == {"success": True, "message": "Success"}, r.text


def test_weight_updates_need_a_session_as_in_sglang(server):
    payload = MultiprocessingSerializer.serialize([], output_str=True)
    r = SESSION.post(server + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": ("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"),
    }
    r = SESSION.post(server + "/end_weight_update", json={})
    assert r.status_code == 400 and "no weight-update session is open" in r.json()["message"]
    begin_update(server)
    r = SESSION.post(server + "/begin_weight_update", json={})
    assert r.status_code == 400 and "already open" in r.json()["message"]
    end_update(server)


def test_bodies_are_checked_strictly_against_sglangs_request_classes(server):
    r = SESSION.post(server + "/release_memory_occupation", json={"tag": ["weights"]})
    assert "unknown field 'tag'" in refusal(r, "Bad Request")
    r = SESSION.post(server + "/pause_generation", json={"mode": "soft"})
    assert "'mode' = 'soft' is not Literal" in refusal(r, "Bad Request")
    r = SESSION.post(server + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
    assert "unknown field 'max_tokens'" in refusal(r, "contract")
    # what sglang-router adds when it re-serialises /generate passes, as on SGLang
    assert (
        SESSION.post(
            server + "/generate", json={"input_ids": [1, 2], "model": None, "sampling_params": {"max_new_tokens": 1}}
        ).status_code
        == 200
    )


def test_update_weights_from_tensor_and_disk(own_server, hf, other_weights, tiny_kit):
    from slime.utils.tensor_serialization import FlattenedTensorBucket, MultiprocessingSerializer, set_shared_authkey

    server = own_server

    set_shared_authkey()
    other_dir, other = other_weights
    named = _hf_named(other)
    # plain list of (name, tensor): shared-memory handles, not bytes
    payload = MultiprocessingSerializer.serialize(named[:10], output_str=True)
    begin_update(server)
    r = SESSION.post(
        server + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": "7"}
    )
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Succeeded to update parameter online."}
    bucket = FlattenedTensorBucket(named_tensors=named[10:])
    payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True
    )
    r = SESSION.post(
        server + "/update_weights_from_tensor",
        json={"serialized_named_tensors": [payload], "load_format": "flattened_bucket"},
    )
    assert r.status_code == 200 and r.json()["success"]
    end_update(server)
    _assert_serves(server, other, "8")
    assert SESSION.get(server + "/model_info").json()["weight_version"] == "8"
    # a wrong name is a 400 naming it, and the server keeps the weights it had
    bad = MultiprocessingSerializer.serialize([("model.layers.0.mlp.bogus.weight", torch.zeros(3))], output_str=True)
    begin_update(server)
    r = SESSION.post(server + "/update_weights_from_tensor", json={"serialized_named_tensors": [bad]})
    end_update(server)
    assert r.status_code == 400 and "model.layers.0.mlp.bogus.weight" in r.json()["message"]
    # a path that is no checkpoint: SGLang's failure body (with its paused-request count), the weights unchanged
    r = SESSION.post(server + "/update_weights_from_disk", json={"model_path": str(tiny_kit[0]) + "-missing"})
    assert r.status_code == 400 and r.json() == {
        "success": False,
        "message": r.json()["message"],
        "num_paused_requests": 0,
    }
    # back to the original weights from disk
    r = SESSION.post(server + "/update_weights_from_disk", json={"model_path": tiny_kit[0], "weight_version": "disk"})
    assert r.status_code == 200 and r.json()["success"]
    _assert_serves(server, hf[0], "disk")


def test_update_weights_from_distributed(own_server, hf, other_weights, tiny_kit):
    import torch.distributed as dist

    from slime.utils.distributed_utils import init_process_group

    server = own_server

    _, other = other_weights
    port = free_port()
    group_name = "test-weight-sync"
    joined = {}
    t = threading.Thread(
        target=lambda: joined.update(
            SESSION.post(
                server + "/init_weights_update_group",
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": group_name,
                    "backend": "gloo",
                },
                timeout=120,
            ).json()
        )
    )
    t.start()
    group = init_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group_name
    )
    t.join(60)
    assert joined.get("success"), joined
    try:
        named = _hf_named(other)
        begin_update(server)
        for chunk in (named[:7], named[7:]):  # two buckets in one session, as the trainer sends them
            done = {}
            t = threading.Thread(
                target=lambda c=chunk: done.update(
                    SESSION.post(
                        server + "/update_weights_from_distributed",
                        json={
                            "names": [n for n, _ in c],
                            "dtypes": [str(p.dtype).replace("torch.", "") for _, p in c],
                            "shapes": [list(p.shape) for _, p in c],
                            "group_name": group_name,
                            "flush_cache": False,
                        },
                        timeout=120,
                    ).json()
                )
            )
            t.start()
            for _, p in chunk:
                dist.broadcast(p, src=0, group=group)
            t.join(60)
            assert done.get("success"), done
        end_update(server)
        version = SESSION.get(server + "/model_info").json()["weight_version"]
        _assert_serves(server, other, version)
    finally:
        dist.destroy_process_group(group)
        SESSION.post(server + "/destroy_weights_update_group", json={"group_name": group_name})
        SESSION.post(
            server + "/update_weights_from_disk", json={"model_path": tiny_kit[0]}
        )  # later tests expect these


def _tiny_hf_model(arch, path):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    if arch == "llama3":  # llama3 rope scaling, untied head
        cfg = LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = LlamaForCausalLM(cfg)
    else:  # qwen2: q/k/v bias, tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6))
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot hide
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def test_weight_load_copies_a_large_update_in_pieces_over_threads(monkeypatch):
    """WeightStore.load's copy: big contiguous pairs cut into 1-D pieces shared by threads, the rest whole; every
    destination ends equal to its source (cast to its dtype), nothing outside it is touched."""
    from slime.backends.cpu_server import weights

    monkeypatch.setattr(weights, "_COPY_THREADS", 3)  # more threads than pieces per tensor, also on a 1-core host
    piece = weights._COPY_PIECE
    srcs = [
        torch.randn(3 * piece + 5),
        torch.randn(2 * piece + 1, dtype=torch.float64),  # cast while copying
        torch.randn(64, 33).t(),  # not contiguous: copied whole
        torch.randn(7),
    ]
    backing = torch.full((3 * piece + 5 + 2 * piece + 1 + 33 * 64 + 7 + 1,), 9.0)  # one tail element beyond all
    dsts, offset = [], 0
    for src in srcs:
        dsts.append(backing[offset : offset + src.numel()].view(src.shape))
        offset += src.numel()
    weights.parallel_copy(list(zip(dsts, srcs)))
    for dst, src in zip(dsts, srcs):
        assert torch.equal(dst, src.to(torch.float32))
    assert backing[-1] == 9.0


def test_a_load_reports_what_it_copied_only_once_all_of_it_is_in_place():
    """`copy_reporting` with `on_copied` (what the served fingerprint hashes after an update): one report, with
    every name, after every tensor is copied, so that no hash competes with the copy."""
    from slime.backends.cpu_server import weights

    items = [(f"t{i}", torch.zeros(n), torch.randn(n)) for i, n in enumerate([600, 600, 2000, 10, 5])]
    reported = []

    def on_copied(names):
        assert all(torch.equal(d, s) for _, d, s in items)
        reported.append(names)

    weights.copy_reporting(items, on_copied)
    assert reported == [["t0", "t1", "t2", "t3", "t4"]]
    weights.copy_reporting([], on_copied)
    assert len(reported) == 1


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_other_llama_family_architectures_match_transformers(arch, tmp_path):
    from slime.backends.cpu_server.model import KVPool, ModelConfig, Transformer
    from slime.backends.cpu_server.weights import WeightStore

    ref = _tiny_hf_model(arch, str(tmp_path))
    cfg = ModelConfig.from_model_dir(str(tmp_path))
    assert (cfg.rope_scaling is not None) == (arch == "llama3") and cfg.attention_bias == (arch == "qwen2")
    w = WeightStore(cfg, torch.float32)
    w.load_from_dir(str(tmp_path))
    model, pool = Transformer(cfg, w, torch.float32, 257), KVPool(cfg, 1024, torch.float32)
    seqs = [list(range(3, 103)), [7, 8, 9]]
    lens = torch.tensor([len(s) for s in seqs])
    rows = pool.alloc(int(lens.sum()))
    got = model.forward_prefill(pool, torch.tensor(seqs[0] + seqs[1]), lens, torch.tensor(rows), all_logits=True)
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([s])).logits[0] for s in seqs])
    assert (got - want).abs().max() < 1e-4
    # one decode step for both sequences against the full-sequence reference
    new = pool.alloc(2)
    index = torch.zeros(2, 101, dtype=torch.long)
    index[0, :100], index[0, 100] = torch.tensor(rows[:100]), new[0]
    index[1, :3], index[1, 3] = torch.tensor(rows[100:]), new[1]
    valid = torch.arange(101)[None, :] <= lens[:, None]
    got = model.forward_decode(pool, torch.tensor([11, 12]), lens, torch.tensor(new), index, valid)
    with torch.no_grad():
        want = torch.stack([ref(torch.tensor([s + [t]])).logits[0, -1] for s, t in zip(seqs, [11, 12])])
    assert (got - want).abs().max() < 1e-4


def test_projections_follow_every_write_into_the_weights_and_free_with_them(tiny_kit):
    """The decoder multiplies by a contiguous transpose of each fused weight (faster GEMMs): it follows every write
    into the weight's storage (through an HF-name view, in inference mode too, and one torch does not see, such as a
    broadcast received in place, which bumps the store's generation), and leaves with the weight when the weights are
    released, so release_memory_occupation still frees that RAM."""
    import gc
    import weakref

    import torch.nn.functional as F

    from slime.backends.cpu_server.model import ModelConfig, Transformer, _transposed
    from slime.backends.cpu_server.weights import WeightStore

    cfg = ModelConfig.from_model_dir(tiny_kit[0])
    w = WeightStore(cfg, torch.float32)
    w.load_from_dir(tiny_kit[0])
    model, x = Transformer(cfg, w, torch.float32, 64), torch.randn(3, cfg.hidden_size)

    def project():
        return model._linear(x, w.layers[0], "qkv", None, 0)

    before = project()
    assert torch.allclose(before, F.linear(x, w.layers[0]["qkv"]), atol=1e-5)
    k = slice(cfg.num_heads * cfg.head_dim, (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim)
    k_proj = w.named["model.layers.0.self_attn.k_proj.weight"]
    for write in ("no_grad", "inference_mode", "raw"):  # a load's copy_, a write during serving, a collective's
        if write == "raw":  # into the memory behind torch's back (no version bump), as the update API announces it
            k_proj.data.add_(0.5)
            w.generation += 1
        else:
            with getattr(torch, write)():
                k_proj.add_(0.5)
        after = project()
        assert torch.allclose(after, F.linear(x, w.layers[0]["qkv"]), atol=1e-5)
        assert (after[:, k] - before[:, k]).abs().max() > 1e-2 and torch.equal(
            after[:, : k.start], before[:, : k.start]
        )
        before = after
    kept = weakref.ref(_transposed(w.layers[0]["qkv"], w.generation))
    del k_proj  # a view keeps its base alive
    w.release()
    gc.collect()
    assert kept() is None
    w.cleanup()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_norms_in_one_pass_round_as_two_rms_norms(tiny_kit, dtype):
    """The projection normalises q and k heads together: bit for bit what F.rms_norm gives each with its own weight,
    in bf16 too (one rounding, after the weight, as SGLang's and Transformer Engine's norms round)."""
    import torch.nn.functional as F
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    from slime.backends.cpu_server.model import ModelConfig, Transformer, rope_inv_freq
    from slime.backends.cpu_server.weights import WeightStore

    cfg = ModelConfig.from_model_dir(tiny_kit[0])
    w = WeightStore(cfg, dtype)
    w.load_from_dir(tiny_kit[0])
    model, layer = Transformer(cfg, w, dtype, 64), w.layers[1]
    with torch.no_grad():
        layer["q_norm"].copy_(torch.randn(cfg.head_dim))  # distinct weights: a swap of q's and k's would show
        layer["k_norm"].copy_(torch.randn(cfg.head_dim))
    h, pos = torch.randn(5, cfg.hidden_size).to(dtype), torch.arange(5)
    q, k, v = model._qkv(layer, h, *model._rope(pos))
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qk = model._linear(h, layer, "qkv", None, 1)[:, : (H + KVH) * D].unflatten(-1, (H + KVH, D))  # its projection
    eps = cfg.rms_norm_eps
    want = torch.cat(
        [F.rms_norm(qk[:, :H], (D,), layer["q_norm"], eps), F.rms_norm(qk[:, H:], (D,), layer["k_norm"], eps)], 1
    )
    freqs = torch.outer(pos.float(), rope_inv_freq(cfg))  # transformers' rotary embedding from its frequencies
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    want = want * emb.cos().to(dtype) + rotate_half(want) * emb.sin().to(dtype)
    assert torch.equal(q, want[:, :H]) and torch.equal(k, want[:, H:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_reads_each_shared_prompt_once_and_equals_transformers(tiny_kit, hf, dtype):
    """Cascade attention: members of a group attend their shared prompt's rows through the group (kv_index holds only
    their own rows), others attend all of theirs; logits equal transformers' full-sequence forward (fp32) and the
    plain decode (within bf16's rounding in bf16). Groups of 3 and 2 with prompts of different lengths, members 0-5
    tokens past the prompt, one request in no group; GQA (4 query heads on 2 KV heads) and q/k-norm."""
    from slime.backends.cpu_server.model import KVPool, ModelConfig, SharedPrefix, Transformer
    from slime.backends.cpu_server.weights import WeightStore

    cfg = ModelConfig.from_model_dir(tiny_kit[0])
    assert cfg.num_heads == 2 * cfg.num_kv_heads and cfg.qk_norm
    w = WeightStore(cfg, dtype)
    w.load_from_dir(tiny_kit[0])
    model, pool = Transformer(cfg, w, dtype, 257), KVPool(cfg, 1024, dtype)
    a, b = list(range(20, 29)), list(range(100, 120))
    seqs = [a, a + [5, 6], a + [7, 8, 9, 10, 11], b + [40], b + [41, 42, 43], [60, 61, 62, 63]]
    group_of = [0, 0, 0, 1, 1, None]
    rows = []
    for s in seqs:  # each prefilled alone; a group's prompt rows are then read from its first member's
        rows.append(pool.alloc(len(s)))
        model.forward_prefill(pool, torch.tensor(s), torch.tensor([len(s)]), torch.tensor(rows[-1]))
    prompts = [(a, rows[0][: len(a)]), (b, rows[3][: len(b)])]
    groups = [(prompts[0][1], [0, 1, 2]), (prompts[1][1], [3, 4])]
    B, new = len(seqs), pool.alloc(len(seqs))
    own = [rows[i][len(prompts[g][0]) :] if g is not None else rows[i] for i, g in enumerate(group_of)]
    own = [r + [n] for r, n in zip(own, new)]
    S = max(len(r) for r in own)
    index = torch.tensor([r + [0] * (S - len(r)) for r in own])
    valid = torch.arange(S)[None, :] < torch.tensor([len(r) for r in own])[:, None]
    tokens, lens = torch.tensor([11, 12, 13, 14, 15, 16]), torch.tensor([len(s) for s in seqs])
    shared = SharedPrefix.build(groups, B, dtype)
    assert shared.index.shape == (2, len(b)) and shared.members.tolist() == [[0, 1, 2], [3, 4, 0]]
    assert shared.ungrouped.view(-1).tolist() == [0.0] * 5 + [float("-inf")]  # request 5 reads its own rows only
    got = model.forward_decode(pool, tokens, lens, torch.tensor(new), index, valid, shared=shared)
    full = [(prompts[g][1] if g is not None else []) + r for g, r in zip(group_of, own)]
    Sf = max(len(r) for r in full)
    full_index = torch.tensor([r + [0] * (Sf - len(r)) for r in full])
    full_valid = torch.arange(Sf)[None, :] < torch.tensor([len(r) for r in full])[:, None]
    plain = model.forward_decode(pool, tokens, lens, torch.tensor(new), full_index, full_valid)
    if dtype == torch.float32:
        with torch.no_grad():
            want = torch.stack([hf[0](torch.tensor([s + [t]])).logits[0, -1] for s, t in zip(seqs, tokens.tolist())])
        assert (got - want).abs().max() < 1e-4
    assert got.dtype == dtype and (got.float() - plain.float()).abs().max() < (
        1e-5 if dtype == torch.float32 else 2e-2
    )
    # the cascade really reads the prompt through the group: spoil a member's own copy of it and nothing changes,
    # spoil the group's rows and the members' logits move, once gathered anew: a SharedPrefix keeps the prompts' K/V
    # its first step gathered, and so does the next step's, built from it (as the scheduler builds every step over
    # the same groups)
    for i in range(cfg.num_layers):
        pool.k[i][torch.tensor(rows[1][: len(a)])] = 9.0
    again = model.forward_decode(pool, tokens, lens, torch.tensor(new), index, valid, shared=shared)
    assert torch.equal(again, got)
    for i in range(cfg.num_layers):
        pool.k[i][torch.tensor(prompts[0][1])] = 9.0
    reused = model.forward_decode(pool, tokens, lens, torch.tensor(new), index, valid, shared=shared)
    assert torch.equal(reused, got)
    following = SharedPrefix.build(groups, B, dtype, prev=shared)
    assert torch.equal(
        model.forward_decode(pool, tokens, lens, torch.tensor(new), index, valid, shared=following), got
    )
    anew = SharedPrefix.build(groups, B, dtype)
    spoiled = model.forward_decode(pool, tokens, lens, torch.tensor(new), index, valid, shared=anew)
    assert (spoiled[:3] - got[:3]).abs().max() > 1e-2 and torch.equal(spoiled[3:], got[3:])


def test_a_busy_port_is_one_line_and_the_server_never_says_it_is_ready(tiny_kit):
    """SGLang's "fired up and ready to roll" line, which launch scripts wait for, comes only once the port listens."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [*_ray_zygote.command(_ray_zygote.shared()[1]), "-m", "slime.backends.cpu_server"]
        cmd += ["--model-path", tiny_kit[0], "--host", "127.0.0.1", "--port", str(port)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=die_with_parent)
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "cannot start" in last and f"('127.0.0.1', {port})" in last and "address already in use" in last, last
    assert "ready to roll" not in run.stderr


def test_unsupported_model_is_a_clear_error(tmp_path):
    from slime.backends.cpu_server.model import ModelConfig, UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        ModelConfig.from_model_dir(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="config.json does not exist"):
        ModelConfig.from_model_dir(str(tmp_path / "missing"))


def _scheduler(model_dir, **kw):
    from transformers import AutoTokenizer

    from slime.backends.cpu_server.model import KVPool, ModelConfig, Transformer
    from slime.backends.cpu_server.scheduler import Scheduler
    from slime.backends.cpu_server.server import ServerState
    from slime.backends.cpu_server.weights import WeightStore

    cfg = ModelConfig.from_model_dir(model_dir)
    w = WeightStore(cfg, torch.float32)
    w.load_from_dir(model_dir)
    pool = KVPool(cfg, kw.pop("max_total_tokens"), torch.float32)
    return Scheduler(
        Transformer(cfg, w, torch.float32, 513),
        w,
        pool,
        AutoTokenizer.from_pretrained(model_dir),
        context_len=512,
        eos_ids=[2],
        max_prefill_tokens=64,
        random_seed=0,
        state=ServerState("default", 1),
        **kw,
    )


def _cached_rows(sched):
    return sum(cache.num_rows for _, cache in sched.caches.values())


def _run_all(sched, reqs, timeout=120):
    done = threading.Semaphore(0)
    for r in reqs:
        r.on_update = lambda req: req.finished and done.release()
        sched.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=timeout), "scheduler did not finish the requests"


def test_scheduler_queues_retracts_and_stays_exact(tiny_kit, hf):
    """6 requests, 2 slots, a KV pool too small for two long ones: requests wait for slots, the newest is retracted
    when the pool runs dry and re-prefilled later; every output still equals transformers' greedy decode."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    sched = _scheduler(tiny_kit[0], max_running=2, max_total_tokens=70)
    sched.start()
    try:
        prompts = [PROMPTS[i % 3] for i in range(6)]
        reqs = [
            Req(
                p,
                SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}, 512),
                return_logprob=True,
            )
            for p in prompts
        ]
        _run_all(sched, reqs)
    finally:
        sched.stop()
    assert sum(r.num_retractions for r in reqs) > 0
    for r, p in zip(reqs, prompts):
        ref_ids, ref_lps = hf_greedy(hf[0], p, 40)
        assert r.output_ids == ref_ids and max(abs(a - b) for a, b in zip(r.output_logprobs, ref_lps)) <= 1e-4
    # everything handed back to the pool or kept by the prefix cache, which the flush empties
    assert sched.pool.num_free() + _cached_rows(sched) == 70 and len(sched.free_slots) == 2 and not sched.row_refs
    sched._flush_cache()
    assert sched.pool.num_free() == 70


def test_input_and_top_logprobs(server, hf):
    prompt = PROMPTS[2]
    out = gen(
        server,
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
        },
    )
    meta = out["meta_info"]
    with torch.no_grad():
        lp = torch.log_softmax(hf[0](torch.tensor([prompt])).logits[0].float(), -1)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt and inp[0][0] is None
    assert max(abs(inp[i][0] - float(lp[i - 1, prompt[i]])) for i in range(1, len(prompt))) <= 1e-4
    top = meta["output_top_logprobs"]
    assert len(top) == 4 and all(len(x) == 3 for x in top)
    assert top[0][0][1] == out["output_ids"][0] and abs(top[0][0][0] - meta["output_token_logprobs"][0][0]) < 1e-6
    assert top[0][0][0] >= top[0][1][0] >= top[0][2][0]


def test_input_top_logprobs_token_ids_logprob_and_a_later_logprob_start_len(server, hf):
    """SGLang's per-position rows, temperature-scaled, against transformers: from logprob_start_len on, the first
    entry without a value (SGLang's hidden states from there predict the tokens after it), then per position the
    top-k of the next token's distribution and the log-probs of the ids token_ids_logprob names; those ids again at
    every output token."""
    prompt, start, ids, temp, n_out = PROMPTS[2], 3, [5, 17, 300], 0.7, 4
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": 2,
        "token_ids_logprob": ids,
        "sampling_params": {"temperature": temp, "max_new_tokens": n_out, "ignore_eos": True},
    }
    meta = (out := gen(server, body))["meta_info"]
    with torch.no_grad():  # lp[i]: the distribution of token i + 1
        lp = torch.log_softmax(hf[0](torch.tensor([prompt + out["output_ids"]])).logits[0].float() / temp, -1)
    n = len(prompt)
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[start:] and inp[0][0] is None
    assert max(abs(v - float(lp[i - 1, t])) for (v, t, _), i in zip(inp[1:], range(start + 1, n))) <= 1e-4
    tops, chosen = meta["input_top_logprobs"], meta["input_token_ids_logprobs"]
    assert len(tops) == len(chosen) == n - start and tops[0] is None and chosen[0] is None
    for top, row, i in zip(tops[1:], chosen[1:], range(start + 1, n)):
        want = lp[i - 1].topk(2)
        assert [t for _, t, _ in top] == want.indices.tolist()
        assert max(abs(v - w) for (v, _, _), w in zip(top, want.values.tolist())) <= 1e-4
        assert [t for _, t, _ in row] == ids and max(abs(v - float(lp[i - 1, t])) for v, t, _ in row) <= 1e-4
    outs = meta["output_token_ids_logprobs"]
    assert len(outs) == len(meta["output_top_logprobs"]) == n_out
    for row, j in zip(outs, range(n, n + n_out)):
        assert [t for _, t, _ in row] == ids and max(abs(v - float(lp[j - 1, t])) for v, t, _ in row) <= 1e-4
    assert "input_token_ids_logprobs" not in gen(server, {**body, "token_ids_logprob": None})["meta_info"]


def test_penalties_follow_sglang(server, hf):
    """Greedy with frequency / presence / repetition penalties equals a hand-written reference on HF logits."""
    prompt, n, fp, pp, rp = PROMPTS[1], 12, 0.5, 0.3, 1.5
    out = gen(
        server,
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": n,
                "ignore_eos": True,
                "frequency_penalty": fp,
                "presence_penalty": pp,
                "repetition_penalty": rp,
            },
        },
    )
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf[0](torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(
                torch.tensor(ids[len(prompt) :], dtype=torch.long), minlength=logits.numel()
            ).float()
            logits = logits - fp * counts - pp * (counts > 0).float()
            logits = torch.where(counts > 0, torch.where(logits > 0, logits / rp, logits * rp), logits)
            t = int(logits.argmax())
            lps.append(float(torch.log_softmax(logits, -1)[t]))
            ids.append(t)
    assert out["output_ids"] == ids[len(prompt) :]
    assert max(abs(a[0] - b) for a, b in zip(out["meta_info"]["output_token_logprobs"], lps)) <= 1e-4
    plain = gen(
        server, {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    )
    assert plain["output_ids"] != out["output_ids"]  # the penalties did something


def test_return_text_in_logprobs(server, hf):
    out = gen(
        server,
        {
            "input_ids": PROMPTS[0],
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        },
    )
    assert [x[2] for x in out["meta_info"]["output_token_logprobs"]] == [hf[1].decode([t]) for t in out["output_ids"]]


def test_transformers_fallback_serves_other_architectures(tiny_kit, tmp_path):
    """GPT-2 is not in the compact model's family: the server runs it through transformers, same API and numerics."""
    import shutil

    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey

    d = tmp_path / "gpt2-tiny"
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=2, eos_token_id=2, bos_token_id=2)
    ).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_kit[0], f), d / f)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    proc, url = start_cpu_server(str(d))
    try:
        assert SESSION.get(url + "/server_info").json()["model_impl"] == "transformers"
        outs = gen(
            url,
            {
                "input_ids": PROMPTS,
                "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
            },
        )
        for p, o in zip(PROMPTS, outs):
            ids, lps = hf_greedy(ref, p, 6)
            assert o["output_ids"] == ids
            assert max(abs(a[0] - b) for a, b in zip(o["meta_info"]["output_token_logprobs"], lps)) <= 1e-4
        sums = _checksums(url)["ranks"][0]["checksums"]
        assert sums["transformer.h.0.attn.c_attn.weight"] == _sha(ref.transformer.h[0].attn.c_attn.weight)[:16]
        set_shared_authkey()
        name = "transformer.h.1.mlp.c_proj.weight"
        payload = MultiprocessingSerializer.serialize([(name, torch.zeros(256, 64))], output_str=True)
        begin_update(url)
        assert (
            SESSION.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": [payload]}).status_code
            == 200
        )
        end_update(url)
        with torch.no_grad():
            ref.transformer.h[1].mlp.c_proj.weight.zero_()
        assert SESSION.post(url + "/release_memory_occupation", json={}).status_code == 200
        assert SESSION.post(url + "/resume_memory_occupation", json={}).status_code == 200
        out = gen(
            url,
            {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}},
        )
        assert out["output_ids"] == hf_greedy(ref, PROMPTS[0], 6)[0]
    finally:
        stop_cpu_server(proc)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_inference_makes_a_request_independent_of_its_batch(tiny_kit, deterministic):
    """SGLang's --enable-deterministic-inference: a request's log-probs are bit-identical alone and batched with
    others. Without it the batched matmuls round differently per batch shape (which is why the flag exists)."""
    proc, url = start_cpu_server(tiny_kit[0], *(["--enable-deterministic-inference"] if deterministic else []))
    try:
        sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}
        prompts = PROMPTS + [list(range(100, 140)), [7, 8]]

        def logprobs(outputs):
            return [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outputs]

        alone = logprobs([gen(url, {"input_ids": p, "sampling_params": sp, "return_logprob": True}) for p in prompts])
        batched = logprobs(gen(url, {"input_ids": prompts, "sampling_params": [sp] * 5, "return_logprob": True}))
    finally:
        stop_cpu_server(proc)
    assert (batched == alone) == deterministic


def _serve(sched, reqs):
    """All of reqs queued before the scheduler starts (one admission window), then run to completion."""
    done = threading.Semaphore(0)
    for r in reqs:
        r.on_update = lambda req: req.finished and done.release()
        sched.submit(r)
    sched.start()
    try:
        for _ in reqs:
            assert done.acquire(timeout=120), "scheduler did not finish the requests"
    finally:
        sched.stop()


def test_shared_prefill_is_exact_and_computes_each_prompt_once(tiny_kit):
    """Issue #40, engine side: n requests with one prompt are prefilled once and share its KV rows; greedy and
    seeded sampled outputs, output and input log-probs equal the same requests served with sharing off (the
    server's --disable-radix-cache), within 1e-6 in batched mode and bit for bit in deterministic mode."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    def group():
        reqs = []
        for i in range(8):  # greedy, outputs of several lengths
            sp = {"temperature": 0, "max_new_tokens": 3 + i % 4, "ignore_eos": True}
            reqs.append(Req(PROMPTS[0], SamplingParams.from_dict(sp, 512), return_logprob=True, logprob_start_len=0))
        for i in range(4):  # sampled at temperature != 1 with seeds, top-p / top-k / min-p
            sp = {"temperature": 0.7, "top_p": 0.9, "top_k": 20 + i, "sampling_seed": i, "max_new_tokens": 5}
            reqs.append(Req(PROMPTS[2], SamplingParams.from_dict(sp, 512), return_logprob=True))
        sp = {"temperature": 1.3, "min_p": 0.01, "max_new_tokens": 4}  # no seed: the server's generator
        reqs.append(Req(PROMPTS[2], SamplingParams.from_dict(sp, 512), return_logprob=True))
        reqs.append(Req(PROMPTS[1], SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 4}, 512)))
        return reqs

    for batch_invariant in (False, True):
        results = {}
        for share in (True, False):
            sched = _scheduler(
                tiny_kit[0], max_running=16, max_total_tokens=400, share_prefill=share, batch_invariant=batch_invariant
            )
            cascades, decode = [], sched.model.forward_decode

            def spy(*args, shared=None, **kw):
                cascades.append(shared is not None)
                return decode(*args, shared=shared, **kw)

            sched.model.forward_decode = spy  # the decode reads a group's prompt once (none in deterministic mode)
            reqs = group()
            _serve(sched, reqs)
            # all handed back, or (batched) kept by the prefix cache
            assert sched.pool.num_free() + _cached_rows(sched) == 400 and not sched.row_refs and not sched.shared
            assert bool(sched.caches) == (share and not batch_invariant)
            assert any(cascades) == (share and not batch_invariant)
            results[share] = (reqs, sched.num_prefill_tokens, sched.num_cached_tokens)
        (on, on_prefill, on_cached), (off, off_prefill, off_cached) = results[True], results[False]
        p0, p1, p2 = (len(p) for p in PROMPTS)
        assert on_prefill == p0 + p1 + p2 and on_cached == 7 * p0 + 4 * p2  # each prompt computed once
        assert off_prefill == 8 * p0 + p1 + 5 * p2 and off_cached == 0
        assert [r.cached_tokens for r in on] == [0] + [p0] * 7 + [0] + [p2] * 4 + [0]
        tol = 0.0 if batch_invariant else 1e-6
        for a, b in zip(on, off):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= tol
            if a.input_logprobs is not None:
                assert [e[1] for e in a.input_logprobs] == [e[1] for e in b.input_logprobs]
                assert max(abs(x[0] - y[0]) for x, y in zip(a.input_logprobs[1:], b.input_logprobs[1:])) <= tol
        assert len({tuple(r.output_ids) for r in on[8:12]}) > 1  # seeded samples of one shared prompt diverge


def test_shared_prefill_spans_steps_but_not_weight_updates(tiny_kit):
    """A group member admitted a step later still shares the prompt while the group holds it; a control task (here a
    weight-version bump) ends that sharing; a retracted / finished request hands its references back."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    sched = _scheduler(tiny_kit[0], max_running=8, max_total_tokens=200)

    def req(n=6):
        return Req(PROMPTS[2], SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n}, 512))

    def step():
        sched._drain()
        with torch.inference_mode():
            sched._step()

    first = req()
    sched.submit(first)
    step()
    second = req()
    sched.submit(second)
    step()
    assert second.cached_tokens == len(PROMPTS[2]) and second.rows[: len(PROMPTS[2])] == first.rows[: len(PROMPTS[2])]
    sched.run_control(lambda: sched.state.bump_version())
    third = req()
    sched.submit(third)
    step()
    assert third.cached_tokens == 0 and not set(third.rows) & set(first.rows)
    assert sched.num_prefill_tokens == 2 * len(PROMPTS[2])
    while sched.running:
        step()
    assert first.output_ids == second.output_ids == third.output_ids
    assert sched.pool.num_free() + _cached_rows(sched) == 200 and not sched.row_refs and not sched.shared


def _step(sched):
    sched._drain()
    with torch.inference_mode():
        sched._step()


def _serve_one(sched, r):
    """r alone through the scheduler's steps (no thread), to its end."""
    sched.submit(r)
    while not r.finished:
        _step(sched)


def test_the_prefix_cache_serves_later_turns_and_branches_exactly(tiny_kit):
    """SGLang's radix cache: a finished request's computed rows stay, and a later request starting with the same
    tokens (an agent's next turn, a branch off the same prompt, a shorter shared start) prefills only the rest, up to
    all but its last token and no further than the input log-probs it asks for. Outputs, output and input log-probs
    and input top log-probs equal the same requests without the cache (--disable-radix-cache) within 1e-6; a control
    task (here a weight-version bump) empties it, and rows computed across one are never cached."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    P = PROMPTS[2]

    def req(ids, n=5, **kw):
        sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        return Req(ids, SamplingParams.from_dict(sp, 512), return_logprob=True, **kw)

    runs = {}
    for cache in (True, False):
        sched = _scheduler(tiny_kit[0], max_running=4, max_total_tokens=300, share_prefill=cache)
        first = req(P, 6)
        _serve_one(sched, first)
        turn = P + first.output_ids + [40, 41, 42]  # the next turn: the whole history, then new tokens
        later = [
            req(turn),
            req(P + [7, 8, 9]),  # a branch after the prompt
            req(P[:4] + [99, 98]),  # a shorter shared start
            req(turn, logprob_start_len=5),  # input log-probs from 5: nothing before it may be cached
            req(turn, logprob_start_len=12, top_logprobs_num=2, token_ids_logprob=[5, 300]),
        ]
        for r in later:
            _serve_one(sched, r)
            assert sched.pool.num_free() + _cached_rows(sched) == 300 and not sched.row_refs
        sched.run_control(lambda: sched.state.bump_version())  # noqa: B023
        after = req(P)
        _serve_one(sched, after)
        across = req(PROMPTS[0])  # admitted and prefilled, then a control task, then decoded to its end
        sched.submit(across)
        _step(sched)
        sched.run_control(lambda: sched.state.bump_version())  # noqa: B023
        while not across.finished:
            _step(sched)
        behind = req(PROMPTS[0])
        _serve_one(sched, behind)
        runs[cache] = ([first, *later, after, across, behind], sched.num_prefill_tokens)
        sched._flush_cache()
        assert sched.pool.num_free() == 300

    (on, on_prefill), (off, off_prefill) = runs[True], runs[False]
    cached = [r.cached_tokens for r in on]
    assert cached == [0, len(P) + 5, len(P), 4, 5, 12, 0, 0, 0]
    assert [r.cached_tokens for r in off] == [0] * 9 and off_prefill - on_prefill == sum(cached)
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-6
        if a.input_logprobs is not None:
            assert [e[1] for e in a.input_logprobs] == [e[1] for e in b.input_logprobs]
            assert max(abs(x[0] - y[0]) for x, y in zip(a.input_logprobs[1:], b.input_logprobs[1:])) <= 1e-6
    a, b = on[5], off[5]
    assert (
        a.input_top_logprobs[0] is None and len(a.input_top_logprobs) == len(b.input_top_logprobs) == len(P) + 9 - 12
    )
    for rows_a, rows_b in (
        (a.input_top_logprobs, b.input_top_logprobs),
        (a.input_token_ids_logprobs, b.input_token_ids_logprobs),
    ):
        for x, y in zip(rows_a[1:], rows_b[1:]):
            assert [e[1] for e in x] == [e[1] for e in y] and max(abs(e[0] - f[0]) for e, f in zip(x, y)) <= 1e-6


def test_the_prefix_cache_under_random_turns_branches_and_a_full_pool_serves_what_no_cache_serves(tiny_kit):
    """A seeded random workload through the scheduler with its prefix cache and without (--disable-radix-cache):
    requests arrive while others run, as new prompts, branches off earlier prompts, identical prompts and next turns
    of finished conversations (prompt + output + new tokens), some asking for input log-probs from a random position,
    on a pool so small that cached rows are evicted and requests retracted. Every request's output tokens and
    log-probs and input log-probs equal the cache-off run's within 1e-6; afterwards, the cache emptied, every pool row
    is free again and no holder is left."""
    import random

    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    POOL = 60  # rows: four running requests outgrow it
    plan_rng = random.Random(11)
    bases = [[plan_rng.randrange(3, 500) for _ in range(plan_rng.randint(4, 12))] for _ in range(3)]
    plan = []  # (kind, parent, extra tokens, max_new_tokens, logprob_start_len or None, arrival step or delay)
    for i in range(28):
        kind = plan_rng.choice(["new", "branch", "same", "turn"]) if i >= 3 else "new"
        parent = plan_rng.randrange(i) if kind != "new" else i % 3
        if kind == "turn" and plan[parent][0] == "turn" and plan[plan[parent][1]][0] == "turn":
            kind = "branch"  # at most two turns deep: every request fits the pool alone
        extra = [plan_rng.randrange(3, 500) for _ in range(plan_rng.randint(1, 4))]
        start = plan_rng.choice([None, None, plan_rng.randint(1, 6)])
        plan.append((kind, parent, extra, plan_rng.randint(2, 12), start, plan_rng.randint(0, 12)))

    def run(cache):
        sched = _scheduler(tiny_kit[0], max_running=4, max_total_tokens=POOL, share_prefill=cache)
        evicted = []
        evict = sched._evict
        sched._evict = lambda want: (evicted.append(want), evict(want))
        reqs, done_at, step = [None] * len(plan), {}, 0
        while len(done_at) < len(plan):
            assert step < 3000, "the scheduler did not finish the workload"
            for i, (kind, parent, extra, n, start, at) in enumerate(plan):
                if reqs[i] is not None:
                    continue
                if kind == "turn":  # the parent's whole conversation so far, then a new message
                    if parent not in done_at or step < done_at[parent] + at:
                        continue
                    ids = reqs[parent].input_ids + reqs[parent].output_ids + extra
                elif step < at or (kind != "new" and parent not in plan_ids):  # a branch waits for its parent
                    continue
                else:
                    src = bases[parent] if kind == "new" else plan_ids[parent]
                    ids = {"new": src, "same": src, "branch": src[: max(1, len(src) // 2)] + extra}[kind]
                sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, 512)
                start = None if start is None or start >= len(ids) else start
                reqs[i] = Req(ids, sp, return_logprob=True, logprob_start_len=-1 if start is None else start)
                plan_ids[i] = ids
                sched.submit(reqs[i])
            _step(sched)
            step += 1
            done_at.update({i: step for i, r in enumerate(reqs) if r is not None and r.finished and i not in done_at})
        sched._flush_cache()
        assert sched.pool.num_free() == POOL and not sched.row_refs and not sched.shared
        return reqs, evicted

    plan_ids = {}
    on, evicted = run(True)
    on_ids, plan_ids = plan_ids, {}
    off, _ = run(False)
    assert plan_ids == on_ids
    assert sum(r.cached_tokens for r in on) > 0 and evicted and sum(r.num_retractions for r in on + off) > 0
    for i, (a, b) in enumerate(zip(on, off)):
        assert a.output_ids == b.output_ids, i
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-6, i
        if a.input_logprobs is not None:
            assert [e[1] for e in a.input_logprobs] == [e[1] for e in b.input_logprobs], i
            assert (
                max((abs(x[0] - y[0]) for x, y in zip(a.input_logprobs[1:], b.input_logprobs[1:])), default=0) <= 1e-6
            )


def test_the_prefix_cache_gives_its_rows_back_before_anyone_is_retracted(tiny_kit, hf):
    """A pool too small for a cached request and a new long one: the decode evicts the cached rows (no request
    holds them) instead of failing or retracting, and the output is transformers' greedy decode."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    sched = _scheduler(tiny_kit[0], max_running=2, max_total_tokens=60)

    def req(ids, n):
        return Req(ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, 512))

    _serve_one(sched, req(PROMPTS[2], 30))
    assert _cached_rows(sched) == 40 and sched.pool.num_free() == 20
    long = req(PROMPTS[0], 40)
    _serve_one(sched, long)
    assert long.output_ids == hf_greedy(hf[0], PROMPTS[0], 40)[0] and long.num_retractions == 0
    # only what the decode needed went: the first request's output (a leaf of 29 rows), not its prompt (cached, as
    # SGLang's, once prefilled: a node of its own)
    assert _cached_rows(sched) == len(PROMPTS[2]) + len(PROMPTS[0]) + 39 and sched.pool.num_free() == 3


def test_a_running_requests_prompt_is_matched_by_later_requests(tiny_kit):
    """As SGLang's cache_unfinished_req: a request's prompt is cached once prefilled, so a request arriving while it
    still decodes starts from the prompt they share; both outputs equal the cache-off server's."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    def req(ids):
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
        return Req(ids, SamplingParams.from_dict(sp, 512), return_logprob=True)

    runs = {}
    for cache in (True, False):
        sched = _scheduler(tiny_kit[0], max_running=4, max_total_tokens=100, share_prefill=cache)
        first, second = req(PROMPTS[2] + [7, 8]), req(PROMPTS[2] + [50])
        sched.submit(first)
        _step(sched)
        _step(sched)
        sched.submit(second)
        while not (first.finished and second.finished):
            _step(sched)
        runs[cache] = (first, second)
        assert sched.pool.num_free() + _cached_rows(sched) == 100 and not sched.row_refs
    assert [r.cached_tokens for r in runs[True]] == [0, len(PROMPTS[2])]
    for a, b in zip(runs[True], runs[False]):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-6


def test_radix_cache_matches_splits_and_evicts_the_least_recently_used_unheld_leaf():
    """The tree by hand: rows per token, a split where a branch leaves an edge or a match ends inside one (as SGLang
    splits, so the unmatched rest can be evicted while the matched part is held), what insert says the cache already
    held, LRU eviction of leaves no one else holds, parents evicted once their last child goes."""
    from slime.backends.cpu_server.radix_cache import RadixCache

    c = RadixCache()
    assert c.insert((1, 2, 3, 4), [11, 12, 13, 14]) == 0
    assert c.insert((1, 2, 5), [11, 12, 25]) == 2  # the first two already held: the caller drops its holds on them
    assert c.insert((1, 2, 3, 4), [31, 32, 33, 34]) == 4 and c.num_rows == 5
    assert c.match((1, 2, 3, 9), 4) == [11, 12, 13]
    assert c.match((1, 2, 3, 4, 7), 3) == [11, 12, 13]  # no further than the limit
    assert c.match((1, 2, 5, 6), 4) == [11, 12, 25] and c.match((2,), 1) == []
    assert c.insert((7, 8), [41, 42]) == 0
    c.match((1, 2, 3, 4), 4)  # touched: leaves by last use are now (5,), (7, 8), (3, 4)
    assert c.evict(1, held=lambda row: False) == [25]
    assert c.evict(1, held=lambda row: row == 42) == [14]  # (7, 8) held: the next least recent leaf (split off (3,))
    assert c.evict(10, held=lambda row: row == 42) == [13, 11, 12]  # parents as they become leaves; (7, 8) held
    assert c.num_rows == 2 and sorted(c.reset()) == [41, 42] and c.match((7, 8), 2) == []
    c.insert((1, 2, 3, 4, 5), [51, 52, 53, 54, 55])
    held = c.match((1, 2, 3, 9), 4)  # a running request holds these three rows: the rest of the edge can still go
    assert held == [51, 52, 53] and c.evict(10, held=held.__contains__) == [54, 55] and c.num_rows == 3


def test_radix_cache_evicts_in_the_order_of_each_eviction_policy():
    """--radix-eviction-policy on the tree by hand: SGLang's hit counting (a node counts each request that inserts
    through it, not again for a second insert by the same request: `inserted`, its inserted_len) and its policies'
    orders, lru (last use), lfu (hits, then last use) and slru (fewer hits than protected_threshold first, each part
    by last use), every one different here; a node split by a diverging insert keeps its hits in its head."""
    from slime.backends.cpu_server.radix_cache import RadixCache, eviction_order

    def evictions(order):
        c = RadixCache(order)
        for tokens, inserted in [
            ((20, 21, 22), 0),
            ((20, 21, 22), 0),  # H = (20, 21, 22) (2)
            ((20, 21, 30), 0),  # split: K = (20, 21) (3), H' = (22,) (2), L = (30,) (1)
            ((1, 2, 3), 0),  # a request's prompt: node A (hits 1)
            ((1, 2, 3, 4, 5), 3),  # the same request at its end: B = (4, 5) (1); A not counted again
            ((1, 2, 3, 6), 0),  # another request: A (2), C = (6,) (1)
            ((1, 2, 3, 6, 7), 4),  # ... at its end: D = (7,) (1)
            ((9, 9), 0),  # E (1)
            ((9, 9, 8), 0),  # E (2), F = (8,) (1)
            ((9, 9, 8), 3),  # the same request again: only touched
            ((9, 9), 0),  # E (3)
            ((1, 2, 3, 6, 7, 5), 0),  # A (3), C (2), D (2), G = (5,) (1)
        ]:
            c.insert(tokens, [100 + t for t in tokens], inserted)
            if tokens == (20, 21, 30):
                c.match((20, 21, 22), 3)  # K and H' used after L
        c.match((1, 2, 3, 4, 5), 5)  # A and B used last
        out = []
        while c.num_rows:
            out.append(c.evict(1, held=lambda row: False))
        return out

    A, B, C, D, E, F, G = [101, 102, 103], [104, 105], [106], [107], [109, 109], [108], [105]
    K, H, L = [120, 121], [122], [130]
    assert evictions(eviction_order("lru")) == [L, H, K, F, E, G, D, C, B, A]
    assert evictions(eviction_order("lfu")) == [L, F, G, B, H, D, C, K, E, A]
    assert evictions(eviction_order("slru")) == [L, F, G, B, H, K, E, D, C, A]  # protected: 2 hits or more
    assert evictions(eviction_order("slru", {"protected_threshold": 3})) == [L, H, F, G, D, C, B, K, E, A]
    for policy, config, message in [
        ("tlru", None, "--radix-eviction-policy 'tlru': slime's CPU server evicts by lru, lfu, slru"),
        ("lfu", {"protected_threshold": 2}, "'protected_threshold' is no parameter of eviction policy 'lfu'"),
        ("slru", {"protected_threshold": "2"}, "'protected_threshold' must be an integer, not '2'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            eviction_order(policy, config)


def test_the_eviction_policy_decides_which_cached_prefix_a_full_pool_gives_up(tiny_kit):
    """Through the scheduler: prompt X served twice (its cached nodes hit twice), then prompt Y once; a long request
    then needs three rows more than the pool has free, evicted a leaf at a time. lru (and slru with protected_threshold
    3) gives up X, used longest ago (its output, the last token of X that its second request's match split off, the
    rest of X); lfu (and slru's default threshold, 2) gives up Y, hit once (its output, then Y): what a later X or Y
    finds cached."""
    from slime.backends.cpu_server.radix_cache import eviction_order
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    X, Y, Z = PROMPTS[2], PROMPTS[0], PROMPTS[1]

    def req(ids, n):
        return Req(ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, 512))

    kept = {}
    for name, policy, config in [
        ("lru", "lru", None),
        ("lfu", "lfu", None),
        ("slru", "slru", None),
        ("slru3", "slru", {"protected_threshold": 3}),
    ]:
        sched = _scheduler(
            tiny_kit[0], max_running=2, max_total_tokens=40, eviction_order=eviction_order(policy, config)
        )
        for ids in (X, X, Y):
            _serve_one(sched, req(ids, 2))
        assert _cached_rows(sched) == len(X) + 1 + len(Y) + 1 and sched.pool.num_free() == 20
        long = req(Z, 21)  # 3 prompt rows + 20 decoded: 3 more than free
        _serve_one(sched, long)
        assert long.num_retractions == 0
        cache = sched.caches[id(None)][1]
        kept[name] = [len(cache.match(ids, len(ids))) for ids in (X, Y)]
    whole = [len(X), len(Y)]
    assert kept == {"lru": [0, len(Y)], "lfu": [len(X), 0], "slru": [len(X), 0], "slru3": [0, len(Y)]}, whole


def test_generate_batch_reports_shared_prompt_as_cached_tokens(server):
    """Over HTTP: one /generate with a prompt 4 times prefills it once (SGLang's meta_info cached_tokens); the same
    prompt later starts from the cached rows (all but its last token, as SGLang matches) until /flush_cache."""
    prompt = PROMPTS[1]
    sp = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    flush(server)
    outs = gen(server, {"input_ids": [prompt] * 4, "return_logprob": True, "sampling_params": sp})
    again = gen(server, {"input_ids": prompt, "return_logprob": True, "sampling_params": sp})
    flush(server)
    alone = gen(server, {"input_ids": prompt, "return_logprob": True, "sampling_params": sp})
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) == 3 * len(prompt)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1 and alone["meta_info"]["cached_tokens"] == 0
    for o in outs + [again]:
        assert o["output_ids"] == alone["output_ids"]
        lps = [x[0] for x in o["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b[0]) for a, b in zip(lps, alone["meta_info"]["output_token_logprobs"])) <= 1e-6


def test_openai_usage_reports_cached_tokens_with_enable_cache_report(reporting_server):
    """SGLang's --enable-cache-report: usage.prompt_tokens_details.cached_tokens, each prompt counted by its first
    choice, in plain answers and a stream's last chunk; a chat chunk's usage carries its own choice's count, a
    completion chunk's none, as SGLang's. (Without the flag there are no details: test_openai_endpoints.)"""
    url = reporting_server
    flush(url)  # from a known state: the other test on this server asks the same prompts
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2}
    completion = {"model": "m", "prompt": ["hi", "ho there"], "max_tokens": 3, "n": 2}
    answers = [
        SESSION.post(url + path, json=body).json()["usage"]
        for path, body in [
            ("/v1/chat/completions", chat),
            ("/v1/chat/completions", chat),  # now cached: all of its prompt but the last token
            ("/v1/completions", completion),
            ("/v1/completions", completion),
        ]
    ]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat_chunks = _events(url, "/v1/chat/completions", {**chat, "stream_options": options})
    completion_chunks = _events(url, "/v1/completions", {**completion, "stream_options": options})
    p_chat, p_completion = answers[0]["prompt_tokens"], answers[2]["prompt_tokens"]
    details = [u["prompt_tokens_details"] for u in answers]
    assert details == [{"cached_tokens": n} for n in (0, p_chat - 1, 0, p_completion - 2)]
    *chunks, last = chat_chunks
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": p_chat - 1}
    # choice 0 took the cached rows; choice 1, a sample of the same prompt, shares choice 0's whole prefill
    counted = [c for c in chunks if "usage" in c]  # the text chunks (not the role's or the finish reasons')
    assert {(c["choices"][0]["index"], c["usage"]["prompt_tokens_details"]["cached_tokens"]) for c in counted} == {
        (0, p_chat - 1),
        (1, p_chat),
    }
    *chunks, last = completion_chunks
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": p_completion - 2}
    assert all(c["usage"]["prompt_tokens_details"] is None for c in chunks)


def test_meta_info_echoes_the_applied_sampling_params(server):
    """slime's addition to SGLang's meta_info: the sampling parameters the server applied, normalised as SGLang
    normalises them (SGLang itself echoes none)."""
    sp = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "presence_penalty": 0.5, "max_new_tokens": 3}
    echo = gen(server, {"input_ids": PROMPTS[1], "sampling_params": sp})["meta_info"]["sampling_params"]
    assert echo == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.5,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "logit_bias": False,
        "regex": False,
        "json_schema": False,
        "ebnf": False,
        "structural_tag": False,
        "custom_logit_processor": False,
    }
    # greedy is temperature 1 at top_k 1 (SGLang's normalisation); a logit_bias is reported as set
    sp = {"temperature": 0, "max_new_tokens": 2, "logit_bias": {"5": 1.0}}
    echo = gen(server, {"input_ids": PROMPTS[1], "sampling_params": sp})["meta_info"]["sampling_params"]
    assert (echo["temperature"], echo["top_k"], echo["logit_bias"]) == (1.0, 1, True)


def test_weight_version_spans_record_a_change_mid_generation(tiny_kit):
    """Issue #37, engine side: as SGLang 0.5.23's scheduler, a label change records, for every live request that has
    output, where the old label's tokens end; a finished request's spans ({version, start, end} over its output,
    end exclusive) then say which label each token was decoded under. A request without output yet when the label
    changes is wholly the new label's."""
    from slime.backends.cpu_server.sampling import SamplingParams
    from slime.backends.cpu_server.scheduler import Req

    sched = _scheduler(tiny_kit[0], max_running=1, max_total_tokens=200)

    def step():
        sched._drain()
        with torch.inference_mode():
            sched._step()

    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    first, second = (Req(PROMPTS[i], SamplingParams.from_dict(sp, 512)) for i in (0, 1))
    sched.submit(first)
    sched.submit(second)  # waits: one running slot
    for _ in range(3):
        step()
    k = len(first.output_ids)
    assert 0 < k < 8 and not second.output_ids
    sched.run_control(lambda: sched.state.bump_version("5"))
    while first.finish_reason is None or second.finish_reason is None:
        step()
    assert first.weight_versions == [
        {"version": "default", "start": 0, "end": k},
        {"version": "5", "start": k, "end": 8},
    ]
    assert first.weight_version == "5" and second.weight_versions == [{"version": "5", "start": 0, "end": 8}]


def test_generate_reports_weight_version_spans_across_an_update(own_server):
    """Over HTTP, SGLang 0.5.23's format: a request paused in place across /update_weight_version reports
    `meta_info.weight_versions` spans of both labels, contiguous over its output, and `weight_version` the last."""
    server, result = own_server, {}
    payload = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 490, "ignore_eos": True}}
    t = threading.Thread(target=lambda: result.update(gen(server, payload)))
    t.start()
    deadline = time.time() + 30
    while SESSION.get(server + "/get_load").json()[0]["num_reqs"] == 0:
        assert time.time() < deadline, "the long request never started running"
        time.sleep(0.01)
    assert SESSION.post(server + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    r = SESSION.post(server + "/update_weight_version", json={"new_version": "3"})
    assert r.status_code == 200 and r.json()["new_version"] == "3"
    assert SESSION.post(server + "/continue_generation", json={}).status_code == 200
    t.join(60)
    meta = result["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "3"] and meta["weight_version"] == "3"
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < spans[1]["end"] == 490
    assert meta["completion_tokens"] == 490


# ------------------------------------------------------------------ the fingerprint is hashed off the scheduler thread
class _GatedHash:
    """`hash_named` for the server's fingerprint that hashes one tensor, then waits for `go` (the rest of a slow hash
    is still to come): `started` is set once it waits."""

    def __init__(self):
        from slime.utils.fingerprint import hash_named

        self.real, self.started, self.go = hash_named, threading.Event(), threading.Event()

    def __call__(self, pairs, out=None, algorithm="tiles32"):
        out = {}
        for i, (name, t) in enumerate(pairs):
            if i == 1:
                self.started.set()
                assert self.go.wait(120), "the test never let the hash go on"
            self.real([(name, t)], out, algorithm)
        return out


def _in_process(tiny_kit, monkeypatch, scenario):
    """Run `scenario(client, server, gate)` against an in-process CPU server whose fingerprint hash is gated."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from slime.backends.cpu_server import fingerprint
    from slime.backends.cpu_server.__main__ import build_parser
    from slime.backends.cpu_server.server import CPUInferenceServer

    gate = _GatedHash()
    monkeypatch.setattr(fingerprint, "hash_named", gate)
    server = CPUInferenceServer(build_parser().parse_args(["--model-path", tiny_kit[0], "--weight-version", "1"]))

    async def run():
        async with TestClient(TestServer(server.make_app())) as client:
            try:
                await scenario(client, server, gate)
            finally:
                gate.go.set()  # never leave the hash (and, before the fix, the scheduler) blocked

    asyncio.run(run())


def _served_hashes(server, algorithm="xxh3"):
    from slime.utils.fingerprint import hash_named

    w = server.weights
    return hash_named(((n, t.to(w.sent_dtypes[n])) for n, t in w.named.items() if n in w.sent_dtypes), None, algorithm)


async def _push(client, named, version):
    """One update session of `/update_weights_from_tensor` carrying `named` [(HF name, tensor)] (shared memory)."""
    set_shared_authkey()
    payload = MultiprocessingSerializer.serialize(named, output_str=True)
    assert (await client.post("/begin_weight_update", json={})).status == 200
    r = await client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [payload], "weight_version": version}
    )
    assert r.status == 200, await r.text()
    assert (await client.post("/end_weight_update", json={})).status == 200


async def _fingerprint(client):
    r = await client.get("/slime/weights_fingerprint", params={"algorithm": "xxh3"})
    assert r.status == 200, await r.text()
    return await r.json()


async def _asked_once(client, server, gate):
    """The check asked for a fingerprint once (from then on updates record what they write); later hashes wait at
    the gate. Returns new values for two served tensors."""
    gate.go.set()
    await _fingerprint(client)
    gate.go.clear()
    gate.started.clear()  # set by that first, whole hash
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    return [(n, torch.randn(server.weights.named[n].shape)) for n in names]


def test_generation_goes_on_while_a_fingerprint_is_hashed(tiny_kit, monkeypatch):
    """The hash runs in a worker thread, not on the scheduler's: a generation sent while a (slow) fingerprint is
    being computed completes before it; the fingerprint is then the served weights'."""
    import asyncio

    async def scenario(client, server, gate):
        want = _served_hashes(server)
        fp = asyncio.ensure_future(client.get("/slime/weights_fingerprint", params={"algorithm": "xxh3"}))
        assert await asyncio.to_thread(gate.started.wait, 60), "the fingerprint never started hashing"
        body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
        try:
            r = await asyncio.wait_for(client.post("/generate", json=body), 30)
        except asyncio.TimeoutError:
            pytest.fail("no generation while the fingerprint was hashed (the hash blocks the scheduler)")
        assert r.status == 200 and len((await r.json())["output_ids"]) == 3
        assert not fp.done()
        gate.go.set()
        info = await (await fp).json()
        assert info["tensor_hashes"] == want and info["weight_version"] == "1"

    _in_process(tiny_kit, monkeypatch, scenario)


def test_a_weight_change_waits_for_the_fingerprint_being_hashed(tiny_kit, monkeypatch):
    """Updates copy into the served tensors in place: a change of the weights (here `/weights_checker
    reset_tensors`) and of their version label sent while a fingerprint is hashed wait for it, so the report
    describes one state (the weights and version before), and the next one the state after."""
    import asyncio

    async def scenario(client, server, gate):
        before = _served_hashes(server)
        fp = asyncio.ensure_future(client.get("/slime/weights_fingerprint", params={"algorithm": "xxh3"}))
        assert await asyncio.to_thread(gate.started.wait, 60), "the fingerprint never started hashing"
        reset = asyncio.ensure_future(client.post("/weights_checker", json={"action": "reset_tensors"}))
        version = asyncio.ensure_future(client.post("/update_weight_version", json={"new_version": "2"}))
        await asyncio.sleep(1.0)
        assert not reset.done() and not version.done()  # held until the hash is done
        gate.go.set()
        info = await (await fp).json()
        assert info["weight_version"] == "1" and info["tensor_hashes"] == before
        assert (await reset).status == 200 and (await version).status == 200
        after = await _fingerprint(client)
        assert after["weight_version"] == "2" and after["tensor_hashes"] == _served_hashes(server) != before

    _in_process(tiny_kit, monkeypatch, scenario)


def test_a_push_is_hashed_as_it_lands_and_any_other_write_is_still_caught(tiny_kit, monkeypatch):
    """Once the check has asked for a fingerprint, an update records the tensors it writes, to be hashed (read back
    from the served tensors) when asked: the map is the new weights' at once, only what changed is hashed again. A write that is not an update
    (`reset_tensors`, here between two pushes) leaves the cached map behind: the next report hashes what is served."""
    from slime.utils.fingerprint import hash_named

    async def scenario(client, server, gate):
        gate.go.set()
        w, fp = server.weights, server.served_fingerprint
        name, other = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"
        assert (await _fingerprint(client))["tensor_hashes"] == _served_hashes(server)
        new = torch.randn(w.named[name].shape)
        await _push(client, [(name, new)], "2")
        assert fp._cached[:2] == (w.generation, "xxh3")  # the map moved with the update
        info = await _fingerprint(client)
        assert info["weight_version"] == "2" and info["tensor_hashes"] == _served_hashes(server)
        assert info["tensor_hashes"][name] == hash_named([(name, new)], None, "xxh3")[name]
        assert (await client.post("/weights_checker", json={"action": "reset_tensors"})).status == 200
        # in bf16 this time: hashed in the dtype it arrived in, as the trainer hashes it
        bf16 = torch.randn(w.named[other].shape).to(torch.bfloat16)
        await _push(client, [(other, bf16)], "3")
        after = (await _fingerprint(client))["tensor_hashes"]
        assert after[other] == hash_named([(other, bf16)], None, "xxh3")[other]
        # every tensor the reset scrambled is reported as served, not as hashed before the reset
        assert after == _served_hashes(server) and after[name] != info["tensor_hashes"][name]

    _in_process(tiny_kit, monkeypatch, scenario)


def test_a_weight_change_waits_for_the_hash_of_an_update_that_landed(tiny_kit, monkeypatch):
    """The update answers before its tensors are hashed (a worker thread reads them back once asked); a weight change
    sent meanwhile (here `reset_tensors`) starts that hash and waits for it, which must not read bytes being
    overwritten."""
    import asyncio

    async def scenario(client, server, gate):
        named = await _asked_once(client, server, gate)
        await asyncio.wait_for(_push(client, named, "2"), 60)  # answered before its tensors are hashed
        reset = asyncio.ensure_future(client.post("/weights_checker", json={"action": "reset_tensors"}))
        assert await asyncio.to_thread(gate.started.wait, 60), "the weight change did not start the update's hash"
        await asyncio.sleep(1.0)
        assert not reset.done()  # held until the hash is done
        gate.go.set()
        assert (await reset).status == 200
        assert (await _fingerprint(client))["tensor_hashes"] == _served_hashes(server)

    _in_process(tiny_kit, monkeypatch, scenario)


def test_the_hash_of_an_update_starts_only_when_something_waits_for_it(tiny_kit, monkeypatch):
    """The tensors an update wrote are hashed after the update, never beside its copies nor the trainer's end of
    the push: not during the session, not when it ends, but when the check asks for the fingerprint."""
    import asyncio

    async def scenario(client, server, gate):
        set_shared_authkey()
        payload = MultiprocessingSerializer.serialize(await _asked_once(client, server, gate), output_str=True)
        assert (await client.post("/begin_weight_update", json={})).status == 200
        r = await client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload]})
        assert r.status == 200, await r.text()
        assert not await asyncio.to_thread(gate.started.wait, 1.0), "hashed while the session was still open"
        assert (await client.post("/end_weight_update", json={})).status == 200
        assert not await asyncio.to_thread(gate.started.wait, 1.0), "hashed beside the end of the push"
        fingerprint = asyncio.ensure_future(_fingerprint(client))
        assert await asyncio.to_thread(gate.started.wait, 60), "asked for, the update's hash never started"
        gate.go.set()
        assert (await fingerprint)["tensor_hashes"] == _served_hashes(server)

    _in_process(tiny_kit, monkeypatch, scenario)


def test_a_write_under_one_name_hashes_again_every_name_sharing_its_bytes():
    """Served names can alias (the transformers fallback's per-expert views of fused experts, a vision-language
    model's two names of one tensor): a write under one name makes every tensor sharing those bytes hashed again,
    and only those."""
    from types import SimpleNamespace

    from slime.backends.cpu_server.fingerprint import ServedFingerprint

    fused, tied = torch.zeros(2, 4, 3), torch.zeros(5)
    named = {"experts": fused, "e0": fused[0], "e1": fused[1], "a.w": tied, "b.w": tied, "c.w": torch.zeros(5)}
    sent = {n: torch.float32 for n in named if n != "experts"}  # the fused tensor never arrives by name
    store = SimpleNamespace(released=False, generation=0, named=named, sent_dtypes=sent)
    fp = ServedFingerprint(lambda: store)
    calls = []

    def write(*names):
        landed = fp.landing(store.generation)
        store.generation += 1
        for n in names:
            named[n].add_(1)
        landed(names)
        calls.append(sorted(n for n, h in fp.snapshot("xxh3").items() if not isinstance(h, str)))
        fresh = ServedFingerprint(lambda: store)
        assert fp.hashes(fp.snapshot("xxh3")) == fresh.hashes(fresh.snapshot("xxh3"))

    fp.hashes(fp.snapshot("xxh3"))
    write("experts")
    write("a.w")
    write("e1")
    assert calls == [["e0", "e1"], ["a.w", "b.w"], ["e1"]]
