"""Property and edge-case tests of megarl.data.packing (THD rows, CP zig-zag split)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megarl.data.packing import (gather_cp_shares, pack_sequences, packed_seq_params_kwargs,
                                 packed_tokens, padded_length, sequence_alignment,
                                 unpack_sequences)

SETTINGS = settings(max_examples=60, deadline=None)


def _seqs(lengths, trailing=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n, *trailing), generator=g) for n in lengths]


@SETTINGS
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=12), tp=st.sampled_from([1, 2, 4]),
       cp=st.sampled_from([1, 2, 3, 4]), trailing=st.sampled_from([(), (3,)]))
def test_pack_unpack_roundtrip(lengths, tp, cp, trailing):
    seqs = _seqs(lengths, trailing)
    shares = [pack_sequences(seqs, tp=tp, cp=cp, cp_rank=r) for r in range(cp)]
    p0 = shares[0]
    align = sequence_alignment(tp, cp)
    padded = [padded_length(n, tp, cp) for n in lengths]
    assert p0.cu_seqlens_N1.dtype == torch.int32 and p0.cu_seqlens_padded_N1.dtype == torch.int32
    assert p0.cu_seqlens_N1.tolist() == [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    assert p0.cu_seqlens_padded_N1.tolist() == [0] + list(torch.tensor(padded).cumsum(0).tolist())
    assert all(p % align == 0 and p - align < n <= p for p, n in zip(padded, lengths))
    assert p0.max_seqlen == max(padded) and p0.lengths == lengths
    for share in shares:
        assert share.tokens_T.shape[0] == sum(packed_tokens(n, tp, cp) for n in lengths)
        assert share.tokens_T.shape[0] % tp == 0
    full = gather_cp_shares([s.tokens_T for s in shares], p0.cu_seqlens_padded_N1)
    out = unpack_sequences(full, p0.cu_seqlens_N1, p0.cu_seqlens_padded_N1)
    assert len(out) == len(seqs) and all(torch.equal(a, b) for a, b in zip(out, seqs))
    positions = gather_cp_shares([s.position_ids_T for s in shares], p0.cu_seqlens_padded_N1)
    assert positions.tolist() == [j for p in padded for j in range(p)]


def test_padding_and_positions_without_cp():
    packed = pack_sequences(_seqs([3, 5]), tp=4, pad_value=-1)
    assert packed.cu_seqlens_N1.tolist() == [0, 3, 8]
    assert packed.cu_seqlens_padded_N1.tolist() == [0, 4, 12]
    assert packed.position_ids_T.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    assert packed.tokens_T[3].item() == -1 and (packed.tokens_T[9:] == -1).all()


def test_cp_zigzag_chunks():
    # cp=2, tp=1: alignment 4. Sequence of 8 -> chunks of 2: rank 0 gets chunks 0 and 3,
    # rank 1 gets chunks 1 and 2; a sequence of 3 is padded to 4 (chunks of 1).
    seqs = [torch.arange(10, 18), torch.arange(20, 23)]
    r0 = pack_sequences(seqs, cp=2, cp_rank=0, pad_value=0)
    r1 = pack_sequences(seqs, cp=2, cp_rank=1, pad_value=0)
    assert r0.tokens_T.tolist() == [10, 11, 16, 17, 20, 0]
    assert r1.tokens_T.tolist() == [12, 13, 14, 15, 21, 22]
    assert r0.position_ids_T.tolist() == [0, 1, 6, 7, 0, 3]
    assert r1.position_ids_T.tolist() == [2, 3, 4, 5, 1, 2]
    # cu_seqlens stay global (TE divides them by cp itself).
    assert r0.cu_seqlens_N1.tolist() == [0, 8, 11]
    assert r0.cu_seqlens_padded_N1.tolist() == [0, 8, 12]


def test_cp_matches_megatron_view_split():
    # Megatron's bshd CP split: view as [2*cp, chunk] and take chunks r and 2cp-1-r.
    cp = 4
    seq = torch.arange(64)
    for r in range(cp):
        share = pack_sequences([seq], cp=cp, cp_rank=r).tokens_T
        ref = seq.view(2 * cp, -1)[[r, 2 * cp - 1 - r]].reshape(-1)
        assert torch.equal(share, ref)


def test_packed_seq_params_kwargs():
    packed = pack_sequences(_seqs([5, 9]), tp=2, cp=2)
    kwargs = packed_seq_params_kwargs(packed)
    assert kwargs["qkv_format"] == "thd"
    assert kwargs["cu_seqlens_q"].tolist() == [0, 5, 14]
    assert kwargs["cu_seqlens_kv_padded"].tolist() == [0, 8, 24]
    assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_kv"] == 16
    psp = pytest.importorskip("megatron.core.packed_seq_params")
    params = psp.PackedSeqParams(**kwargs)
    assert params.qkv_format == "thd" and params.max_seqlen_kv == 16


@SETTINGS
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), tp=st.sampled_from([1, 2]),
       cp=st.sampled_from([1, 2]), extra_units=st.integers(0, 5))
def test_pad_to_only_lengthens_the_last_padding(lengths, tp, cp, extra_units):
    """pad_to (one shape for every micro-batch of a call, the fixed-shape pipeline exchange):
    the real tokens, real cu_seqlens and the other sequences' layout are unchanged; the last
    sequence's padding grows; the full row has exactly pad_to tokens."""
    seqs = _seqs(lengths)
    align = sequence_alignment(tp, cp)
    own = sum(padded_length(n, tp, cp) for n in lengths)
    target = own + extra_units * align
    shares = [pack_sequences(seqs, tp=tp, cp=cp, cp_rank=r, pad_to=target) for r in range(cp)]
    plain = pack_sequences(seqs, tp=tp, cp=cp)   # the cu_seqlens are global: the same on every CP rank
    for padded in shares:
        assert padded.tokens_T.shape[0] * cp == target
        assert torch.equal(padded.cu_seqlens_N1, plain.cu_seqlens_N1)
        assert padded.cu_seqlens_padded_N1[:-1].tolist() == plain.cu_seqlens_padded_N1[:-1].tolist()
        assert padded.cu_seqlens_padded_N1[-1].item() == target
    p0 = shares[0]
    full = gather_cp_shares([s.tokens_T for s in shares], p0.cu_seqlens_padded_N1)
    out = unpack_sequences(full, p0.cu_seqlens_N1, p0.cu_seqlens_padded_N1)
    assert all(torch.equal(a, b) for a, b in zip(out, seqs))


def test_pad_to_errors():
    with pytest.raises(ValueError) as err:
        pack_sequences(_seqs([3, 5]), tp=2, pad_to=6)
    assert str(err.value) == ("pack_sequences: pad_to=6 but the sequences pack to 10 tokens; expected at "
                              "least that, more by a multiple of 2")
    with pytest.raises(ValueError) as err:
        pack_sequences(_seqs([3, 5]), tp=2, pad_to=11)
    assert "pad_to=11" in str(err.value)


def test_errors_are_exact():
    with pytest.raises(ValueError) as err:
        pack_sequences(_seqs([3]), cp=2, cp_rank=2)
    assert str(err.value) == "cp_rank=2, expected an int in [0, cp=2)"
    with pytest.raises(ValueError) as err:
        pack_sequences([])
    assert str(err.value) == "pack_sequences: sequences is empty; expected at least one tensor"
    with pytest.raises(ValueError) as err:
        pack_sequences([torch.zeros(3), torch.zeros(2, 2)])
    assert str(err.value) == ("sequences[1] has trailing shape (2,) and dtype torch.float32, "
                              "expected () and torch.float32 like sequences[0]")
    with pytest.raises(ValueError) as err:
        pack_sequences([torch.zeros(0)])
    assert str(err.value) == "sequences[0] is not a non-empty tensor of shape [L, ...]"
    with pytest.raises(ValueError) as err:
        sequence_alignment(tp=0)
    assert str(err.value) == "tp=0, expected an int >= 1"
    packed = pack_sequences(_seqs([3, 4]), cp=2)
    with pytest.raises(ValueError) as err:
        unpack_sequences(packed.tokens_T, packed.cu_seqlens_N1, packed.cu_seqlens_padded_N1)
    assert str(err.value) == ("packed tensor has 4 tokens, expected cu_seqlens_padded[-1]=8 "
                              "(under context parallelism gather the CP shares first)")
    with pytest.raises(ValueError) as err:
        gather_cp_shares([packed.tokens_T, packed.tokens_T[:3]], packed.cu_seqlens_padded_N1)
    assert str(err.value) == ("gather_cp_shares: shares[1] has 3 tokens, expected 4 (= 8 padded "
                              "tokens / cp=2)")
