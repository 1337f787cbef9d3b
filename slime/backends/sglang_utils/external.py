"""Inference engines slime did not start (`--rollout-external-engine-addrs host:port ...`).

Someone else owns their lifecycle: slime reads each one's shape from its server info, checks that it serves the
run's model, registers it with the run's router and pushes weights to it (broadcast or disk), but never starts,
stops or restarts it. The checks here run once, at start-up (`check_external_engines` in parse_args), so a wrong
address or model fails the job in one line before anything is placed. The on-policy distillation teacher server
(`--use-opd --opd-type sglang`, `--rm-url`) is checked here the same way (`check_opd_teacher`).
"""

import os
from urllib.parse import urlparse

import requests

SERVER_INFO_ENDPOINTS = ("/server_info", "/get_server_info")  # SGLang's newer name first, then the older one


def normalize_external_engine_addr(addr: str) -> str:
    """`host:port` or `http://host:port` -> `http://host:port`; ValueError naming the address otherwise."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/")
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "http" or not parsed.hostname or port is None or parsed.path:
        raise ValueError(f"{addr!r} is not host:port (or http://host:port; IPv6 hosts in brackets)")
    return url


def get_server_info(url: str, api_key=None, timeout: float = 30.0) -> dict:
    """The engine's server info (SGLang's ServerArgs plus runtime state); RuntimeError saying what each endpoint
    answered when neither does."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    session = requests.Session()
    session.trust_env = False  # an engine address is reached directly, never through a proxy from the environment
    errors = []
    for endpoint in SERVER_INFO_ENDPOINTS:
        try:
            resp = session.get(url + endpoint, timeout=timeout, headers=headers)
        except requests.RequestException as e:
            errors.append(f"{endpoint}: {type(e).__name__}")
            continue
        if resp.status_code != 200:
            errors.append(f"{endpoint}: HTTP {resp.status_code}")
            continue
        try:
            info = resp.json()
        except ValueError:
            info = None
        if isinstance(info, dict):
            return info
        errors.append(f"{endpoint}: not a JSON object")
    raise RuntimeError(f"does not answer as an inference server ({'; '.join(errors)})")


def engine_shape(info: dict) -> dict:
    """tp/pp/dp/ep sizes, GPUs and worker type of an engine, from its server info (absent fields: 1, regular)."""

    def size(*keys):
        for k in keys:
            if info.get(k):
                return int(info[k])
        return 1

    tp, pp = size("tp_size", "tensor_parallel_size"), size("pp_size", "pipeline_parallel_size")
    mode = info.get("disaggregation_mode")
    return {
        "tp_size": tp,
        "pp_size": pp,
        "dp_size": size("dp_size", "data_parallel_size"),
        "ep_size": size("ep_size", "expert_parallel_size"),
        "num_gpus": int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp * pp),
        "worker_type": "encoder" if info.get("encoder_only") else mode if mode in ("prefill", "decode") else "regular",
        # SGLang's LoRA serving (--lora-sync adapter needs it); --lora-paths alone enables it too
        "lora": {
            "enable_lora": bool(info.get("enable_lora") or info.get("lora_paths")),
            "max_lora_rank": info.get("max_lora_rank"),
        },
    }


def same_model(served: str, hf_checkpoint: str) -> bool:
    """Does an engine whose model path is `served` serve `hf_checkpoint`? The same path (as given, or resolved on this
    host), or, where the engine's host mounts the model elsewhere or names it by hub id, the same model directory
    name (`/models/Qwen3-4B` serves `/data/Qwen3-4B` and `Qwen/Qwen3-4B`)."""
    a, b = served.rstrip("/"), hf_checkpoint.rstrip("/")
    if a == b or os.path.realpath(a) == os.path.realpath(b):
        return True
    return bool(os.path.basename(a)) and os.path.basename(a) == os.path.basename(b)


def discover_external_engines(addrs, hf_checkpoint, api_key=None, timeout: float = 30.0) -> list:
    """One record per address: {url, host, port, model_path, tp_size, pp_size, dp_size, ep_size, num_gpus, worker_type}.
    ValueError naming the address for one that is malformed, does not answer, serves another model, or is a
    prefill/decode/encoder worker."""
    infos = []
    for addr in addrs:
        url = normalize_external_engine_addr(addr)
        try:
            info = get_server_info(url, api_key, timeout)
        except RuntimeError as e:
            raise ValueError(f"{addr}: {e}") from None
        shape = engine_shape(info)
        if shape["worker_type"] != "regular":
            raise ValueError(
                f"{addr} is a {shape['worker_type']} worker: slime drives regular engines only (each serves both "
                "prefill and decode)"
            )
        served = info.get("model_path")
        if not served or not same_model(str(served), hf_checkpoint):
            raise ValueError(
                f"{addr} serves model {served!r}, not --hf-checkpoint {hf_checkpoint}: point it at an engine "
                "serving the run's model"
            )
        if url in (i["url"] for i in infos):
            raise ValueError(f"{addr} is given twice")
        parsed = urlparse(url)
        infos.append({"url": url, "host": parsed.hostname, "port": parsed.port, "model_path": served, **shape})
    return infos


def tokenizer_vocab(path):
    from transformers import AutoTokenizer  # heavy, and only when a teacher is checked

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True).get_vocab()


def _probe_ids(tok) -> list:
    """Token ids that show a vocabulary: 192 spread over the whole of it, the special ones and the last 16 (added
    tokens live at the end, where two vocabularies of one family differ first)."""
    n = len(tok)
    spread = {i * n // 192 for i in range(192)}
    return sorted(spread | set(tok.all_special_ids) | set(range(max(0, n - 16), n)))


def probe_teacher_vocab(rm_url: str, teacher_tok, hf_checkpoint: str, timeout: float = 30.0) -> bool:
    """Ask the teacher's own /generate (`rm_url`) to decode probe ids of the student's vocabulary (SGLang's
    `return_text_in_logprobs`, prefill only) and compare each token's text with the student tokenizer's.
    ValueError naming the URL and both vocabularies on a difference (or when the teacher refuses an id of the
    student's vocabulary), or naming the URL when the prefill fails; True when they agree, False when the server
    gave no token texts to compare."""
    from transformers import AutoTokenizer  # heavy, and only when a teacher is checked

    tok = AutoTokenizer.from_pretrained(hf_checkpoint, trust_remote_code=True)
    ids = _probe_ids(tok)
    payload = {
        "input_ids": ids,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_text_in_logprobs": True,
    }
    session = requests.Session()
    session.trust_env = False
    theirs = f"the OPD teacher's vocabulary ({teacher_tok or 'tokenizer unknown'}, as the server reports it)"
    ours = f"the student's (--hf-checkpoint {hf_checkpoint}, {len(tok)} tokens)"
    try:
        resp = session.post(rm_url, json=payload, timeout=timeout)
    except requests.RequestException as e:
        raise ValueError(
            f"--rm-url {rm_url}: the OPD teacher does not answer a prefill ({type(e).__name__})"
        ) from None
    if resp.status_code == 400:  # e.g. an id outside the teacher's vocabulary
        reason = " ".join(resp.text.split())[:200]
        raise ValueError(
            f"--rm-url {rm_url}: {theirs} differs from {ours}: the teacher refuses the student's token ids "
            f"({reason}); OPD needs one tokenizer for both"
        )
    if resp.status_code != 200:  # the rollout's scoring requests are prefills like this one: they would fail too
        reason = " ".join(resp.text.split())[:200]
        raise ValueError(
            f"--rm-url {rm_url}: the OPD teacher answers a prefill with HTTP {resp.status_code} ({reason})"
        )
    try:
        entries = resp.json()["meta_info"]["input_token_logprobs"]
    except (ValueError, KeyError, TypeError):
        return False
    if len(entries) != len(ids) or any(len(e) < 3 or e[2] is None for e in entries):
        return False
    for i, entry in zip(ids, entries):
        # single-token texts; whitespace is not compared (tokenizer configs may clean up spaces differently)
        mine, their = tok.decode([i]), entry[2]
        if entry[1] != i or mine.strip() != str(their).strip():
            raise ValueError(
                f"--rm-url {rm_url}: {theirs} differs from {ours}: token id {i} is {their!r} to the teacher and "
                f"{mine!r} to the student; OPD needs one tokenizer for both"
            )
    return True


def check_opd_teacher(rm_url: str, hf_checkpoint: str | None, timeout: float = 30.0) -> str | None:
    """ValueError when the teacher behind `rm_url` does not answer, or its vocabulary differs from
    `hf_checkpoint`'s: probed over HTTP (`probe_teacher_vocab`), so also a teacher on another host, and compared
    whole when its tokenizer is readable on this host. Returns a warning line when neither is possible (a server
    that returns no token texts, on another host), else None."""
    parsed = urlparse(rm_url)
    if not parsed.scheme or not parsed.netloc:
        raise ValueError(f"--rm-url {rm_url}: not an http(s) URL of the OPD teacher's /generate")
    base = f"{parsed.scheme}://{parsed.netloc}"
    try:
        info = get_server_info(base, timeout=timeout)
    except RuntimeError as e:
        raise ValueError(f"--rm-url {rm_url}: the OPD teacher {e}") from None
    teacher_tok = info.get("tokenizer_path") or info.get("model_path")
    probed = bool(hf_checkpoint) and probe_teacher_vocab(rm_url, teacher_tok, hf_checkpoint, timeout)
    if probed and (not teacher_tok or not os.path.isdir(str(teacher_tok))):
        return None
    if not hf_checkpoint or not teacher_tok or not os.path.isdir(str(teacher_tok)):
        return (
            f"--rm-url {rm_url}: cannot read the OPD teacher's tokenizer {teacher_tok!r} here; make sure it is "
            "the student's (the teacher scores the student's token ids as they are)"
        )
    if os.path.realpath(teacher_tok) == os.path.realpath(hf_checkpoint):
        return None
    if tokenizer_vocab(teacher_tok) != tokenizer_vocab(hf_checkpoint):
        raise ValueError(
            f"--rm-url {rm_url}: the OPD teacher's tokenizer ({teacher_tok}) differs from the student's "
            f"(--hf-checkpoint {hf_checkpoint}); OPD needs one tokenizer for both"
        )
    return None
