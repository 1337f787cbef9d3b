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


def check_opd_teacher(rm_url: str, hf_checkpoint: str | None, timeout: float = 30.0) -> str | None:
    """ValueError when the teacher behind `rm_url` does not answer, or serves a tokenizer (readable on this host)
    whose vocabulary differs from `hf_checkpoint`'s. Returns a warning line when the tokenizer cannot be compared
    here (the teacher's tokenizer lives on another host), else None."""
    parsed = urlparse(rm_url)
    if not parsed.scheme or not parsed.netloc:
        raise ValueError(f"--rm-url {rm_url}: not an http(s) URL of the OPD teacher's /generate")
    base = f"{parsed.scheme}://{parsed.netloc}"
    try:
        info = get_server_info(base, timeout=timeout)
    except RuntimeError as e:
        raise ValueError(f"--rm-url {rm_url}: the OPD teacher {e}") from None
    teacher_tok = info.get("tokenizer_path") or info.get("model_path")
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
