"""SGLang's HTTP contract (`sglang_contract.json`, generated from SGLang's source by `tools/gen_sglang_contract.py`)
and a strict check of request bodies against it.

SGLang itself ignores unknown body fields, so a misspelt field slime sends would be dropped silently on a GPU.
`body_errors` reports it instead (and missing required fields, and values of the wrong JSON type); slime's CPU server
refuses such bodies with 400, and the tests check every body the GPU code path sends.
"""

import ast
import functools
import json
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_contract.json")


@functools.lru_cache(None)
def load_contract() -> dict:
    with open(_PATH) as f:
        return json.load(f)


def route(path: str) -> dict | None:
    return load_contract()["routes"].get(path)


def request_fields(path: str) -> dict | None:
    """name -> {type, required, default} of the request class behind `path` (None: the route takes no body)."""
    r = route(path)
    if r is None or "request" not in r:
        return None
    return load_contract()["classes"][r["request"]]


_SIMPLE = {
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "List": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "Dict": lambda v: isinstance(v, dict),
    "tuple": lambda v: isinstance(v, list),
    "Tuple": lambda v: isinstance(v, list),
}
_ANYTHING = lambda v: True  # noqa: E731
# The exact types a parsed JSON scalar of each simple annotation may have (bool is not an int here).
_JSON_TYPES = {"str": {str}, "bytes": {str}, "bool": {bool}, "int": {int}, "float": {int, float}}


def _compile(node):
    """A predicate: whether a JSON value fits a Python annotation (as SGLang's pydantic/msgspec decoding would take
    it). Built once per annotation, since the CPU server checks every request body it serves. Names the contract does
    not define (SGLang's own aliases and classes) accept anything."""
    if isinstance(node, ast.Constant) and node.value is None:
        return lambda v: v is None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _any_of([_compile(node.left), _compile(node.right)])
    if isinstance(node, ast.Attribute):
        node = ast.Name(node.attr)
    if isinstance(node, ast.Name):
        return _SIMPLE.get(node.id, _ANYTHING)
    if not isinstance(node, ast.Subscript):
        return _ANYTHING
    head = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
    args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if head == "Optional":
        inner = _compile(args[0])
        return lambda v: v is None or inner(v)
    if head == "Union":
        return _any_of([_compile(a) for a in args])
    if head == "Annotated":
        return _compile(args[0])
    if head == "Literal":
        allowed = [ast.literal_eval(a) for a in args]
        return lambda v: v in allowed
    if head in ("List", "list", "Sequence"):
        if isinstance(args[0], ast.Name) and args[0].id in _JSON_TYPES:  # token ids: checked at C speed
            allowed = _JSON_TYPES[args[0].id]
            return lambda v: isinstance(v, list) and allowed.issuperset(map(type, v))
        item = _compile(args[0])
        return lambda v: isinstance(v, list) and all(map(item, v))
    if head in ("Dict", "dict"):
        item = _compile(args[-1])
        return lambda v: isinstance(v, dict) and all(map(item, v.values()))
    if head in ("Tuple", "tuple"):
        return _SIMPLE["list"]
    return _ANYTHING


def _any_of(predicates):
    return lambda v: any(p(v) for p in predicates)


@functools.lru_cache(None)
def _predicate(annotation: str):
    return _compile(ast.parse(annotation, mode="eval").body)


def type_ok(value, annotation: str) -> bool:
    return _predicate(annotation)(value)


def fields_errors(body: dict, fields: dict, what: str) -> list:
    errors = [
        f"{what}: unknown field {k!r} (SGLang's fields: {', '.join(sorted(fields))})" for k in body if k not in fields
    ]
    errors += [f"{what}: missing required field {k!r}" for k, f in fields.items() if f["required"] and k not in body]
    errors += [
        f"{what}: field {k!r} = {str(v)[:80]!r} is not {fields[k]['type']}"
        for k, v in body.items()
        if k in fields and not type_ok(v, fields[k]["type"])
    ]
    return errors


def body_errors(path: str, body) -> list:
    """Every way `body` (a parsed JSON body for `path`) departs from SGLang's request class: [] when it conforms."""
    r = route(path)
    if r is None:
        return [f"{path}: not an SGLang route slime uses"]
    fields = request_fields(path)
    if fields is None:
        return [] if body in (None, {}) else [f"{path}: SGLang takes no request body here"]
    if body is None:
        body = {}
    if not isinstance(body, dict):
        return [f"{path}: the body must be a JSON object"]
    errors = fields_errors(body, fields, path)
    if path == "/generate":  # SGLang checks sampling_params' keys and types itself (its api_contract)
        sp_fields = load_contract()["schemas"]["SamplingParams"]
        sps = body.get("sampling_params")
        for sp in sps if isinstance(sps, list) else [sps]:
            if isinstance(sp, dict):
                errors += [
                    f"unknown field {k!r}, expected one of {', '.join(map(repr, sp_fields))} (sampling_params)"
                    for k in sp
                    if k not in sp_fields
                ]
                errors += [
                    f"field {k!r} = {str(v)[:80]!r} is not {sp_fields[k]['type']} (sampling_params)"
                    for k, v in sp.items()
                    if k in sp_fields and not type_ok(v, sp_fields[k]["type"])
                ]
    return errors
