"""CPU implementations of the Transformer-Engine modules that megatron-core's TE layer spec uses.

With them the TE layer spec builds, on a CPU-only machine, a model whose parameter names, shapes
and ``sharded_state_dict`` keys are the GPU (TE) model's: one spec, the same checkpoints and
TE-named weight map (megarl.bridge.mapping), packed THD sequences and context parallelism.
Stand-ins: CpuTENorm (TENorm), CpuTELinear (TELinear 'duplicated'), CpuTELayerNormColumnParallelLinear,
Cpu{Column,Row}ParallelGroupedLinear (the TE grouped linears, weight0..weightN-1),
CpuTEDotProductAttention (GQA, k != v head dim, THD, CP), and megatron's own
Column/RowParallelLinear for TE's (same parameter names).

Deviations from TE: attention is a plain O(S^2) math implementation (fp32 scores);
``attention_bias``, FP8 and TE's fused kernels are not emulated. Context parallelism follows
megatron's load-balanced layout (cp rank r holds chunks r and 2*cp-1-r of 2*cp); K/V are
all-gathered over the CP group and the mask is built from global positions, so results equal cp=1.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _initialize_affine_weight_cpu,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size


def te_norm(x, weight, bias, config):
    """The norm TE fuses into LayerNormLinear (RMSNorm or LayerNorm per ``config``, zero-centred gamma)."""
    w = weight + 1 if config.layernorm_zero_centered_gamma else weight
    if config.normalization == "RMSNorm":
        return F.rms_norm(x, (x.shape[-1],), w, config.layernorm_epsilon)
    return F.layer_norm(x, (x.shape[-1],), w, bias, config.layernorm_epsilon)


class CpuTENorm:
    """TENorm(config, hidden_size, eps) -> torch RMSNorm/LayerNorm; params tagged sequence_parallel."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        if config.normalization == "RMSNorm":
            m = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            m = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(config.normalization)
        assert not config.layernorm_zero_centered_gamma, "zero_centered_gamma: use CpuTELayerNorm... n/a"
        m = m.to(dtype=config.params_dtype)
        for p in m.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return m


class CpuTELayerNormColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with the input norm fused in; params: weight, [bias], layer_norm_weight,
    [layer_norm_bias] -- the same names as TELayerNormColumnParallelLinear."""

    def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias,
                 skip_bias_add, is_expert, skip_weight_param_allocation=False,
                 tp_comm_buffer_name=None, tp_group=None, stride=1):
        assert not gather_output, "TE linear layers do not support gather_output=True"
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=False, stride=stride, skip_bias_add=skip_bias_add,
                         skip_weight_param_allocation=skip_weight_param_allocation,
                         is_expert=is_expert, tp_comm_buffer_name=tp_comm_buffer_name,
                         tp_group=tp_group)
        init_val = 0.0 if config.layernorm_zero_centered_gamma else 1.0
        self.layer_norm_weight = Parameter(torch.full((input_size,), init_val, dtype=config.params_dtype))
        setattr(self.layer_norm_weight, "sequence_parallel", bool(config.sequence_parallel))
        if config.normalization == "LayerNorm":
            self.layer_norm_bias = Parameter(torch.zeros(input_size, dtype=config.params_dtype))
            setattr(self.layer_norm_bias, "sequence_parallel", bool(config.sequence_parallel))
        else:
            self.layer_norm_bias = None

    def forward(self, input_, weight=None, runtime_gather_output=None):
        x = te_norm(input_, self.layer_norm_weight, self.layer_norm_bias, self.config)
        return super().forward(x, weight=weight, runtime_gather_output=runtime_gather_output)


class CpuTELinear(MegatronModule):
    """TELinear with parallel_mode='duplicated' (weight replicated on all TP ranks; grads are
    all-reduced over TP by finalize_model_grads when sequence_parallel, like TE)."""

    def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias,
                 skip_bias_add, skip_weight_param_allocation=False, tp_comm_buffer_name=None,
                 is_expert=False, symmetric_ar_type=None, tp_group=None):
        super().__init__(config=config)
        assert parallel_mode in ("duplicated", None), parallel_mode
        assert not skip_weight_param_allocation
        self.parallel_mode = None
        self.skip_bias_add = skip_bias_add
        self.weight = Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            w = torch.empty(output_size, input_size, dtype=torch.float32)
            init_method(w)   # CPU RNG: identical on all ranks after model_parallel_seed()
            with torch.no_grad():
                self.weight.copy_(w)
        self.bias = Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None
        for p in self.parameters():
            setattr(p, "allreduce", True)
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        self._tp_group = ps.get_tensor_model_parallel_group()

    def forward(self, x):
        out = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        return (out, self.bias) if self.skip_bias_add else (out, None)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, None, sharded_offsets,
                                                   tp_group=self._tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


class _CpuGroupedLinear(MegatronModule):
    """num_gemms expert linears with TE GroupedLinear parameter names weight{i} / bias{i}.
    Like TE with explicit expert comm: no communication inside (the token dispatcher does it)."""

    parallel_mode = ""
    """"column" or "row": fixed by the two public subclasses (TE's constructor signature has no
    parallel_mode argument for them)."""

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert=True, tp_comm_buffer_name=None, pg_collection=None):
        super().__init__(config=config)
        assert is_expert
        parallel_mode = self.parallel_mode
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp_size, tp_rank = get_pg_size(self._tp_group), get_pg_rank(self._tp_group)
        self.num_gemms, self.use_bias, self.skip_bias_add = num_gemms, bias, skip_bias_add
        self.expert_parallel = config.expert_model_parallel_size > 1
        if parallel_mode == "column":
            out_pp, in_pp, pdim, per_part = divide(output_size, tp_size), input_size, 0, divide(output_size, tp_size)
        else:
            out_pp, in_pp, pdim, per_part = output_size, divide(input_size, tp_size), 1, divide(input_size, tp_size)
        # fc1 of a gated MLP holds [gate_r; up_r] per rank (same as TEGroupedMLP's swiglu sharding)
        stride = 2 if (parallel_mode == "column" and config.gated_linear_unit) else 1
        for i in range(num_gemms):
            w = Parameter(torch.empty(out_pp, in_pp, dtype=config.params_dtype))
            if config.perform_initialization:
                _initialize_affine_weight_cpu(w, output_size, input_size, per_part, pdim, init_method,
                                              stride=stride, params_dtype=config.params_dtype,
                                              rank=tp_rank, world_size=tp_size)
            else:
                tensor_parallel.set_tensor_model_parallel_attributes(w, True, pdim, stride)
            setattr(w, "allreduce", not self.expert_parallel)
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = Parameter(torch.zeros(out_pp if parallel_mode == "column" else output_size,
                                          dtype=config.params_dtype))
                if parallel_mode == "column":
                    tensor_parallel.set_tensor_model_parallel_attributes(b, True, 0, stride)
                setattr(b, "allreduce", not self.expert_parallel)
                self.register_parameter(f"bias{i}", b)

    def forward(self, x, m_splits):
        m_splits = list(m_splits)
        outs = []
        for i, xi in enumerate(torch.split(x, m_splits)):
            b = getattr(self, f"bias{i}") if (self.use_bias and not self.skip_bias_add) else None
            outs.append(F.linear(xi, getattr(self, f"weight{i}"), b))
        out = torch.cat(outs, dim=0)
        if self.use_bias and self.skip_bias_add:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out, None

    def backward_dw(self):
        pass

    def _sharded_state_dict_grouped(self, tp_axis_map, prefix="", sharded_offsets=(), metadata=None):
        # same logic/keys as TEGroupedLinear._sharded_state_dict_grouped (minus TE _extra_state)
        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        out = {}
        full = self.state_dict(prefix="", keep_vars=True)
        ep = self._pg_collection.ep
        num_global = get_pg_size(ep) * self.num_gemms
        offset = get_pg_rank(ep) * self.num_gemms
        ep_axis = len(sharded_offsets)
        for g in range(self.num_gemms):
            gidx = offset + g
            state = {f"{g}.weight": full[f"weight{g}"]}
            if self.use_bias:
                state[f"{g}.bias"] = full[f"bias{g}"]
            if singleton_local_shards:
                expert_prefix, new_off = f"{gidx}.{prefix}", sharded_offsets
            else:
                expert_prefix, new_off = prefix, (*sharded_offsets, (ep_axis, gidx, num_global))
            sub = make_sharded_tensors_for_checkpoint(state, "", tp_axis_map, new_off,
                                                      tp_group=self._tp_group,
                                                      dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{g}.", expert_prefix)
            out[f"{prefix}weight{g}"] = sub[f"{g}.weight"]
            if self.use_bias:
                out[f"{prefix}bias{g}"] = sub[f"{g}.bias"]
        for k, sh in out.items():
            sh.replica_id = (*sh.replica_id[:2], get_pg_rank(self._pg_collection.expt_dp))
        return out


class CpuColumnParallelGroupedLinear(_CpuGroupedLinear):
    parallel_mode = "column"

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        m = {}
        for g in range(self.num_gemms):
            m.update({f"{g}.weight": 0, f"{g}.bias": 0})
        return self._sharded_state_dict_grouped(m, prefix, sharded_offsets, metadata)


class CpuRowParallelGroupedLinear(_CpuGroupedLinear):
    parallel_mode = "row"

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        m = {f"{g}.weight": 1 for g in range(self.num_gemms)}
        return self._sharded_state_dict_grouped(m, prefix, sharded_offsets, metadata)


def _cp_local_positions(local_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp ``rank`` holds for one sequence of local_len tokens."""
    c = local_len // 2
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _cp_local_positions_thd(cu_seqlens_padded_N1: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Global packed positions of the tokens cp ``rank`` holds, sequence after sequence."""
    out = []
    for start, end in zip(cu_seqlens_padded_N1[:-1].tolist(), cu_seqlens_padded_N1[1:].tolist()):
        out.append(start + _cp_local_positions((end - start) // cp, cp, rank))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class CpuTEDotProductAttention(MegatronModule):
    """Reference (math) attention with the TEDotProductAttention interface:
    GQA, different q/k vs v head dims (MLA), causal / padding masks, packed THD sequences
    (PackedSeqParams.cu_seqlens_q/kv -> block-diagonal mask) and context parallelism
    (K/V all-gathered over the CP group, mask built from megatron's 2*cp load-balanced chunking)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p",
                 pg_collection=None, **kwargs):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.fused_without_grad = False
        """Whole sequences without gradients through torch's fused kernel (:meth:`_attend_sequence`)."""

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise NotImplementedError("CpuTEDotProductAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:                                   # [t, h, d] -> [t, 1, h, d]
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq, b, nh, _ = query.shape
        cp = get_pg_size(self.cp_group) if self.cp_group is not None else 1
        cu_q = cu_k = None
        if thd:
            cu_q = packed_seq_params.cu_seqlens_q_padded if packed_seq_params.cu_seqlens_q_padded is not None else packed_seq_params.cu_seqlens_q
            cu_k = packed_seq_params.cu_seqlens_kv_padded if packed_seq_params.cu_seqlens_kv_padded is not None else packed_seq_params.cu_seqlens_kv
            cu_q, cu_k = cu_q.to(torch.long).cpu(), cu_k.to(torch.long).cpu()
            if cp == 1 and torch.equal(cu_q, cu_k):
                # One sequence at a time: cost sum(len_i^2), not T^2 over the whole packed row.
                causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
                bounds = list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()))
                ctx = torch.cat([self._attend_sequence(query[s:e], key[s:e], value[s:e], causal)
                                 for s, e in bounds if e > s]
                                + ([query.new_zeros((sq - bounds[-1][1],) + tuple(query.shape[1:3]) + (value.shape[-1],))]
                                   if bounds and bounds[-1][1] < sq else []))
                return ctx.reshape(sq, nh * ctx.shape[-1])
        if key.shape[2] != nh:                    # GQA
            rep = nh // key.shape[2]
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        if cp > 1:
            r = get_pg_rank(self.cp_group)
            if thd:   # cu_seqlens are global (whole padded sequences); local = chunks r, 2cp-1-r of each
                q_pos = _cp_local_positions_thd(cu_q, cp, r)
                k_pos = torch.cat([_cp_local_positions_thd(cu_k, cp, j) for j in range(cp)])
            else:
                q_pos = _cp_local_positions(sq, cp, r)
                k_pos = torch.cat([_cp_local_positions(sq, cp, j) for j in range(cp)])
            key = gather_from_sequence_parallel_region(key, True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, True, group=self.cp_group)
        else:
            q_pos = torch.arange(sq)
            k_pos = torch.arange(key.shape[0])
        # masked[q, k] = True -> not allowed
        masked = torch.zeros(sq, key.shape[0], dtype=torch.bool)
        if mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            masked = masked | (k_pos[None, :] > q_pos[:, None])
        if thd:
            seg_q = torch.bucketize(q_pos, cu_q[1:], right=True)
            seg_k = torch.bucketize(k_pos, cu_k[1:], right=True)
            masked = masked | (seg_q[:, None] != seg_k[None, :])
        masked = masked[None, None]               # [1, 1, sq, sk]
        if attention_mask is not None and not thd:
            masked = masked | attention_mask.to(torch.bool)
        ctx = self._attend(query, key, value, masked)                        # [sq, b, h, dv]
        if thd:
            return ctx.reshape(sq, nh * ctx.shape[-1])                      # [t, h*dv]
        return ctx.reshape(sq, b, nh * ctx.shape[-1])

    def _attend_sequence(self, query, key, value, causal: bool):
        """One whole sequence, q [s,1,h,d], k/v [s,1,hkv,d] -> [s,1,h,dv].

        In a frozen model (``fused_without_grad``: the reference model, set by
        :class:`megarl.policy.model.PolicyModel`) without gradients: torch's fused CPU attention
        (``scaled_dot_product_attention``: fp32 softmax and accumulation, GQA without repeating
        K/V); a quickstart-shaped bf16 log-prob pass (3,360 tokens, 30 layers) takes 3.8 s against
        4.5 s through the math path. Otherwise the math path below: the fused
        kernel's CPU backward measured 4x slower than autograd through the math (3.8 s against
        ~0.9 s a step there), attention dropout needs megatron's RNG tracker, and a trained model's
        passes without gradients (the old log-probs) must equal its training forward bit for bit
        (the ratio is then exactly 1 before the first update; the fused kernel differs by ~4e-6
        in fp32)."""
        if not (FUSED_INFERENCE_ATTENTION and self.fused_without_grad) or (self.training and self.dropout_p > 0) or \
                (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)):
            if key.shape[2] != query.shape[2]:
                rep = query.shape[2] // key.shape[2]
                key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
            return self._attend(query, key, value, _segment_mask(query.shape[0], causal))
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))          # [1, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3)                                         # [s, 1, h, dv]

    def _attend(self, query, key, value, masked):
        """softmax(q k^T * scale, masked) v with q [s,b,h,d], k/v [t,b,h,d], masked [1|b,1|h,s,t]."""
        scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.dropout_p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = F.dropout(probs, p=self.dropout_p)
        return torch.einsum("bhst,tbhd->sbhd", probs.to(value.dtype), value)


FUSED_INFERENCE_ATTENTION = True
"""False: no model uses ``scaled_dot_product_attention`` (:meth:`CpuTEDotProductAttention._attend_sequence`;
for an A/B comparison of the two paths)."""


def _segment_mask(length: int, causal: bool) -> torch.Tensor:
    """[1, 1, length, length] mask (True = not allowed) for one whole sequence."""
    if not causal:
        return torch.zeros(1, 1, length, length, dtype=torch.bool)
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


class CpuTESpecProvider(BackendSpecProvider):
    """BackendSpecProvider returning the CPU stand-ins above (drop-in for TESpecProvider)."""

    def linear(self):
        return CpuTELinear

    def column_parallel_linear(self):
        return ColumnParallelLinear

    def row_parallel_linear(self):
        return RowParallelLinear

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return CpuTELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return CpuTENorm

    def core_attention(self):
        return CpuTEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm, moe_use_legacy_grouped_gemm):
        if moe_use_grouped_gemm and not moe_use_legacy_grouped_gemm:
            return TEGroupedMLP, MLPSubmodules(linear_fc1=CpuColumnParallelGroupedLinear,
                                               linear_fc2=CpuRowParallelGroupedLinear)
        return SequentialMLP, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def activation_func(self):
        return None


def install_cpu_te_spec():
    """Make megatron's TE spec builders (and mbridge, which calls them) use the CPU stand-ins."""
    from megatron.core.models.gpt import gpt_layer_specs, moe_module_specs
    from megatron.core.transformer import multi_latent_attention, transformer_block
    transformer_block.LayerNormImpl = CpuTENorm      # final_layernorm when a *layer* spec is passed
    gpt_layer_specs.TESpecProvider = CpuTESpecProvider
    gpt_layer_specs.TENorm = CpuTENorm
    moe_module_specs.TESpecProvider = CpuTESpecProvider
    multi_latent_attention.TELinear = CpuTELinear     # MLA checks `linear_q_down_proj in [TELinear]`
