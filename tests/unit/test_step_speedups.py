"""The CPU step's speed-ups change no numbers (perf/bench_step_cpu.py measures what they save).

One child process (gloo needs its own) builds the tiny Qwen2 fixture (GQA, fp32) three times from
the same checkpoint: a trained engine that computes the logits of the response positions only
(the default), one that computes every position's (``runner.select_logits`` off), and a frozen
reference engine whose passes use torch's fused attention. On packed micro-batches of mixed
prompt and response lengths it checks:
- the log-probs and entropies of the two trained engines agree (<= 1e-6), and so do their
  weights after one Adam step (<= 1e-6 absolute; both from the same start), where the second
  engine also steps the way it did before the CPU optimizer cuts: torch's per-tensor AdamW loop
  (not the fused kernel) and megatron's own one-rank gradient reduce-scatter and parameter
  all-gather (P11 in :mod:`megarl.compat.megatron_cpu` skips them: counted, none);
- the reference engine's log-probs (fused attention, counted) agree with the trained engine's
  math attention to 1e-5;
- :func:`megarl.compat.heap.keep`: a freed 64 MiB buffer stays resident for the next allocation
  (glibc would unmap it) until :func:`megarl.compat.heap.trim` gives it back.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(r"""
    import json, os, resource, socket, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from megarl.compat import heap, setup_cpu
    setup_cpu()
    from megarl.policy import ModelOptions, OptimOptions, PolicyModel, SequenceBatch, reference_model
    from megarl.models.fixtures import ensure_fixture
    from megarl.parallel import Topology, build_process_groups

    out = {}
    # heap.keep first (the training worker sets it at start): a freed 64 MiB buffer stays resident
    # (reused by the next one), and heap.trim gives it back
    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    out["keep"] = heap.keep()
    r0 = rss_mib()
    t = torch.empty(16 << 20, dtype=torch.float32)
    t.fill_(1.0)
    r1 = rss_mib()
    del t
    r2 = rss_mib()
    out["trim"] = heap.trim()
    out["rss_mib"] = [r0, r1, r2, rss_mib()]

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = build_process_groups(Topology(world_size=1))
    path = str(ensure_fixture("tiny-qwen2"))
    opts = ModelOptions(path=path)
    optim = OptimOptions(optimizer="adam", lr=1e-3)
    selecting = PolicyModel(opts, groups, optim)
    full = PolicyModel(opts, groups, optim)
    full.runner.select_logits = False
    ref = reference_model(opts, groups)
    out["selects"] = [selecting.runner.select_logits, ref.runner.select_logits]

    g = torch.Generator().manual_seed(0)
    def batches():
        g.manual_seed(0)
        mbs = []
        for lens in ([(13, 5), (21, 17), (9, 1)], [(30, 12), (7, 3)]):
            ids = [torch.randint(0, 500, (n,), generator=g) for n, _ in lens]
            r = sum(n - p for n, p in lens)
            mbs.append(SequenceBatch(ids, [p for _, p in lens],
                                     extras={"advantages_T": torch.randn(r, generator=g), "mask_T": torch.ones(r)}))
        return mbs

    def diff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    a = selecting.forward_logprobs(batches(), with_entropy=True)
    b = full.forward_logprobs(batches(), with_entropy=True)
    out["logprob_diff"] = diff([o.logprobs_R for o in a], [o.logprobs_R for o in b])
    out["entropy_diff"] = diff([o.entropy_R for o in a], [o.entropy_R for o in b])
    out["response_tokens"] = sum(o.logprobs_R.numel() for o in a)

    calls = []
    real_sdpa = F.scaled_dot_product_attention
    def counting(*args, **kw):
        calls.append(1)
        return real_sdpa(*args, **kw)
    F.scaled_dot_product_attention = counting
    r = ref.forward_logprobs(batches())
    F.scaled_dot_product_attention = real_sdpa
    out["fused_calls"] = len(calls)
    out["reference_diff"] = diff([o.logprobs_R for o in a], [o.logprobs_R for o in r])

    from megarl.algorithms.losses import ppo_policy_loss
    def loss_fn(lp, mb):
        e = mb.extras
        return ppo_policy_loss(lp, lp.detach(), e["advantages_T"], e["mask_T"], mb.cu_seqlens_N1,
                               agg_mode="token-mean", num_tokens=mb.num_global_tokens)
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megarl.policy.offload import _torch_optimizers
    G = pgb._ParamAndGradBucketGroup
    out["fused"] = sorted({g["fused"] for o in _torch_optimizers(selecting.optimizer) for g in o.param_groups})
    collectives = []
    real_rs, real_ag = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func
    def counting_rs(*args, **kw):
        collectives.append("rs")
        return real_rs(*args, **kw)
    def counting_ag(*args, **kw):
        collectives.append("ag")
        return real_ag(*args, **kw)
    pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func = counting_rs, counting_ag
    ra = selecting.train_step(batches(), loss_fn)
    out["collectives_patched"] = list(collectives)
    del collectives[:]
    for o in _torch_optimizers(full.optimizer):   # the step as it was: per-tensor AdamW, 1-rank collectives
        for grp in o.param_groups:
            grp["fused"] = False
    patched = (G.start_grad_sync, G.start_param_sync)
    G.start_grad_sync, G.start_param_sync = patched[0]._megarl_orig, patched[1]._megarl_orig
    rb = full.train_step(batches(), loss_fn)
    G.start_grad_sync, G.start_param_sync = patched
    pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func = real_rs, real_ag
    out["collectives_upstream"] = sorted(set(collectives))
    out["loss"] = [ra["loss"], rb["loss"]]
    out["grad_norm"] = [ra["grad_norm"], rb["grad_norm"]]
    pa = [p.detach() for c in selecting.model.chunks for p in c.parameters()]
    pb = [p.detach() for c in full.model.chunks for p in c.parameters()]
    p0 = [p.detach() for c in ref.model.chunks for p in c.parameters()]
    out["weight_diff"] = diff(pa, pb)
    out["moved"] = diff(pa, p0)
    print("RESULT " + json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def result():
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stderr[-4000:]
    return json.loads(line[0][len("RESULT "):])


def test_logits_of_response_positions_only_change_nothing(result):
    assert result["selects"] == [True, True]
    assert result["response_tokens"] == (13 - 5) + (21 - 17) + (9 - 1) + (30 - 12) + (7 - 3)
    assert result["logprob_diff"] <= 1e-6, result
    assert result["entropy_diff"] <= 1e-6, result


def test_one_step_with_and_without_selection_lands_on_the_same_weights(result):
    la, lb = result["loss"]
    assert abs(la - lb) <= 1e-6 * max(1.0, abs(lb)), result
    ga, gb = result["grad_norm"]
    assert abs(ga - gb) <= 1e-5 * gb, result
    assert result["moved"] > 1e-4, result          # the step did update (Adam, lr 1e-3)
    assert result["weight_diff"] <= 1e-6, result


def test_cpu_optimizer_cuts_fused_adam_and_no_one_rank_collectives(result):
    assert result["fused"] == [True], result                    # torch's fused CPU AdamW kernel
    assert result["collectives_patched"] == [], result          # P11: nothing sent within a 1-rank group
    assert result["collectives_upstream"] == ["ag", "rs"], result   # what megatron does unpatched


def test_the_reference_models_fused_attention_matches_the_math(result):
    assert result["fused_calls"] > 0, result       # one per sequence and layer
    assert result["reference_diff"] <= 1e-5, result


def test_heap_keep_holds_freed_memory_until_trim(result):
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc only")
    assert result["keep"] is True and result["trim"] is True
    before, filled, freed, trimmed = result["rss_mib"]
    assert filled - before >= 60, result           # the 64 MiB buffer, touched
    assert freed - before >= 60, result            # freed: still in the process (glibc would munmap it)
    assert trimmed - before <= 16, result          # heap.trim: back to the OS
