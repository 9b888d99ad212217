"""Patches that let megatron-core 0.16.1 run on CPU under the gloo backend.

Applied by :func:`megarl.compat.setup_cpu` only when CUDA is absent; no megatron-core file is
edited. Each patch function names the upstream site it works around (megatron-core 0.16.1,
torch 2.13.0+cpu): P1 ``current_device``, P2 causal masks, P3 the RNG tracker, P4 hard-coded CUDA
allocations (a TorchFunctionMode), P5 TE-only MoE names, P6 MoE streams and split sizes, P7
uneven gather / reduce-scatter, P9 distributed-optimizer checkpoint loading, P10 optimizer
offload on a CPU host, P11 one-rank data-parallel syncs (a speed patch: gloo would copy the whole
gradient buffer, 0.7 s a step for 135M parameters). ``tests/unit/test_compat_sites.py`` checks each
``SITES`` entry against the installed source and fails when an upstream site moves (then the
patch must be revisited).

P8 (SP with the local torch norm) is not needed: megarl always builds the TE spec, whose CPU norm
(:class:`megarl.compat.te_cpu.CpuTENorm`) tags its parameters for SP itself.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Site:
    """One upstream location a patch depends on: ``module.attr`` must exist and, when
    ``needle`` is set, its source must still contain it (else the bug may be fixed or moved)."""

    patch: str
    module: str
    attr: str
    needle: str | None = None


SITES = [
    Site("P1", "megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding",
         "torch.cuda.current_device()"),
    Site("P2", "megatron.core.transformer.utils", "get_default_causal_mask", 'device="cuda"'),
    Site("P2", "megatron.core.transformer.utils", "get_sliding_window_causal_mask", 'device="cuda"'),
    Site("P2", "megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
    Site("P3", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    Site("P3", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    Site("P3", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker", "get_cuda_rng_state"),
    Site("P4", "megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining",
         'device="cuda"'),
    Site("P4", "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
         "torch.cuda.FloatTensor"),
    Site("P5", "megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction",
         "te_general_gemm is not None"),
    Site("P6", "megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher",
         "torch.cuda"),
    Site("P6", "megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", "is_cuda"),
    Site("P7", "megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
         "output_split_sizes"),
    Site("P7", "megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim",
         "input_split_sizes"),
    Site("P9", "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
         "_set_main_param_and_optimizer_states"),
    Site("P10", "megatron.core.optimizer.cpu_offloading.hybrid_optimizer", "HybridDeviceOptimizer",
         "param.is_cuda"),
    Site("P10", "megatron.core.optimizer.optimizer_config", "OptimizerConfig", 'is_te_min_version("2.1.0")'),
    Site("P10", "megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
         "shard_model_param = model_param.view(-1)[param_range.start : param_range.end]"),
    Site("P11", "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
         "dist_reduce_scatter_func("),
    Site("P11", "megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBucketGroup",
         "dist_all_gather_func("),
]

_MOE_TE_NAMES = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
    "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
)


# --- P1 -------------------------------------------------------------------------------------
def patch_current_device():
    """P1: ``torch.cuda.current_device`` -> the cpu device (rotary_pos_embedding.py get_emb,
    utils.py GlobalMemoryBuffer, tensor_parallel/mappings.py buffers, p2p_communication.py,
    param_and_grad_buffer.py, moe/router.py)."""
    torch.cuda.current_device = lambda: torch.device("cpu")


# --- P2 -------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=32)
def _causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    lo, hi = skv - sq - window_size[0], skv - sq + window_size[1]
    return ~torch.tril(torch.triu(m, diagonal=lo), diagonal=hi)


def patch_causal_masks():
    """P2: CPU causal and sliding-window masks for transformer/utils.py's (``device="cuda"``),
    also rebound in fused_softmax, which imported them by name."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    for mod in (tutils, fused_softmax):
        mod.get_default_causal_mask = _causal_mask
        if hasattr(mod, "get_sliding_window_causal_mask"):
            mod.get_sliding_window_causal_mask = _sliding_window_mask


# --- P3 -------------------------------------------------------------------------------------
def patch_rng_tracker():
    """P3: tensor_parallel/random.py's CUDA RNG state getter/setter and
    ``CudaRNGStatesTracker.add`` (``torch.cuda.get_rng_state``): the tracker stores CPU generator
    states."""
    from megatron.core.tensor_parallel import random as mrandom

    # Both getter and setter: the unpatched setter silently queues a lazy CUDA call that never
    # runs on a CPU build, so patching only the getter would not switch RNG states at all.
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    base = mrandom.CudaRNGStatesTracker

    class CpuRNGStatesTracker(base):
        """Same bookkeeping as megatron's tracker, on the CPU default generator."""

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

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    # fork() warns "CPU RNG state changed within GPU RNG context" whenever dropout runs: harmless here.
    logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)


# --- P4 -------------------------------------------------------------------------------------
def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """P4: redirects hard-coded CUDA allocations and type checks in megatron-core to the CPU
    (schedules.py ``total_num_tokens``, optimizer.py ``found_inf`` and friends, distrib_optimizer's
    ``param.type() == 'torch.cuda.FloatTensor'``, clip_grads.py, language_module.py
    ``weight.data.cuda()``, rope_utils.py): ``device="cuda"`` / ``.cuda()`` / ``pin_memory`` go to
    the CPU and CPU tensors report their cuda type names.

    Costs ~30% CPU time per tiny-model step (every torch call passes through it); it is only
    entered when CUDA is absent.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                name = "torch.cuda." + name[len("torch."):]
            return name
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_CUDA_MODE: CudaToCpuMode | None = None


def install_cuda_to_cpu_mode():
    """Enter the redirect mode for the rest of the process (thread-local: CPU autograd runs on
    the calling thread, so the main thread is where megatron allocates)."""
    global _CUDA_MODE
    if _CUDA_MODE is None:
        _CUDA_MODE = CudaToCpuMode()
        _CUDA_MODE.__enter__()
        torch.cuda.synchronize = lambda *a, **k: None


# --- P5 -------------------------------------------------------------------------------------
def patch_moe_router_without_te():
    """P5: moe_utils.py defines ``te_general_gemm`` and the ``fused_*`` names only when TE imports
    but uses them unguarded (NameError): define the missing ones as None."""
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


# --- P6 -------------------------------------------------------------------------------------
class _NoEvent:
    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def query(self):
        return True


class _NoStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _NoEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


def patch_moe_alltoall():
    """P6: no-op ``torch.cuda.Stream`` / ``Event`` stubs for moe/token_dispatcher.py, and
    ``maybe_move_tensor_to_cpu`` gives CPU split sizes as numpy too (``all_to_all_single`` raises
    TypeError on tensors)."""
    default_stream = _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda *a, **k: default_stream
    torch.cuda.default_stream = lambda *a, **k: default_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu
    if getattr(orig, "_megarl_patched", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megarl_patched = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- P7 -------------------------------------------------------------------------------------
def patch_uneven_collectives():
    """P7: tensor_parallel/mappings.py's gather / reduce-scatter along the first dim with unequal
    splits, which gloo lacks: pad + ``all_gather_into_tensor``, and ``all_reduce`` + slice."""
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim
    orig_rs = mappings._reduce_scatter_along_first_dim
    if getattr(orig_gather, "_megarl_patched", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((width * group.size(),) + tuple(input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[r * width: r * width + s] for r, s in enumerate(output_split_sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return orig_rs(input_, group, input_split_sizes, use_global_buffer)
        full = input_.clone()
        dist.all_reduce(full, group=group)
        return torch.split(full, list(input_split_sizes))[group.rank()].contiguous()

    _gather_along_first_dim._megarl_patched = True
    mappings._gather_along_first_dim = _gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


# --- P9 -------------------------------------------------------------------------------------
def patch_distributed_optimizer_checkpoint():
    """P9: distrib_optimizer.py checkpoint loading with a torch AdamW: dummy states before
    ``sharded_state_dict(is_loading)`` on a fresh optimizer, only present keys copied (under
    no_grad) instead of KeyError 'step', and the one ``step`` tensor that ``load_state_dict``
    shares between parameters un-shared (silent Adam bias-correction error)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_megarl_patched", False):
        return
    orig_sd = DistributedOptimizer.sharded_state_dict
    orig_set = DistributedOptimizer._set_main_param_and_optimizer_states
    orig_load = DistributedOptimizer.load_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, sharding_type=None,
                           metadata=None):
        # torch AdamW has no state before its first step; the upstream code asserts one `step`.
        if is_loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return orig_sd(self, model_sharded_state_dict, is_loading=is_loading,
                       sharding_type=sharding_type, metadata=metadata)

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return orig_set(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        dst = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, value in dst.items():
                if key in tensors:
                    value.copy_(tensors[key])

    def load_state_dict(self, state_dict):
        # Upstream assigns ONE shared `step` tensor to every param; torch AdamW increments it
        # per param, so Adam's bias correction silently goes wrong after a resume.
        orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._megarl_patched = True


# --- P10 ------------------------------------------------------------------------------------
def patch_hybrid_optimizer():
    """``trainer.optimizer_offload`` on a CPU host. megatron-core's HybridDeviceOptimizer moves
    the first ``offload_fraction`` of the *CUDA* parameters to host copies that a host optimizer
    steps, and a post-step hook copies them back. Here no parameter is a CUDA one, so the same
    split is made over all of them: an offloaded parameter gets its own host copy (a clone, where
    a GPU run makes ``.cpu().pin_memory()``), fp32 copies for lower-precision ones as upstream,
    and the streams are P6's no-ops. The copies, the host step and the copy back then run as on
    a GPU, which is what the CPU test of the option checks (weights equal to a run without)."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    if getattr(HybridDeviceOptimizer, "_megarl_patched", False):
        return
    # the precision-aware path the offload rides asks for TE >= 2.1 and crashes without TE
    optimizer_config.is_te_min_version = lambda *a, **k: utils.get_te_version() is not None and \
        utils.is_te_min_version(*a, **k)
    orig = HybridDeviceOptimizer._get_sub_optimizer_param_groups

    def _get_sub_optimizer_param_groups(self, offload_fraction: float):
        params = [p for group in self.param_groups for p in group["params"]]
        if any(p.is_cuda for p in params):
            return orig(self, offload_fraction)
        threshold = sum(p.numel() for p in params) * offload_fraction
        offloaded, host_groups, device_groups = 0, [], []
        to_host, to_device, fp32 = {}, {}, {}
        for group in self.param_groups:
            host, device = dict(group, params=[]), dict(group, params=[])
            for orig_param in group["params"]:
                param, on_host = orig_param, offloaded < threshold
                if on_host:
                    param = param.detach().clone()
                    offloaded += param.numel()
                if self.param_update_in_fp32 and param.dtype != torch.float32:
                    param = param.detach().clone().float()
                    fp32[orig_param] = param
                if on_host:
                    to_host[orig_param], to_device[param] = param, orig_param
                (host if on_host else device)["params"].append(param)
            host_groups += [host] if host["params"] else []
            device_groups += [device] if device["params"] else []
        return host_groups, device_groups, to_host, to_device, fp32

    HybridDeviceOptimizer._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups

    # loading a checkpoint: upstream copies every state's ``master_param`` into the parameter's
    # fp32 copy, but fp32 parameters have none (only lower-precision ones get one): KeyError.
    # An fp32 parameter's master is the parameter itself, or its host copy when offloaded.
    def _update_fp32_params_by_new_state(self):
        if not self.param_update_in_fp32:
            return
        for param, state in self.state.items():
            target = self.param_to_fp32_param.get(param, self.param_to_inner_param.get(param, param))
            if "master_param" in state and target is not state["master_param"]:
                target.data.copy_(state["master_param"])

    HybridDeviceOptimizer._update_fp32_params_by_new_state = _update_fp32_params_by_new_state
    HybridDeviceOptimizer._megarl_patched = True

    # fp32 model parameters (every CPU run; a GPU run with model.dtype float32): their shards are
    # views of the parameter that still require grad, and HybridDeviceOptimizer builds a new
    # torch optimizer from them. A detached view shares the storage, so updates still land in the
    # parameter.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = DistributedOptimizer._build_model_and_main_param_groups

    def _build_model_and_main_param_groups(gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = build(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        if not config.optimizer_cpu_offload:
            return groups
        detached = {}
        for shards in groups[3]:   # shard_fp32_groups
            for i, shard in enumerate(shards):
                if not shard.is_leaf:
                    leaf = shard.detach()
                    leaf.__dict__.update(shard.__dict__)   # tensor-parallel attributes, ``shared``
                    detached[id(shard)] = shards[i] = leaf
        for group_range in opt_group_ranges:
            params = group_range["orig_group"]["params"]
            params[:] = [detached.get(id(p), p) for p in params]
        return groups

    DistributedOptimizer._build_model_and_main_param_groups = staticmethod(_build_model_and_main_param_groups)


# --- P11 ------------------------------------------------------------------------------------
def patch_single_rank_grad_sync():
    """Skip the data-parallel collectives of megatron's gradient and parameter buffers when the
    group has one rank and the sync is synchronous (``overlap_grad_reduce`` / ``overlap_param_gather``
    off, one distributed-optimizer instance): a one-rank reduce-scatter or all-gather leaves every
    byte as it was, but gloo copies the whole buffer through a temporary to get there."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    if getattr(G.start_grad_sync, "_megarl_patched", False):
        return
    orig_grad, orig_param = G.start_grad_sync, G.start_param_sync

    def alone(group) -> bool:
        return group is not None and dist.get_world_size(group) == 1

    def start_grad_sync(self, force_all_reduce=False):
        c = self.ddp_config
        group = self.intra_distributed_optimizer_instance_group if c.use_distributed_optimizer \
            else self.data_parallel_group
        if c.overlap_grad_reduce or c.num_distributed_optimizer_instances != 1 or not alone(group):
            return orig_grad(self, force_all_reduce)
        if c.check_for_nan_in_grad or c.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=c.check_for_nan_in_grad, check_for_large=c.check_for_large_grads)
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        self.grad_reduce_handle = None

    def start_param_sync(self, force_sync=False):
        if (self.ddp_config.overlap_param_gather and not force_sync) or self.param_gather_handle is not None \
                or not alone(self.intra_distributed_optimizer_instance_group):
            return orig_param(self, force_sync)
        self.param_gather_handle = None
        self.param_gather_dispatched = True

    start_grad_sync._megarl_patched = True
    start_grad_sync._megarl_orig, start_param_sync._megarl_orig = orig_grad, orig_param
    G.start_grad_sync, G.start_param_sync = start_grad_sync, start_param_sync


def apply_all():
    """Apply P1-P7 and P9-P11 (idempotent)."""
    patch_current_device()
    patch_causal_masks()
    patch_rng_tracker()
    install_cuda_to_cpu_mode()
    patch_moe_router_without_te()
    patch_moe_alltoall()
    patch_uneven_collectives()
    patch_distributed_optimizer_checkpoint()
    patch_hybrid_optimizer()
    patch_single_rank_grad_sync()
