"""The GPU Gated DeltaNet kernel (`--qwen-gdn-backend fla`, flash-linear-attention's Triton kernel) against the
project's torch rule (`torch_chunk_gated_delta_rule`, itself checked against transformers' recurrence on CPU in
tests/test_hybrid_models.py): outputs and the gradients of q, k, v, g and beta, with grouped value heads (HV = 2H)
and variable-length packed samples whose lengths are not multiples of the kernel's 64-token chunk, in fp32 and bf16.
Where fla cannot train (`fla_training_problem`) the gradient checks are skipped with its reason and the backend must
be refused at model build.

Both run on the GPU on the same inputs; skipped without CUDA or without the `fla` package (`pip install 'slime[gdn]'`).
"""

import importlib.util

import pytest
import torch

from slime_plugins.models.qwen_gdn_backend import (
    _fla_chunk_gated_delta_rule,
    fla_training_problem,
    get_chunk_gated_delta_rule,
    torch_chunk_gated_delta_rule,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (slime[gdn])"),
]


def _inputs(dtype, lengths=(37, 130, 64, 5), h=2, hv=4, dk=64, dv=32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype).requires_grad_()

    q, k = rand(1, t, h, dk), rand(1, t, h, dk)
    v = rand(1, t, hv, dv)
    # log decays in the range Qwen's gates give (-softplus(.) * exp(A_log)): mostly small, some near -3
    gate = (-torch.nn.functional.softplus(torch.randn(1, t, hv, generator=g, device="cuda")) * 0.5).to(dtype)
    beta = torch.sigmoid(torch.randn(1, t, hv, generator=g, device="cuda")).to(dtype)
    gate.requires_grad_(), beta.requires_grad_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return (q, k, v, gate, beta), cu


def _run(fn, leaves, cu, grad_out):
    out = fn(*leaves, cu)
    (out.float() * grad_out).sum().backward()
    grads = [x.grad.float().clone() for x in leaves]
    for x in leaves:
        x.grad = None
    return out.float().detach(), grads


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


# fp32: the kernel's tensor-core dots may round inputs to tf32 (10-bit mantissa); bf16: both sides see bf16 inputs,
# the torch rule computes in fp32 and the kernel accumulates in fp32, so they differ by bf16 output rounding and more
TOLERANCES = [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)]


@pytest.mark.parametrize("dtype,tol", TOLERANCES, ids=["fp32", "bf16"])
def test_fla_forward_matches_the_torch_rule_with_grouped_heads_and_varlen(dtype, tol):
    leaves, cu = _inputs(dtype)
    with torch.no_grad():
        got, ref = _fla_chunk_gated_delta_rule(*leaves, cu).float(), torch_chunk_gated_delta_rule(*leaves, cu).float()
    assert got.shape == ref.shape and torch.isfinite(got).all()
    assert rel(got, ref) < tol, f"output: max relative error {rel(got, ref):.2e}"


@pytest.mark.parametrize("dtype,tol", TOLERANCES, ids=["fp32", "bf16"])
def test_fla_gradients_match_the_torch_rule_with_grouped_heads_and_varlen(dtype, tol):
    if problem := fla_training_problem():
        pytest.skip(problem)
    leaves, cu = _inputs(dtype)
    grad_out = torch.randn(1, leaves[0].shape[1], leaves[2].shape[2], leaves[2].shape[3], device="cuda")
    got, got_grads = _run(get_chunk_gated_delta_rule("fla"), leaves, cu, grad_out)
    ref, ref_grads = _run(torch_chunk_gated_delta_rule, leaves, cu, grad_out)
    assert rel(got, ref) < tol, f"output: max relative error {rel(got, ref):.2e}"
    for name, a, b in zip("q k v g beta".split(), got_grads, ref_grads):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, f"d{name}: max relative error {rel(a, b):.2e}"


def test_the_backend_is_refused_at_model_build_where_fla_cannot_train():
    """Where fla's gated backward is known wrong (Hopper with Triton 3.4 to 3.7.0, no tilelang), the trainer's model
    build stops with the reason and the way out, not at the first backward."""
    problem = fla_training_problem()
    if problem is None:
        pytest.skip("fla can train on this GPU")
    with pytest.raises(ValueError, match="Triton >= 3.7.1, or use --qwen-gdn-backend torch"):
        get_chunk_gated_delta_rule("fla")


def test_fla_kernel_resets_state_at_each_sample_boundary():
    """Packing must not leak state: the second sample of a pack equals that sample run alone."""
    leaves, cu = _inputs(torch.float32, lengths=(70, 45))
    with torch.no_grad():
        packed = _fla_chunk_gated_delta_rule(*leaves, cu)
        alone = _fla_chunk_gated_delta_rule(
            *(x[:, 70:] for x in leaves), torch.tensor([0, 45], device="cuda", dtype=torch.int32)
        )
    assert (packed[:, 70:] - alone).abs().max().item() < 1e-5
