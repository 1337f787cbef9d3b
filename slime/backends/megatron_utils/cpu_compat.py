"""CUDA-compat shim that lets megatron-core 0.16.1 train on CPU with gloo.

megatron-core has no CPU mode: it hard-codes `torch.cuda.current_device()`, `device="cuda"` literals, the CUDA RNG
tracker and `torch.cuda.*Tensor` type asserts. Nothing on our path is inherently CUDA-only, so `apply()` (called by
`initialize.init` before any model is built; once per process; nothing on GPU) replaces exactly those spots. Every
patch is one attribute replacement `(owner, name, replacement)` listed in `_patches()`; none is ever undone, so all
of them hold in this process, on every thread, for its lifetime:

- `torch.cuda.current_device` / `synchronize` / `empty_cache`, process-wide (megatron calls them from too many
  modules to patch one by one; slime's own code goes through `slime.utils.device` and never relies on them);
- the name `torch` inside the megatron modules of `_PROXIED_MODULES`: a proxy whose tensor factories send
  `device="cuda"` to the CPU;
- megatron functions, classes and methods: the RNG tracker, grad clipping, the distributed optimizer's state
  loader, the MoE router's missing `te_general_gemm` and allgather dispatcher, context-parallel RoPE slicing, and
  the calls that assert `torch.cuda.*` parameter types or call `.cuda()` (the optimizers' constructors, the
  tied-embedding setup), which now run under `_spoofed` (see there).

`transformer_config_overrides` adds the CPU settings to the TransformerConfig slime builds, once `apply()` ran.
"""

import contextlib
import functools
import logging
import types

import megatron.core
import torch
from megatron.core import rerun_state_machine
from megatron.core import utils as mcore_utils
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler, optimizer
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer import utils as transformer_utils
from megatron.core.transformer.moe import moe_layer, moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch.overrides import TorchFunctionMode

from slime.utils.device import is_cpu

logger = logging.getLogger(__name__)

PINNED_MEGATRON_CORE = "0.16"
_applied = False

# Megatron modules that allocate with device="cuda" (schedules, masks, optimizer scalars, grad clipping, rerun state).
_PROXIED_MODULES = [
    schedules,
    transformer_utils,
    optimizer,
    clip_grads,
    grad_scaler,
    distrib_optimizer,
    rerun_state_machine,
    mcore_utils,
]


def apply() -> bool:
    """Install the patches once per process (CPU only). Returns True when the shim is active."""
    global _applied
    if _applied or not is_cpu():
        return _applied
    version = getattr(megatron.core, "__version__", "?")
    if not version.startswith(PINNED_MEGATRON_CORE):
        logger.warning(
            "cpu_compat is pinned to megatron-core %s.x but found %s; CPU training may break",
            PINNED_MEGATRON_CORE,
            version,
        )
    for owner, name, replacement in _patches():
        setattr(owner, name, replacement)
    _applied = True
    return True


def _patches() -> list:
    """Every patch the shim makes, as (owner, attribute name, replacement)."""
    proxy = _proxy_torch()
    return [
        # rotary embeddings, attention buffers, TP mappings and DDP buffers use device=torch.cuda.current_device()
        (torch.cuda, "current_device", lambda: "cpu"),
        # p2p (PP>1) and dist_checkpointing call synchronize; empty_cache is called by offload paths
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "empty_cache", lambda *a, **k: None),
        *[(module, "torch", proxy) for module in _PROXIED_MODULES],
        (mrandom, "CudaRNGStatesTracker", CpuRNGStatesTracker),
        (mrandom, "_CUDA_RNG_STATE_TRACKER", None),
        (mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32),
        (optimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32),
        # without transformer_engine, 0.16.1 leaves `te_general_gemm` undefined (NameError in the MoE router)
        (moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
        (moe_layer, "MoEAllGatherTokenDispatcher", PaddedAllGatherTokenDispatcher),
        *[(module, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank) for module in _ROPE_MODULES],
        (
            distrib_optimizer.DistributedOptimizer,
            "_set_main_param_and_optimizer_states",
            _keep_live_adam_step(distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states),
        ),
        # the optimizers' constructors assert torch.cuda.* parameter types
        (
            distrib_optimizer.DistributedOptimizer,
            "__init__",
            _spoofed(distrib_optimizer.DistributedOptimizer.__init__),
        ),
        (
            optimizer.Float16OptimizerWithFloat16Params,
            "__init__",
            _spoofed(optimizer.Float16OptimizerWithFloat16Params.__init__),
        ),
        # PP>1 with tied embeddings: the embedding / output-layer copy is moved with `weight.data.cuda()` before
        # it is all-reduced over the embedding group (first + last stage)
        (
            LanguageModule,
            "setup_embeddings_and_output_layer",
            _spoofed(LanguageModule.setup_embeddings_and_output_layer),
        ),
    ]


def transformer_config_overrides(kw: dict) -> dict:
    """What the CPU shim changes in a TransformerConfig's arguments `kw` (nothing unless `apply()` ran): fp32 (no
    fp16), CPU initialisation, no CUDA-stream sync in p2p (PP>1), and for MoE the allgather dispatcher (alltoall
    creates CUDA streams), whose config check rejects variable_seq_lengths (`finish_transformer_config` sets it
    back)."""
    if not _applied:
        return {}
    out = {"fp16": False, "use_cpu_initialization": True, "batch_p2p_sync": False}
    if kw.get("num_moe_experts"):
        out.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
    return out


def finish_transformer_config(config):
    """Packed micro-batches differ in length, so PP>1 p2p must send shapes first (variable_seq_lengths). Without it
    the receiving stage allocates `seq_length` rows and gloo fills only the sent ones, leaving uninitialised memory
    (sometimes NaN) in the rest. The allgather dispatcher handles it: every rank of its TP x EP group holds the
    same micro-batch, so its gathers see equal shapes; only its config check refuses it."""
    if _applied and config.num_moe_experts:
        config.variable_seq_lengths = True
    return config


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda"
    )


class _CudaTypeSpoofMode(TorchFunctionMode):
    """Makes `tensor.type()` report `torch.cuda.*` and sends `device="cuda"`, `.cuda()` and `.to("cuda")` to CPU."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = func(*args)
            return t if t.startswith("torch.cuda.") else t.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def _spoofed(fn):
    """`fn` run under `_CudaTypeSpoofMode`. A mode, not an attribute patch, because `Tensor.type` / `Tensor.cuda`
    are methods of every tensor: replacing them would change them for all code, not just inside these calls."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _CudaTypeSpoofMode():
            return fn(*args, **kwargs)

    return wrapped


class CpuRNGStatesTracker:
    """Drop-in for megatron's CudaRNGStatesTracker on the CPU generator (TP-rank dropout streams, recompute)."""

    def __init__(self, *args, **kwargs):
        self.reset()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = False

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized, self.states_, self.seeds_ = False, {}, set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized, self.states_ = True, states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _CpuTorch(types.ModuleType):
    """Stands in for the name `torch` inside the proxied modules: factories ignore device="cuda"."""

    def __getattr__(self, name):
        return getattr(torch, name)


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapped


def _proxy_torch():
    proxy = _CpuTorch("torch")
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like"):
        setattr(proxy, name, _cpu_factory(getattr(torch, name)))
    return proxy


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    # megatron's version minus its `param.grad.type() == 'torch.cuda.FloatTensor'` assert.
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [
        g.detach() for g in ((p.decoupled_grad if use_decoupled_grad else p.grad) for p in parameters) if g is not None
    ]
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)


class PaddedAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """On CPU MoE runs the allgather dispatcher (alltoall needs CUDA streams), whose all-gather / reduce-scatter over
    TP x EP assume every rank holds as many tokens. Expert-parallel ranks are data-parallel ranks with their own
    micro-batches, so pad each rank's tokens to the group's maximum with rows routed to no expert, and drop them
    after the combine."""

    _pad = 0

    def token_dispatch(self, hidden_states, probs):
        self._pad = 0
        if self.tp_size > 1 or self.ep_size > 1:
            n = torch.tensor([hidden_states.shape[0]])
            sizes = [torch.zeros_like(n) for _ in range(self.tp_ep_group.size())]
            torch.distributed.all_gather(sizes, n, group=self.tp_ep_group)
            self._pad = int(max(sizes)) - int(n)
        if self._pad:
            hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(self._pad, hidden_states.shape[1])])
            probs = torch.cat([probs, probs.new_zeros(self._pad, probs.shape[1])])
            self.routing_map = torch.cat(
                [self.routing_map, self.routing_map.new_zeros(self._pad, self.routing_map.shape[1])]
            )
        return super().token_dispatch(hidden_states, probs)

    def token_combine(self, hidden_states):
        out = super().token_combine(hidden_states)
        return out[: out.shape[0] - self._pad] if self._pad else out


def _keep_live_adam_step(original):
    """Without Apex/TE the distributed optimizer wraps torch Adam, which keeps a per-param "step". Checkpoints store
    the step once (in param_groups) and skip it per param, but 0.16.1's loader copies every key of the live state
    and fails with KeyError('step'). Keep the live step when the loaded tensors carry none."""

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


# Context parallelism: RoPE keeps the positions of the rank's zigzag chunks (used by name in these modules).
_ROPE_MODULES = [rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding]


def _get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    # megatron's version minus its pinned-memory `.cuda()` index: the zigzag pair of position blocks of this CP rank.
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])
