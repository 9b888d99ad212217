"""2-process gloo check of megarl.compat: a GPTModel built from megatron-core's TE layer spec
(CPU TE modules) at TP=2, CP=2 and with THD packing matches the TP=1 / unpacked computation.
``run`` inside the launch of engine_parity.py (tests/distributed/test_compat_parity.py), or this
script alone under torchrun.

Legend: B batch, S sequence, T packed tokens, V vocab.
"""
import json

import torch
import torch.distributed as dist

from megarl.compat import cpu_transformer_overrides, setup_cpu

setup_cpu()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB, S, B = 128, 32, 2


def build(tp=1, cp=1, sp=False):
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    overrides = cpu_transformer_overrides()
    overrides.pop("batch_p2p_comm")
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        kv_channels=16, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, init_method_std=0.05, **overrides)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
                     vocab_size=VOCAB, max_sequence_length=S, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    return model.eval()


def per_token_loss(model, tokens_BS, labels_BS, packed=None, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(tokens_BS.shape[1]).unsqueeze(0).expand_as(tokens_BS)
    with torch.no_grad():
        return model(tokens_BS, position_ids, None, labels=labels_BS, packed_seq_params=packed)


def cp_local(x_BS, cp, rank):
    """Megatron's load-balanced CP split: 2*cp chunks, rank r keeps chunks r and 2cp-1-r."""
    chunks = x_BS.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def run(rank: int, world: int) -> dict:
    """Every comparison (the gloo process group is up; megatron's model-parallel state is left
    destroyed); what rank 0 reports."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = torch.randint(0, VOCAB, (B, S), generator=g)
    out = {}

    ref = per_token_loss(build(tp=1), tokens, labels)                      # [B, S]
    for name, kw in {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sp=True)}.items():
        loss = per_token_loss(build(**kw), tokens, labels)
        out[f"{name}_max_abs_diff"] = (loss - ref).abs().max().item()
        out[f"{name}_mean_loss_diff"] = abs(loss.mean().item() - ref.mean().item())

    # CP=2: each rank feeds its two chunks; gather and put the chunks back in order.
    model = build(cp=2)
    local = per_token_loss(model, cp_local(tokens, 2, rank), cp_local(labels, 2, rank),
                           position_ids=cp_local(torch.arange(S).unsqueeze(0).expand(B, -1), 2, rank))
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    full = torch.empty_like(ref)
    c = S // 4
    for r, part in enumerate(parts):
        full[:, r * c:(r + 1) * c] = part[:, :c]
        full[:, (3 - r) * c:(4 - r) * c] = part[:, c:]
    out["cp2_max_abs_diff"] = (full - ref).abs().max().item()

    # THD: three sequences of different lengths packed into one row, vs one at a time.
    lengths = [5, 12, 9]
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    labs = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    for name, kw in {"thd_tp1": dict(tp=1), "thd_tp2": dict(tp=2)}.items():
        model = build(**kw)
        packed_loss = per_token_loss(model, torch.cat(seqs)[None], torch.cat(labs)[None], packed, pos)[0]
        single = torch.cat([per_token_loss(model, s[None], lab[None])[0] for s, lab in zip(seqs, labs)])
        out[f"{name}_vs_unpacked_max_abs_diff"] = (packed_loss - single).abs().max().item()
    # THD + CP=2: each sequence padded to a multiple of 2*cp, cut in 4 chunks, zig-zag per rank.
    padded = [-(-n // 4) * 4 for n in lengths]
    cu_pad = torch.tensor([0] + torch.tensor(padded).cumsum(0).tolist(), dtype=torch.int32)
    packed_cp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad,
                                max_seqlen_q=max(padded), max_seqlen_kv=max(padded))

    def zigzag(per_seq):
        parts = []
        for x, n in zip(per_seq, padded):
            x = torch.cat([x, x.new_zeros(n - x.numel())]).chunk(4)
            parts += [x[rank], x[3 - rank]]
        return torch.cat(parts)[None]

    model = build(cp=2)
    local = per_token_loss(model, zigzag(seqs), zigzag(labs), packed_cp,
                           zigzag([torch.arange(n) for n in lengths]))[0]
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous())
    got, offset = [], 0
    for n, npad in zip(lengths, padded):
        c = npad // 4
        chunks = [None] * 4
        for r in range(world):
            chunks[r] = gathered[r][offset: offset + c]
            chunks[3 - r] = gathered[r][offset + c: offset + 2 * c]
        got.append(torch.cat(chunks)[:n])
        offset += 2 * c
    out["thd_cp2_vs_unpacked_max_abs_diff"] = (torch.cat(got) - single).abs().max().item()
    out["thd_vs_tp1_ref_loss_mean"] = single.mean().item()
    out["ref_loss_mean"] = ref.mean().item()
    ps.destroy_model_parallel()
    return out


def main():
    dist.init_process_group("gloo")
    out = run(dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
