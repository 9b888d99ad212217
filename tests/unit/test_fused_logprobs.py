"""The fused, chunked vocab-parallel log-softmax + entropy (megarl.policy.logprobs) equals the
unfused computation: log-probs, entropy and the gradient w.r.t. the logits (random upstream grads
on the log-probs, the entropy, or both).

Oracles and tolerances: (1) the previous unfused implementation (fp32, whole logits, autograd;
kept below as ``_previous_unfused``): within 1e-6 absolute; (2) torch.log_softmax on the whole
logits in fp64 from the same numbers: within 1e-6 + 2^-22 |value| (an fp32 value of magnitude
above 8 cannot be closer than its ulp, 2^-23 |value|; the unfused fp32 entropy -(p log p).sum is
itself off by up to 2e-6 at V = 1001). Logits ~N(0, 2^2) (log-probs down to about -16), and
~N(0, 5^2) (down to -36) in one test. At tp1 and at tp2 (two gloo processes spawned with
torch.multiprocessing inside one test, no torchrun launch, ~5 s idle, 26 s at load 80; each
rank holds half of the vocabulary and is compared with the whole-vocabulary oracles' half);
chunk sizes that do not
divide the tokens, odd local vocabularies (1001, 2 x 501, 4099); bf16 logits (computed in fp32
from the bf16 values: the values as in fp32; the returned bf16 gradient is rounded, 2^-8
relative); and no tensor of the size of the logits is allocated except the returned gradient
(recorded with a TorchDispatchMode).

Run as a script, it measures the previous (unfused) implementation against the fused one on the
quickstart's shapes (peak RSS above the logits, in a fresh process per case, and seconds):
``python tests/unit/test_fused_logprobs.py [--tokens 2048] [--vocab 49152]``; ``--policy``
measures the policy engine's whole log-prob pass on SmolLM2-135M instead.
"""
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.policy.logprobs import vocab_parallel_logprobs

TOL = 1e-6
REL64 = 2.0 ** -22      # allowance against fp64: 2 fp32 ulps of the value
BF16_GRAD_RTOL = 2.0 ** -8


def _case(T, V, scale=2.0, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g) * scale).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    g_lp, g_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return logits, labels, g_lp, g_h


def _reference(logits, labels, g_lp, g_h, dtype=torch.float64):
    """The unfused computation in ``dtype``: (log-probs, entropy, grad of sum(g_lp lp + g_h H));
    a None upstream grad leaves that term out."""
    x = logits.to(dtype).requires_grad_()
    logp = torch.log_softmax(x, dim=-1)
    lp = logp.gather(1, labels[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    loss = sum((t * g.to(dtype)).sum() for t, g in ((lp, g_lp), (ent, g_h)) if g is not None)
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), ent.detach(), grad


def _fused(logits, labels, g_lp, g_h, tp_group=None, chunk_tokens=None):
    x = logits.clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, labels, tp_group, with_entropy=True, chunk_tokens=chunk_tokens)
    loss = sum((t * g).sum() for t, g in ((lp, g_lp), (ent, g_h)) if g is not None)
    (grad,) = torch.autograd.grad(loss, x)
    return lp, ent, grad


def _maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


def _err64(a, b64, rel=REL64):
    """max |a - b64| beyond the relative allowance (compare with TOL)."""
    return ((a.double() - b64).abs() - rel * b64.abs()).max().item()


def _previous(logits, labels, g_lp, g_h):
    """The previous unfused implementation in fp32: (log-probs, entropy, grad) as ``_reference``."""
    x = logits.float().requires_grad_()
    lp, ent = _previous_unfused(x, labels, with_entropy=True)
    loss = sum((t * g).sum() for t, g in ((lp, g_lp), (ent, g_h)) if g is not None)
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), ent.detach(), grad


# (tokens, vocab, chunk): chunk not dividing tokens, chunk = tokens, chunk > tokens, one token per
# chunk, the default budget (127 + 3 tokens here)
SHAPES = [(37, 1001, 8), (64, 257, 64), (5, 300, 16), (9, 50, 1), (130, 4099, None)]
GRADS = ["both", "logprob", "entropy"]


def _upstream(which, g_lp, g_h):
    return (g_lp if which != "entropy" else None), (g_h if which != "logprob" else None)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("which", GRADS)
def test_tp1_equals_unfused(shape, which):
    T, V, C = shape
    logits, labels, g_lp, g_h = _case(T, V)
    g_lp, g_h = _upstream(which, g_lp, g_h)
    got = _fused(logits, labels, g_lp, g_h, chunk_tokens=C)
    prev, ref = _previous(logits, labels, g_lp, g_h), _reference(logits, labels, g_lp, g_h)
    for name, a, b, b64 in zip(("logprob", "entropy", "grad"), got, prev, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert _maxdiff(a, b) < TOL, (name, "vs previous", _maxdiff(a, b))
        assert _err64(a, b64) < TOL, (name, "vs fp64", _err64(a, b64))


def test_without_entropy_and_no_grad():
    logits, labels, g_lp, _ = _case(37, 1001)
    with torch.no_grad():
        lp, ent = vocab_parallel_logprobs(logits, labels, None, chunk_tokens=10)
    assert ent is None and not lp.requires_grad
    x = logits.clone().requires_grad_()
    lp2, _ = vocab_parallel_logprobs(x, labels, None, chunk_tokens=10)
    (grad,) = torch.autograd.grad((lp2 * g_lp).sum(), x)
    ref_lp, _, ref_grad = _previous(logits, labels, g_lp, None)
    assert _maxdiff(lp, ref_lp) < TOL and _maxdiff(lp2, ref_lp) < TOL and _maxdiff(grad, ref_grad) < TOL


def test_large_logits_limited_by_fp32_rounding_only():
    """Logits ~N(0, 5^2) (log-probs down to about -36)."""
    logits, labels, g_lp, g_h = _case(300, 4099, scale=5.0)
    got = _fused(logits, labels, g_lp, g_h, chunk_tokens=64)
    prev, ref = _previous(logits, labels, g_lp, g_h), _reference(logits, labels, g_lp, g_h)
    for name, a, b, b64 in zip(("logprob", "entropy", "grad"), got, prev, ref):
        assert _maxdiff(a, b) < TOL, (name, "vs previous", _maxdiff(a, b))
        assert _err64(a, b64) < TOL, (name, "vs fp64", _err64(a, b64))


def test_bf16_logits():
    """bf16 logits are read a chunk at a time and computed in fp32: the values equal the
    computation on the same (bf16-exact) numbers within 1e-6; the gradient comes back in bf16,
    rounded from the fp32 one (2^-8 relative)."""
    logits, labels, g_lp, g_h = _case(37, 1001, dtype=torch.bfloat16)
    lp, ent, grad = _fused(logits, labels, g_lp, g_h, chunk_tokens=8)
    ref_lp, ref_ent, ref_grad = _reference(logits, labels, g_lp, g_h)
    assert grad.dtype == torch.bfloat16 and lp.dtype == ent.dtype == torch.float32
    assert _err64(lp, ref_lp) < TOL and _err64(ent, ref_ent) < TOL
    assert _err64(grad, ref_grad, rel=BF16_GRAD_RTOL) < TOL


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"expected \[T, V/tp\] and \[T\]"):
        vocab_parallel_logprobs(torch.zeros(1, 4, 8), torch.zeros(4, dtype=torch.long), None)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        vocab_parallel_logprobs(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long), None, chunk_tokens=0)


class _Allocations(TorchDispatchMode):
    """Bytes of every new tensor storage an op returns (views of existing storages are skipped)."""

    def __init__(self, known):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.known.add(t.untyped_storage().data_ptr())
                self.sizes.append(t.untyped_storage().nbytes())
        return out


def test_logits_sized_tensors_are_never_allocated():
    T, V, C = 96, 2048, 16
    logits, labels, g_lp, g_h = _case(T, V)
    x = logits.requires_grad_()
    with _Allocations([x, labels]) as fwd:
        lp, ent = vocab_parallel_logprobs(x, labels, None, with_entropy=True, chunk_tokens=C)
    with _Allocations([x, labels, lp, ent, g_lp, g_h]) as bwd:
        (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), x)
    chunk_bytes = C * V * 4
    assert max(fwd.sizes) <= chunk_bytes, sorted(fwd.sizes)[-3:]
    assert sum(fwd.sizes) <= 2 * chunk_bytes + 64 * T * 4
    big = [n for n in bwd.sizes if n > chunk_bytes]
    assert big == [T * V * 4], big   # the returned gradient, nothing else
    assert sum(bwd.sizes) - big[0] <= 2 * chunk_bytes + 64 * T * 4
    assert grad.untyped_storage().nbytes() == T * V * 4


def _tp2_worker(rank, port, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = {}
        for T, V, C, dtype, which in [(45, 1002, 7, torch.float32, "both"), (45, 1002, 7, torch.float32, "logprob"),
                                      (45, 1002, 7, torch.float32, "entropy"), (20, 300, None, torch.float32, "both"),
                                      (45, 1002, 7, torch.bfloat16, "both")]:
            logits, labels, g_lp, g_h = _case(T, V, dtype=dtype, seed=T)
            g_lp, g_h = _upstream(which, g_lp, g_h)
            # one shard gets a token whose maximum sits on the other shard, and labels on both
            shard = slice(rank * V // 2, (rank + 1) * V // 2)
            lp, ent, grad = _fused(logits[:, shard].contiguous(), labels, g_lp, g_h, tp_group=dist.group.WORLD,
                                   chunk_tokens=C)
            key = f"{T}x{V}/{C}/{str(dtype)[6:]}/{which}"
            grad_rel = BF16_GRAD_RTOL if dtype == torch.bfloat16 else REL64
            for oracle, (r_lp, r_ent, r_grad) in (("previous", _previous(logits, labels, g_lp, g_h)),
                                                  ("fp64", _reference(logits, labels, g_lp, g_h))):
                rel = REL64 if oracle == "fp64" else 0.0
                out[f"{key} vs {oracle}"] = (_err64(lp, r_lp.double(), rel), _err64(ent, r_ent.double(), rel),
                                             _err64(grad, r_grad[:, shard].double(), max(rel, grad_rel)))
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_equals_unfused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp2_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(out) == 10
        for key, diffs in out.items():
            assert max(diffs) < TOL, (rank, key, diffs)


# ----------------------------------------------------------------------------- measurement script
def _previous_unfused(logits_TV, labels_T, with_entropy=False):
    """The implementation before the fused one (tp1 path), for the measurements only."""
    logits = logits_TV.float()
    with torch.no_grad():
        max_T = logits.max(dim=-1).values
    shifted = logits - max_T[:, None]
    exp = shifted.exp()
    sum_exp_T = exp.sum(dim=-1)
    target_T = shifted.gather(1, labels_T[:, None])[:, 0]
    log_z_T = sum_exp_T.log()
    entropy_T = (log_z_T - (exp * shifted).sum(dim=-1) / sum_exp_T) if with_entropy else None
    return target_T - log_z_T, entropy_T


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_one(impl, mode, T, V, repeats):
    """Peak RSS above the logits (and the process before the call), and seconds, of one pass."""
    import resource
    import time

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    g = torch.Generator().manual_seed(0)
    # filled in place: a temporary of the logits' size would set ru_maxrss before the measurement
    logits = torch.empty(T, V).normal_(0.0, 3.0, generator=g)
    labels = torch.randint(0, V, (T,), generator=g)
    g_lp, g_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
    fn = (lambda x: vocab_parallel_logprobs(x, labels, None, with_entropy=True)) if impl == "fused" else \
        (lambda x: _previous_unfused(x, labels, with_entropy=True))
    x = logits.requires_grad_(mode == "train")
    base = _rss()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if mode == "train":
            lp, ent = fn(x)
            (grad,) = torch.autograd.grad((lp * g_lp).sum() + (ent * g_h).sum(), x)
            del grad, lp, ent
        else:
            with torch.no_grad():
                fn(x)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra_peak_mib": (peak - base) / 2 ** 20, "seconds": min(times)}


def _measure_policy(impl, tokens_per_micro_batch, sequences, length):
    """The policy engine's log-prob pass (forward_logprobs with entropy) on SmolLM2-135M, fp32."""
    import resource
    import time

    from megarl.compat import setup_cpu

    setup_cpu()
    import megarl.policy.logprobs as lpmod
    from megarl.policy import ModelOptions, PolicyModel, SequenceBatch
    from megarl.models.fixtures import ensure_fixture
    from megarl.parallel import Topology, build_process_groups

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if impl == "unfused":
        lpmod.vocab_parallel_logprobs = lambda x, y, g, e=False: _previous_unfused(x, y, e)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engine = PolicyModel(ModelOptions(path=str(ensure_fixture("smollm2"))), build_process_groups(Topology(world_size=1)))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 49152, (length,), generator=g) for _ in range(sequences)]
    per_mb = max(1, tokens_per_micro_batch // length)
    mbs = [SequenceBatch(ids[i:i + per_mb], [length - 64] * len(ids[i:i + per_mb])) for i in range(0, sequences, per_mb)]
    engine.forward_logprobs(mbs[:1], with_entropy=True)   # warm-up (also the allocator's first touch)
    base = _rss()
    t0 = time.perf_counter()
    outs = engine.forward_logprobs(mbs, with_entropy=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    checksum = float(sum(o.logprobs_R.double().sum() + o.entropy_R.double().sum() for o in outs))
    dist.destroy_process_group()
    return {"extra_peak_mib": (peak - base) / 2 ** 20, "seconds": seconds, "micro_batches": len(mbs),
            "checksum": checksum}


def main(argv=None):
    import argparse
    import json
    import subprocess

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[-1])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", action="store_true")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--length", type=int, default=160)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:   # the child process of one case: print its JSON
        impl, mode = args.one
        res = _measure_policy(impl, args.tokens, args.sequences, args.length) if args.policy else \
            _measure_one(impl, mode, args.tokens, args.vocab, args.repeats)
        print("RESULT " + json.dumps(res))
        return
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    modes = ["logprob"] if args.policy else ["logprob", "train"]
    for mode in modes:
        for impl in ("unfused", "fused"):
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
                   "--one", impl, mode]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise RuntimeError(f"{impl}/{mode} failed:\n{proc.stderr[-3000:]}")
            print(json.dumps({"impl": impl, "mode": mode, "tokens": args.tokens, "vocab": args.vocab,
                              **json.loads(line[0][7:])}))


if __name__ == "__main__":
    main()
