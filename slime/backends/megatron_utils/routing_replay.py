"""MoE routing replay in the trainer (R3 `--use-rollout-routing-replay`, R2 `--use-routing-replay`).

Built on megatron-core's own mechanism (`moe_enable_routing_replay`: every `TopKRouter` holds a `RouterReplay`). In
replay, a router takes its top-k expert ids from `RouterReplay.target_topk_idx` instead of its own top-k, and
recomputes the routing weights from its live logits for exactly those experts (softmax / sigmoid, expert bias,
scaling), so gradients still reach the router. In record, it keeps the ids it chose.

The routing travels with the rollout data as one `[tokens - 1, layers, top-k]` tensor per sample
(`rollout_routed_experts`: the engine's for R3, SGLang's layout; the old-log-prob forward's for R2). For each
micro-batch it is laid out exactly as the tokens are (`data.get_batch`: THD-packed or right-padded rows, padding,
context parallelism's zigzag chunks, a `--tree-training` prefix tree, then Megatron's `[s, b]` order and the
sequence-parallel split). Each sample's last token (never computed by the engine, and scoring nothing) and padding
get a fixed filler routing.

One phase at a time (`phase(model, mode)`): "replay" (R3's forwards, R2's training), "record" (R2's old-log-prob
forward) or None (the model's own routing: the reference model under R2, the OPD teacher).

Pipeline parallelism: each stage's routers (numbered by global layer) take their own layers' columns. Under 1F1B
several micro-batches are in flight, so a router run again by activation recompute in the backward pass takes the
oldest routing not yet recomputed (megatron-core's `replay_backward_list`, a FIFO: backwards run in forward order).
R2's record is kept on every stage and merged over the pipeline group once the forward-only schedule is done.
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


def _in_backward() -> bool:
    # the autograd engine is running a backward pass: a forward now is activation recompute
    return torch._C._current_graph_task_id() != -1


def _choose_action(router, _inputs):
    """Forward pre-hook of a replaying router: a recompute in the backward pass replays its micro-batch's routing
    (the FIFO), a plain forward the routing just set."""
    if _mode == "replay":
        backward = _in_backward()
        action = RouterReplayAction.REPLAY_BACKWARD if backward else RouterReplayAction.REPLAY_FORWARD
        router.router_replay.set_router_replay_action(action)


def _hooked(router):
    if not getattr(router, "_slime_replay_hook", False):  # once per router, over all phases
        router.register_forward_pre_hook(_choose_action)
        router._slime_replay_hook = True
    return router


def _layout_index(args, batch):
    """`([s * b]` (this rank's sequence-parallel part) row numbers into the micro-batch's routing table, its row
    count, each sample's `[tokens - 1]` rows)`: row 0 is the filler (padding, each sample's last token), sample i's
    token j is row 1 + (its offset) + j. A `--tree-training` row holds a shared token once: it takes the rows of one
    of the samples that continue past it (which `before_forward` checks agree)."""
    index, sample_rows, row = [], [], 1
    for t in batch["unconcat_tokens"]:
        n = t.size(0)
        sample_rows.append(torch.arange(row, row + n - 1, device=t.device))
        index.append(torch.cat([sample_rows[-1], t.new_zeros(1)]))
        row += n - 1
    tree_index = batch.get("tree_index")
    if tree_index is not None:
        layout = torch.zeros_like(batch["tokens"])  # [1, L]: padding to a multiple of TP is filler too
        for nodes, rows in zip(tree_index, sample_rows):
            layout[0, nodes[:-1].to(layout.device)] = rows
        sample_rows = [layout[0, nodes[:-1].to(layout.device)] for nodes in tree_index]
    else:
        pad = mpu.get_tensor_model_parallel_world_size() * args.data_pad_size_multiplier
        packed = batch["packed_seq_params"] is not None
        layout = _packed_layout(index, pad)["tokens"] if packed else _padded_layout(index)["tokens"]  # [b, s]
    flat = layout.t().reshape(-1)  # Megatron's hidden states are [s, b]: the router sees them flattened so
    if args.sequence_parallel:
        flat = flat.chunk(mpu.get_tensor_model_parallel_world_size())[mpu.get_tensor_model_parallel_rank()]
    return flat, row, sample_rows


def before_forward(args, model_chunk, batch):
    """Prepare the routers of `model_chunk` for the forward of `batch` (a `data.get_batch` result)."""
    if _mode is None:
        return
    routers = [_hooked(r) for r in _routers(model_chunk, args.num_layers)]
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
    index, _, sample_rows = _layout_index(args, batch)
    k = routed[0].shape[2]
    filler = torch.arange(k, device=index.device).expand(1, args.num_layers, k)  # k distinct experts
    table = torch.cat([filler, *[r.to(index.device, torch.long) for r in routed]])
    if batch.get("tree_index") is not None:
        # a shared prefix is routed once: only exact when every sample sharing it was routed to the same experts
        # there (the engine's shared prefill, or a radix-cache hit, gives one routing per prefix); their order in
        # the top-k does not change the routing
        for i, rows in enumerate(sample_rows):
            if not torch.equal(table[rows].sort(-1).values, routed[i].to(table).sort(-1).values):
                raise ValueError(
                    f"--tree-training with MoE routing replay: sample {i} of the micro-batch shares a prefix with "
                    "another sample but its rollout_routed_experts differ there; a prefix computed once takes one "
                    "routing"
                )
    laid_out = table.index_select(0, index)  # [s * b, layers, k]
    # 1F1B runs at most (stages - 1) micro-batches forward ahead of their backward: older entries are those of
    # routers that activation recompute does not run again (never popped), dropped to bound the queue
    keep = mpu.get_pipeline_model_parallel_world_size() - 1
    for r in routers:
        target = laid_out[:, r.layer_number - 1].contiguous()
        r.router_replay.target_topk_idx = target
        if torch.is_grad_enabled():  # a backward follows, which may recompute this forward: queue it
            queue = r.router_replay.replay_backward_list
            del queue[: max(0, len(queue) - keep)]
            queue.append(target)
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def recorded(args, model_chunk, batch):
    """After a "record" forward of `batch`: each sample's routing `[tokens - 1, layers, top-k]` (dense layers zero),
    the same on every rank of the micro-batch's tensor- and context-parallel groups. Under pipeline parallelism only
    this stage's layers are filled (a stage may hold none): `across_stages` completes them."""
    index, rows, sample_rows = _layout_index(args, batch)
    routers = _routers(model_chunk, args.num_layers)
    table = torch.zeros(rows, args.num_layers, args.moe_router_topk, dtype=torch.long, device=index.device)
    for r in routers:
        table[index, r.layer_number - 1] = r.router_replay.get_recorded_indices().to(torch.long)
    # each rank routed its part of the sequence (sequence parallelism, context parallelism's zigzag chunks); rows
    # it did not route are zero, the rest agree
    if mpu.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    if mpu.get_context_parallel_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=mpu.get_context_parallel_group())
    return [table[r] for r in sample_rows]  # a copy each (advanced indexing)


def across_stages(recorded):
    """R2's record of every sample (`recorded`'s results, in order) with every stage's layers: each stage filled its
    own, the others are zero. Called on all pipeline stages after the forward-only schedule (a collective inside a
    micro-batch's forward would wait on a stage that waits for that forward's activations)."""
    if mpu.get_pipeline_model_parallel_world_size() == 1 or not recorded:
        return recorded
    flat = torch.cat(recorded)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mpu.get_pipeline_model_parallel_group())
    return list(flat.split([r.shape[0] for r in recorded]))
