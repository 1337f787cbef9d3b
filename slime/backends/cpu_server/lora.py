"""LoRA serving in slime's CPU server, as SGLang serves it: `--enable-lora`, adapters loaded and unloaded at run
time (`/load_lora_adapter` from a PEFT directory, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`), and
each `/generate` request choosing its adapter by name (`lora_path`; none = the base model).

Adapters are PEFT LoRA checkpoints: `...layers.{i}.self_attn.{q,k,v,o}_proj` / `...mlp.{gate,up,down}_proj` entries
`lora_A.weight` [r, in] and `lora_B.weight` [out, r], scaled by alpha / r (alpha / sqrt(r) with rslora). The server
fuses q/k/v and gate/up, so each adapter is stored per fused projection as one stacked `A` and a block-diagonal `B`
(scale folded in): the delta of a fused projection is then one `(x A^T) B^T`. A batch may mix adapters and base
requests; each adapter's rows get their own delta.
"""

import json
import os
import re
import threading
from collections import OrderedDict

import torch

from slime.utils.fingerprint import hash_named

from .weights import WeightError

# HF projection -> (fused projection of the server's layer, its part); the part order is the fused layout's
PROJECTIONS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
FUSED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors
_KEY_RE = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def server_target_modules(names) -> set:
    """`--lora-target-modules` (SGLang's names; `all`, `qkv_proj`, `gate_up_proj` expand) -> HF projection names."""
    out = set()
    for n in names or ():
        if n == "all":
            out |= set(PROJECTIONS)
        elif n in FUSED_NAMES:
            out |= set(FUSED_NAMES[n])
        elif n in PROJECTIONS:
            out.add(n)
        else:
            raise ValueError(
                f"--lora-target-modules {n}: slime's CPU server serves LoRA on "
                f"{', '.join(['all', *PROJECTIONS, *FUSED_NAMES])} (not embeddings or lm_head)"
            )
    return out


class Adapter:
    """One loaded adapter, in the served model's form: per layer and fused projection (A stacked [sum r, in], B
    block-diagonal [out, sum r]; `fuse`, the compact decoder), else per layer and HF projection (A [r, in], B [out, r]).
    B carries the scale. dims: {(layer, HF projection): out features} of the served model's projections."""

    def __init__(self, name, path, config: dict, tensors: dict, dims: dict, dtype, pinned=False, fuse=True):
        self.name, self.path, self.pinned = name, path, pinned
        # the tensors as they arrived, by their names: `/slime/weights_fingerprint?adapter=` hashes these, as the
        # trainer hashes what it sent (the served form below is fused, scaled and cast)
        self.received, self._hashes = dict(tensors), {}
        r, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
        self.rank = r
        self.scale = alpha / (r**0.5 if config.get("use_rslora") else r)
        parts: dict = {}  # (layer, fused) -> {part: (A, B)}
        pairs: dict = {}
        for key, t in tensors.items():
            m = _KEY_RE.search(key)
            if m is None or m.group(2) not in PROJECTIONS:
                raise WeightError(
                    f"LoRA adapter {name}: tensor {key!r} is not a LoRA weight of a supported projection"
                )
            pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
        self.modules = sorted({proj for _, proj in pairs})
        self.projections = {}  # (layer, HF projection) -> (A, B * scale), unless fused
        for (layer, proj), ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise WeightError(f"LoRA adapter {name}: layer {layer} {proj} needs lora_A and lora_B")
            if (layer, proj) not in dims:
                raise WeightError(f"LoRA adapter {name}: the served model has no layer {layer} {proj}")
            fused, part = PROJECTIONS[proj]
            a, b = ab["A"].float(), ab["B"].float()
            if a.shape[0] != r or b.shape[1] != r or b.shape[0] != dims[layer, proj]:
                raise WeightError(
                    f"LoRA adapter {name}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                    f"not rank {r} with {dims[layer, proj]} outputs"
                )
            parts.setdefault((layer, fused), {})[part] = (a, b)
            if not fuse:
                self.projections[layer, proj] = (a.to(dtype), (b * self.scale).to(dtype))
        self.layers = {}
        for (layer, fused), by_part in parts.items() if fuse else ():
            sizes = [dims[layer, p] for p in _PARTS[fused]]
            a = torch.cat([by_part[p][0] for p in sorted(by_part)])
            b = torch.zeros(sum(sizes), a.shape[0])
            col = 0
            for p in sorted(by_part):
                row = sum(sizes[:p])
                b[row : row + sizes[p], col : col + r] = by_part[p][1] * self.scale
                col += r
            self.layers[(layer, fused)] = (a.to(dtype), b.to(dtype))

    def tensor_hashes(self, algorithm: str) -> dict:
        """`{name: 16-hex-digit hash}` of the tensors as they arrived (slime.utils.fingerprint), cached."""
        if algorithm not in self._hashes:
            self._hashes[algorithm] = hash_named(self.received.items(), algorithm=algorithm)
        return self._hashes[algorithm]


_PARTS = {
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "o": ["o_proj"],
    "gate_up": ["gate_proj", "up_proj"],
    "down": ["down_proj"],
}


def projection_dims(cfg) -> dict:
    """{(layer, HF projection): out features} of the compact decoder."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter, hidden = cfg.intermediate_size, cfg.hidden_size
    out = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inter, "up_proj": inter}
    out["down_proj"] = hidden
    return {(i, p): n for i in range(cfg.num_layers) for p, n in out.items()}


def read_peft_dir(path):
    """(config dict, {name: tensor}) of a PEFT LoRA directory."""
    from safetensors.torch import load_file  # lazy: only for adapters loaded from disk

    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise WeightError(f"LoRA adapter path {path!r} has no adapter_config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    st, binf = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        return config, load_file(st)
    if os.path.isfile(binf):
        return config, torch.load(binf, map_location="cpu", weights_only=True)
    raise WeightError(f"LoRA adapter path {path!r} has no adapter_model.safetensors or adapter_model.bin")


class LoRARegistry:
    """The loaded adapters by name (least recently used first), SGLang's checks on each load, and how many
    requests hold each adapter (an unload waits for them)."""

    def __init__(self, args, dims: dict, dtype, fuse: bool = True):
        self.dims, self.dtype, self.fuse = dims, dtype, fuse  # as Adapter takes them
        self.max_rank = args.max_lora_rank
        self.targets = server_target_modules(args.lora_target_modules) if args.lora_target_modules else None
        self.max_per_batch, self.max_loaded = args.max_loras_per_batch, args.max_loaded_loras
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.evicted: dict[str, tuple] = {}  # adapters from disk evicted by --max-loaded-loras: reloaded on demand
        self.in_use: dict[int, int] = {}  # id(adapter) -> running/waiting requests holding it
        self.lock = threading.Lock()  # requests acquire on the HTTP thread and release on the scheduler thread
        if not (args.lora_paths or (args.max_lora_rank and args.lora_target_modules)):
            raise ValueError(
                "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
                "--lora-target-modules for LoRA initialization."
            )
        if self.max_loaded is not None and self.max_loaded < self.max_per_batch:
            raise ValueError(
                "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
                f"max_loaded_loras={self.max_loaded}, max_loras_per_batch={self.max_per_batch}"
            )
        initial = [self._parse_path(p) for p in args.lora_paths or ()]
        for name, path, pinned in initial:
            config, tensors = read_peft_dir(path)
            adapter = self.new_adapter(name, path, config, tensors, pinned)
            self.max_rank = max(self.max_rank or 0, adapter.rank) if not args.max_lora_rank else self.max_rank
            if args.lora_target_modules is None:
                self.targets = (self.targets or set()) | set(adapter.modules)
            self.add(adapter)

    def new_adapter(self, name, path, config, tensors, pinned=False) -> Adapter:
        """An adapter in the served model's form (not yet loaded)."""
        return Adapter(name, path, config, tensors, self.dims, self.dtype, pinned, self.fuse)

    @staticmethod
    def _parse_path(item: str):
        """SGLang's `--lora-paths` forms: PATH, NAME=PATH, or JSON {"lora_name", "lora_path", "pinned"}."""
        if item.lstrip().startswith("{"):
            d = json.loads(item)
            return d["lora_name"], d["lora_path"], bool(d.get("pinned", False))
        if "=" in item:
            name, path = item.split("=", 1)
            return name, path, False
        return item, item, False

    def load(self, adapter: Adapter):
        with self.lock:
            self.add(adapter)

    def add(self, adapter: Adapter):  # the caller holds self.lock
        if adapter.name in self.adapters:
            raise WeightError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
        if (self.max_rank and adapter.rank > self.max_rank) or (
            self.targets and not set(adapter.modules) <= self.targets
        ):
            raise WeightError(
                f"LoRA adapter {adapter.name} with rank {adapter.rank} is incompatible with the current LoRA memory "
                "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        if adapter.pinned and sum(a.pinned for a in self.adapters.values()) >= self.max_per_batch - 1:
            raise WeightError(
                f"Failed to load LoRA adapter {adapter.name} as a pinned adapter. It is not allowed to pin all slots "
                "in the LoRA memory pool to avoid starvation for unpinned adapters and base models."
            )
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            # never the adapter being loaded: a tensor adapter evicted is gone for good
            lru = next((n for n, a in self.adapters.items() if not a.pinned and not self.in_use.get(id(a))), None)
            if lru is None:
                raise WeightError(
                    f"Failed to load LoRA adapter {adapter.name}: --max-loaded-loras {self.max_loaded} adapters are "
                    "loaded and each is pinned or in use by a request"
                )
            evicted = self.adapters.pop(lru)
            if evicted.path != TENSOR_PATH:
                self.evicted[lru] = (evicted.path, evicted.pinned)
        self.adapters[adapter.name] = adapter
        self.evicted.pop(adapter.name, None)

    def remove(self, name) -> Adapter:
        with self.lock:
            self.evicted.pop(name, None)
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise WeightError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}")
            return adapter

    def acquire(self, names) -> list:
        """The adapters of a request's prompts (None: the base), each held until `release`; every name is checked
        before any is held."""
        with self.lock:
            for name in names:
                if name is not None and name not in self.adapters and name in self.evicted:
                    path, pinned = self.evicted[name]
                    self.add(self.new_adapter(name, path, *read_peft_dir(path), pinned))
            missing = [n for n in names if n is not None and n not in self.adapters]
            if missing:
                raise KeyError(
                    f"The following requested LoRA adapters are not loaded: {missing[0]}\n"
                    f"Loaded adapters: {list(self.adapters)}."
                )
            out = []
            for name in names:
                adapter = None if name is None else self.adapters[name]
                if adapter is not None:
                    self.adapters.move_to_end(name)
                    self.in_use[id(adapter)] = self.in_use.get(id(adapter), 0) + 1
                out.append(adapter)
            return out

    def release(self, adapter: Adapter):
        with self.lock:
            n = self.in_use.get(id(adapter), 0) - 1
            if n > 0:
                self.in_use[id(adapter)] = n
            else:
                self.in_use.pop(id(adapter), None)

    def get(self, name) -> Adapter | None:
        with self.lock:
            return self.adapters.get(name)

    def busy(self, adapter: Adapter) -> bool:
        with self.lock:
            return bool(self.in_use.get(id(adapter)))

    def loaded(self) -> dict:
        with self.lock:
            return {n: a.path for n, a in self.adapters.items()}


class LoRABatch:
    """The adapters of one forward: for each, the rows (packed tokens or decode rows) it applies to."""

    def __init__(self, groups, adapters=()):
        self.groups = groups  # [(Adapter, index tensor or None for every row)]
        self.adapters = list(adapters)  # each request's Adapter or None

    @classmethod
    def of(cls, adapters, rows_per_req):
        """adapters: one Adapter or None per request; rows_per_req: each request's row count in the forward."""
        if not any(adapters):
            return None
        offsets, start = [], 0
        for n in rows_per_req:
            offsets.append((start, start + n))
            start += n
        by_adapter: dict = {}
        for a, (lo, hi) in zip(adapters, offsets):
            if a is not None:
                by_adapter.setdefault(id(a), (a, []))[1].append(torch.arange(lo, hi))
        groups = []
        for a, idx in by_adapter.values():
            idx = torch.cat(idx)
            groups.append((a, None if len(idx) == start else idx))
        return cls(groups, adapters)

    def add(self, layer: int, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for adapter, idx in self.groups:
            ab = adapter.layers.get((layer, fused))
            if ab is None:
                continue
            a, b = ab
            if idx is None:
                out = out + (x @ a.t()) @ b.t()
            else:
                out = out.index_add(0, idx, (x.index_select(0, idx) @ a.t()) @ b.t())
        return out
