"""--data-pad-size-multiplier: a packed micro-batch (3 + 5 + 2 = 10 tokens) is padded to the next multiple of
TP size x multiplier, the padding being one extra segment of cu_seqlens (by hand: 128 -> 128 tokens, 7 -> 14,
1 -> 10, unpadded; at TP=2, 8 -> a multiple of 16: 16)."""

import pytest
import torch

from slime.backends.megatron_utils.rollout_data import DataIterator
from tests._args import make_args
from tests._megatron_helpers import spawn

TOKENS = [torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 4, 9]), torch.tensor([8, 8])]


def _packed(multiplier):
    from slime.backends.megatron_utils.data import get_batch

    it = DataIterator({"tokens": TOKENS}, micro_batch_size=3, packed_sequences=True)
    args = make_args("--data-pad-size-multiplier", str(multiplier))
    batch = get_batch(it, ["tokens"], pad_multiplier=args.data_pad_size_multiplier)
    return batch["tokens"][0], batch["packed_seq_params"].cu_seqlens_q.tolist()


@pytest.mark.parametrize(
    "multiplier, length, cu_seqlens",
    [(128, 128, [0, 3, 8, 10, 128]), (7, 14, [0, 3, 8, 10, 14]), (5, 10, [0, 3, 8, 10]), (1, 10, [0, 3, 8, 10])],
)
def test_packed_batch_is_padded_to_the_multiplier(multiplier, length, cu_seqlens):
    tokens, cu = _packed(multiplier)
    assert tokens.numel() == length and cu == cu_seqlens
    assert tokens[:10].tolist() == [5, 6, 7, 1, 2, 3, 4, 9, 8, 8] and tokens[10:].eq(0).all()


def _tp2(rank):
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tokens, cu = _packed(8)
        assert tokens.numel() == 16 and cu == [0, 3, 8, 10, 16]
    finally:
        mpu.destroy_model_parallel()


def test_tensor_parallel_size_multiplies_the_pad_size():
    spawn(_tp2, 2)


def test_default_and_bad_multiplier(capsys):
    assert make_args().data_pad_size_multiplier == 128
    with pytest.raises(SystemExit) as exc:
        make_args("--data-pad-size-multiplier", "0")
    assert exc.value.code == 2 and "--data-pad-size-multiplier 0: must be >= 1." in capsys.readouterr().err
