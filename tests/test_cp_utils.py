"""Context-parallel bookkeeping (`cp_utils`): slime's zigzag split of a sequence over CP ranks and the map from a
rank's local logits back to the response. Pure tensor code; the multi-rank parity tests are in
test_megatron_parallel.py."""

import pytest
import torch

from slime.backends.megatron_utils import cp_utils
from slime.backends.megatron_utils.cp_utils import (
    response_pieces,
    slice_with_cp,
    zigzag_chunk_size,
    zigzag_ranges,
)


def test_zigzag_split_by_hand(monkeypatch):
    # T = 10, CP = 2: 4 chunks of 3 over the sequence padded to 12; rank 0 keeps chunks 0 and 3, rank 1 chunks 1, 2
    tokens = torch.arange(100, 110)
    assert zigzag_chunk_size(10, 2) == 3
    assert zigzag_ranges(3, 2, 0) == [(0, 3), (9, 12)] and zigzag_ranges(3, 2, 1) == [(3, 6), (6, 9)]
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (2, 0))
    assert slice_with_cp(tokens, pad_value=0).tolist() == [100, 101, 102, 109, 0, 0]
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (2, 1))
    assert slice_with_cp(tokens, pad_value=0).tolist() == [103, 104, 105, 106, 107, 108]
    monkeypatch.setattr(cp_utils, "cp_size_and_rank", lambda: (1, 0))
    assert slice_with_cp(tokens, pad_value=0) is tokens


def test_response_pieces_by_hand():
    # T = 10, R = 4: response tokens 6..9 are scored by logits 5..8. Rank 0 (positions 0-2, 9-11) scores none of
    # them; rank 1 holds 3-5 (local 0-2) and 6-8 (local 3-5): logit 5 at local 2 -> response 0, logits 6-8 at
    # local 3-5 -> response 1-3.
    assert response_pieces(10, 4, 3, 2, 0) == []
    assert response_pieces(10, 4, 3, 2, 1) == [(2, 0, 1), (3, 1, 3)]


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_pieces_cover_each_response_position_once_from_the_right_logit(cp_size):
    """Over all CP ranks, every response position is scored exactly once, by the local logit whose global position
    is one before the scored token."""
    for total in range(2, 30):
        for resp in range(total):
            chunk = zigzag_chunk_size(total, cp_size)
            seen = []
            for rank in range(cp_size):
                global_of_local = [p for lo, hi in zigzag_ranges(chunk, cp_size, rank) for p in range(lo, hi)]
                for local, r0, n in response_pieces(total, resp, chunk, cp_size, rank):
                    assert n > 0
                    for j in range(n):
                        assert global_of_local[local + j] == total - resp - 1 + r0 + j
                        seen.append(r0 + j)
            assert sorted(seen) == list(range(resp)), (total, resp, cp_size)


def test_local_global_positions_by_hand():
    """Where a rank's local tokens sit in the whole sequence (what the hybrids' Gated DeltaNet layers gather).
    Padded row of 12 at CP=2 (chunks of 3): rank 1 holds chunks 1 and 2. Packed, global cu_seqlens [0, 8, 12]:
    segment 0 in chunks of 2 (rank 0: [0,2) and [6,8)), segment 1 in chunks of 1 (rank 0: 8 and 11)."""
    from slime.backends.megatron_utils.cp_utils import local_global_positions

    index, total = local_global_positions(6, 2, 1)
    assert index.tolist() == [3, 4, 5, 6, 7, 8] and total == 12
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    index, total = local_global_positions(6, 2, 0, cu)
    assert index.tolist() == [0, 1, 6, 7, 8, 11] and total == 12
    assert local_global_positions(6, 2, 1, cu)[0].tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(AssertionError, match="5 local tokens"):
        local_global_positions(5, 2, 0, cu)
