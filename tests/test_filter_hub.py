"""filter_hub: dynamic sampling keeps only groups whose rewards differ; over-sampling sorts by reward std."""

from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.rollout.filter_hub.over_sampling_filters import sort_by_reward_std
from slime.utils.misc import load_function
from slime.utils.types import Sample
from tests._args import make_args

ARGS = make_args()


def group(*rewards):
    return [Sample(index=i, reward=r) for i, r in enumerate(rewards)]


def test_nonzero_std_keeps_mixed_groups_and_drops_uniform_ones():
    assert bool(check_reward_nonzero_std(ARGS, group(1, 0, 1))) is True
    assert bool(check_reward_nonzero_std(ARGS, group(-1.0, 1.0))) is True
    assert bool(check_reward_nonzero_std(ARGS, group(1, 1, 1, 1))) is False
    assert bool(check_reward_nonzero_std(ARGS, group(0.1, 0.1, 0.1))) is False  # equal floats: no rounding-noise std
    assert bool(check_reward_nonzero_std(ARGS, group(1))) is False  # a single sample has no spread


def test_nonzero_std_uses_reward_key():
    args = make_args("--reward-key", "score")
    dict_group = [Sample(reward={"score": s, "acc": s > 0}) for s in (1.0, 1.0, -1.0)]
    assert bool(check_reward_nonzero_std(args, dict_group)) is True
    assert bool(check_reward_nonzero_std(args, dict_group[:2])) is False


def test_sort_by_reward_std_descending_and_stable():
    g_zero_a, g_half_a, g_mid, g_half_b, g_zero_b = (
        group(1, 1),
        group(0, 1),
        group(0, 0, 1, 1),
        group(1, 0),
        group(2, 2),
    )
    # std: 0, 0.7071, 0.5774, 0.7071, 0 (sample std, n-1)
    ordered = sort_by_reward_std(ARGS, [g_zero_a, g_half_a, g_mid, g_half_b, g_zero_b])
    assert [id(g) for g in ordered] == [id(g) for g in (g_half_a, g_half_b, g_mid, g_zero_a, g_zero_b)]
    args = make_args("--reward-key", "score")
    low, high = [Sample(reward={"score": s}) for s in (1, 1)], [Sample(reward={"score": s}) for s in (-1, 1)]
    assert sort_by_reward_std(args, [low, high]) == [high, low]


def test_filters_load_by_their_documented_paths():
    assert (
        load_function("slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
        is check_reward_nonzero_std
    )
    assert load_function("slime.rollout.filter_hub.over_sampling_filters.sort_by_reward_std") is sort_by_reward_std
