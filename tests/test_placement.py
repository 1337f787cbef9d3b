"""Placement: the layout table (docs/architecture.md), bundle ordering, fractional sharing of bundles, and loud failures."""

import pytest

from slime.ray.placement_group import get_placement_group_layout, sort_key
from tests._args import make_args as real_args


def _args(**kw):
    base = dict(
        actor_num_nodes=1,
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        colocate=False,
        debug_train_only=False,
        debug_rollout_only=False,
    )
    base.update(kw)
    return real_args(**base)


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, (4, 2)),  # disaggregated: trainers first, engines after
        ({"colocate": True}, (2, 0)),  # colocated: same bundles
        ({"colocate": True, "rollout_num_gpus": 4}, (4, 0)),  # colocated, more engines than trainers
        ({"debug_train_only": True}, (2, 0)),
        ({"debug_rollout_only": True, "rollout_num_gpus": 3}, (3, 0)),
        ({"actor_num_nodes": 2, "actor_num_gpus_per_node": 8, "rollout_num_gpus": 8}, (24, 16)),
    ],
)
def test_layout_table(kw, expected):
    assert get_placement_group_layout(_args(**kw)) == expected


def test_sort_key_orders_by_ip_then_gpu():
    infos = [(0, "127.0.2.2", 1), (1, "127.0.2.10", 0), (2, "127.0.2.2", 0), (3, "127.0.1.255", 7)]
    assert [b for b, _, _ in sorted(infos, key=sort_key)] == [3, 2, 0, 1]  # numeric, not string, IP order


def test_sort_key_resolves_hostnames_and_falls_back_to_characters():
    assert sort_key((0, "localhost", "3")) == ([127, 0, 0, 1], 3)
    unresolvable = "no-such-host.invalid"
    assert sort_key((0, unresolvable, 0)) == ([ord(c) for c in unresolvable], 0)


def test_bundles_shared_by_trainer_and_engine(ray_session):
    """A 0.8-GPU trainer and a 0.2-GPU engine on one bundle see the same GPU id; a third actor does not fit."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from slime.ray.placement_group import _create_placement_group

    @ray.remote
    class Probe:
        def gpu(self):
            return ray.get_gpu_ids()

    pg, order = _create_placement_group(2)
    try:
        assert sorted(order) == [0, 1]

        def on(i, frac):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=order[i])
            return Probe.options(num_gpus=frac, num_cpus=0, scheduling_strategy=strategy)

        trainer, engine = on(0, 0.8).remote(), on(0, 0.2).remote()
        assert ray.get(trainer.gpu.remote(), timeout=60) == ray.get(engine.gpu.remote(), timeout=60)
        extra = on(0, 0.2).remote()
        ready, _ = ray.wait([extra.gpu.remote()], timeout=2)
        assert not ready, "a full bundle must not take a third actor"
        for a in (trainer, engine, extra):
            ray.kill(a)
    finally:
        remove_placement_group(pg)
