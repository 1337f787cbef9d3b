"""Process groups outside the training world: the trainer <-> inference-engine weight-update group.

`init_process_group` mirrors the helper SGLang and slime both use (a TCP rendezvous, then a named group via
torch's `_new_process_group_helper`), so a trainer can join a real SGLang server's group on GPU (NCCL) and
slime's CPU server on CPU (gloo) with the same call. It works with or without a default process group.
"""

from datetime import timedelta

from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    default_pg_timeout,
    rendezvous,
)


def init_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name: str = "",
    pg_options=None,
):
    assert (store is None) or (init_method is None), "init_method and store are mutually exclusive"
    backend = Backend(backend) if backend else Backend("undefined")
    timeout = timeout or default_pg_timeout
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    # Same prefix as torch's init_process_group, so every side of the group agrees on keys.
    store = PrefixStore(group_name, store)
    kwargs = {
        "backend_options"
        if "backend_options" in _new_process_group_helper.__code__.co_varnames
        else "pg_options": pg_options
    }
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout, **kwargs
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def seconds(t: float) -> timedelta:
    return timedelta(seconds=t)


def __getattr__(name):
    # slime v0.1.0 defined `distributed_masked_whiten` here; it lives in ppo_utils now. Resolved lazily so that
    # importing this module (the inference server does) does not pull in megatron.
    if name == "distributed_masked_whiten":
        from slime.utils.ppo_utils import distributed_masked_whiten  # heavy: megatron

        return distributed_masked_whiten
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
