"""Boxes, logical tensors and the generic parts of a family mapping (pure: no processes, no groups).

Every layout relation in the bridge is a list of :class:`Piece`: a box (one ``(start, stop)`` per
dim) of a source tensor that lands, unchanged in shape, in a box of a named destination tensor.
The plan composes three of them:

1. Megatron logical tensor -> HF tensors (:meth:`FamilyMapping.to_hf`): QKV de-interleaving,
   ``linear_fc1`` -> gate / up, vocabulary padding dropped, expert stacks -> stacked HF tensors.
2. A rank's Megatron shard -> the logical tensor (:func:`shard_segments`): TP split on ``tp_dim``
   (a fused gate/up shard is two segments), experts split over EP on dim 0.
3. HF tensor -> vLLM's fused, TP-sharded parameters (:meth:`FamilyMapping.vllm_pieces`).

A logical tensor is a Megatron parameter by its global name, except that one MoE layer's experts
are one stacked tensor ``[E, 2I, H]`` (:func:`expert_param_name`); its HF stack has ``*`` for the
expert id and :func:`unstack_hf` gives the per-expert checkpoint tensors as zero-copy views.
Legend: E experts, I (expert) intermediate size, H hidden size, Q/K/V rows of q/k/v projections.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from megarl.models.dims import ModelDims

Box = tuple  # tuple[tuple[int, int], ...]: one (start, stop) per dim


# ----------------------------------------------------------------------------- boxes
def full_box(shape) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> tuple:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(s >= e for s, e in out) else out


def translate(box: Box, src_origin: Box, dst_origin: Box) -> Box:
    """Move ``box`` (inside a region starting at ``src_origin``) to the region at ``dst_origin``."""
    return tuple((s - so + do, e - so + do) for (s, e), (so, _), (do, _) in zip(box, src_origin, dst_origin))


def slices(box: Box) -> tuple:
    return tuple(slice(a, b) for a, b in box)


def replace_dim(box: Box, dim: int, start: int, stop: int) -> Box:
    return tuple((start, stop) if i == dim else r for i, r in enumerate(box))


@dataclass(frozen=True)
class Piece:
    """``src[src_box]`` is ``dst_name[dst_box]`` (same shape)."""

    src_box: Box
    dst_name: str
    dst_box: Box


def piece_extents(pieces: Iterable[Piece], out: Optional[dict] = None) -> dict[str, tuple]:
    """Destination name -> the smallest shape that holds every piece's box (``out`` grown in place)."""
    out = {} if out is None else out
    for p in pieces:
        ends = tuple(e for _, e in p.dst_box)
        out[p.dst_name] = tuple(max(a, b) for a, b in zip(out.get(p.dst_name, ends), ends))
    return out


def compose(first: Iterable[Piece], second: dict) -> list[tuple[Box, str, Box]]:
    """Compose A->B pieces with B->C pieces (``second``: B name -> list of pieces out of B).

    Returns ``(box in A, C name, box in C)`` for every overlap."""
    out = []
    for p in first:
        for q in second.get(p.dst_name, ()):
            mid = intersect(p.dst_box, q.src_box)
            if mid is None:
                continue
            out.append((translate(mid, p.dst_box, p.src_box), q.dst_name, translate(mid, q.src_box, q.dst_box)))
    return out


# ----------------------------------------------------------------------------- logical tensors
@dataclass(frozen=True)
class MegatronTensor:
    """One logical Megatron tensor (full, unsharded shape) and how Megatron shards it."""

    name: str
    shape: tuple
    layer: Optional[int]
    """Global decoder layer, or None (embedding, final norm, output layer)."""
    tp_dim: Optional[int] = None
    """Dim split over the TP group (the expert-TP group for experts); None: replicated."""
    gated: bool = False
    """Fused [gate; up] rows (``linear_fc1``): each TP rank holds [gate_r; up_r]."""
    expert: bool = False
    """Stacked routed experts [E, ...]: dim 0 split over EP."""


def expert_param_name(stack_name: str, expert_id: int) -> str:
    """Megatron's per-expert parameter name (``...linear_fc1.weight`` + id)."""
    return f"{stack_name}{expert_id}"


def shard_segments(t: MegatronTensor, tp_size: int, tp_rank: int, ep_size: int = 1,
                   ep_rank: int = 0) -> list[tuple[Box, Box]]:
    """``(box in the local shard, box in the logical tensor)`` for one rank's shard of ``t``.

    ``tp_size``/``tp_rank`` are the expert-TP ones for expert tensors."""
    segs = [(full_box(t.shape), full_box(t.shape))]
    if t.expert and ep_size > 1:
        per = t.shape[0] // ep_size
        segs = [(replace_dim(lb, 0, 0, per), replace_dim(fb, 0, ep_rank * per, (ep_rank + 1) * per))
                for lb, fb in segs]
    if t.tp_dim is not None and tp_size > 1:
        d, rows = t.tp_dim, t.shape[t.tp_dim]
        out = []
        for lb, fb in segs:
            if t.gated:
                half = rows // 2
                per = half // tp_size
                out.append((replace_dim(lb, d, 0, per), replace_dim(fb, d, tp_rank * per, (tp_rank + 1) * per)))
                out.append((replace_dim(lb, d, per, 2 * per),
                            replace_dim(fb, d, half + tp_rank * per, half + (tp_rank + 1) * per)))
            else:
                per = rows // tp_size
                out.append((replace_dim(lb, d, 0, per), replace_dim(fb, d, tp_rank * per, (tp_rank + 1) * per)))
        segs = out
    return segs


def local_shape(t: MegatronTensor, tp_size: int, ep_size: int = 1) -> tuple:
    shape = list(t.shape)
    if t.expert:
        shape[0] //= ep_size
    if t.tp_dim is not None:
        shape[t.tp_dim] //= tp_size
    return tuple(shape)


def unstack_hf(name: str, tensor) -> list[tuple[str, object]]:
    """A stacked HF expert tensor (name with ``*``) -> per-expert checkpoint names (views)."""
    if "*" not in name:
        return [(name, tensor)]
    return [(name.replace("*", str(e)), tensor[e]) for e in range(tensor.shape[0])]


VLLM_VOCAB_PADDING = 64   # vllm DEFAULT_VOCAB_PADDING_SIZE


class FamilyMapping:
    """Megatron <-> HF <-> vLLM layouts of one family. Subclasses list the per-layer tensors.

    A family is registered once, with its mapping class, in :mod:`megarl.models.registry`."""

    def __init__(self, cfg: ModelDims):
        self.cfg = cfg

    # -- Megatron side -------------------------------------------------------------------
    def layer_tensors(self, i: int) -> list[MegatronTensor]:
        raise NotImplementedError

    def megatron_tensors(self) -> list[MegatronTensor]:
        """Every logical Megatron tensor of the model, in Megatron's order."""
        c = self.cfg
        vocab = (c.megatron_vocab_size, c.hidden_size)
        out = [MegatronTensor("embedding.word_embeddings.weight", vocab, None, tp_dim=0)]
        for i in range(c.num_layers):
            out += self.layer_tensors(i)
        out.append(MegatronTensor("decoder.final_layernorm.weight", (c.hidden_size,), None))
        if not c.tie_word_embeddings:
            out.append(MegatronTensor("output_layer.weight", vocab, None, tp_dim=0))
        return out

    # -- Megatron -> HF ------------------------------------------------------------------
    def hf_rules(self, t: MegatronTensor) -> list[Piece]:
        """Family-specific pieces; the default handles names shared by every family."""
        raise NotImplementedError

    def to_hf(self, t: MegatronTensor) -> list[Piece]:
        hf_vocab = full_box((self.cfg.vocab_size, self.cfg.hidden_size))   # Megatron's padding rows dropped
        if t.name == "embedding.word_embeddings.weight":
            return [Piece(hf_vocab, "model.embed_tokens.weight", hf_vocab)]
        if t.name == "output_layer.weight":
            return [Piece(hf_vocab, "lm_head.weight", hf_vocab)]
        if t.name == "decoder.final_layernorm.weight":
            return [Piece(full_box(t.shape), "model.norm.weight", full_box(t.shape))]
        pieces = self.hf_rules(t)
        if not pieces:
            raise ValueError(f"{self.cfg.model_type}: no HF mapping for megatron tensor {t.name!r}")
        return pieces

    def hf_shapes(self) -> dict[str, tuple]:
        """HF tensor name -> shape (stacked experts with ``*``), in Megatron order."""
        out: dict[str, tuple] = {}
        for t in self.megatron_tensors():
            piece_extents(self.to_hf(t), out)
        return out

    # -- HF -> vLLM ----------------------------------------------------------------------
    def vllm_rules(self, name: str, shape: tuple, tp: int, rank: int) -> Optional[list[Piece]]:
        """Family-specific HF -> vLLM pieces (None: fall back to the shared rules)."""
        return None

    def vllm_pieces(self, name: str, shape: tuple, tp: int, rank: int) -> list[Piece]:
        """Pieces of HF tensor ``name`` that vLLM TP rank ``rank`` (of ``tp``) holds, into its params."""
        pieces = self.vllm_rules(name, shape, tp, rank)
        if pieces is not None:
            return pieces
        c = self.cfg
        prefix, _, leaf = name.rpartition(".")           # leaf: weight / bias
        module = prefix.rpartition(".")[2]
        parent = prefix.rpartition(".")[0]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-c.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            per = padded // tp
            start, stop = rank * per, min((rank + 1) * per, c.vocab_size)
            if start >= stop:
                return []
            return [Piece(((start, stop), (0, shape[1])), name, ((0, stop - start), (0, shape[1])))]
        if module in ("q_proj", "k_proj", "v_proj"):
            return [self._qkv_piece(parent, module, leaf, shape, tp, rank)]
        if module in ("gate_proj", "up_proj"):
            rows = shape[0] // tp
            off = 0 if module == "gate_proj" else rows
            return [Piece(replace_dim(full_box(shape), 0, rank * rows, (rank + 1) * rows),
                          f"{parent}.gate_up_proj.{leaf}", replace_dim(full_box(shape), 0, off, off + rows))]
        if module in ("o_proj", "down_proj"):
            cols = shape[1] // tp
            dst_shape = (shape[0], cols)
            return [Piece(replace_dim(full_box(shape), 1, rank * cols, (rank + 1) * cols), name, full_box(dst_shape))]
        if len(shape) == 1 or module in ("gate",):      # norms, router, routing bias: replicated
            return [Piece(full_box(shape), name, full_box(shape))]
        raise ValueError(f"{self.cfg.model_type}: no vLLM layout for HF tensor {name!r}")

    def _qkv_piece(self, parent, module, leaf, shape, tp, rank) -> Piece:
        c = self.cfg
        q_rows = c.num_attention_heads * c.head_dim // tp
        if c.num_kv_heads >= tp:
            kv_rows, kv_start = c.num_kv_heads * c.head_dim // tp, rank * (c.num_kv_heads * c.head_dim // tp)
        else:   # vLLM replicates KV heads: rank r holds head r // (tp / kv_heads)
            kv_rows, kv_start = c.head_dim, (rank // (tp // c.num_kv_heads)) * c.head_dim
        if module == "q_proj":
            src, off, rows = rank * q_rows, 0, q_rows
        elif module == "k_proj":
            src, off, rows = kv_start, q_rows, kv_rows
        else:
            src, off, rows = kv_start, q_rows + kv_rows, kv_rows
        return Piece(replace_dim(full_box(shape), 0, src, src + rows), f"{parent}.qkv_proj.{leaf}",
                     replace_dim(full_box(shape), 0, off, off + rows))

    def vllm_shapes(self, tp: int) -> dict[str, tuple]:
        """vLLM parameter name -> per-rank (checkpoint-format) shape at TP size ``tp``."""
        out: dict[str, tuple] = {}
        for name, shape in self.hf_shapes().items():
            piece_extents(self.vllm_pieces(name, shape, tp, 0), out)
        if self.cfg.vocab_size:   # padded vocabulary rows exist in vLLM even where nothing lands
            padded = -(-self.cfg.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            for n in ("model.embed_tokens.weight", "lm_head.weight"):
                if n in out:
                    out[n] = (padded // tp, out[n][1])
        return out
