"""The Megatron trainer's GPU-only paths on the tiny Qwen3 kit: the Transformer-Engine layer spec (THD-packed batches)
against transformers, a bf16 training step, an NCCL broadcast of a weight bucket, offload/onload on the GPU and an
--async-save checkpoint written while training goes on.

Each test runs in fresh processes with SLIME_DEVICE=cuda, so slime picks CUDA + NCCL in `slime.utils.device` exactly
as a trainer on a GPU node does. Without CUDA every test here is skipped (the reasons show with `pytest -rs`).
"""

import importlib.util
import os

import pytest
import torch
import torch.multiprocessing as mp

from slime.backends.megatron_utils.param_utils import unwrap_model
from tests._megatron_helpers import (
    fixed_rollout,
    free_port,
    hf_log_probs,
    run_processes,
    train_args,
    train_once_for_offload,
)

HAS_CUDA = torch.cuda.is_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
needs_te = pytest.mark.skipif(not HAS_TE, reason="needs transformer_engine (not importable here)")


class _Ref:
    """What `process_rollout_data` receives from Ray: a Box whose `.inner` is passed to `ray.get`."""

    def __init__(self, data):
        self.inner = data


def _entry(index, fn, args):
    """Process `index` of a GPU test: GPU `index`, CUDA chosen through slime's one device switch."""
    os.environ.update(SLIME_DEVICE="cuda", LOCAL_RANK=str(index), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    torch.cuda.set_device(index)
    fn(index, *args)


def _spawn(fn, nprocs, *args, timeout=300):
    """Run `fn(index, *args)` in `nprocs` fresh processes (one per GPU); an exception in any fails the caller."""
    # fresh interpreters: the CPU tests' forkserver may have touched CUDA, and a forked child cannot use it then
    run_processes(_entry, (fn, args), nprocs, fn.__name__, timeout, start_method="spawn")


def _init_trainer(args, port):
    """A one-rank training world on this GPU (NCCL, as `TrainRayActor.init` picks), Megatron state, model from HF."""
    import ray
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.utils.device import dist_backend, is_cpu

    assert not is_cpu() and dist_backend() == "nccl"
    dist.init_process_group(dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    init(args)
    model, opt, sched, iteration = initialize_model_and_optimizer(args)
    assert iteration == -1
    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    rollout = process_rollout_data(args, _Ref(fixed_rollout()), mpu.get_data_parallel_rank(), 1)
    iters, nmb = get_data_iterator(args, model, rollout)
    return model, opt, sched, rollout, iters, nmb


# ---- (i) layer specs on the GPU: log-probs vs transformers -------------------------------------------------------
def _log_probs(index, model_dir, impl, bf16, port, out_path):
    from slime.backends.megatron_utils.model import forward_only
    from slime.backends.megatron_utils.model_provider import use_transformer_engine

    args = train_args(model_dir, transformer_impl=impl, bf16=bf16, ci_test=False)
    model, _, _, rollout, iters, nmb = _init_trainer(args, port)
    te = impl == "transformer_engine"
    assert use_transformer_engine(args) == te and iters[0].packed_sequences == te  # TE: THD-packed micro-batches
    qkv = unwrap_model(model[0]).decoder.layers[0].self_attention.linear_qkv
    assert ("transformer_engine" in type(qkv).__module__) == te, type(qkv)
    param = next(unwrap_model(model[0]).parameters())
    assert param.is_cuda and param.dtype == (torch.bfloat16 if bf16 else torch.float32)
    got = forward_only(args, model, iters, nmb)["log_probs"]
    assert all(g.is_cuda for g in got)
    torch.save(torch.cat([g.float().cpu() for g in got]), out_path)


@pytest.mark.parametrize(
    "impl,bf16,tol",
    [
        pytest.param("transformer_engine", True, 0.05, marks=needs_te, id="te-bf16"),
        pytest.param("local", False, 1e-4, id="local-fp32"),
    ],
)
def test_layer_spec_log_probs_match_transformers_on_gpu(tiny_kit, tmp_path, impl, bf16, tol):
    """The TE spec (bf16: flash/fused attention needs half precision for THD) is within bf16 rounding of an fp32
    transformers forward (bf16 alone moves these log-probs by ~6e-3; a wrong layout by ~0.2); the local spec in fp32
    matches to 1e-4."""
    out = tmp_path / "lp.pt"
    _spawn(_log_probs, 1, tiny_kit[0], impl, bf16, free_port(), str(out))
    got, expected = torch.load(out), torch.cat(hf_log_probs(tiny_kit[0], fixed_rollout()))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= tol, (got, expected)


# ---- (ii) bf16 training lowers the loss ----------------------------------------------------------------------
def _bf16_train(index, model_dir, port, out_path):
    from slime.backends.megatron_utils.model import train

    impl = "transformer_engine" if HAS_TE else "local"
    args = train_args(model_dir, transformer_impl=impl, bf16=True, loss_type="sft_loss", ci_test=False)
    model, opt, sched, _, iters, nmb = _init_trainer(args, port)
    assert next(unwrap_model(model[0]).parameters()).dtype == torch.bfloat16
    history = []
    for step in range(3):  # the same batch three times: the NLL of its responses must fall
        history += train(args, step, model, opt, sched, iters, nmb)
    torch.save(history, out_path)


def test_bf16_training_steps_lower_the_loss(tiny_kit, tmp_path):
    out = tmp_path / "hist.pt"
    _spawn(_bf16_train, 1, tiny_kit[0], free_port(), str(out))
    history = torch.load(out)
    losses = [h["train/loss"] for h in history]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[0] > losses[1] > losses[2], losses
    assert all(0 < h["train/grad_norm"] < float("inf") for h in history)


# ---- (iii) NCCL broadcast of a weight bucket: trainer -> engine ------------------------------------------------
def _nccl_bucket(index, model_dir, ports, queue, out_path):
    """Process 0: a trainer (GPU 0) that exports its params to HF tensors and broadcasts them as one bucket over a
    `slime-pp_0` group; process 1: the engine side (GPU 1), which joins that group as SGLang does and receives."""
    import torch.distributed as dist

    from slime.utils.device import dist_backend, get_device
    from slime.utils.distributed_utils import init_process_group

    train_port, group_port = ports
    group_url = f"tcp://127.0.0.1:{group_port}"
    if index == 0:
        from slime.backends.megatron_utils.param_utils import named_parameters
        from slime.backends.megatron_utils.update_weight.common import gather_and_convert

        args = train_args(model_dir, bf16=True, ci_test=False)
        model, *_ = _init_trainer(args, train_port)
        bucket = []
        for name, param in named_parameters(args, model):
            bucket += gather_and_convert(args, args.model_name, name, param, args.vocab_size)
        queue.put([(n, str(t.dtype), list(t.shape)) for n, t in bucket])
        group = init_process_group(
            backend=dist_backend(), init_method=group_url, world_size=2, rank=0, group_name="slime-pp_0"
        )
        works = [dist.broadcast(t, 0, group=group, async_op=True) for _, t in bucket]  # as `_send_bucket` does
        for w in works:
            w.wait()
        torch.cuda.synchronize()
    else:
        meta = queue.get(timeout=240)
        group = init_process_group(
            backend=dist_backend(), init_method=group_url, world_size=2, rank=1, group_name="slime-pp_0"
        )
        device = get_device(index)
        received = {
            n: torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device=device)
            for n, dtype, shape in meta
        }
        for n in received:  # same order as the sender
            dist.broadcast(received[n], 0, group=group)
        torch.cuda.synchronize()
        torch.save({n: t.cpu() for n, t in received.items()}, out_path)


@pytest.mark.skipif(
    HAS_CUDA and torch.cuda.device_count() < 2,
    reason="an NCCL group cannot hold two ranks on the same GPU: needs 2 GPUs",
)
def test_nccl_broadcast_of_a_weight_bucket_delivers_the_hf_tensors(tiny_kit, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "received.pt"
    queue = mp.get_context("spawn").Queue()
    _spawn(_nccl_bucket, 2, tiny_kit[0], (free_port(), free_port()), queue, str(out))
    received = torch.load(out)
    expected = load_file(f"{tiny_kit[0]}/model.safetensors")
    assert set(received) == set(expected)
    for name, t in expected.items():  # the bf16 trainer holds (and sends) the checkpoint rounded to bf16
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], t.to(torch.bfloat16)), name


# ---- (iv) offload / onload on the GPU ---------------------------------------------------------------------------
def _gpu_offload(index, model_dir, port):
    from slime.backends.megatron_utils.model import train

    impl = "transformer_engine" if HAS_TE else "local"
    args = train_args(model_dir, transformer_impl=impl, bf16=True, use_distributed_optimizer=True, ci_test=False)
    model, opt, sched, rollout, iters, nmb = _init_trainer(args, port)
    actor = train_once_for_offload(args, model, opt, sched, rollout, iters, nmb)
    storages = actor._offload_storages()
    assert storages and all(s.device.type == "cuda" for s in storages)
    before = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).cpu() for s in storages]
    total = sum(b.numel() for b in before)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    actor.sleep(("model",))
    assert all(s.nbytes() == 0 for s in storages), "sleep must free every param/grad/optimizer storage"
    assert torch.cuda.memory_allocated() <= allocated - total, "sleep must give the GPU memory back"
    actor.wake_up(("model",))
    after = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).cpu() for s in storages]
    assert all(torch.equal(b, a) for b, a in zip(before, after)), "wake_up must restore every byte"
    train(args, 1, model, opt, sched, iters, nmb)  # still trains after onload


def test_offload_onload_on_gpu_is_bit_exact(tiny_kit):
    _spawn(_gpu_offload, 1, tiny_kit[0], free_port())


# ---- (vi) --async-save: the forked writer of a CUDA process holds the state of the save call -----------------------
def _gpu_async_save(index, model_dir, port, save_dir):
    import copy

    from slime.backends.megatron_utils.checkpoint import finalize_async_save, load_checkpoint, save_checkpoint
    from slime.backends.megatron_utils.model import train

    impl = "transformer_engine" if HAS_TE else "local"
    args = train_args(model_dir, transformer_impl=impl, bf16=True, loss_type="sft_loss", ci_test=False)
    args.save, args.async_save = save_dir, True
    model, opt, sched, _, iters, nmb = _init_trainer(args, port)
    train(args, 0, model, opt, sched, iters, nmb)
    params = lambda: {n: p.detach().float().cpu() for n, p in unwrap_model(model[0]).named_parameters()}  # noqa: E731
    saved = params()
    save_checkpoint(args, 0, model, opt, sched)  # device tensors copied to host, then the writer forked
    train(args, 1, model, opt, sched, iters, nmb)  # moves the weights while the fork writes
    assert finalize_async_save() == 0 and os.path.isdir(f"{save_dir}/iter_0000000")
    assert any(not torch.equal(saved[n], p) for n, p in params().items()), "the second step moved nothing"
    load = copy.copy(args)
    load.load, load.finetune, load.no_load_optim, load.no_load_rng = save_dir, False, True, True
    assert load_checkpoint(load, model, opt, sched) == 0
    assert all(torch.equal(saved[n], p) for n, p in params().items()), "the checkpoint is not the saved state"


def test_async_save_writes_the_state_of_the_save_call_on_gpu(tiny_kit, tmp_path):
    _spawn(_gpu_async_save, 1, tiny_kit[0], free_port(), str(tmp_path / "ckpt"))


# ---- (v) --tree-attention-backend flex: compiled FlexAttention on the tree's block mask ----------------------------
def _tree_flex_vs_dense(index, out):
    import torch.nn.functional as F

    from slime.backends.megatron_utils import tree_attention
    from slime.backends.megatron_utils.data import _tree_layout
    from slime.utils.device import compile_kernels

    assert compile_kernels()  # a GPU trainer compiles the kernel and the block mask
    g = torch.Generator().manual_seed(0)
    # two groups of four: a 300-token prompt each, 200-token responses (several 128-token blocks, some skipped)
    samples = []
    for _ in range(2):
        prompt = torch.randint(3, 1000, (300,), generator=g)
        samples += [torch.cat([prompt, torch.randint(3, 1000, (200,), generator=g)]) for _ in range(4)]
    samples = [s.cuda() for s in samples]
    dense, block = _tree_layout(samples, "dense")["attention_mask"], _tree_layout(samples, "flex")["attention_mask"]
    n = dense.shape[-1]
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, h, n, 64, generator=g).cuda() for h in (8, 2, 2))
        dy = torch.randn(1, 8, n, 64, generator=g).cuda()

        def run(fn, dt):
            # fresh leaves each run: `.to` of the same dtype returns q itself, whose grad would carry over
            x = [t.detach().to(dt, copy=True).requires_grad_(True) for t in (q, k, v)]
            y = fn(*x)
            y.backward(dy.to(dt))
            return [y.float()] + [t.grad.float() for t in x]

        flex = run(
            lambda a, b, c: tree_attention._flex()(a, b, c, block_mask=block, scale=0.125, enable_gqa=True), dtype
        )
        sdpa = lambda a, b, c: F.scaled_dot_product_attention(  # noqa: E731
            a, b.repeat_interleave(4, 1), c.repeat_interleave(4, 1), attn_mask=~dense, scale=0.125
        )
        ref64 = run(sdpa, torch.float64)  # the reference; the dense path in the same dtype sets the tolerance
        dense_dt = run(sdpa, dtype)
        result[str(dtype)] = [
            ((a - r).abs().max().item(), (d - r).abs().max().item()) for a, d, r in zip(flex, dense_dt, ref64)
        ]
    torch.save(result, out)


def test_tree_flex_attention_matches_the_dense_mask_forward_and_backward(tmp_path):
    """What `--tree-attention-backend flex` runs on a GPU (compiled FlexAttention, compiled block mask) against the
    dense ancestor mask through SDPA, on a tree row of two groups: output and the gradients of q, k and v, each within
    twice the dense path's own error from an fp64 reference (fp32 and bf16)."""
    out = tmp_path / "errors.pt"
    _spawn(_tree_flex_vs_dense, 1, str(out))
    for dtype, errors in torch.load(out).items():
        print(dtype, errors)
        for name, (flex, dense) in zip(("out", "dq", "dk", "dv"), errors):
            assert flex <= 2 * dense + 1e-6, f"{dtype} {name}: flex {flex:.3g} vs the dense path's {dense:.3g}"
