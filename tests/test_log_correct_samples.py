"""--log-correct-samples: metrics of the samples whose raw reward is 1, over two data-parallel ranks (gloo).

By hand, 8 samples, --rollout-max-response-len 8 (quarters end at 2, 4, 6, 8 tokens):
  raw reward        1  0  1  1  0  1  1  0      (rank 0 holds samples 0, 2, 4, 6; rank 1 holds 1, 3, 5, 7)
  response length   2  3  5  8  4  9  6  1
Correct: samples 0, 2, 3, 5, 6 -> mean length 30 / 5 = 6; quarters: 2 -> first, 5 and 6 -> third, 8 -> fourth,
9 exceeds the maximum (in none) -> p25 1/4, p50 0, p75 2/4, p100 1/4. Sample g's log-probs are -0.1 (g + 1), except
sample 2 whose loss mask keeps only its first two tokens (log-probs -1, -3: mean -log p 2) -> correct_entropy
(0.1 + 2 + 0.4 + 0.6 + 0.7) / 5 = 0.76."""

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import spawn

RAW = [1, 0, 1, 1, 0, 1, 1, 0]
LENGTHS = [2, 3, 5, 8, 4, 9, 6, 1]


def _rank_data(rank):
    indices = list(range(rank, 8, 2))
    data = {"raw_reward": RAW, "global_indices": indices, "response_lengths": [], "loss_masks": [], "log_probs": []}
    for g in indices:
        n = LENGTHS[g]
        data["response_lengths"].append(n)
        if g == 2:
            data["loss_masks"].append(torch.tensor([1, 1, 0, 0, 0], dtype=torch.int))
            data["log_probs"].append(torch.tensor([-1.0, -3.0, -100.0, -100.0, -100.0]))
        else:
            data["loss_masks"].append(torch.ones(n, dtype=torch.int))
            data["log_probs"].append(torch.full((n,), -0.1 * (g + 1)))
    return data


def _log(rank, out_path):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import log_rollout_data

    mpu.initialize_model_parallel(1, 1)
    try:
        on = make_args("--log-correct-samples", "--rollout-max-response-len", "8")
        off = make_args("--rollout-max-response-len", "8")
        torch.save(
            {"on": log_rollout_data(0, on, _rank_data(rank)), "off": log_rollout_data(0, off, _rank_data(rank))},
            f"{out_path}.{rank}",
        )
    finally:
        mpu.destroy_model_parallel()


def test_correct_sample_metrics_over_two_dp_ranks(tmp_path):
    out = str(tmp_path / "metrics")
    spawn(_log, 2, out)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert got[0] == got[1]  # every logging rank returns the same dict
    on, off = got[0]["on"], got[0]["off"]
    assert on["rollout/correct_response_lengths"] == pytest.approx(6.0)
    assert [on[f"rollout/correct_length/p{q}"] for q in (25, 50, 75, 100)] == pytest.approx([0.25, 0, 0.5, 0.25])
    assert on["rollout/correct_entropy"] == pytest.approx(0.76, abs=1e-6)
    assert not any("correct" in k for k in off)
    assert {k: v for k, v in on.items() if "correct" not in k} == off  # the other rollout metrics are unchanged
