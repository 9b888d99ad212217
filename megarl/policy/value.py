"""Critic (value model) on the same Megatron GPTModel: the LM head replaced by a scalar head.

PPO's critic is the policy's architecture from the same HF checkpoint with the output layer
replaced by :class:`ValueHead` ``[H] -> [1]`` (zero-initialised: training starts from V = 0);
everything else is the policy engine's (``PolicyModel`` with ``ModelOptions(value_head=True)``).
The head is replicated on every TP rank; under sequence parallelism its input slice is
all-gathered with a backward that splits the gradient (megatron's
``tensor_parallel_output_grad=False``), since every TP rank computes the same loss, so the head's
gradient agrees across TP without a reduction. CP shares and response selection are the
log-probs' (:mod:`megarl.policy.logprobs`): response token j's value is read at position j - 1.

A reward model (``ModelOptions(score_head=True)``) has the same head without a bias, read at each
sequence's last token (:func:`sequence_scores`): HF's ``*ForSequenceClassification`` layout with
one label, whose ``score.weight`` it loads and exports.
Shape legend: N sequences, T packed tokens on this rank, H hidden size, R packed response tokens.
"""
from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """``[T, B, H] -> ([T, B, 1], None)``, called like megatron's output layer."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group, bias: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # a reward model's head has none: HF's *ForSequenceClassification score layer is bias-free
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype)) if bias else None
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_TBH: torch.Tensor, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            hidden_TBH = gather_from_sequence_parallel_region(hidden_TBH, tensor_parallel_output_grad=False,
                                                              group=self.tp_group)
        bias = self.bias.float() if self.bias is not None else None
        return torch.nn.functional.linear(hidden_TBH.float(), self.weight.float(), bias), None


def attach_value_heads(chunks: list, config, tp_group, bias: bool = True) -> None:
    """Replace the output layer of the last-stage chunks by a :class:`ValueHead` (before DDP)."""
    for chunk in chunks:
        # untie: the head does not share the word embeddings (and megatron must not all-reduce
        # embedding grads between the first and last pipeline stage for it)
        chunk.share_embeddings_and_output_weights = False
        if getattr(chunk, "post_process", False):
            sp = bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1
            chunk.output_layer = ValueHead(config.hidden_size, config.params_dtype, sp, tp_group, bias=bias)


def has_value_head(module) -> bool:
    """Whether ``module`` (an unwrapped GPTModel chunk) carries a :class:`ValueHead`: its
    ``output_layer.*`` parameters then have no HF-mapping counterpart (weight loading, export
    and the bridge skip them)."""
    return isinstance(getattr(module, "output_layer", None), ValueHead)


def head_weight(modules: list):
    """The scalar head's weight ``[1, H]`` of the last-stage chunk among ``modules`` (None on
    other pipeline stages)."""
    for module in modules:
        if has_value_head(module) and getattr(module, "post_process", False):
            return module.output_layer.weight
    return None


def sequence_scores(values_1T1: torch.Tensor, packed, pgs, with_entropy: bool = False):
    """Score-head output of one micro-batch -> (each sequence's score ``[N]``, read at its last
    token, as HF's ``*ForSequenceClassification`` reads it; None). A reward model's output."""
    from megarl.data.packing import unpack_sequences
    from megarl.policy.logprobs import gather_cp

    full_Tf = gather_cp(values_1T1[0, :, 0].float(), packed, pgs.cp)
    per_seq = unpack_sequences(full_Tf, packed.cu_seqlens_N1, packed.cu_seqlens_padded_N1)
    return torch.stack([x[-1] for x in per_seq]), None


def response_values(values_1T1: torch.Tensor, packed, pgs, with_entropy: bool = False):
    """Value-head output of one micro-batch -> (values of the response tokens ``[R]``, None)."""
    from megarl.policy.logprobs import gather_cp, select_response

    values_T = values_1T1[0, :, 0].float()
    return select_response(gather_cp(values_T, packed, pgs.cp), packed), None
