"""Regenerate `slime/backends/sglang_utils/sglang_contract.json`: SGLang's HTTP contract for the endpoints slime calls.

For every route slime (or its CPU server) uses it records, from SGLang's own source: the HTTP methods, the auth level
(`@auth_level(...)`), the request class behind the body with the name, type, default and required-ness of every
field (inherited ones included), and the keys of the JSON the handler answers with. It also records the schema
classes of `/generate` (request, sampling params, response, meta info, finish reasons), the model/server info
responses, the weights-checker payload and the memory tags. Tests check every body slime sends against it strictly
(`slime.backends.sglang_utils.contract`), and slime's CPU server refuses what it does not allow.

    python tools/gen_sglang_contract.py [--version 0.5.23] [--work-dir /tmp/sgl-gen] [--src DIR] [--out FILE]

The source is read, not imported (the request classes pull in CUDA-only packages): the wheel is fetched with
`pip download --no-deps` and unpacked, or `--src` names an installed `site-packages` (the one holding `sglang/`).
"""

import argparse
import ast
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.gen_sglang_server_args import fetch_source  # noqa: E402  (run as a script from the repo root)

OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "slime",
    "backends",
    "sglang_utils",
    "sglang_contract.json",
)

# The routes slime's engine, rollout, router and CPU server use (the OpenAI routes are not part of this contract).
ROUTES = (
    "/generate",
    "/abort_request",
    "/health",
    "/health_generate",
    "/flush_cache",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weight_version",
    "/get_weights_by_name",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/weights_checker",
    "/pause_generation",
    "/continue_generation",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
)
# Classes of the wire schema (`sglang/api/v1/api_types.py`) and of io_struct that describe what slime reads.
API_TYPES = (
    "GenerateRequest",
    "SamplingParams",
    "GenerateResponse",
    "GenerateMetaInfo",
    "FinishStop",
    "FinishLength",
    "FinishAbort",
    "GetModelInfoResponse",
    "GetServerInfoResponse",
)
IO_STRUCT_EXTRA = ("ChecksumInfo", "ParallelismInfo")


def _classes(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}, tree


def _default(node):
    if node is None:
        return None
    try:
        return {"value": ast.literal_eval(node)}
    except ValueError:
        text = ast.unparse(node)
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("field"):
            for kw in node.keywords:  # dataclasses.field(default=...) / msgspec.field(default=...)
                if kw.arg == "default":
                    return _default(kw.value)
        return {"expr": text}


def class_fields(classes, name):
    """name -> {type, required, default} of a dataclass / msgspec.Struct, base classes of the same module first."""
    cls = classes[name]
    fields = {}
    for base in cls.bases:
        base_name = ast.unparse(base)
        if base_name in classes:
            fields.update(class_fields(classes, base_name))
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = ast.unparse(stmt.annotation)
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        entry = {"type": annotation, "required": stmt.value is None}
        if stmt.value is not None:
            entry["default"] = _default(stmt.value)
        fields[stmt.target.id] = entry
    return fields


def _route_decorators(func):
    """[(path, methods)] and the auth level of a FastAPI handler, from its decorators."""
    routes, auth = [], "normal"
    for dec in func.decorator_list:
        if not isinstance(dec, ast.Call):
            continue
        target = ast.unparse(dec.func)
        if target == "auth_level":
            auth = ast.unparse(dec.args[0]).split(".")[-1].lower()
        elif target.endswith((".api_route", ".get", ".post", ".put")) and dec.args:
            try:
                path = ast.literal_eval(dec.args[0])
            except ValueError:
                continue
            methods = [target.rsplit(".", 1)[1].upper()]
            for kw in dec.keywords:
                if kw.arg == "methods":
                    methods = ast.literal_eval(kw.value)
            routes.append((path, sorted(methods)))
    return routes, auth


def _request_class(func, known):
    """The io_struct class FastAPI parses the body into (`obj: Annotated[Optional[X], Body()]`, `obj: X`)."""
    for arg in func.args.args:
        if arg.annotation is None:
            continue
        names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
        hits = sorted(names & known)
        if hits:
            return hits[0]
    return None


def _query_params(func):
    """Query parameters of a handler (`timeout: float = Query(...)`)."""
    out = {}
    defaults = func.args.defaults
    offset = len(func.args.args) - len(defaults)
    for i, arg in enumerate(func.args.args):
        d = defaults[i - offset] if i >= offset else None
        if d is not None and isinstance(d, ast.Call) and ast.unparse(d.func) == "Query":
            out[arg.arg] = ast.unparse(arg.annotation) if arg.annotation is not None else "Any"
    return out


def _response_keys(func):
    """String keys of the dict literals the handler builds and of `body["key"] = ...` it sets."""
    keys = []
    for node in ast.walk(func):
        if isinstance(node, ast.Dict):
            keys += [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.slice, ast.Constant)
                    and isinstance(t.slice.value, str)
                ):
                    keys.append(t.slice.value)
    return sorted(set(keys))


def record(src):
    srt = os.path.join(src, "sglang", "srt")
    io_classes, _ = _classes(os.path.join(srt, "managers", "io_struct.py"))
    _, http_tree = _classes(os.path.join(srt, "entrypoints", "http_server.py"))
    api_classes, _ = _classes(os.path.join(src, "sglang", "api", "v1", "api_types.py"))
    routes, requests = {}, {}
    for func in ast.walk(http_tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, auth = _route_decorators(func)
        for path, methods in paths:
            if path not in ROUTES:
                continue
            req = _request_class(func, set(io_classes))
            entry = routes.setdefault(path, {"methods": [], "auth": auth, "handler": func.name})
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
            if req:
                entry["request"] = req
                requests[req] = class_fields(io_classes, req)
            if q := _query_params(func):
                entry["query"] = q
            if keys := _response_keys(func):
                entry["response_keys"] = keys
    missing = sorted(set(ROUTES) - set(routes))
    if missing:
        raise SystemExit(f"routes not found in SGLang's http_server.py: {missing}")
    for name in IO_STRUCT_EXTRA:
        requests[name] = class_fields(io_classes, name)
    schemas = {name: class_fields(api_classes, name) for name in API_TYPES}
    tags = {}
    with open(os.path.join(srt, "constants.py")) as f:
        for node in ast.parse(f.read()).body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id.startswith("GPU_MEMORY_TYPE_")
            ):
                tags[node.targets[0].id] = ast.literal_eval(node.value)
    return {
        "routes": dict(sorted(routes.items())),
        "classes": dict(sorted(requests.items())),
        "schemas": schemas,
        "memory_tags": sorted(tags.values()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.5.23")
    ap.add_argument("--work-dir", default="/tmp/sgl-gen")
    ap.add_argument("--src", default=None, help="a directory holding sglang/ (an installed site-packages)")
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    src = a.src or fetch_source(a.version, a.work_dir)
    contract = {"sglang_version": a.version, "generated_by": "tools/gen_sglang_contract.py", **record(src)}
    with open(a.out, "w") as f:
        json.dump(contract, f, indent=1)
        f.write("\n")
    print(f"wrote the contract of {len(contract['routes'])} routes (sglang {a.version}) to {a.out}")


if __name__ == "__main__":
    main()
