"""INT4 quantisation-aware training of routed MoE experts (current slime's patched-Megatron switches).

With OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 every routed expert's fc1/fc2 weight W is replaced, in each forward, by
`fake_quantize_int4(W, G)` (G = OPEN_TRAINING_INT4_GROUP_SIZE, default 128): the codes and scales the INT4 sync sends
the engine, dequantised, so the policy computes with what it is served with. Backward is the identity
(straight-through): W's gradient is the gradient with respect to the fake-quantised weight. Master weights,
checkpoints, attention, dense and shared-expert MLPs and the router are untouched.
"""

import re

import torch

from slime.utils.quantization import INT4_QAT_GROUP_SIZE, fake_quantize_int4, qat_group_size

# SequentialMLP's experts (`...mlp.experts.local_experts.<i>.linear_fc1`) and TEGroupedMLP's (`...mlp.experts.linear_fc1`)
_LOCAL_EXPERT_LINEAR = re.compile(r"(^|\.)mlp\.experts\.local_experts\.\d+\.linear_fc[12]$")
_GROUPED_EXPERT_LINEAR = re.compile(r"(^|\.)mlp\.experts\.linear_fc[12]$")


class _FakeInt4STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, group_size):
        return fake_quantize_int4(w, group_size)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_int4_ste(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """fake_quantize_int4(w) in forward, identity in backward. A shard whose input dimension the group does not
    divide cannot be fake-quantised as the engine's full weight is."""
    if w.shape[-1] % group_size:
        raise ValueError(
            f"{INT4_QAT_GROUP_SIZE}={group_size}: an expert weight of shape {tuple(w.shape)} (this rank's shard) has "
            f"an input dimension the group does not divide"
        )
    out = _FakeInt4STE.apply(w, group_size)
    if hasattr(w, "main_grad"):  # fused weight-grad accumulation writes into the real parameter's buffer
        out.main_grad = w.main_grad
    return out


def _wrap_linear(module):
    """The linear computes with fake-quantised `weight` while QAT is on (read on every forward, as upstream)."""
    forward = module.forward

    def qat_forward(*args, **kwargs):
        group = qat_group_size()
        if group is None:
            return forward(*args, **kwargs)
        w = module._parameters["weight"]
        module._parameters["weight"] = fake_int4_ste(w, group)  # what `self.weight` reads inside the forward
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters["weight"] = w

    module.forward = qat_forward


def _wrap_grouped(module):
    """TE GroupedLinear (`--moe-grouped-gemm` with Transformer Engine): its per-expert weights, as upstream's patch."""
    get = module._get_weight_tensors

    def qat_weights():
        weights = get()
        group = qat_group_size()
        return weights if group is None else [fake_int4_ste(w, group) for w in weights]

    module._get_weight_tensors = qat_weights


def apply_int4_qat(model) -> list:
    """Install the fake quantisation on every routed expert linear of `model` (one chunk); returns their names.
    Nothing is installed when the flag is off at build time."""
    if qat_group_size() is None:
        return []
    wrapped = []
    for name, module in model.named_modules():
        if _LOCAL_EXPERT_LINEAR.search(name) and "weight" in module._parameters:
            _wrap_linear(module)
        elif _GROUPED_EXPERT_LINEAR.search(name) and hasattr(module, "_get_weight_tensors"):
            _wrap_grouped(module)
        else:
            continue
        wrapped.append(name)
    return wrapped
