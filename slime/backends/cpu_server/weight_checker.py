"""SGLang's `/weights_checker` over the CPU server's weights: the same actions, request and response shapes.

`snapshot` copies the served tensors, `reset_tensors` overwrites them with noise, `compare` checks the served
tensors against the snapshot (and drops it once they are equal), `checksum` hashes each tensor as SGLang does on CPU
(the first 8 bytes of the sha256 of its bytes, 16 hex digits). Tensors go by SGLang's parameter names (the fused
`qkv_proj` / `gate_up_proj`), not the HF names the trainer sends.

As in SGLang 0.5.23, a block-FP8 weight and its `weight_scale_inv` are one entry, compared and hashed dequantised
to bf16; with `allow_quant_error` a difference within both sides' e4m3 rounding (one ulp of each code times its
scale) passes. Everything else is compared and hashed bytewise.
"""

import hashlib
from typing import NamedTuple

import torch


class WeightCheckError(Exception):
    pass


def tensor_hash(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]


def overall_checksum(checksums: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


class Raw(NamedTuple):
    tensor: torch.Tensor

    def __repr__(self):
        return f"raw(shape={tuple(self.tensor.shape)} dtype={self.tensor.dtype})"

    def values(self):  # (what is compared, each element's tolerance: none)
        return self.tensor, None

    def dequantize(self):
        return self.tensor


class Fp8Block(NamedTuple):
    q: torch.Tensor
    scale: torch.Tensor

    def __repr__(self):
        return f"fp8_block(shape={tuple(self.q.shape)} dtype={self.q.dtype} is_shuffled=False)"

    def _expand(self, x, dtype):
        """SGLang's block_quant_dequant, with its block size inferred from the shapes (square blocks)."""
        k, sk = self.q.shape[-1], self.scale.shape[-1]
        if k % sk:
            raise WeightCheckError(
                f"cannot infer block size from w_q.shape={self.q.shape} w_s.shape={self.scale.shape}"
            )
        b = k // sk
        s = self.scale.float().repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)[..., : self.q.shape[-2], :k]
        return (x.float() * s).to(dtype)

    def dequantize(self):
        return self._expand(self.q, torch.bfloat16)

    def values(self):
        """The bf16 dequantised weight, and one e4m3 ulp of each code times its scale (fp32)."""
        x = self.q.float().abs()
        smallest = torch.finfo(self.q.dtype).smallest_normal
        binade = torch.exp2((torch.frexp(x)[1] - 1).float()).masked_fill(x < smallest, smallest)
        return self.dequantize(), self._expand(binade * torch.finfo(self.q.dtype).eps, torch.float32)


def _entries(state: dict, skipped: set):
    """[(name, compared, Raw | Fp8Block)] in `state`'s order, SGLang's check entries: an e4m3 `...weight` beside a
    `...weight_scale_inv` takes its scale along (and is compared even when skipped, as in SGLang)."""
    fp8 = {
        n: n[: -len("weight")] + "weight_scale_inv"
        for n, t in state.items()
        if n.endswith("weight")
        and t.dtype == torch.float8_e4m3fn
        and n[: -len("weight")] + "weight_scale_inv" in state
    }
    scales = set(fp8.values())
    return [
        (n, True, Fp8Block(t, state[fp8[n]])) if n in fp8 else (n, n not in skipped, Raw(t))
        for n, t in state.items()
        if n not in scales
    ]


def _compare(want, got):
    """(max_abs_err, mean_abs_err, num_exceed) of two entries, or None when they are equal."""
    (a, tol_a), (b, tol_b) = want.values(), got.values()
    diff = (b.float() - a.float()).abs()
    if torch.all(diff == 0):
        return None
    tol = 0.0 if tol_a is None or tol_b is None else tol_a + tol_b
    # `~(diff <= tol)`: NaN exceeds
    return diff.max().item(), diff.sum().item() / max(diff.numel(), 1), int((~(diff <= tol)).sum())


def _random_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.rand(t.shape, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.rand(t.shape) > 0.5
    info = torch.iinfo(t.dtype)
    return torch.randint(int(info.min), int(info.max), t.shape, dtype=t.dtype)


class WeightChecker:
    def __init__(self, get_state, on_change=None):
        self._get_state = get_state  # () -> {name: tensor} of the server's parameters
        self._on_change = on_change  # called after reset_tensors changed the weights
        self._snapshot = None

    def handle(self, action: str, allow_quant_error: bool = False, skip_tensor_list=None):
        """The payload of the action (checksum only), or raise WeightCheckError with SGLang's message."""
        state = self._get_state()
        skipped = {n for n in state if any(s in n for s in skip_tensor_list or ())}
        if action == "snapshot":
            self._snapshot = {n: t.detach().clone() for n, t in state.items()}
        elif action == "reset_tensors":
            with torch.no_grad():
                for n, t in state.items():
                    if n not in skipped:
                        t.copy_(_random_like(t))
            if self._on_change is not None:
                self._on_change()
        elif action == "compare":
            if self._snapshot is None:
                raise WeightCheckError("compare needs a snapshot: call the 'snapshot' action first")
            errors = []
            for (name, compared, want), (_, _, got) in zip(
                _entries(self._snapshot, skipped), _entries(state, skipped)
            ):
                result = _compare(want, got)
                if result is None or not compared or (allow_quant_error and result[2] == 0):
                    continue
                max_err, mean_err, exceed = result
                errors.append(
                    f"name={name} max_abs_err={max_err} mean_abs_err={mean_err} num_exceed={exceed} "
                    f"expect={want!r} actual={got!r} "
                )
            if errors:  # the snapshot stays for another compare, as in SGLang
                raise WeightCheckError("check tensor equality failed:\n" + "\n".join(errors))
            self._snapshot = None
        elif action == "checksum":
            checksums = {n: tensor_hash(c.dequantize()) for n, compared, c in _entries(state, skipped) if compared}
            info = {
                "role": "target",
                "tp_rank": 0,
                "tp_size": 1,
                "dp_rank": 0,
                "dp_size": 1,
                "pp_rank": 0,
                "pp_size": 1,
                "rank": 0,
                "size": 1,
            }
            return [
                {"checksums": checksums, "per_gpu_checksum": overall_checksum(checksums), "parallelism_info": [info]}
            ]
        else:
            raise WeightCheckError(f"Unsupported action='{action}'")
        return None
