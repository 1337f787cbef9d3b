"""Megatron-side batching: micro-batch schedule per training step (`get_data_iterator`), model-input layout
(`get_batch`) and per-rollout data metrics (`log_rollout_data`).

Two layouts, chosen once by whether the model runs Transformer Engine attention (`use_packed_sequences`):
- THD-packed (TE on GPU, slime's layout): all samples of a micro-batch concatenated into one `[1, T]` row padded to a
  multiple of 128, with `PackedSeqParams(cu_seqlens)` so attention never crosses sample boundaries;
- right-padded `[b, s]` with an explicit causal+padding mask (the local spec, e.g. on CPU, asserts
  `packed_seq_params is None`).
`--tree-training` (local spec only) replaces both with a prefix tree in one row (`_tree_layout`), padded to a multiple of TP.
With `--context-parallel-size` > 1 both layouts hold only this CP rank's zigzag chunks of each sample (`cp_utils`).
"""

import numbers

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_model_config

from slime.backends.megatron_utils.cp_utils import cp_size_and_rank, slice_with_cp, zigzag_chunk_size, zigzag_ranges
from slime.backends.megatron_utils.model_provider import use_transformer_engine
from slime.backends.megatron_utils.rollout_data import (
    DataIterator,
    count_tree_tokens,
    get_micro_batch_partitions,
    get_minimum_num_micro_batch_size,
)
from slime.backends.megatron_utils.tree_attention import tree_block_mask
from slime.utils.device import current_device
from slime.utils.flops_utils import forward_flops
from slime.utils.processing_utils import merge_multimodal_inputs
from slime.utils.sampling_record import TEMPERATURES_KEY
from slime.utils.top_p_replay import TOP_P_KEYS

PAD_TOKEN_ID = 0  # pad positions are never scored, any id works


def use_packed_sequences(args) -> bool:
    """THD packing needs TE attention, i.e. exactly when the model provider picks the TE layer spec."""
    return use_transformer_engine(args)


def _dp_size():
    return mpu.get_data_parallel_world_size(with_context_parallel=False)


def get_data_iterator(args, model, rollout_data):
    """`(data_iterators, num_microbatches)`: one iterator per virtual-pipeline stage and the micro-batch count of
    each optimizer step of this rollout (identical on every DP rank)."""
    dp_size = _dp_size()
    total_rollouts = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size % dp_size != 0 or total_rollouts % dp_size != 0:
        raise ValueError(
            f"--global-batch-size {args.global_batch_size} and rollout_batch_size*n_samples_per_prompt "
            f"{total_rollouts} must both be divisible by the data-parallel size {dp_size}"
        )
    # A step takes global_batch_size / dp of this rank's rollouts (process_rollout_data split them): one sample
    # each, or with fan-out every sample of a rollout, so a step's sample count may vary.
    num_local_gbs = args.global_batch_size // dp_size
    total_lengths = rollout_data["total_lengths"]
    sizes = rollout_data.get("rollout_sizes") or [1] * len(total_lengths)  # built by hand: one sample per rollout
    if len(sizes) != total_rollouts // dp_size:
        raise ValueError(
            f"this DP rank holds {len(sizes)} rollouts but expects rollout_batch_size*n_samples_per_prompt/dp = "
            f"{total_rollouts // dp_size}; the rollout function must return exactly --rollout-batch-size groups of "
            "--n-samples-per-prompt samples"
        )
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    steps = [range(starts[i], starts[i + num_local_gbs]) for i in range(0, len(sizes), num_local_gbs)]
    fan_out = "rollout_weights" in rollout_data  # on every rank when any rollout has several samples

    vpp_size = mpu.get_virtual_pipeline_model_parallel_world_size() or 1
    packed = use_packed_sequences(args)
    # --tree-training: the tree row's attention ("dense" mask or "flex" block mask), else False
    tree = getattr(args, "tree_training", False) and (getattr(args, "tree_attention_backend", None) or "dense")

    if not args.use_dynamic_batch_size:
        if not fan_out:
            if num_local_gbs % args.micro_batch_size != 0:
                raise ValueError(
                    f"global_batch_size/dp = {num_local_gbs} samples per step is not a multiple of "
                    f"--micro-batch-size {args.micro_batch_size}"
                )
            num_microbatches = [num_local_gbs // args.micro_batch_size] * len(steps)
            iterators = [
                DataIterator(rollout_data, args.micro_batch_size, packed_sequences=packed, tree=tree)
                for _ in range(vpp_size)
            ]
            return iterators, num_microbatches
        # fan-out: consecutive micro-batches of --micro-batch-size samples (the last of a step may be short)
        mbs = args.micro_batch_size
        micro_batch_indices = [list(s[i : i + mbs]) for s in steps for i in range(0, len(s), mbs)]
        num_microbatches = _same_on_every_dp_rank([-(-len(s) // mbs) for s in steps], dp_size)
        iterators = [
            DataIterator(rollout_data, None, micro_batch_indices, packed_sequences=packed, tree=tree)
            for _ in range(vpp_size)
        ]
        return iterators, num_microbatches

    if not args.max_tokens_per_gpu:
        raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    # each CP rank holds 1/cp of every sequence, so a micro-batch may hold cp times the per-GPU token budget
    max_tokens = args.max_tokens_per_gpu * mpu.get_context_parallel_world_size()
    # the unit a micro-batch takes whole: a sample, or with --tree-training a prompt group's tree (counted in its
    # unique tokens; a micro-batch's trees may share more, so its row is never longer than the sum)
    if tree:
        step_units, unit_lengths = _tree_units(args, rollout_data, starts, num_local_gbs)
    else:
        step_units = [[[j] for j in s] for s in steps]
        unit_lengths = [[total_lengths[j] for j in s] for s in steps]
    counts = [get_minimum_num_micro_batch_size(lengths, max_tokens) for lengths in unit_lengths]
    unit_name = "prompt groups" if tree else "samples"
    # every DP rank must run the same number of micro-batches per step
    counts_t = torch.tensor(counts, dtype=torch.int64, device=current_device())
    dist.all_reduce(counts_t, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
    if vpp_size > 1:
        # The interleaved schedule runs micro-batches in groups of `microbatch_group_size_per_vp_stage` (PP by
        # default) and needs a whole number of groups. Round *up*: fewer micro-batches would overfill them past
        # --max-tokens-per-gpu (and fewer than one group is rejected by the schedule).
        group = get_model_config(model[0]).microbatch_group_size_per_vp_stage
        counts_t = (counts_t + group - 1) // group * group
        if int(counts_t.max()) > min(len(us) for us in step_units):
            raise ValueError(
                f"virtual pipeline parallelism runs micro-batches in groups of {group}, so a step needs "
                f"{int(counts_t.max())} micro-batches, but this DP rank has only {min(len(us) for us in step_units)} "
                f"{unit_name} in a step (--global-batch-size / dp); raise --global-batch-size or --max-tokens-per-gpu"
            )
    num_microbatches = counts_t.tolist()
    short = [(i, len(us)) for i, (us, n) in enumerate(zip(step_units, num_microbatches)) if len(us) < n]
    if short:  # fan-out: another DP rank's step needs more micro-batches than this rank has samples
        raise ValueError(
            f"step {short[0][0]} needs {num_microbatches[short[0][0]]} micro-batches on every DP rank but this rank "
            f"holds only {short[0][1]} {unit_name} in it; raise --max-tokens-per-gpu or --global-batch-size"
        )

    micro_batch_indices = []
    for units, lengths, num_mbs in zip(step_units, unit_lengths, num_microbatches):
        workloads = [forward_flops(args, n) for n in lengths] if args.balance_by_flops else None
        parts = get_micro_batch_partitions(lengths, num_mbs, max_tokens, workloads)
        micro_batch_indices.extend([[j for k in part for j in units[k]] for part in parts])
    assert sorted(i for mb in micro_batch_indices for i in mb) == list(range(len(total_lengths)))
    iterators = [
        DataIterator(rollout_data, None, micro_batch_indices, packed_sequences=packed, tree=tree)
        for _ in range(vpp_size)
    ]
    return iterators, num_microbatches


def _tree_units(args, rollout_data, starts, num_local_gbs):
    """`--tree-training` dynamic batching: per step, each prompt group's sample indices (`--n-samples-per-prompt`
    consecutive rollouts, kept together by the DP split) and its tree's unique token count."""
    n = args.n_samples_per_prompt
    if num_local_gbs % n:
        raise ValueError(
            f"--tree-training keeps a prompt group's tree in one step, but global_batch_size/dp = {num_local_gbs} "
            f"rollouts per step is not a multiple of --n-samples-per-prompt {n}"
        )
    tokens, mm = rollout_data["tokens"], rollout_data.get("multimodal_train_inputs")
    num_rollouts = len(starts) - 1
    step_units = [
        [list(range(starts[g], starts[g + n])) for g in range(i, i + num_local_gbs, n)]
        for i in range(0, num_rollouts, num_local_gbs)
    ]

    def unique_tokens(unit):  # as get_batch lays the group out: keyed by images where it has any
        ts = [tokens[j] for j in unit]
        if mm is not None and any(mm[j] is not None for j in unit):
            ts, _ = _keyed_by_images(ts, [mm[j] for j in unit])
        return count_tree_tokens(ts)

    return step_units, [[unique_tokens(u) for u in units] for units in step_units]


def _same_on_every_dp_rank(counts, dp_size):
    """Micro-batch counts per step; they must agree over DP ranks (expert-parallel all-to-alls run per micro-batch)."""
    if dp_size == 1:
        return counts
    gathered = [None] * dp_size
    dist.all_gather_object(gathered, counts, group=mpu.get_data_parallel_group_gloo(with_context_parallel=False))
    if any(g != counts for g in gathered):
        raise ValueError(
            f"fan-out rollouts split into different micro-batch counts per step on the DP ranks ({gathered}) with "
            f"a fixed --micro-batch-size; use --use-dynamic-batch-size (it evens them out)"
        )
    return counts


def get_batch(data_iterator, keys, pad_multiplier=128):
    """Next micro-batch as model input: `tokens` (`[b, s]` padded or `[1, T]` packed), `unconcat_tokens` (the
    per-sample token tensors), `attention_mask`/`position_ids` (padded layout) or `packed_seq_params` (packed),
    plus the requested per-sample `keys` as lists. A packed row is padded to a multiple of TP x `pad_multiplier`
    tokens (`--data-pad-size-multiplier`), as slime does to reduce allocator fragmentation."""
    assert "tokens" in keys, "get_batch needs 'tokens' among the keys"
    batch = data_iterator.get_next(keys)
    tokens = batch["tokens"]
    batch["unconcat_tokens"] = tokens
    mm = batch.get("multimodal_train_inputs")
    images = mm is not None and any(m is not None for m in mm)
    if getattr(data_iterator, "tree", False):
        if images:  # samples with other images never share a node; the model places each sample's images itself
            keys, vocab = _keyed_by_images(tokens, mm)
            batch.update(_tree_layout(keys, data_iterator.tree))
            batch["tokens"] = batch["tokens"] % vocab
            batch["multimodal_train_inputs"] = {"tree_samples": list(zip(batch["tree_index"], mm))}
            return batch
        batch.update(_tree_layout(tokens, data_iterator.tree))
    elif data_iterator.packed_sequences:
        batch.update(_packed_layout(tokens, _tp_size() * pad_multiplier))
    else:
        batch.update(_padded_layout(tokens))
    if "multimodal_train_inputs" in batch:
        merged = merge_multimodal_inputs(mm)
        if merged:  # how many of each key's rows (images, videos) each sample brought: the model matches its own
            merged["rows_per_sample"] = {k: [len(m[k]) if m and k in m else 0 for m in mm] for k in merged}
        batch["multimodal_train_inputs"] = merged
    return batch


def _keyed_by_images(tokens, mm):
    """(tokens + vocab * the index of the sample's image set, vocab): a prefix tree over these keys shares tokens
    only between samples with the same images (two images of one size have identical pad runs: merged on token ids,
    one would get the other's features). 0 for samples without images; `% vocab` gives the tokens back."""
    import hashlib

    vocab = int(max(int(t.max()) for t in tokens)) + 1
    sets, keys = {}, []
    for t, m in zip(tokens, mm):
        digest = None
        if m is not None:
            h = hashlib.blake2b(digest_size=16)
            for name in sorted(m):
                h.update(name.encode() + m[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digest = h.digest()
        index = 0 if digest is None else sets.setdefault(digest, len(sets) + 1)
        keys.append(t + vocab * index)
    return keys, vocab


def _tp_size():
    """Tensor-parallel size; 1 without Megatron's parallel state (a batch built outside a trainer)."""
    return mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1


def _packed_layout(tokens, pad_size):
    # Under CP each sample contributes its zigzag pair of chunks; TE's THD attention and RoPE take global
    # per-sequence lengths, hence cu_seqlens x cp (every local piece has even length, so the global ones split
    # into 2*cp equal chunks, as TE requires).
    cp_size, _ = cp_size_and_rank()
    pieces = [slice_with_cp(t, PAD_TOKEN_ID) for t in tokens]
    flat = torch.cat(pieces)
    cu_seqlens = [0]
    for piece in pieces:
        cu_seqlens.append(cu_seqlens[-1] + piece.size(0))
    pad = -flat.size(0) % pad_size
    if pad:
        flat = F.pad(flat, (0, pad), value=PAD_TOKEN_ID)
        cu_seqlens.append(cu_seqlens[-1] + pad)  # the padding is its own segment, attended by nothing real
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=flat.device) * cp_size
    max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen
    )
    return {"tokens": flat.unsqueeze(0), "packed_seq_params": params, "attention_mask": None, "position_ids": None}


def _padded_layout(tokens):
    """Under CP every row is padded to 2*cp chunks of one common length and the rank keeps its zigzag pair of
    chunks: the query rows of the mask are cut to them, the key columns stay global (the CP attention gathers
    keys and values over the CP group)."""
    cp_size, cp_rank = cp_size_and_rank()
    lengths = torch.tensor([t.size(0) for t in tokens])
    b, s = len(tokens), int(lengths.max())
    if cp_size > 1:
        s = 2 * cp_size * zigzag_chunk_size(s, cp_size)
    device = tokens[0].device
    padded = torch.full((b, s), PAD_TOKEN_ID, dtype=torch.long, device=device)
    for i, t in enumerate(tokens):
        padded[i, : t.size(0)] = t
    # Megatron's convention: True = masked out. Causal within the row, and no attention to padding keys.
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    key_valid = torch.arange(s, device=device)[None, :] < lengths.to(device)[:, None]
    attention_mask = ~(causal[None, None] & key_valid[:, None, None, :])
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    if cp_size > 1:
        local = torch.cat(
            [torch.arange(lo, hi, device=device) for lo, hi in zigzag_ranges(s // (2 * cp_size), cp_size, cp_rank)]
        )
        padded, position_ids, attention_mask = padded[:, local], position_ids[:, local], attention_mask[:, :, local]
    return {
        "tokens": padded,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "packed_seq_params": None,
    }


def build_token_tree(tokens):
    """Prefix tree (trie) of the samples' token sequences, laid out in DFS order: `(node_tokens [L], parent [L],
    depth [L], subtree_end [L], sample_index)` where node j is the j-th token of the layout, `parent[j]` its
    parent's layout index (-1 for a root), `depth[j]` its position in every sample that passes through it,
    `subtree_end[j]` the last layout index of its subtree, and `sample_index[i]` the `[T_i]` layout indices of
    sample i's tokens (`node_tokens[sample_index[i]] == tokens[i]`). Samples sharing a prefix share its nodes: a
    GRPO group's prompt is laid out once; identical samples, or one that is a prefix of another, map onto the same
    nodes. Children are visited in order of first appearance, so the layout is deterministic."""
    children = [{}]  # node 0 is the virtual root; trie nodes are numbered in insertion order
    node_token = [None]
    paths = []
    for t in tokens:
        node, path = 0, []
        for tok in t.tolist():
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(children)
                children[node][tok] = nxt
                children.append({})
                node_token.append(tok)
            path.append(nxt)
            node = nxt
        paths.append(path)
    n = len(children) - 1
    order = [0] * (n + 1)  # trie node -> layout index
    layout_tokens, parent, depth, end = [], [], [], [0] * n
    stack = [(c, -1, 0) for c in reversed(list(children[0].values()))]
    # iterative DFS; a node's subtree ends just before the next node whose depth is not larger
    while stack:
        node, par, d = stack.pop()
        order[node] = len(layout_tokens)
        layout_tokens.append(node_token[node])
        parent.append(par)
        depth.append(d)
        me = order[node]
        stack.extend((c, me, d + 1) for c in reversed(list(children[node].values())))
    open_nodes = []  # the current DFS path: close every node whose subtree is over
    for j, d in enumerate(depth):
        while open_nodes and depth[open_nodes[-1]] >= d:
            end[open_nodes.pop()] = j - 1
        open_nodes.append(j)
    for j in open_nodes:
        end[j] = n - 1
    device = tokens[0].device
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    # every sample's indices in one tensor, split into views: one conversion, not one per sample
    index = as_long([order[v] for path in paths for v in path]).split([len(path) for path in paths])
    return as_long(layout_tokens), as_long(parent), as_long(depth), as_long(end), list(index)


def _tree_layout(tokens, attention="dense"):
    """`--tree-training`: the micro-batch as one row holding its prefix forest in DFS order (`build_token_tree`),
    with an ancestor mask (a token attends to itself and its ancestors only: key k is visible from query q iff
    k <= q <= subtree_end[k]; other trees of the forest are never ancestors) and `position_ids` = depth, so
    every token sees exactly the keys and positions it has in its own flat row; the row is padded to a multiple of
    TP. `tree_index` ([T_i] layout
    indices per sample) lets `model._forward` gather each sample's logit rows back into the flat padded layout,
    so everything downstream (log-probs, entropy, values, losses) is per sample and unchanged."""
    if cp_size_and_rank()[0] > 1:
        raise NotImplementedError("--tree-training does not support context parallelism yet")
    node_tokens, _, depth, end, index = build_token_tree(tokens)
    pad = -node_tokens.numel() % _tp_size()  # sequence parallelism splits the row over TP ranks
    if pad:  # padding tokens see only themselves (no empty softmax row) and are seen by no real token
        n = node_tokens.numel()
        node_tokens = F.pad(node_tokens, (0, pad), value=PAD_TOKEN_ID)
        depth = F.pad(depth, (0, pad), value=0)
        end = torch.cat([end, torch.arange(n, n + pad, device=end.device)])
    if attention == "flex":  # --tree-attention-backend flex: the same mask as FlexAttention blocks
        mask = tree_block_mask(end)
    else:
        q = torch.arange(node_tokens.numel(), device=node_tokens.device)
        visible = (q[None, :] <= q[:, None]) & (q[:, None] <= end[None, :])  # [q, k]
        mask = ~visible[None, None]  # Megatron's convention: True = masked out
    return {
        "tokens": node_tokens.unsqueeze(0),
        "attention_mask": mask,
        "position_ids": depth.unsqueeze(0),
        "packed_seq_params": None,
        "tree_index": index,
    }


def unpack_tree_output(output, tree_index):
    """The model's `[1, L, ...]` output on a tree row as the flat padded layout's `[b, s, ...]`: row i holds
    sample i's token outputs at positions 0..T_i-1 (a differentiable gather; positions past T_i repeat node 0
    and are never read)."""
    gather = torch.nn.utils.rnn.pad_sequence([idx.to(output.device) for idx in tree_index], batch_first=True)
    return output[0][gather]


# token-level values logged as per-sample means over the loss-masked tokens (current slime's per-rollout-mean keys)
_TRAINED_TOKEN_MEAN_KEYS = (
    "log_probs",
    "ref_log_probs",
    "rollout_log_probs",
    "returns",
    "advantages",
    "values",
    "teacher_log_probs",
    "opd_reverse_kl",
)


def _aligned(masks, values):
    return (
        masks is not None and len(masks) == len(values) and all(m.numel() == v.numel() for m, v in zip(masks, values))
    )


def log_rollout_data(rollout_id, args, rollout_data):
    """`{"rollout/<key>": value}` averaged over the whole rollout's samples (summed over DP ranks, then divided):
    per-sample means over the trained tokens for log-probs, returns, advantages and values, token means for other
    token-level tensors (kl, entropy), plain means for per-sample numbers (other values are skipped). Computed on TP rank 0 of the last
    pipeline stage (other ranks return `{}`); every such rank returns the same dict."""
    if mpu.get_tensor_model_parallel_rank() != 0 or not mpu.is_pipeline_last_stage():
        return {}
    local = {}  # key: (sum, count); with fan-out the DP ranks hold different sample counts
    masks = rollout_data.get("loss_masks")
    skip = ("tokens", "loss_masks", "sample_indices", "global_indices", "rollout_routed_experts", *TOP_P_KEYS)
    skip += (TEMPERATURES_KEY,)
    skip += ("rollout_ids", "rollout_sizes", "rollout_mask_sums", "rollout_weights", "multimodal_train_inputs")
    for key, val in rollout_data.items():
        if key in skip or val is None:
            continue
        if isinstance(val, torch.Tensor):
            local[key] = (val.float().mean().item(), 1)
        elif isinstance(val, (list, tuple)) and len(val) > 0:
            if isinstance(val[0], torch.Tensor) and key in _TRAINED_TOKEN_MEAN_KEYS and _aligned(masks, val):
                # as current slime: each sample's mean over its trained tokens, averaged over samples
                means = [(v.float() * m.float()).sum() / m.float().sum().clamp_min(1) for v, m in zip(val, masks)]
                local[key] = (float(sum(means)), len(val))
            elif isinstance(val[0], torch.Tensor):  # as current slime: a mean over every token
                local[key] = (float(sum(v.float().sum() for v in val)), sum(v.numel() for v in val))
            elif isinstance(val[0], numbers.Number):
                local[key] = (float(sum(val)), len(val))
    correct = _correct_sample_sums(args, rollout_data) if args.log_correct_samples else None
    gathered = [None] * _dp_size()
    dist.all_gather_object(
        gathered, (local, correct), group=mpu.get_data_parallel_group_gloo(with_context_parallel=False)
    )
    out = {
        f"rollout/{key}": sum(d[key][0] for d, _ in gathered) / sum(d[key][1] for d, _ in gathered) for key in local
    }
    if args.log_correct_samples:
        out.update(_correct_sample_metrics([c for _, c in gathered]))
    return out


def _correct_sample_sums(args, rollout_data):
    """This DP rank's sums over its samples whose raw reward is 1 (`--log-correct-samples`): count, response
    lengths, how many fall in each quarter of --rollout-max-response-len (a length counts in the first quarter
    whose upper end it does not exceed; longer ones in none), and the per-sample mean of -log p over loss-masked
    tokens where the trainer computed log-probs before training."""
    raw = rollout_data.get("raw_reward")
    if raw is None:
        return None
    idx = [i for i, g in enumerate(rollout_data["global_indices"]) if raw[g] == 1]
    max_len = args.rollout_max_response_len
    cuts = [max_len * (q + 1) / 4 for q in range(4)]
    sums = {"n": len(idx), "length": 0, "quarters": [0] * 4}
    for i in idx:
        length = rollout_data["response_lengths"][i]
        sums["length"] += length
        quarter = next((q for q, cut in enumerate(cuts) if length <= cut), None)
        if quarter is not None:
            sums["quarters"][quarter] += 1
    if "log_probs" in rollout_data:
        nll = 0.0
        for i in idx:
            mask = rollout_data["loss_masks"][i].float()
            nll += (-(rollout_data["log_probs"][i].float() * mask).sum() / mask.sum().clamp_min(1)).item()
        sums["nll"] = nll
    return sums


def _correct_sample_metrics(per_rank):
    """Rollout-wide metrics of the correct samples (names as slime's `--log-correct-samples`): mean response
    length, the fraction in each length quarter, and the mean per-sample -log p (`correct_entropy`)."""
    per_rank = [c for c in per_rank if c is not None]
    n = sum(c["n"] for c in per_rank)
    if n == 0:
        return {}
    out = {"rollout/correct_response_lengths": sum(c["length"] for c in per_rank) / n}
    bucketed = [sum(c["quarters"][q] for c in per_rank) for q in range(4)]
    for q, count in enumerate(bucketed):
        out[f"rollout/correct_length/p{25 * (q + 1)}"] = count / max(sum(bucketed), 1)
    if all("nll" in c for c in per_rank):
        out["rollout/correct_entropy"] = sum(c["nll"] for c in per_rank) / n
    return out
