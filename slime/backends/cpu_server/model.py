"""A compact batched Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5 with qkv bias, Qwen3 with q/k-norm).

gpt-fast style: plain tensors, no nn.Module tree. Weights live in a `WeightStore` (weights.py) that fuses q/k/v and
gate/up for speed but exposes every HF parameter name as a view, so loading and weight updates work by HF name.
The KV cache is a token pool (SGLang's layout with page size 1): `req_to_token[slot, pos]` maps a request's
position to a row of the per-layer K/V pools, so requests join and leave the batch without moving anyone's cache.
Numerics follow transformers' implementation (fp32 RoPE tables, RMSNorm in fp32) so log-probs match HF within 1e-6 in fp32.
"""

import json
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

# MiMo is a Qwen2 decoder plus multi-token-prediction layers, which serve speculative decoding only: not loaded here.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    mlp_bias: bool
    torch_dtype: str
    eos_token_ids: list
    quantization_config: dict | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise UnsupportedModelError(
                f"{path} does not exist: --model-path must be a local HuggingFace model directory."
            )
        with open(path) as f:
            c = json.load(f)
        arch = (c.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: architecture {arch!r} is not supported by slime's CPU server "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}). Use a GPU machine with SGLang for other models."
            )
        # transformers 5 moved rope settings into `rope_parameters`; older configs use rope_theta / rope_scaling.
        rope = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise UnsupportedModelError(
                    f"{path}: rope scaling type {kind!r} is not supported by slime's CPU server."
                )
            if kind == "default":
                scaling = None
        if c.get("sliding_window") and c.get("use_sliding_window", arch == "MistralForCausalLM"):
            raise UnsupportedModelError(f"{path}: sliding-window attention is not supported by slime's CPU server.")
        heads = c["num_attention_heads"]
        eos = c.get("eos_token_id")
        model_type = c.get("model_type", "")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=c.get("tie_word_embeddings", False),
            attention_bias=c.get("attention_bias", arch in ("Qwen2ForCausalLM", "MiMoForCausalLM")),
            qk_norm=model_type.startswith("qwen3"),
            mlp_bias=c.get("mlp_bias", False),
            torch_dtype=str(c.get("torch_dtype") or c.get("dtype") or "float32"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            quantization_config=c.get("quantization_config"),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between (as transformers does)
    factor, lo, hi, old = (
        s["factor"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["original_max_position_embeddings"],
    )
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


class KVPool:
    """Per-layer K/V rows for `size` tokens plus a free list; `release()` really frees the memory."""

    routed = None  # no routed-experts capture: this decoder has no MoE layers

    def __init__(self, cfg: ModelConfig, size: int, dtype: torch.dtype):
        self.cfg, self.size, self.dtype = cfg, size, dtype
        self.k = self.v = None
        self.allocate()

    def allocate(self):
        shape = (self.size + 1, self.cfg.num_kv_heads, self.cfg.head_dim)  # row 0 is a padding sink, never handed out
        self.k = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.cfg.num_layers)]
        self.free = list(range(self.size, 0, -1))

    def release(self):
        self.k = self.v = None
        self.free = []

    @property
    def allocated(self) -> bool:
        return self.k is not None

    def num_free(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list:
        assert n <= len(self.free), "KV pool exhausted"
        out = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        return out

    def give_back(self, rows):
        self.free.extend(rows)

    def bytes_per_token(self) -> int:
        return 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * torch.finfo(self.dtype).bits // 8


class SharedPrefix(NamedTuple):
    """Cascade attention's layout for one decode step: each group's shared prompt rows, read once for all its members.

    A request in a group gets kv_index / kv_valid over its own rows after the prompt only; the others, all of theirs."""

    index: torch.Tensor  # [G, P] pool rows of each group's prompt (padding: row 0)
    mask: torch.Tensor  # [G, 1, 1, P] additive: 0 on the prompt, -inf on padding
    members: torch.Tensor  # [G, M] batch positions of each group's requests (padding: 0, a query nobody reads)
    slot: torch.Tensor  # [B] each request's place in the flattened [G * M] layout (in no group: 0, outweighed)
    # [B, 1, 1, 1] additive to the prompt block's log-sum-exp: 0 for a group's member, -inf for a request in no
    # group (its own rows are all it reads); None when every request is in a group
    ungrouped: torch.Tensor | None
    # layer -> the prompts' gathered K/V ([G, KVH, P, D] each): a prompt's rows do not change while it is decoded
    # from, so every step over the same prompts shares this dict (and index, mask) and each layer gathers once
    kv: dict

    @classmethod
    def build(cls, groups, batch_size: int, dtype: torch.dtype, prev: "SharedPrefix | None" = None) -> "SharedPrefix":
        """groups: [(prompt rows, batch positions of its requests)]; prev: an earlier step's SharedPrefix over the
        same prompts in the same order (its prompt tensors and gathered K/V are kept), or None."""
        M = max(len(who) for _, who in groups)
        slot = [None] * batch_size
        for g, (_, who) in enumerate(groups):
            for j, b in enumerate(who):
                slot[b] = g * M + j
        ungrouped = None
        if None in slot:
            ungrouped = torch.tensor([-math.inf if x is None else 0.0 for x in slot]).view(batch_size, 1, 1, 1)
        members = torch.tensor([who + [0] * (M - len(who)) for _, who in groups])
        slot = torch.tensor([0 if x is None else x for x in slot])
        if prev is not None:
            return cls(prev.index, prev.mask, members, slot, ungrouped, prev.kv)
        P = max(len(rows) for rows, _ in groups)
        index = torch.tensor([rows + [0] * (P - len(rows)) for rows, _ in groups])
        mask = torch.tensor([[0.0] * len(rows) + [-math.inf] * (P - len(rows)) for rows, _ in groups], dtype=dtype)
        return cls(index, mask.view(len(groups), 1, 1, P), members, slot, ungrouped, {})


class Transformer:
    """forward_prefill / forward_decode over a WeightStore and a KVPool."""

    shares_prefix_kv = True  # forward_decode takes a SharedPrefix (cascade attention)
    extends_prefix = True  # forward_prefill takes cached rows before each sequence (prefix_rows)
    fuses_lora = True  # adapters are applied per fused projection (qkv, gate_up)

    def __init__(self, cfg: ModelConfig, weights, dtype: torch.dtype, max_positions: int):
        self.cfg, self.w, self.dtype = cfg, weights, dtype
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(cfg))
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) * sin == roll(x, D/2) * sin_rot: the sign of rotate_half's negated half moved into the table
        sign = torch.cat((-torch.ones(cfg.head_dim // 2), torch.ones(cfg.head_dim // 2)))
        self.cos, self.sin_rot = emb.cos().to(dtype), (emb.sin() * sign).to(dtype)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def lora_dims(self) -> dict:
        """{(layer, HF projection): out features} that LoRA adapters may target."""
        from .lora import projection_dims

        return projection_dims(self.cfg)

    def _norm(self, x, w):
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)

    def _linear(self, x, layer, name, lora, i):
        """One projection of layer i, plus the LoRA deltas of the batch's adapters (lora: a LoRABatch or None)."""
        wt, bias = _transposed(layer[name], self.w.generation), layer.get(name + "_bias")
        out = x @ wt if bias is None else torch.addmm(bias, x, wt)
        return out if lora is None else lora.add(i, name, x, out)

    def _rope(self, positions):
        """The rotary tables at `positions`, [N, 1, D] each (broadcast over heads): `_qkv`'s cos and sin."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin_rot.index_select(0, positions).unsqueeze(1)

    def _qkv(self, layer, h, cos, sin, lora=None, i=0):
        cfg = self.cfg
        qkv = self._linear(h, layer, "qkv", lora, i)
        H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk, v = qkv.unflatten(-1, (H + 2 * KVH, D)).split([H + KVH, KVH], dim=-2)
        if cfg.qk_norm:  # q and k heads in one pass, scaled by their own weights in fp32: F.rms_norm's exact bits
            w = torch.cat([layer["q_norm"].expand(H, D), layer["k_norm"].expand(KVH, D)])
            qk = (F.rms_norm(qk.float(), (D,), None, cfg.rms_norm_eps) * w.float()).to(qk.dtype)
        qk = qk * cos + qk.roll(D // 2, -1) * sin  # q and k heads rotated in one pass (transformers' bits)
        q, k = qk.split([H, KVH], dim=-2)
        return q, k, v

    def _mlp(self, layer, h, lora=None, i=0):
        gate, up = self._linear(h, layer, "gate_up", lora, i).chunk(2, dim=-1)
        return self._linear(F.silu(gate, inplace=True).mul_(up), layer, "down", lora, i)  # in place: fewer allocations

    def _logits(self, h):
        return F.linear(self._norm(h, self.w.final_norm), self.w.lm_head)

    @torch.inference_mode()
    def forward_prefill(
        self,
        pool: KVPool,
        tokens: torch.Tensor,
        lens: torch.Tensor,
        rows: torch.Tensor,
        all_logits: bool = False,
        lora=None,
        prefix_rows: list | None = None,
    ):
        """tokens [N]: sequences packed back to back, lens [B] their lengths, rows [N] their pool rows;
        lora: the LoRA adapters of the packed tokens (a LoRABatch) or None; prefix_rows: per sequence the pool rows
        of the positions before its tokens, already computed (a prefix cache hit), or None (every sequence whole).
        Returns logits at each sequence's last token [B, V] (or at every token [N, V]).
        Matmuls run on the packed tokens (no padding waste); only attention uses a padded [B, L] layout."""
        B, N, L = len(lens), len(tokens), int(lens.max())
        starts = torch.cumsum(lens, 0) - lens
        seq = torch.repeat_interleave(torch.arange(B), lens)
        local = torch.arange(N) - starts[seq]
        pad_index = seq * L + local  # where each packed token sits in the padded [B * L] layout
        past = torch.tensor([len(p) for p in prefix_rows]) if prefix_rows else torch.zeros(B, dtype=torch.long)
        positions = local + past[seq]
        total = past + lens
        T = int(total.max())
        # queries see the keys of their own sequence (cached ones, then its own causally), nothing past its end
        kpos, qpos = torch.arange(T)[None, None, :], past[:, None, None] + torch.arange(L)[None, :, None]
        mask = ((kpos <= qpos) & (kpos < total[:, None, None])).unsqueeze(1)
        kv_index = None
        if prefix_rows:  # keys gathered from the pool: each sequence's cached rows, then its new ones (row 0 pads)
            new = rows.split(lens.tolist())
            kv_index = torch.tensor([r + n.tolist() + [0] * (T - len(r) - len(n)) for r, n in zip(prefix_rows, new)])
            kv_index = kv_index.view(-1)
        cos, sin = self._rope(positions)
        h = F.embedding(tokens, self.w.embed)  # [N, hidden]

        def padded(t):  # [N, heads, D] -> [B, heads, L, D]
            out = t.new_zeros((B * L,) + t.shape[1:]).index_copy_(0, pad_index, t)
            return out.unflatten(0, (B, L)).transpose(1, 2)

        def keys(cache, t):  # -> [B, kv_heads, T, D]
            if kv_index is None:
                return padded(t)
            return cache.index_select(0, kv_index).unflatten(0, (B, T)).transpose(1, 2)

        for i, layer in enumerate(self.w.layers):
            x = self._norm(h, layer["input_norm"])
            q, k, v = self._qkv(layer, x, cos, sin, lora, i)
            pool.k[i].index_copy_(0, rows, k)
            pool.v[i].index_copy_(0, rows, v)
            o = F.scaled_dot_product_attention(
                padded(q), keys(pool.k[i], k), keys(pool.v[i], v), attn_mask=mask, scale=self.scale, enable_gqa=True
            )
            o = o.transpose(1, 2).flatten(2).flatten(0, 1).index_select(0, pad_index)  # back to packed [N, H*D]
            h = h + self._linear(o, layer, "o", lora, i)
            h = h + self._mlp(layer, self._norm(h, layer["post_norm"]), lora, i)
        if all_logits:
            return self._logits(h)
        return self._logits(h.index_select(0, starts + lens - 1))

    @torch.inference_mode()
    def forward_decode(
        self,
        pool: KVPool,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        new_rows: torch.Tensor,
        kv_index: torch.Tensor,
        kv_valid: torch.Tensor,
        lora=None,
        shared: SharedPrefix | None = None,
    ):
        """One token per request. tokens/positions/new_rows [B]; kv_index [B, S] pool rows of every cached position
        including the new one (padding points at row 0), kv_valid [B, S]; lora as in forward_prefill; shared: the
        groups whose prompt rows are attended once (kv_index then holds only their members' rows after it), or None.
        Returns logits [B, V]."""
        cos, sin = self._rope(positions)
        B, S = kv_index.shape
        # one additive float mask per step (a bool mask is converted inside every attention call)
        mask = torch.zeros(B, 1, 1, S, dtype=self.dtype).masked_fill_(~kv_valid[:, None, None, :], float("-inf"))
        flat_index = kv_index.reshape(-1)
        rowsel = None if shared is None else self._stats_rows(shared)
        h = F.embedding(tokens, self.w.embed)  # [B, hidden]
        for i, layer in enumerate(self.w.layers):
            x = self._norm(h, layer["input_norm"])
            q, k, v = self._qkv(layer, x, cos, sin, lora, i)  # [B, heads, D]
            pool.k[i].index_copy_(0, new_rows, k)
            pool.v[i].index_copy_(0, new_rows, v)
            # index_select, not advanced indexing: ~100x faster gathers on CPU
            ks = pool.k[i].index_select(0, flat_index).unflatten(0, (B, S)).transpose(1, 2)  # [B, kv_heads, S, D]
            vs = pool.v[i].index_select(0, flat_index).unflatten(0, (B, S)).transpose(1, 2)
            if shared is None:
                o = F.scaled_dot_product_attention(
                    q.unsqueeze(2), ks, vs, attn_mask=mask, scale=self.scale, enable_gqa=True
                ).flatten(1)
            else:
                o = self._cascade_attention(q, ks, vs, mask, self._prompt_kv(pool, i, shared), shared, rowsel)
            h += self._linear(o, layer, "o", lora, i)  # h: this forward's own tensor (the embedding's gather)
            h += self._mlp(layer, self._norm(h, layer["post_norm"]), lora, i)
        return self._logits(h)

    @staticmethod
    def _prompt_kv(pool, i, shared):
        """Layer i's K/V of the groups' prompts, [G, KVH, P, D] each: gathered by the first step that needs them."""
        if i not in shared.kv:
            (G, P), rows = shared.index.shape, shared.index.reshape(-1)
            shared.kv[i] = tuple(
                t.index_select(0, rows).unflatten(0, (G, P)).transpose(1, 2).contiguous()
                for t in (pool.k[i], pool.v[i])
            )
        return shared.kv[i]

    def _stats_rows(self, shared):
        """[B * KVH * rep]: where each request's (KV head, query head) rows sit in the prompt attention's output
        [G, KVH, M * rep] flattened (once per step; the same for every layer)."""
        KVH = self.cfg.num_kv_heads
        rep, M = self.cfg.num_heads // KVH, shared.members.shape[1]
        g, j = (shared.slot // M)[:, None, None], (shared.slot % M)[:, None, None]
        kvh, r = torch.arange(KVH)[None, :, None], torch.arange(rep)[None, None, :]
        return (((g * KVH + kvh) * M + j) * rep + r).reshape(-1)

    def _cascade_attention(self, q, ks, vs, mask, prompt_kv, shared, rowsel):
        """Attention over [shared prompt rows | own rows] as two blocks merged by their log-sum-exps: a group's
        prompt K/V are gathered and attended once for all its members, not once per request.
        q [B, H, D]; ks/vs [B, KVH, S, D] each request's own rows, mask [B, 1, 1, S]; prompt_kv: `_prompt_kv`;
        rowsel: `_stats_rows`. Returns [B, H * D]."""
        B, H, D = q.shape
        G, M, KVH = shared.members.shape[0], shared.members.shape[1], ks.shape[1]
        rep = H // KVH  # query head h reads KV head h // rep (SDPA's enable_gqa): a KV head's queries form its rows
        qg = q.index_select(0, shared.members.view(-1)).view(G, M, KVH, rep, D).transpose(1, 2)
        op, lp = _attention_lse(qg.reshape(G, KVH, M * rep, D), *prompt_kv, shared.mask, self.scale)
        # each request's prompt-block output and log-sum-exp, [B, KVH, rep, D + 1] (fp32)
        stats = torch.cat([op, lp.unsqueeze(-1)], -1).view(-1, D + 1).index_select(0, rowsel).view(B, KVH, rep, D + 1)
        os_, ls = _attention_lse(q.view(B, KVH, rep, D), ks, vs, mask, self.scale)
        # softmax over both blocks = own + (prompt - own) * sigmoid(lse_prompt - lse_own)
        diff = stats[..., D:] - ls.unsqueeze(-1)
        if shared.ungrouped is not None:
            diff = diff + shared.ungrouped
        return torch.lerp(os_.float(), stats[..., :D], torch.sigmoid(diff)).reshape(B, H * D).to(self.dtype)


def _transposed(w, generation):
    """w.T made contiguous (a second copy of the weight): at decode batch sizes a CPU GEMM from it runs up to 2x
    faster than F.linear's on the transposed view. Kept on the weight itself (freed with it) and made again after any
    write into its storage: a torch write bumps the version counter a tensor shares with its views; one torch does
    not see (a collective receiving straight into the weight) comes with a new `generation` of the weight store."""
    kept = getattr(w, "_slime_transposed", None)
    if kept is None or kept[0] != (w._version, generation):
        kept = w._slime_transposed = ((w._version, generation), w.t().contiguous())
    return kept[1]


def _attention_lse(q, k, v, mask, scale):
    """SDPA that also returns each query's log-sum-exp (fp32) of its scores: PyTorch's CPU flash kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
