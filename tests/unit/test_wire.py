"""megarl.data.wire: the controller's per-token tensors compacted for the trip to the ranks, and
given back bit for bit."""
import math
import pickle

import torch

from megarl.data.wire import Narrow, Runs, decode, decode_batches, encode, encode_batches
from megarl.policy import SequenceBatch


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


def trip(t):
    """encode, pickle (as Ray sends call arguments), unpickle, decode."""
    return decode(pickle.loads(pickle.dumps(encode(t))))


def test_outcome_advantages_travel_as_one_value_a_sample():
    lengths = [5, 3, 8, 1]
    adv = torch.cat([torch.full((n,), v) for n, v in zip(lengths, [0.5, -1.25, 0.0, 2.0])])
    enc = encode(adv)
    assert isinstance(enc, Runs) and enc.values.tolist() == [0.5, -1.25, 0.0, 2.0] and enc.lengths.tolist() == lengths
    assert same_bits(trip(adv), adv)


def test_an_all_true_mask_is_one_run_and_a_tool_mask_a_few():
    mask = torch.ones(1000, dtype=torch.bool)
    enc = encode(mask)
    assert isinstance(enc, Runs) and enc.values.tolist() == [True] and enc.lengths.tolist() == [1000]
    tool = torch.ones(1000, dtype=torch.bool)
    tool[100:140] = False
    assert isinstance(encode(tool), Runs) and same_bits(trip(tool), tool)


def test_signed_zeros_and_nans_are_told_apart_bit_for_bit():
    t = torch.tensor([0.0, -0.0, math.nan, 1.0] * 4, dtype=torch.float32).repeat_interleave(10)
    enc = encode(t)
    assert isinstance(enc, Runs) and len(enc.values) == 16   # 0.0 and -0.0 are two runs
    assert same_bits(trip(t), t)


def test_vllm_logprobs_narrow_to_float32_only_when_exact():
    g = torch.Generator().manual_seed(0)
    lp32 = -torch.rand(500, generator=g) * 5   # vLLM's log-probs: float32 numbers as Python floats
    lp = lp32.to(torch.float64)
    lp[7] = math.nan   # a tool token's
    enc = encode(lp)
    assert isinstance(enc, Narrow) and enc.values.dtype == torch.float32
    assert same_bits(trip(lp), lp)
    exact = lp.clone()
    exact[3] = -0.1   # not a float32 number: the tensor goes as it is
    assert encode(exact) is exact


def test_other_tensors_go_as_they_are():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(300, generator=g)
    assert encode(values) is values
    assert encode(torch.tensor([1.0])).numel() == 1   # too short to gain
    assert encode("not a tensor") == "not a tensor"
    two_d = torch.zeros(4, 4)
    assert encode(two_d) is two_d


def test_micro_batches_round_trip_and_shrink():
    ids = [torch.arange(10, dtype=torch.int32), torch.arange(6, dtype=torch.int32)]
    resp = [6, 2]
    g = torch.Generator().manual_seed(2)
    extras = {"advantages_T": torch.cat([torch.full((6,), 0.75), torch.full((2,), -0.75)]),
              "mask_T": torch.ones(8, dtype=torch.bool),
              "rollout_logprobs_T": (-torch.rand(8, generator=g)).to(torch.float64),
              "old_logprobs_T": torch.randn(8, generator=g)}
    mb = SequenceBatch(ids, [4, 4], dict(extras))
    sent = pickle.loads(pickle.dumps(encode_batches([mb])))
    assert isinstance(sent[0].extras["advantages_T"], Runs) and isinstance(sent[0].extras["rollout_logprobs_T"], Narrow)
    decode_batches(sent)
    assert sent[0].extras.keys() == extras.keys()
    for k, v in extras.items():
        assert same_bits(sent[0].extras[k], v), k
    assert sum(resp) == 8
