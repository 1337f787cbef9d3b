"""MoE routing replay in the trainer (R3 `--use-rollout-routing-replay`, R2 `--use-routing-replay`).

Built on megatron-core's own mechanism (`moe_enable_routing_replay`: every `TopKRouter` holds a `RouterReplay`). In
replay, a router takes its top-k expert ids from `RouterReplay.target_topk_idx` instead of its own top-k, and
recomputes the routing weights from its live logits for exactly those experts (softmax / sigmoid, expert bias,
scaling), so gradients still reach the router. In record, it keeps the ids it chose.

The routing travels with the rollout data as one `[tokens - 1, layers, top-k]` tensor per sample
(`rollout_routed_experts`: the engine's for R3, SGLang's layout; the old-log-prob forward's for R2). For each
micro-batch it is laid out exactly as the tokens are (`data.get_batch`: THD-packed or right-padded rows, padding,
context parallelism's zigzag chunks, then Megatron's `[s, b]` order and the sequence-parallel split). Each sample's last token (never computed by the
engine, and scoring nothing) and padding get a fixed filler routing.

One phase at a time (`phase(model, mode)`): "replay" (R3's forwards, R2's training), "record" (R2's old-log-prob
forward) or None (the model's own routing: the reference model under R2, the OPD teacher).
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import mpu
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from .data import _packed_layout, _padded_layout

KEY = "rollout_routed_experts"

_mode = None  # None | "replay" | "record": what the routers of the current phase do


def _routers(model, num_layers=None):
    """The MoE routers of a model (a list of chunks, or one chunk) that replay; with `num_layers`, only the decoder's
    (multi-token-prediction layers, numbered after them, have no engine routing and route themselves)."""
    chunks = model if isinstance(model, list) else [model]
    routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter) and m.router_replay is not None]
    return [r for r in routers if num_layers is None or r.layer_number <= num_layers]


@contextmanager
def phase(model, mode):
    """Run the forwards of one phase with `mode` (see the module doc); routers are reset afterwards."""
    global _mode
    _mode = mode
    try:
        yield
    finally:
        _mode = None
        for r in _routers(model):
            r.router_replay.clear_router_replay_action()
            r.router_replay.clear_indices()


def recording() -> bool:
    return _mode == "record"


def _layout_index(args, batch):
    """`[s * b]` (this rank's sequence-parallel part) row numbers into the micro-batch's routing table: row 0 is the
    filler (padding, each sample's last token), sample i's token j is row 1 + (its offset) + j."""
    index, row = [], 1
    for t in batch["unconcat_tokens"]:
        n = t.size(0)
        index.append(torch.cat([torch.arange(row, row + n - 1, device=t.device), t.new_zeros(1)]))
        row += n - 1
    pad = mpu.get_tensor_model_parallel_world_size() * args.data_pad_size_multiplier
    packed = batch["packed_seq_params"] is not None
    layout = _packed_layout(index, pad)["tokens"] if packed else _padded_layout(index)["tokens"]  # [b, s]
    flat = layout.t().reshape(-1)  # Megatron's hidden states are [s, b]: the router sees them flattened so
    if args.sequence_parallel:
        flat = flat.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return flat, row


def before_forward(args, model_chunk, batch):
    """Prepare the routers of `model_chunk` for the forward of `batch` (a `data.get_batch` result)."""
    if _mode is None:
        return
    routers = _routers(model_chunk, args.num_layers)
    if _mode == "record":
        for r in routers:
            r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
        return
    routed = batch.get(KEY)
    if routed is None:
        raise ValueError(
            "MoE routing replay: this micro-batch has no rollout_routed_experts (R3: the engine's routing; R2: the "
            "old-log-prob forward's)"
        )
    tokens = batch["unconcat_tokens"]
    for i, (t, r) in enumerate(zip(tokens, routed, strict=True)):
        if r.shape[0] != t.size(0) - 1 or r.shape[1] != args.num_layers:
            raise ValueError(
                f"MoE routing replay: sample {i} of the micro-batch has routing of shape {tuple(r.shape)} for "
                f"{t.size(0)} tokens, expected ({t.size(0) - 1}, {args.num_layers}, top-k)"
            )
    index, _ = _layout_index(args, batch)
    k = routed[0].shape[2]
    filler = torch.arange(k, device=index.device).expand(1, args.num_layers, k)  # k distinct experts
    table = torch.cat([filler, *[r.to(index.device, torch.long) for r in routed]])
    laid_out = table.index_select(0, index)  # [s * b, layers, k]
    for r in routers:
        r.router_replay.clear_indices()
        r.router_replay.set_target_indices(laid_out[:, r.layer_number - 1].contiguous())
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def recorded(args, model_chunk, batch):
    """After a "record" forward of `batch`: each sample's routing `[tokens - 1, layers, top-k]` (dense layers zero),
    the same on every rank of the micro-batch's tensor- and context-parallel groups."""
    index, rows = _layout_index(args, batch)
    routers = _routers(model_chunk, args.num_layers)
    k = routers[0].topk
    table = torch.zeros(rows, args.num_layers, k, dtype=torch.long, device=index.device)
    for r in routers:
        table[index, r.layer_number - 1] = r.router_replay.get_recorded_indices().to(torch.long)
    # each rank routed its part of the sequence (sequence parallelism, context parallelism's zigzag chunks); rows
    # it did not route are zero, the rest agree
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    if mpu.get_context_parallel_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=mpu.get_context_parallel_group())
    out, row = [], 1
    for t in batch["unconcat_tokens"]:
        n = t.size(0) - 1
        out.append(table[row : row + n].clone())
        row += n
    return out
