"""SGLang's `/weights_checker` over the CPU server's weights: the same actions, request and response shapes.

`snapshot` copies the served tensors, `reset_tensors` overwrites them with noise, `compare` checks the served
tensors against the snapshot (and drops it), `checksum` hashes each tensor as SGLang does on CPU (the first 8 bytes
of the sha256 of its bytes, 16 hex digits). Tensors are the server's own storage (fused q|k|v and gate|up, as
SGLang's `qkv_proj` / `gate_up_proj`), not the HF names the trainer sends.
"""

import hashlib

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


class WeightChecker:
    def __init__(self, get_state, on_change=None):
        self._get_state = get_state  # () -> {name: tensor} of what the server computes with
        self._on_change = on_change  # called after reset_tensors changed the weights
        self._snapshot = None

    def handle(self, action: str, skip_tensor_list=None):
        """The payload of the action (checksum only), or raise WeightCheckError with SGLang's message."""
        skip = tuple(skip_tensor_list or ())
        state = {n: t for n, t in self._get_state().items() if not any(s in n for s in skip)}
        if action == "snapshot":
            self._snapshot = {n: t.detach().clone() for n, t in state.items()}
        elif action == "reset_tensors":
            with torch.no_grad():
                for t in state.values():
                    t.copy_(torch.rand(t.shape, dtype=torch.float32).to(t.dtype))
            if self._on_change is not None:
                self._on_change()
        elif action == "compare":
            if self._snapshot is None:
                raise WeightCheckError("compare needs a snapshot: call the 'snapshot' action first")
            expect, self._snapshot = self._snapshot, None
            errors = []
            for name, want in expect.items():
                got = state[name]
                if not torch.equal(want, got):
                    diff = (want.float() - got.float()).abs()
                    errors.append(
                        f"name={name} max_abs_err={diff.max().item()} mean_abs_err={diff.mean().item()} "
                        f"num_exceed={int((diff > 0).sum())} "
                    )
            if errors:
                raise WeightCheckError("check tensor equality failed:\n" + "\n".join(errors))
        elif action == "checksum":
            checksums = {n: tensor_hash(t) for n, t in state.items()}
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
