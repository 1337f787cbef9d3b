"""Rollout data on the trainer: Karmarkar-Karp balancing, micro-batch counts and dynamic
batching, DataIterator, DP partition of a rollout (`process_rollout_data`, incl. --balance-data and the rank-0
broadcast), model-input layouts of `get_batch` (padded layout checked against transformers through a TP=2 Megatron
model), and `log_rollout_data`."""

import numpy as np
import pytest
import torch

from slime.backends.megatron_utils.rollout_data import (
    DataIterator,
    get_micro_batch_partitions,
    get_minimum_num_micro_batch_size,
    process_rollout_data,
)
from slime.utils.flops_utils import forward_flops
from slime.utils.ray_utils import Box
from slime.utils.seqlen_balancing import get_seqlen_balanced_partitions
from tests._args import make_args
from tests._megatron_helpers import build_random_hf, megatron_args, spawn


def _sums(lengths, parts):
    return [sum(lengths[i] for i in p) for p in parts]


# ---------------------------------------------------------------- Karmarkar-Karp
def test_karmarkar_karp_hand_cases():
    # the textbook largest-differencing example: {8,7,6,5,4} -> spread 2 (16 vs 14)
    parts = get_seqlen_balanced_partitions([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(_sums([8, 7, 6, 5, 4], parts)) == [14, 16]
    # equal size: one long and one short sequence per partition
    lengths = [10, 10, 10, 1, 1, 1]
    parts = get_seqlen_balanced_partitions(lengths, 3, equal_size=True)
    assert _sums(lengths, parts) == [11, 11, 11] and all(len(p) == 2 for p in parts)
    parts = get_seqlen_balanced_partitions([1, 2, 3, 4, 5, 6], 2, equal_size=True)
    assert sorted(_sums([1, 2, 3, 4, 5, 6], parts)) == [10, 11] and all(len(p) == 3 for p in parts)
    # every index exactly once, each partition sorted and non-empty
    parts = get_seqlen_balanced_partitions([3, 1, 4, 1, 5, 9, 2, 6], 4, equal_size=False)
    assert sorted(i for p in parts for i in p) == list(range(8)) and all(p == sorted(p) and p for p in parts)
    assert max(_sums([3, 1, 4, 1, 5, 9, 2, 6], parts)) == 9  # 31 tokens; the 9 alone bounds the max


def test_karmarkar_karp_beats_naive_split_on_skewed_lengths():
    g = np.random.default_rng(0)
    lengths = [int(x) for x in g.integers(10, 2000, size=64)]
    parts = get_seqlen_balanced_partitions(lengths, 8, equal_size=True)
    sums = _sums(lengths, parts)
    strided = [sum(lengths[r::8]) for r in range(8)]
    assert max(sums) - min(sums) < (max(strided) - min(strided)) / 5
    assert max(sums) - min(sums) <= max(lengths) // 4


def test_karmarkar_karp_rejects_impossible_requests():
    with pytest.raises(ValueError, match="3 sequences into 4"):
        get_seqlen_balanced_partitions([1, 2, 3], 4, equal_size=False)
    with pytest.raises(ValueError, match="multiple of 2"):
        get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)


# ---------------------------------------------------------------- micro-batching
def test_first_fit_micro_batch_counts():
    assert get_minimum_num_micro_batch_size([5, 5, 5, 5], 10) == 2
    assert get_minimum_num_micro_batch_size([6, 6, 4, 4], 10) == 2  # 6+4, 6+4
    assert get_minimum_num_micro_batch_size([3, 8, 3, 8], 11) == 2
    assert get_minimum_num_micro_batch_size([11, 1], 10) == 2  # an over-long sample gets its own micro-batch
    assert get_minimum_num_micro_batch_size([1] * 7, 100) == 1


def test_dynamic_micro_batches_respect_max_tokens():
    # Karmarkar-Karp alone would put 7+5+5=17 tokens in one of 3 micro-batches here; the cap is 16
    lengths = [5, 3, 7, 5, 6, 5, 7, 7]
    parts = get_micro_batch_partitions(lengths, 3, 16)
    assert len(parts) == 3 and max(_sums(lengths, parts)) <= 16
    g = np.random.default_rng(1)
    for _ in range(300):
        lengths = [int(x) for x in g.integers(1, 50, size=int(g.integers(2, 20)))]
        cap = int(g.integers(50, 120))
        k = get_minimum_num_micro_batch_size(lengths, cap) + int(g.integers(0, 2))
        k = min(k, len(lengths))
        parts = get_micro_batch_partitions(lengths, k, cap)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(lengths)))
        assert max(_sums(lengths, parts)) <= cap, (lengths, cap, k, parts)


def test_forward_flops_of_the_tiny_model_by_hand():
    args = make_args()  # 2 layers, hidden 64, 4 heads of 16, ffn 256 (no gate), no vocabulary given
    # per token: QKV 64*(4+2*4)*16 + out 4*16*64 + MLP 64*256*2 = 49152 weights -> 2*L*49152 FLOPs per layer;
    # QK^T and AV over the causal half: 2 * 2*4*16 * L^2/2 = 128 L^2
    assert forward_flops(args, 10) == 2 * (2 * 10 * 49152 + 128 * 10**2)
    swiglu = make_args("--swiglu", "--ffn-hidden-size", "256", "--vocab-size", "1000")
    assert forward_flops(swiglu, 1) == 2 * (2 * (12288 + 4096 + 64 * 256 * 3) + 128) + 2 * 64 * 1000


def test_balance_by_flops_packs_long_samples_apart():
    # 2 micro-batches of at most 4000 tokens. By tokens the best split is 3000 | 3000 ({1000 1000 1000} and
    # {2000 1000}); by FLOPs the 2000-token sample (attention ~ L^2: 4x a 1000-token one) is worth more than its
    # tokens, so it goes alone: 1000*4 | 2000
    lengths = [1000, 1000, 1000, 1000, 2000]
    args = make_args("--use-dynamic-batch-size", "--max-tokens-per-gpu", "4000", "--balance-by-flops")
    by_tokens = get_micro_batch_partitions(lengths, 2, 4000)
    by_flops = get_micro_batch_partitions(lengths, 2, 4000, [forward_flops(args, n) for n in lengths])
    assert sorted(_sums(lengths, by_tokens)) == [3000, 3000]
    assert sorted(by_flops) == [[0, 1, 2, 3], [4]]
    flops = [forward_flops(args, n) for n in lengths]
    assert max(_sums(flops, by_flops)) < max(_sums(flops, by_tokens))
    # the token cap still holds: three 2000-token samples never share a micro-batch of 4000
    parts = get_micro_batch_partitions(
        [2000, 2000, 2000, 10], 3, 4000, [forward_flops(args, n) for n in [2000] * 3 + [10]]
    )
    assert max(_sums([2000, 2000, 2000, 10], parts)) <= 4000


def _micro_batches_by_flops(rank):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator

    mpu.initialize_model_parallel(1, 1)
    lengths = [1000, 1000, 1000, 1000, 2000]
    for flag, expected in (([], [[1000, 1000, 1000], [1000, 2000]]), (["--balance-by-flops"], [[1000] * 4, [2000]])):
        args = make_args(
            *["--rollout-batch-size", "5", "--n-samples-per-prompt", "1", "--global-batch-size", "5"],
            *["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4000", "--transformer-impl", "local", *flag],
        )
        [it], num_mbs = get_data_iterator(args, None, {"total_lengths": lengths})
        assert num_mbs == [2]
        assert sorted(it.get_next(["total_lengths"])["total_lengths"] for _ in range(2)) == expected, flag


def test_the_trainers_micro_batches_follow_balance_by_flops():
    spawn(_micro_batches_by_flops, 1)


def test_balance_by_flops_needs_dynamic_batches(capsys):
    with pytest.raises(SystemExit):
        make_args("--balance-by-flops")
    assert "--balance-by-flops balances the micro-batches of --use-dynamic-batch-size" in capsys.readouterr().err


def test_data_iterator_static_dynamic_and_reset():
    data = {"tokens": list(range(6)), "rewards": [0.1 * i for i in range(6)]}
    it = DataIterator(data, micro_batch_size=2)
    assert it.get_next(["tokens", "missing"]) == {"tokens": [0, 1], "missing": None}
    assert it.get_next(["tokens"])["tokens"] == [2, 3]
    assert it.get_next(["rewards"])["rewards"] == pytest.approx([0.4, 0.5])
    with pytest.raises(AssertionError):
        it.get_next(["tokens"])
    assert it.reset().get_next(["tokens"])["tokens"] == [0, 1]
    it = DataIterator(data, micro_batch_indices=[[0, 5], [1, 2, 3], [4]])
    assert [it.get_next(["tokens"])["tokens"] for _ in range(3)] == [[0, 5], [1, 2, 3], [4]]


# ---------------------------------------------------------------- process_rollout_data
def _train_data(num_groups=4, n=2):
    g = np.random.default_rng(2)
    lengths = [int(x) for x in g.integers(4, 40, size=num_groups * n)]
    resp = [length // 2 for length in lengths]
    return {
        "tokens": [np.arange(length, dtype=np.int64) for length in lengths],
        "response_lengths": resp,
        "rewards": [float(i) for i in range(len(lengths))],
        "raw_reward": [float(i % 2) for i in range(len(lengths))],
        "truncated": [0] * len(lengths),
        "sample_indices": list(range(len(lengths))),
        "loss_masks": [np.ones(r, dtype=np.int32) for r in resp],
        "rollout_log_probs": [np.full(r, -0.5, dtype=np.float32) for r in resp],
    }


def test_process_rollout_data_strided_and_balanced(ray_session):
    from slime.observability.timer import Timer

    data = _train_data()
    ref = Box(ray_session.put(data))
    args = make_args()
    shards = [process_rollout_data(args, ref, r, 2) for r in range(2)]
    assert shards[0]["sample_indices"] == [0, 2, 4, 6] and shards[1]["sample_indices"] == [1, 3, 5, 7]
    s = shards[1]
    assert s["total_lengths"] == [len(data["tokens"][i]) for i in (1, 3, 5, 7)]
    assert all(t.dtype == torch.long for t in s["tokens"]) and torch.equal(
        s["tokens"][0], torch.arange(len(data["tokens"][1]))
    )
    assert all(m.dtype == torch.int32 for m in s["loss_masks"])
    assert all(lp.dtype == torch.float32 for lp in s["rollout_log_probs"])
    assert s["raw_reward"] == data["raw_reward"]  # stays global, for logging
    assert Timer().seq_lens == [len(t) for t in data["tokens"]]

    args = make_args("--balance-data")
    shards = [process_rollout_data(args, ref, r, 2) for r in range(2)]
    idx = [sh["sample_indices"] for sh in shards]
    assert sorted(idx[0] + idx[1]) == list(range(8))
    for ix in idx:  # prompt groups stay whole on one rank
        assert len(ix) == 4 and all(i // 2 == j // 2 for i, j in zip(ix[::2], ix[1::2]))
    group_len = [len(data["tokens"][2 * g]) + len(data["tokens"][2 * g + 1]) for g in range(4)]
    best = get_seqlen_balanced_partitions(group_len, 2, equal_size=True)
    assert sorted(sum(sh["total_lengths"]) for sh in shards) == sorted(_sums(group_len, best))

    with pytest.raises(ValueError, match="do not divide over 3 DP ranks"):
        process_rollout_data(args, ref, 0, 3)


# ---------------------------------------------------------------- get_batch layouts
def test_get_batch_padded_layout():
    from slime.backends.megatron_utils.data import get_batch

    tokens = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 9]), torch.tensor([8, 8])]
    data = {"tokens": tokens, "total_lengths": [3, 5, 2], "response_lengths": [1, 2, 1]}
    batch = get_batch(
        DataIterator(data, micro_batch_size=3), ["tokens", "total_lengths", "response_lengths", "advantages"]
    )
    assert batch["tokens"].tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 9], [8, 8, 0, 0, 0]]
    assert (
        all(a is b for a, b in zip(batch["unconcat_tokens"], tokens))
        and batch["packed_seq_params"] is None
        and batch["advantages"] is None
    )
    assert batch["position_ids"].tolist() == [list(range(5))] * 3
    mask = batch["attention_mask"]  # True = masked
    assert mask.shape == (3, 1, 5, 5) and mask.dtype == torch.bool
    allowed = ~mask[0, 0]
    assert allowed[2].tolist() == [True, True, True, False, False]  # causal, padding keys hidden
    assert allowed[0].tolist() == [True, False, False, False, False]
    assert (~mask[1, 0]).sum().item() == 15  # full causal triangle of a 5-token row


def test_get_batch_packed_layout():
    from slime.backends.megatron_utils.data import get_batch

    tokens = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 9]), torch.tensor([8, 8])]
    it = DataIterator({"tokens": tokens}, micro_batch_size=3, packed_sequences=True)
    batch = get_batch(it, ["tokens"])
    assert batch["tokens"].shape == (1, 128) and batch["tokens"][0, :10].tolist() == [5, 6, 7, 1, 2, 3, 4, 9, 8, 8]
    assert batch["tokens"][0, 10:].eq(0).all()
    p = batch["packed_seq_params"]
    assert (
        p.qkv_format == "thd" and p.cu_seqlens_q.tolist() == [0, 3, 8, 10, 128] and p.cu_seqlens_q.dtype == torch.int32
    )
    assert p.max_seqlen_q == p.max_seqlen_kv == 118 and batch["attention_mask"] is None


# ---------------------------------------------------------------- multi-rank: DP=2 and TP=2
def _dp2_iterators_logging_and_broadcast(rank, gcs_address, data):
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator, log_rollout_data

    mpu.initialize_model_parallel(1, 1)
    if rank == 0:
        ray.init(address=gcs_address, log_to_driver=False)
        ref = Box(ray.put(data))
    else:
        ref = Box(None)  # only global rank 0 touches the object store
    args = make_args(
        "--global-batch-size",
        "4",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "40",
        "--transformer-impl",
        "local",
    )
    local = process_rollout_data(args, ref, rank, 2)
    if rank == 0:
        ray.shutdown()
    assert local["sample_indices"] == list(range(rank, 8, 2))

    iterators, num_mbs = get_data_iterator(args, None, local)
    lengths = local["total_lengths"]
    own = [get_minimum_num_micro_batch_size(lengths[i * 2 : (i + 1) * 2], 40) for i in range(2)]
    expected = _expected_dp2_counts(data)
    assert num_mbs == expected and all(m >= o for m, o in zip(num_mbs, own)), (rank, num_mbs, own, expected)
    seen = []
    for _ in range(sum(num_mbs)):
        mb = iterators[0].get_next(["total_lengths", "sample_indices"])
        assert sum(mb["total_lengths"]) <= 40 or len(mb["total_lengths"]) == 1
        seen += mb["sample_indices"]
    assert sorted(seen) == local["sample_indices"]

    static_args = make_args("--global-batch-size", "4", "--micro-batch-size", "2", "--transformer-impl", "local")
    _, num_mbs = get_data_iterator(static_args, None, local)
    assert num_mbs == [1, 1]  # gbs/dp = 2 samples per step, 2 per micro-batch, 4 local samples -> 2 steps

    local["log_probs"] = [torch.full((r,), -0.1 * (rank + 1)) for r in local["response_lengths"]]
    local["loss_masks"][0][0], local["log_probs"][0][0] = 0, -5.0  # an untrained token (a tool's output)
    local["kl"] = [torch.full((r,), float(r)) for r in local["response_lengths"]]
    metrics = log_rollout_data(0, args, local)
    # as current slime: the mean over both ranks' per-sample means over trained tokens; kl's over every token
    assert metrics["rollout/log_probs"] == pytest.approx(-0.15)
    lengths = data["response_lengths"]
    assert metrics["rollout/kl"] == pytest.approx(sum(r * r for r in lengths) / sum(lengths))
    assert metrics["rollout/rewards"] == pytest.approx(sum(data["rewards"]) / 8)
    assert metrics["rollout/raw_reward"] == pytest.approx(0.5)
    assert "rollout/tokens" not in metrics and "rollout/loss_masks" not in metrics


def _expected_dp2_counts(data):
    lengths = [len(t) for t in data["tokens"]]
    per_rank = [lengths[r::2] for r in range(2)]
    return [max(get_minimum_num_micro_batch_size(ls[i * 2 : (i + 1) * 2], 40) for ls in per_rank) for i in range(2)]


def test_dp2_broadcast_dynamic_batching_and_rollout_logging(ray_session):
    data = _train_data()
    data["tokens"][0] = np.arange(35, dtype=np.int64)  # rank 0's first step needs 2 micro-batches, rank 1's maybe not
    data["tokens"][2] = np.arange(30, dtype=np.int64)
    data["response_lengths"][0] = data["response_lengths"][2] = 5
    data["loss_masks"][0] = data["loss_masks"][2] = np.ones(5, dtype=np.int32)
    data["rollout_log_probs"][0] = data["rollout_log_probs"][2] = np.full(5, -0.5, dtype=np.float32)
    assert _expected_dp2_counts(data)[0] == 2
    spawn(_dp2_iterators_logging_and_broadcast, 2, ray_session.get_runtime_context().gcs_address, data, timeout=240)


def _tp2_padded_batch_log_probs_match_transformers(rank, hf_dir):
    import warnings

    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron_utils.data import get_batch
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.log_probs import get_log_probs_and_entropy
    from slime.backends.megatron_utils.megatron_to_hf import hf_to_megatron
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    args = megatron_args(hf_dir, tensor_model_parallel_size=2)
    args.rollout_temperature = 0.8
    init(args)
    model = get_model_provider_func(args)()
    hf_to_megatron(args, [model])
    model.eval()

    g = torch.Generator().manual_seed(0)
    lengths, resp = [7, 12, 4], [3, 5, 2]
    tokens = [torch.randint(0, args.vocab_size, (n,), generator=g) for n in lengths]
    data = {"tokens": tokens, "total_lengths": lengths, "response_lengths": resp}
    batch = get_batch(DataIterator(data, micro_batch_size=3), ["tokens", "total_lengths", "response_lengths"])
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], attention_mask=batch["attention_mask"])
        out = get_log_probs_and_entropy(
            logits,
            args=args,
            unconcat_tokens=batch["unconcat_tokens"],
            total_lengths=lengths,
            response_lengths=resp,
            with_entropy=True,
        )
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        for i, t in enumerate(tokens):  # each sample alone, unpadded
            logp = torch.log_softmax(ref(t[None]).logits[0, lengths[i] - resp[i] - 1 : lengths[i] - 1] / 0.8, -1)
            want = logp.gather(-1, t[lengths[i] - resp[i] :, None])[:, 0]
            assert torch.allclose(out["log_probs"][i], want, atol=1e-4), (i, (out["log_probs"][i] - want).abs().max())
            assert torch.allclose(out["entropy"][i], -(logp.exp() * logp).sum(-1), atol=1e-4)


def test_padded_batch_log_probs_tp2_match_transformers(tmp_path):
    hf_dir = build_random_hf("qwen3", str(tmp_path / "qwen3"))
    spawn(_tp2_padded_batch_log_probs_match_transformers, 2, hf_dir, timeout=300)


def _dp2_throughput(rank):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.actor import _throughput

    mpu.initialize_model_parallel()  # 2 ranks: data parallel
    try:
        perf = {"perf/actor_train_time": 2.0, "perf/log_probs_time": 0.5}
        out = _throughput(make_args(), perf, [[10], [20, 5]][rank])
        # the tiny model's forward: 196608 L + 256 L^2 FLOPs (test above); both ranks' 35 tokens on 2 GPUs
        per_gpu = (196608 * 35 + 256 * (10**2 + 20**2 + 5**2)) / 2 / 1e12
        assert out == pytest.approx(
            {
                "perf/actor_train_tflops": 3 * per_gpu / 2.0,
                "perf/actor_train_tok_per_s": 35 / 2.0,
                "perf/log_probs_tflops": per_gpu / 0.5,
            }
        )
    finally:
        mpu.destroy_model_parallel()


def test_train_throughput_counts_every_data_parallel_ranks_samples():
    spawn(_dp2_throughput, 2)
