"""The Gated DeltaNet core (`--qwen-gdn-backend`): the chunked gated delta rule over packed samples.

Every backend is called as `fn(q, k, v, g, beta, cu_seqlens)` with q, k `[1, T, H, K]`, v `[1, T, HV, V]`
(grouped value heads: HV a multiple of H), g (log decay) and beta `[1, T, HV]`, and `cu_seqlens` the packed
samples' boundaries (int, `[N+1]`); q and k are L2-normalised inside and q scaled by `K**-0.5`, as the Qwen models
ask. It returns `[1, T, HV, V]`; the recurrent state starts at zero at every sample boundary.

- `fla`: flash-linear-attention's Triton kernel `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (GPU; the
  `gdn` extra of pyproject.toml).
- `torch`: `torch_chunk_gated_delta_rule` below, plain torch in fp32 (any device; the CPU default).

`slime.utils.device.default_gdn_backend()` picks the default for the machine.
"""

import importlib.util

import torch
import torch.nn.functional as F

GDN_BACKENDS = ("fla", "torch")


def gdn_backend_problem(backend):
    """Why `backend` cannot run here (one line), or None."""
    if backend == "fla" and importlib.util.find_spec("fla") is None:
        return (
            "--qwen-gdn-backend fla: flash-linear-attention is not installed (pip install 'slime[gdn]', GPU "
            "only); use --qwen-gdn-backend torch"
        )
    if backend not in GDN_BACKENDS:
        return f"--qwen-gdn-backend {backend}: not available in this build (choose from {', '.join(GDN_BACKENDS)})"
    return None


def fla_training_problem():
    """Why fla's kernel cannot train on this machine's GPU (one line), or None. fla itself refuses its gated backward
    on Hopper with Triton >= 3.4 and < 3.7.1 (wrong gradients) unless tilelang serves that op; asked on the rank that
    builds the model, where the GPU is known, so a run stops at model build rather than at its first backward."""
    import fla.utils as fla_utils
    import triton

    if not (fla_utils.IS_NVIDIA_HOPPER and fla_utils.TRITON_ABOVE_3_4_0 and not fla_utils.TRITON_ABOVE_3_7_1):
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    return (
        f"--qwen-gdn-backend fla: flash-linear-attention cannot train on this Hopper GPU with Triton "
        f"{triton.__version__} (its gated backward is wrong for Triton >= 3.4 and < 3.7.1); install tilelang or "
        "Triton >= 3.7.1, or use --qwen-gdn-backend torch"
    )


def get_chunk_gated_delta_rule(backend):
    problem = gdn_backend_problem(backend) or (backend == "fla" and fla_training_problem())
    if problem:
        raise ValueError(problem)
    if backend == "fla":
        return _fla_chunk_gated_delta_rule
    return torch_chunk_gated_delta_rule


def _fla_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # lazy: GPU-only package (Triton)

    # grouped value heads as transformers' Qwen3-Next feeds the kernel: q and k repeated to one head per value head
    # (fla releases differ in whether they accept fewer q/k heads than v heads; repeated heads are right for all)
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    out, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.long(),
    )
    return out


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, chunk_size=64):
    """The gated delta rule S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T, o_t = S_t^T q_t (a_t = exp(g_t),
    state reset per sample), computed chunk by chunk: within a chunk the delta-rule updates form a unit lower-
    triangular system solved in one go, and only the chunk-to-chunk state update is sequential. Samples are padded
    to a common number of chunks and run as one batch (padding has k = v = g = beta = 0, so it changes nothing)."""
    dtype = v.dtype
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    c = chunk_size
    padded = max(-(-n // c) * c for n in lens) if lens else c
    rep = v.shape[2] // q.shape[2]

    def batch(x):  # [1, T, ...] -> [N, padded, ...] in fp32, each sample zero-padded at its end
        x = x[0].float()
        out = x.new_zeros(len(lens), padded, *x.shape[1:])
        for i, (s, n) in enumerate(zip(bounds[:-1], lens)):
            out[i, :n] = x[s : s + n]
        return out

    q, k = (_l2norm(batch(x)).repeat_interleave(rep, dim=2) for x in (q, k))
    v, g, beta = batch(v), batch(g), batch(beta)
    q = q * q.shape[-1] ** -0.5
    # [N, HV, chunks, c, ...]
    q, k, v = (x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1, c) for x in (g, beta))

    cum = g.cumsum(-1)  # log of the decay from the chunk start to each position (inclusive)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [i, j]: j <= i
    kk = k @ k.transpose(-1, -2)
    # (I + A) d = beta (v - exp(cum) k S0): A_ij = beta_i exp(cum_i - cum_j) k_i.k_j for j < i
    system = torch.eye(c, device=q.device) + (beta.unsqueeze(-1) * kk * decay).tril(-1)
    rhs_v = torch.linalg.solve_triangular(system, beta.unsqueeze(-1) * v, upper=False, unitriangular=True)
    rhs_k = torch.linalg.solve_triangular(
        system, (beta * cum.exp()).unsqueeze(-1) * k, upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()

    state = q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])
    outs = []
    for i in range(q.shape[2]):
        d = rhs_v[:, :, i] - rhs_k[:, :, i] @ state  # the chunk's delta-rule corrections
        outs.append(q_decayed[:, :, i] @ state + attn[:, :, i] @ d)
        state = state * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ d
    out = torch.stack(outs, dim=2).reshape(q.shape[0], q.shape[1], padded, -1).transpose(1, 2)
    return torch.cat([out[i, :n] for i, n in enumerate(lens)]).unsqueeze(0).to(dtype)


def varlen_causal_conv1d(x, weight, cu_seqlens, activation=F.silu):
    """Depthwise causal convolution over packed samples: x `[T, C]`, weight `[C, W]` (HF's conv1d weight squeezed);
    no tap reaches back across a sample boundary."""
    T, width = x.shape[0], weight.shape[-1]
    bounds = cu_seqlens.long()
    pos = torch.arange(T, device=x.device) - bounds[:-1].repeat_interleave(bounds[1:] - bounds[:-1])
    out = x * weight[:, width - 1]
    for j in range(1, width):
        shifted = F.pad(x, (0, 0, j, 0))[:T]
        out = out + shifted * weight[:, width - 1 - j] * (pos >= j).unsqueeze(-1).to(x.dtype)
    return activation(out)
