"""Rollout data on the trainer side: fetch + DP partition (`process_rollout_data`), micro-batch iteration
(`DataIterator`) and the first-fit micro-batch count used by dynamic batching. Imports no Megatron module."""

import numpy as np
import ray
import torch
import torch.distributed as dist

from slime.observability.timer import Timer
from slime.utils.device import current_device
from slime.utils.flops_utils import forward_flops
from slime.utils.sampling_record import TEMPERATURES_KEY
from slime.utils.seqlen_balancing import get_seqlen_balanced_partitions
from slime.utils.types import OPTIONAL_TRAIN_DATA_KEYS, TRAIN_DATA_KEYS

# Per-sample keys split across DP ranks: the train-data contract's (slime.utils.types.TrainData), the lengths and
# fan-out loss weights added here and the critic's values (PPO); `raw_reward` stays global (logged over the whole
# rollout).
PARTITIONED_KEYS = (
    "total_lengths",
    "values",
    "returns",
    "rollout_mask_sums",
    "rollout_weights",
    *(k for k in TRAIN_DATA_KEYS + OPTIONAL_TRAIN_DATA_KEYS if k != "raw_reward"),
)


class DataIterator:
    """Hands out micro-batches of a rank's rollout data: fixed-size consecutive slices (`micro_batch_size`) or
    explicit index lists per micro-batch (`micro_batch_indices`, dynamic batching).

    `packed_sequences` tells the batch builder the model takes THD-packed rows (TE attention) rather than a
    right-padded `[b, s]` batch; it is decided once, where the iterator is built, by the same check as the layer spec.
    `tree` (`--tree-training`) asks for the prefix-tree layout instead (`data._tree_layout`).
    """

    def __init__(
        self, rollout_data, micro_batch_size=None, micro_batch_indices=None, packed_sequences=False, tree=False
    ):
        assert (micro_batch_size is None) != (micro_batch_indices is None), (
            "give exactly one of micro_batch_size / micro_batch_indices"
        )
        self.rollout_data = rollout_data
        self.micro_batch_size = micro_batch_size
        self.micro_batch_indices = micro_batch_indices
        self.packed_sequences = packed_sequences
        # --tree-training: the batch builder packs the micro-batch as a prefix tree, its attention "dense" or "flex"
        self.tree = tree
        self.offset = 0

    def get_next(self, keys):
        """`{key: values of this micro-batch}` for each key (None where the data has no such key); advances."""
        batch = {}
        for key in keys:
            vals = self.rollout_data.get(key)
            if vals is None:
                batch[key] = None
            elif self.micro_batch_indices is not None:
                batch[key] = [vals[i] for i in self.micro_batch_indices[self.offset]]
            else:
                assert self.offset + self.micro_batch_size <= len(vals), (
                    f"micro-batch [{self.offset}, {self.offset + self.micro_batch_size}) runs past the {len(vals)} samples of {key!r}"
                )
                batch[key] = vals[self.offset : self.offset + self.micro_batch_size]
        self.offset += 1 if self.micro_batch_indices is not None else self.micro_batch_size
        return batch

    def reset(self):
        self.offset = 0
        return self


def _first_fit(total_lengths, max_tokens_per_gpu):
    """First-fit bins of sample indices, each within `max_tokens_per_gpu` tokens unless it holds one longer sample."""
    bins, used = [], []
    for i, length in enumerate(total_lengths):
        for b in range(len(bins)):
            if used[b] + length <= max_tokens_per_gpu:
                bins[b].append(i)
                used[b] += length
                break
        else:
            bins.append([i])
            used.append(length)
    return bins


def get_minimum_num_micro_batch_size(total_lengths, max_tokens_per_gpu):
    """Number of micro-batches first-fit packing needs so none exceeds `max_tokens_per_gpu` tokens
    (a single longer sample gets a micro-batch of its own)."""
    return len(_first_fit(total_lengths, max_tokens_per_gpu))


def get_micro_batch_partitions(total_lengths, num_micro_batches, max_tokens_per_gpu, workloads=None):
    """Split one step's samples into exactly `num_micro_batches` index lists with balanced token counts (or
    `workloads`, e.g. FLOPs, one per sample), none over `max_tokens_per_gpu` tokens (except a lone over-long sample).
    `num_micro_batches` must be at least the first-fit count.

    Karmarkar-Karp balances sums but ignores the cap; in the rare case it overshoots, split the first-fit packing
    (which fits by construction) until there are enough micro-batches.
    """
    parts = get_seqlen_balanced_partitions(workloads or total_lengths, num_micro_batches, equal_size=False)
    if all(len(p) == 1 or sum(total_lengths[i] for i in p) <= max_tokens_per_gpu for p in parts):
        return parts
    bins = _first_fit(total_lengths, max_tokens_per_gpu)
    assert len(bins) <= num_micro_batches, f"{num_micro_batches} micro-batches cannot hold {len(bins)} first-fit bins"
    while len(bins) < num_micro_batches:
        largest = max(bins, key=len)
        bins.append([largest.pop()])
    return [sorted(b) for b in bins]


def count_tree_tokens(token_lists):
    """Unique tokens of the samples' prefix tree (`--tree-training`): the nodes of their token trie, i.e. what a
    micro-batch holding exactly these samples forwards (`data.build_token_tree`, before padding to TP)."""
    root, count = {}, 0
    for t in token_lists:
        node = root
        for tok in np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t).tolist():
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                count += 1
            node = nxt
    return count


def _balanced_dp_partitions(workloads, dp_size, n_samples_per_prompt, flag="--balance-data", group_workload=sum):
    """Karmarkar-Karp over whole prompt groups (`n_samples_per_prompt` consecutive rollouts, their workloads
    combined by `group_workload`), expanded back to rollout positions per DP rank."""
    n = n_samples_per_prompt
    if len(workloads) % n != 0:
        raise ValueError(
            f"{flag} keeps prompt groups together, but {len(workloads)} rollouts are not a "
            f"multiple of --n-samples-per-prompt {n}"
        )
    num_groups = len(workloads) // n
    if num_groups % dp_size != 0:
        raise ValueError(
            f"{flag} gives every DP rank the same number of prompt groups, but {num_groups} groups "
            f"do not divide over {dp_size} DP ranks; change --rollout-batch-size"
            + (" or turn off --balance-data" if flag == "--balance-data" else "")
        )
    group_workloads = [group_workload(workloads[g * n : (g + 1) * n]) for g in range(num_groups)]
    group_parts = get_seqlen_balanced_partitions(group_workloads, dp_size, equal_size=True)
    return [[g * n + j for g in groups for j in range(n)] for groups in group_parts]


def group_by_rollout(rollout_ids):
    """Sample positions per rollout, rollouts in first-occurrence order (fan-out siblings share a rollout id)."""
    groups = {}
    for i, rid in enumerate(rollout_ids):
        groups.setdefault(rid, []).append(i)
    return list(groups.values())


def _add_rollout_weights(data, rollouts):
    """Fan-out: each sample's loss is averaged over its whole rollout's loss-masked tokens (`rollout_mask_sums`, the
    same for all siblings), so a rollout counts once however many samples it split into; `rollout_weights`
    (1 / its sample count) makes the logged per-sample means per-rollout means."""
    sums, weights = [0] * len(data["tokens"]), [0.0] * len(data["tokens"])
    for r in rollouts:
        total = int(sum(int(np.asarray(data["loss_masks"][i]).sum()) for i in r))
        for i in r:
            sums[i], weights[i] = total, 1.0 / len(r)
    data["rollout_mask_sums"], data["rollout_weights"] = sums, weights


def _fetch_rollout_data(rollout_data_ref):
    """Global rank 0 pulls the dict from the object store once and broadcasts it to every trainer rank."""
    multi_rank = dist.is_initialized() and dist.get_world_size() > 1
    if not multi_rank or dist.get_rank() == 0:
        data = ray.get(rollout_data_ref.inner)
        if not multi_rank:
            return data
        holder = [data]
    else:
        holder = [None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def process_rollout_data(args, rollout_data_ref, dp_rank, dp_size, values_ref=None):
    """This DP rank's share of a rollout (`Box(ObjectRef)` of the controller's train-data dict), plus the critic's
    `values` from `values_ref` (a `Box` of `{"values": [per-sample arrays in rollout order]}`) when given, and the
    `returns` and `phase` it may also hold (`slime.ray.critic.train_step` with `--kl-coef` != 0).

    Adds `total_lengths`, `global_indices` (each local sample's index in the rollout) and `rollout_sizes` (the sample
    count of each local rollout, in order); tokens become LongTensors and loss masks IntTensors on the training
    device, rollout log-probs float32 tensors. Partition over rollouts (a sample, or a fan-out call's samples):
    strided `rollouts[dp_rank::dp_size]`, or with `--balance-data` Karmarkar-Karp over whole prompt groups so every
    rank gets about the same number of tokens (`--tree-training`: the same over groups, by unique tree tokens).
    """
    data = _fetch_rollout_data(rollout_data_ref)
    missing = [k for k in TRAIN_DATA_KEYS if k not in data]
    if missing:
        raise KeyError(
            f"rollout data has no {', '.join(missing)} (keys: {sorted(data)}); a custom rollout/convert function must "
            "produce the train data of slime.utils.types.TrainData"
        )
    extra = _fetch_rollout_data(values_ref) if values_ref is not None else {}
    for key in ("values", "returns"):  # the critic's values; the actor's returns for the critic (--kl-coef != 0)
        if extra.get(key) is not None:
            data[key] = extra[key]
    data["total_lengths"] = [len(t) for t in data["tokens"]]
    Timer().seq_lens = data["total_lengths"]  # whole-rollout lengths, for FLOPs accounting

    # The unit of the DP split (and of optimizer steps, get_data_iterator) is the rollout: one sample, or all
    # samples of one fan-out generate call, which stay on one rank and in one step.
    rollouts = group_by_rollout(data.get("rollout_ids") or range(len(data["tokens"])))
    expected = args.rollout_batch_size * args.n_samples_per_prompt
    if len(rollouts) != expected:
        raise ValueError(
            f"the rollout holds {len(rollouts)} rollouts ({len(data['tokens'])} samples) but the trainer takes "
            f"--rollout-batch-size x --n-samples-per-prompt = {expected} per rollout step; the rollout function "
            "must return that many (a generate function returning several samples of one rollout gives them the "
            "same Sample.rollout_id)"
        )
    if getattr(args, "tree_training", False):
        # a group's samples share their prompt's prefix tree only on one rank: split by groups, balance tree tokens
        tokens = data["tokens"]
        mine = [
            rollouts[k]
            for k in _balanced_dp_partitions(
                [[tokens[i] for i in r] for r in rollouts],
                dp_size,
                args.n_samples_per_prompt,
                flag="--tree-training",
                group_workload=lambda group: count_tree_tokens([t for r in group for t in r]),
            )[dp_rank]
        ]
    elif args.balance_data:
        workloads = data["total_lengths"]
        if args.balance_by_flops:
            workloads = [forward_flops(args, n) for n in workloads]
        workloads = [sum(workloads[i] for i in r) for r in rollouts]
        mine = [rollouts[k] for k in _balanced_dp_partitions(workloads, dp_size, args.n_samples_per_prompt)[dp_rank]]
    else:
        mine = rollouts[dp_rank::dp_size]
    indices = [i for r in mine for i in r]
    if len(rollouts) < len(data["tokens"]):
        _add_rollout_weights(data, rollouts)

    def partition(vals):
        return [vals[i] for i in indices]

    device = current_device()
    rollout_data = {"raw_reward": data["raw_reward"]} if "raw_reward" in data else {}
    rollout_data["global_indices"] = indices
    if extra.get("phase"):  # the driver's step protocol with a critic (slime.ray.critic.train_step); callers pop it
        rollout_data["phase"] = extra["phase"]
    rollout_data["rollout_sizes"] = [len(r) for r in mine]
    for key in PARTITIONED_KEYS:
        if key not in data or data[key] is None:
            continue
        vals = partition(data[key])
        # torch.tensor copies: arrays from the object store are read-only views of shared memory
        if key == "tokens":
            vals = [torch.tensor(np.asarray(t), dtype=torch.long, device=device) for t in vals]
        elif key == "loss_masks":
            vals = [torch.tensor(np.asarray(m), dtype=torch.int, device=device) for m in vals]
        elif key == "rollout_routed_experts":  # [tokens - 1, layers, top-k]; int64 is what the router gathers with
            vals = [torch.tensor(np.asarray(v), dtype=torch.long, device=device) for v in vals]
        elif key in ("rollout_top_p_token_ids", "rollout_top_p_token_offsets"):
            vals = [torch.tensor(np.asarray(v), dtype=torch.long, device=device) for v in vals]
        elif key == "multimodal_train_inputs":  # per sample: None (text only) or the processor's tensors
            vals = [None if d is None else {k: torch.as_tensor(v).to(device) for k, v in d.items()} for d in vals]
        elif key in ("rollout_log_probs", "teacher_log_probs", "values", "returns", TEMPERATURES_KEY):
            vals = [torch.tensor(np.asarray(lp), dtype=torch.float32, device=device) for lp in vals]
        rollout_data[key] = vals
    return rollout_data
