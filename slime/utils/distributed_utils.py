"""Process groups outside the training world: the trainer <-> inference-engine weight-update group.

`init_process_group` mirrors the helper SGLang and slime both use (a TCP rendezvous, then a named group via
torch's `_new_process_group_helper`), so a trainer can join a real SGLang server's group on GPU (NCCL) and
slime's CPU server on CPU (gloo) with the same call. It works with or without a default process group.

`tcp_store` is the rendezvous store of every process group slime builds (the trainers' own and the weight-update
group): torch's TCPStore server listens on every interface whatever host it is given, so its listening socket is
opened here, bound to that host only, and handed over.
"""

import socket
from datetime import timedelta
from urllib.parse import urlparse

from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    default_pg_timeout,
)


def rendezvous_socket(host: str, port: int = 0) -> socket.socket:
    """A socket bound to host:port (0: a port the OS picks), for `tcp_store` to listen on. Rank 0 binds it when it
    announces its port and holds it until its store listens: a port only probed could be taken meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port:  # a fixed port may still be in TIME_WAIT from a previous run; an OS-picked one never is
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port} for a process-group rendezvous: {e}") from e
    return sock


def tcp_store(
    host: str, port: int, world_size: int, is_master: bool, timeout: timedelta, sock: socket.socket | None = None
) -> TCPStore:
    """A TCPStore at host:port; its server (on the master) listens on `host` only, never on the wildcard address,
    on `sock` when the master bound it beforehand."""
    if not is_master:
        return TCPStore(host, port, world_size, False, timeout)
    sock = sock or rendezvous_socket(host, port)
    try:
        sock.listen(max(128, world_size))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port} for a process-group rendezvous: {e}") from e
    # the store owns the socket from here on (it closes it when it is destroyed)
    return TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())


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
        url = urlparse(init_method)
        assert url.scheme == "tcp" and url.hostname and url.port, f"init_method must be tcp://host:port: {init_method}"
        store = tcp_store(url.hostname, url.port, world_size, rank == 0, timeout)
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
