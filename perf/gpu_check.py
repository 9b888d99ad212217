"""GPU check for the lent single-GPU machine: megarl's engine, log-softmax and CUDA-IPC hand-off in bf16.

What it measures, part by part (on the GPU each in a process of its own, under its own time
limit, so a part that hangs or crashes costs only its own slice of the lease and the rest still
run; ``--cpu-smoke`` runs them all in one child process, one megatron import on 2 cores):

==================  ============================================================================
part                what runs
==================  ============================================================================
env                 versions, the device, and one large bf16 matmul (the achievable peak)
logsoftmax          :func:`megarl.policy.logprobs.vocab_parallel_logprobs` (log-prob + entropy of
                    every token from ``[T, V]`` logits) forward and backward, against plain torch
smollm2             the policy engine (:class:`megarl.policy.PolicyModel`, bf16, Adam) on
                    SmolLM2-135M's shape: response log-probs, then GRPO train steps
dense               the same on a random ~1.7B dense model (Qwen3-1.7B's shape)
moe                 the same on a random ~1.25B MoE (Qwen3-MoE layout, 64 experts, top-8)
cuda_ipc            a real :class:`megarl.bridge.WeightBridge` with ``transport=cuda_ipc``
                    filling device buffers that a second process (the stand-in for the colocated
                    vLLM worker) maps through CUDA IPC and hashes; every tensor must match
engine_as_worker    the engine exactly as a GPU training worker starts it (plain NCCL group, CUDA
                    inputs, no default device): does it run, and if not, where does it fail
==================  ============================================================================

Printed and written (``--out``, default perf/results/gpu_check.json, and the same name with .md):
tokens/s, MFU (model FLOPs of :func:`megarl.planner.flops.flops_per_token` over the bf16 peak of
:data:`megarl.planner.hardware.GPUS` for the detected GPU), peak device memory per phase, and the
values that show the numbers are real (finite losses and log-probs, exact IPC hashes, the
log-softmax's distance to torch's). Timed phases follow one untimed warm-up call; CUDA is
synchronised around every timed region.

SmolLM2's real weights cannot travel (the GGUF file of the ``smollm2`` fixture is 98 MB, the
lent machine takes 64 MiB and reaches no network), so every model here is random bf16 weights
of the named shape, written as an HF folder on the machine and loaded through megarl's own
path (:func:`megarl.policy.build.build_model`). Speed does not depend on the weights' values.

How megarl runs on a GPU machine without Transformer Engine (the lent one has none)
-----------------------------------------------------------------------------------
:func:`megarl.compat.setup_cpu` does nothing when CUDA is present, and megatron's TE layer spec
then needs Transformer Engine. This check uses megarl's TE-compatible modules
(:mod:`megarl.compat.te_cpu`: same parameter names and checkpoints; math attention, a loop over
experts) through :func:`megarl.compat.install_cpu_te_spec`, plus site P5 of
:mod:`megarl.compat.megatron_cpu` (megatron's MoE router names TE functions that exist only when
TE imports). Megatron's own fusions are switched off (``bias_activation_fusion`` & co.): they are
``torch.compile`` functions that would compile again for every new packed length, minutes of a
15-minute lease. So the numbers are those of megarl's portable path, not of a TE build.

This check found that the engine could not be built in bf16 on any device (megatron's
``Float16Module`` wrapper was not taken off, so no weight name matched its HF tensor): fixed in
:func:`megarl.policy.build._unwrap`; ``--cpu-smoke`` builds the engine in bf16 and keeps it so.

The engine has only run on CPU so far: it creates its bookkeeping tensors (token counts, the
finite-update flag, attention masks of :mod:`megarl.compat.te_cpu`, MoE padding masks) without a
device. The measuring parts therefore run the engine's calls with CUDA as torch's default device
and a default process group that is gloo for CPU tensors and NCCL for CUDA ones
(``cpu:gloo,cuda:nccl``); the ``engine_as_worker`` part reports what happens without that help.

Usage
-----
    python perf/gpu_check.py [--out perf/results/gpu_check.json] [--budget-s 470] [--parts a,b]
    python perf/gpu_check.py --cpu-smoke --out /tmp/smoke.json   # every part, tiny, on CPU

Without a CUDA device (and without ``--cpu-smoke``) it prints that it skipped and exits 0.
Exit code otherwise: 0 when every part finished, 1 when one failed or ran out of time.

On the lent H200 (the wheels it lacks travel in ``.whl``, built by ``perf/gpu_bundle.sh``; see
perf/README.md for the whole ``run`` call), the command is::

    python3 -m pip install -q --no-index --no-deps --no-compile --find-links .whl -r .whl/requirements.txt
    --target /tmp/site && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 perf/gpu_check.py --out $OUT/gpu_check.json
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEFAULT_OUT = os.path.join(ROOT, "perf", "results", "gpu_check.json")
DEFAULT_SMOKE_OUT = os.path.join(ROOT, "perf", "results", "gpu_check_cpu_smoke.json")
GIB = 1 << 30


@dataclass(frozen=True)
class Part:
    name: str
    limit_s: float
    """Its own wall-clock limit on the GPU (the whole check's budget may cut it shorter)."""
    smoke_limit_s: float
    """The limit under --cpu-smoke (2 CPU cores)."""


PARTS = (Part("env", 60, 60), Part("logsoftmax", 60, 60), Part("smollm2", 110, 90), Part("dense", 170, 90),
         Part("moe", 150, 90), Part("cuda_ipc", 75, 60), Part("engine_as_worker", 75, 90))


# ------------------------------------------------------------------------------------------ models
# HF configs of the three engine models. The GPU sizes follow published config.json files
# (SmolLM2-135M-Instruct; Qwen3-1.7B; a scaled-down Qwen3-30B-A3B); the smoke sizes only exercise
# the same code (same families, GQA, tied or untied head, experts).
def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


_SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                tie_word_embeddings=True, rope_parameters=_rope(100000.0), rms_norm_eps=1e-5,
                max_position_embeddings=8192)
_DENSE = dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
              tie_word_embeddings=True, rope_parameters=_rope(1000000.0), rms_norm_eps=1e-6,
              max_position_embeddings=40960)
_MOE = dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
            num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=64,
            num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            vocab_size=151936, tie_word_embeddings=False, rope_parameters=_rope(1000000.0), rms_norm_eps=1e-6,
            max_position_embeddings=40960)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)
MODELS = {
    "smollm2": (_SMOLLM2, {**_SMOLLM2, **_TINY}),
    "dense": (_DENSE, {**_DENSE, **_TINY}),
    "moe": (_MOE, {**_MOE, **_TINY, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}),
}


@dataclass(frozen=True)
class Workload:
    """A GRPO-like batch: ``sequences`` samples, prompt lengths uniform in ``prompt``, response
    lengths log-normal around ``response_median`` capped so that prompt + response <= max_len."""

    sequences: int
    prompt: tuple
    response_median: int
    max_len: int
    tokens_per_micro_batch: int
    timed_calls: int


# The published GRPO rows this project compares with: max sequence 1,536, mean generated ~700.
GPU_WORKLOAD = Workload(sequences=16, prompt=(64, 160), response_median=640, max_len=1536,
                        tokens_per_micro_batch=8192, timed_calls=2)
SMOKE_WORKLOAD = Workload(sequences=4, prompt=(8, 16), response_median=16, max_len=48,
                          tokens_per_micro_batch=96, timed_calls=1)

# Megatron fusions that are torch.compile functions or need TE / apex (see the module docstring).
NO_FUSIONS = dict(bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                  moe_permute_fusion=False)


# ------------------------------------------------------------------------------------------ helpers
def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak():
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_gib() -> float:
    """Peak device memory allocated since the last reset (GPU), or the process's peak resident
    host memory (CPU: ``ru_maxrss``, never reset)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def gpu_key(device_name: str) -> str | None:
    """The :data:`megarl.planner.hardware.GPUS` key of a CUDA device name, or None."""
    name = device_name.upper()
    for key in ("GB200", "H200", "H100", "H20"):   # H200 before H20: "H200" contains "H20"
        if key in name:
            return key.lower()
    return None


def peak_flops() -> float | None:
    """bf16 dense peak FLOP/s of this process's device (None on CPU or an unknown GPU)."""
    import torch

    from megarl.planner.hardware import GPUS

    if not torch.cuda.is_available():
        return None
    key = gpu_key(torch.cuda.get_device_name())
    return GPUS[key].bf16_tflops * 1e12 if key in GPUS else None


def mfu(flops: float, seconds: float) -> float | None:
    peak = peak_flops()
    return None if peak is None else flops / seconds / peak


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_dist(backend: str) -> None:
    """A one-rank default group of ``backend`` (the one already there when it has that backend)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_backend() == backend:
            return
        dist.destroy_process_group()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def use_megarl_te_modules() -> None:
    """On a CUDA machine without Transformer Engine: megarl's TE-compatible modules in megatron's
    TE spec, and site P5 (see the module docstring). With TE present nothing changes."""
    from megarl.compat import has_te, install_cpu_te_spec
    from megarl.compat.megatron_cpu import patch_moe_router_without_te

    if not has_te():
        install_cpu_te_spec()
        patch_moe_router_without_te()


def _setup(smoke: bool, te_modules: bool = True) -> None:
    import torch

    if smoke:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        from megarl.compat import setup_cpu

        setup_cpu()
    else:
        torch.cuda.set_device(0)
        if te_modules:
            use_megarl_te_modules()


@contextlib.contextmanager
def engine_device():
    """CUDA as torch's default device for the engine's calls (no-op on CPU; module docstring)."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    with torch.device("cuda"):
        yield


def write_random_hf_model(config: dict, folder: str, seed: int = 0) -> None:
    """An HF folder (config.json + safetensors) of ``config`` with random bf16 weights, made on
    the GPU when there is one (transformers' own initialisation: std initializer_range)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(config)
    hf_config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model


def grpo_lengths(w: Workload, seed: int) -> list[tuple[int, int]]:
    """(total length, prompt length) per sequence of the workload."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(w.sequences):
        p = int(torch.randint(w.prompt[0], w.prompt[1] + 1, (1,), generator=g))
        r = math.exp(math.log(w.response_median) + 0.6 * float(torch.randn(1, generator=g)))
        out.append((p + max(1, min(int(r), w.max_len - p)), p))
    return out


def micro_batches(lengths, vocab: int, w: Workload, seed: int, device: str) -> list:
    """SequenceBatches of at most ``w.tokens_per_micro_batch`` tokens (one sequence at least),
    with random tokens, advantages and a full mask, on ``device``."""
    import torch

    from megarl.policy import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    groups, cur, cur_tokens = [], [], 0
    for n, p in lengths:
        if cur and cur_tokens + n > w.tokens_per_micro_batch:
            groups.append(cur)
            cur, cur_tokens = [], 0
        cur.append((n, p))
        cur_tokens += n
    groups.append(cur)
    out = []
    for group in groups:
        ids = [torch.randint(0, vocab, (n,), generator=g).to(device) for n, _ in group]
        adv = torch.cat([torch.randn(n - p, generator=g) for n, p in group]).to(device)
        mask = torch.ones(sum(n - p for n, p in group), device=device)
        out.append(SequenceBatch(ids, [p for _, p in group], extras={"advantages_T": adv, "mask_T": mask}))
    return out


def grpo_loss(logprobs_R, batch):
    """GRPO's clipped surrogate, token-mean, with the batch's log-probs as the old ones (ratio 1)."""
    from megarl.algorithms.losses import ppo_policy_loss

    e = batch.extras
    return ppo_policy_loss(logprobs_R, logprobs_R.detach(), e["advantages_T"], e["mask_T"], batch.cu_seqlens_N1,
                           agg_mode="token-mean", num_tokens=batch.num_global_tokens)


def sequence_flops(dims, lengths, training: bool) -> float:
    """Model FLOPs of the sequences (every token of each, prompt included)."""
    from megarl.planner.flops import flops_per_token

    return sum(n * flops_per_token(dims, n, training) for n, _ in lengths)


def _timed(fn, calls: int):
    """Seconds of ``calls`` calls of ``fn`` (after one untimed warm-up) and the last result."""
    fn()
    _sync()
    _reset_peak()
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    _sync()
    return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------------------ parts
def part_env(smoke: bool) -> dict:
    import torch

    out = {"python": platform.python_version(), "cuda": torch.version.cuda}
    for dist_name in ("torch", "megatron-core", "mbridge", "transformers", "triton"):
        try:
            out[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            out[dist_name] = "missing"
    from megarl.compat import has_te

    out["transformer_engine"] = has_te()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, gpu_key=gpu_key(p.name), multiprocessors=p.multi_processor_count,
                   memory_gib=round(p.total_memory / GIB, 1))
    n, dtype, device = (256, torch.float32, "cpu") if smoke else (8192, torch.bfloat16, "cuda")
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    seconds, _ = _timed(lambda: a @ b, 10)
    out["matmul"] = {"n": n, "dtype": str(dtype).replace("torch.", ""), "seconds_each": seconds / 10,
                     "tflops": 2 * n ** 3 * 10 / seconds / 1e12, "fraction_of_peak": mfu(2 * n ** 3 * 10, seconds)}
    return out


def part_logsoftmax(smoke: bool) -> dict:
    """The engine's log-softmax (+ entropy) vs torch's log_softmax, same fp32 maths."""
    import torch

    from megarl.policy.logprobs import vocab_parallel_logprobs

    tokens, vocab = (256, 1024) if smoke else (8192, 151936)   # one micro-batch of the engine parts
    device = "cpu" if smoke else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(tokens, vocab, generator=g, device=device) * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)

    def megarl_fwd():
        return vocab_parallel_logprobs(logits, labels, None, with_entropy=True)

    def torch_fwd():
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    def fwd_bwd(fwd):
        def run():
            lp, ent = fwd()
            (lp.sum() + 0.1 * ent.sum()).backward()
            logits.grad = None
        return run

    out = {"tokens": tokens, "vocab": vocab, "logits_dtype": "bfloat16"}
    with torch.no_grad():
        (lp, ent), (ref_lp, ref_ent) = megarl_fwd(), torch_fwd()
    out["max_abs_diff_logprob"] = float((lp - ref_lp).abs().max())
    out["max_abs_diff_entropy"] = float((ent - ref_ent).abs().max())
    logits_bytes = tokens * vocab * logits.element_size()
    for name, fwd in (("megarl", megarl_fwd), ("torch", torch_fwd)):
        with torch.no_grad():
            fwd_s, _ = _timed(fwd, 3)
        fwd_peak = _peak_gib()
        both_s, _ = _timed(fwd_bwd(fwd), 3)
        both_peak = _peak_gib()
        # the planner's activation model charges bytes per logit (megarl.planner.memory); on the
        # GPU these are measured (logits and their gradient included), on CPU they mean little
        out[name] = {"forward_s": fwd_s / 3, "forward_tokens_per_s": tokens * 3 / fwd_s,
                     "forward_logits_gbps": logits_bytes * 3 / fwd_s / 1e9, "forward_peak_gib": fwd_peak,
                     "fwd_bwd_s": both_s / 3, "fwd_bwd_tokens_per_s": tokens * 3 / both_s,
                     "fwd_bwd_peak_gib": both_peak, "fwd_bwd_peak_bytes_per_logit": both_peak * GIB / (tokens * vocab)}
    return out


def part_engine(model: str, smoke: bool) -> dict:
    """Build the policy engine on a random model, then time response log-probs and train steps."""
    import torch

    from megarl.policy import ModelOptions, OptimOptions, PolicyModel
    from megarl.models.dims import ModelDims
    from megarl.parallel import Topology, build_process_groups

    config = MODELS[model][1 if smoke else 0]
    w = SMOKE_WORKLOAD if smoke else GPU_WORKLOAD
    _init_dist("gloo" if smoke else "cpu:gloo,cuda:nccl")
    groups = build_process_groups(Topology(world_size=1))
    with tempfile.TemporaryDirectory(prefix=f"gpu_check_{model}_") as folder:
        t0 = time.perf_counter()
        write_random_hf_model(config, folder)
        write_s = time.perf_counter() - t0
        _reset_peak()
        t0 = time.perf_counter()
        engine = PolicyModel(ModelOptions(path=folder, dtype="bfloat16", config_overrides=dict(NO_FUSIONS)), groups,
                              OptimOptions(optimizer="adam", lr=1e-6))
        _sync()
        build_s = time.perf_counter() - t0
    build_peak = _peak_gib()
    dims = ModelDims.from_hf(config)
    lengths = grpo_lengths(w, seed=1)
    tokens = sum(n for n, _ in lengths)
    mbs = micro_batches(lengths, dims.vocab_size, w, seed=2, device="cpu" if smoke else "cuda")
    out = {"config": config, "params": sum(p.numel() for m in engine.model.modules for p in m.parameters()),
           "write_random_weights_s": write_s, "build_s": build_s, "build_peak_gib": build_peak,
           "sequences": len(lengths), "tokens": tokens, "response_tokens": sum(n - p for n, p in lengths),
           "micro_batches": len(mbs), "timed_calls": w.timed_calls}
    with engine_device():
        seconds, lp = _timed(lambda: engine.forward_logprobs(mbs), w.timed_calls)
        all_lp = torch.cat([o.logprobs_R.float() for o in lp])
        flops = sequence_flops(dims, lengths, training=False) * w.timed_calls
        out["logprobs"] = {"seconds": seconds / w.timed_calls, "tokens_per_s": tokens * w.timed_calls / seconds,
                           "model_tflops_per_s": flops / seconds / 1e12, "mfu": mfu(flops, seconds),
                           "peak_gib": _peak_gib(), "mean_logprob": float(all_lp.mean()),
                           "max_logprob": float(all_lp.max())}
        seconds, res = _timed(lambda: engine.train_step(mbs, grpo_loss), w.timed_calls)
        flops = sequence_flops(dims, lengths, training=True) * w.timed_calls
        out["train"] = {"seconds": seconds / w.timed_calls, "tokens_per_s": tokens * w.timed_calls / seconds,
                        "model_tflops_per_s": flops / seconds / 1e12, "mfu": mfu(flops, seconds),
                        "peak_gib": _peak_gib(), "loss": res["loss"], "grad_norm": res["grad_norm"],
                        "update_successful": res["update_successful"]}
    if not (math.isfinite(out["train"]["loss"]) and math.isfinite(out["train"]["grad_norm"])
            and out["train"]["update_successful"]):
        raise RuntimeError(f"{model}: train step not finite or not applied: {out['train']}")
    return out


def _outcome(call) -> str:
    """"ok", or the error's type, first line and the place it was raised (the finding)."""
    import traceback

    try:
        call()
        _sync()
        return "ok"
    except Exception as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        return (f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err).strip() else ''} "
                f"(at {os.path.relpath(frame.filename, ROOT)}:{frame.lineno})")


def part_engine_as_worker(smoke: bool) -> dict:
    """The engine as megarl.actors.worker starts it on a GPU: an NCCL default group, inputs on
    the device, no default device. First the build as the worker does it (megatron's TE spec as
    it is; when that fails, again with megarl's TE modules), then a log-prob call and a train
    step. Outcomes are reported, not raised. (Megatron's fusions stay off here too: they cost
    compile time and have nothing to do with devices.)"""
    import torch.distributed as dist

    from megarl.policy import ModelOptions, OptimOptions, PolicyModel
    from megarl.models.dims import ModelDims
    from megarl.parallel import Topology, build_process_groups

    config = MODELS["smollm2"][1 if smoke else 0]
    w = SMOKE_WORKLOAD
    _init_dist("gloo" if smoke else "nccl")
    groups = build_process_groups(Topology(world_size=1))
    out = {"backend": dist.get_backend()}
    built = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_worker_") as folder:
        write_random_hf_model(config, folder)
        options = ModelOptions(path=folder, dtype="bfloat16", config_overrides=dict(NO_FUSIONS))
        optim = OptimOptions(optimizer="adam", lr=1e-6)
        out["build_as_is"] = _outcome(lambda: built.append(PolicyModel(options, groups, optim)))
        if not built:   # no Transformer Engine: build with megarl's modules to try the calls
            use_megarl_te_modules()
            built.append(PolicyModel(options, groups, optim))
    engine = built[0]
    mbs = micro_batches(grpo_lengths(w, seed=1), ModelDims.from_hf(config).vocab_size, w, seed=2,
                        device="cpu" if smoke else "cuda")
    out["forward_logprobs"] = _outcome(lambda: engine.forward_logprobs(mbs))
    out["train_step"] = _outcome(lambda: engine.train_step(mbs, grpo_loss))
    return out


class _IpcEngine:
    """Stands in for the colocated vLLM engine: each bucket's manifests go to the reader process
    (through a pipe, as vLLM's RPC would carry them), which maps them and returns a hash per tensor."""

    def __init__(self, conn):
        self.conn, self.hashes = conn, {}

    def collective_rpc(self, method, args=()):
        from megarl.bridge import rpc

        if method == rpc.WEIGHT_VERSION:
            return [0]
        assert method == rpc.LOAD_BUCKET, method
        self.conn.send(args[0])
        reply = self.conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"IPC reader process failed: {reply}")
        self.hashes.update(reply)
        return []

    def reset_prefix_cache(self):
        pass


def tensor_hash(t) -> int:
    """An exact, order-sensitive hash of a tensor's bytes (int16 words, position-weighted)."""
    import torch

    words = t.contiguous().view(-1).view(torch.int16).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum())


def _ipc_reader(conn, cuda: bool) -> None:
    """The reader process: map each manifest (CUDA IPC or shared memory) and hash every tensor."""
    import torch

    from megarl.bridge.buffer import open_manifest

    try:
        if cuda:
            torch.cuda.set_device(0)
        while (manifests := conn.recv()) is not None:
            hashes = {}
            for manifest in manifests.values():   # the mapped tensors are dropped with each list
                hashes.update({name: (tensor_hash(t), t.numel() * t.element_size())
                               for name, t in open_manifest(manifest)})
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.ipc_collect()
            conn.send(hashes)
    except Exception as err:
        conn.send(f"{type(err).__name__}: {err}")


def part_cuda_ipc(smoke: bool) -> dict:
    """WeightBridge (cuda_ipc; shm under --cpu-smoke) -> a second process; every tensor checked."""
    import multiprocessing

    import torch

    from megarl.bridge import SyncOptions, WeightBridge
    from megarl.bridge.mapping import get_mapping, hf_to_megatron, hf_to_vllm_shard, split_shard
    from megarl.bridge.transfers import MegatronLayout
    from megarl.parallel import Topology

    config = MODELS["dense"][1 if smoke else 0]
    device = "cpu" if smoke else "cuda"
    mapping = get_mapping(config)
    topology = Topology(world_size=1)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.device(device):
        hf = {n: torch.randn(s, generator=g, device=device).to(torch.bfloat16) for n, s in mapping.hf_shapes().items()}
        layout = MegatronLayout(topology)
        shards = []
        for t in mapping.megatron_tensors():
            full = hf_to_megatron(mapping, t, hf)
            tp, ep = layout.shard_sizes(t)
            for (tp_rank, ep_rank), ranks in layout.holders(t, mapping.cfg.num_layers).items():
                if 0 in ranks:
                    shards.append(SimpleNamespace(name=t.name, tensor=split_shard(t, full, tp, tp_rank, ep, ep_rank),
                                                  tp_size=tp, is_expert=t.expert, ep_rank=ep_rank, ep_size=ep))
        want = {n: tensor_hash(v) for n, v in hf_to_vllm_shard(mapping, hf, 1, 0).items()}
    del hf
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    reader = ctx.Process(target=_ipc_reader, args=(child, not smoke), daemon=True)
    reader.start()
    try:
        engine = _IpcEngine(parent)
        options = SyncOptions(bucket_bytes=(64 << 10) if smoke else (512 << 20),
                              transport="shm" if smoke else "cuda_ipc", format="vllm_shard", dtype="bfloat16")
        bridge = WeightBridge(lambda: shards, config, topology, 1, llm=engine, options=options, node="local")
        bridge.sync()                      # warm-up: the reader's first mapping, allocator growth
        engine.hashes = {}
        _sync()
        _reset_peak()
        stats = bridge.sync()
        peak = _peak_gib()
    finally:
        parent.send(None)
        reader.join(timeout=30)
    mismatched = sorted(n for n in want if engine.hashes.get(n, (None,))[0] != want[n])
    nbytes = sum(b for _, b in engine.hashes.values())
    copy_s = stats["seconds"] - stats["vllm_load_seconds"]
    out = {"transport": options.transport, "tensors": len(want), "tensors_received": len(engine.hashes),
           "mismatched": mismatched[:10], "bytes": nbytes, "buckets": stats["buckets"],
           "sync_s": stats["seconds"], "copy_s": copy_s, "reader_s": stats["vllm_load_seconds"],
           "copy_gbps": stats["bytes_sent_by_rank"] / copy_s / 1e9, "end_to_end_gbps": nbytes / stats["seconds"] / 1e9,
           "peak_gib": peak, "peak_extra_bytes": stats["peak_extra_bytes"]}
    if mismatched or len(engine.hashes) != len(want):
        raise RuntimeError(f"IPC hand-off lost or changed tensors: {out}")
    return out


PART_FUNCS = {"env": part_env, "logsoftmax": part_logsoftmax, "smollm2": lambda s: part_engine("smollm2", s),
              "dense": lambda s: part_engine("dense", s), "moe": lambda s: part_engine("moe", s),
              "cuda_ipc": part_cuda_ipc, "engine_as_worker": part_engine_as_worker}


# ------------------------------------------------------------------------------------------ driver
def run_parts_here(names: list[str], smoke: bool, out_file: str) -> None:
    """Child side: run the parts in this process; after each, (re)write all results so far."""
    results = {}
    for name in names:
        _setup(smoke, te_modules=name != "engine_as_worker")   # that part probes the build without them first
        t0 = time.perf_counter()
        results[name] = PART_FUNCS[name](smoke)
        results[name]["part_seconds"] = time.perf_counter() - t0
        with open(out_file + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(out_file + ".tmp", out_file)
    # Written: leave without process-group teardown or atexit hooks (a hang there would cost the
    # part its result).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_parts(parts: list[Part], smoke: bool, limit_s: float) -> dict:
    """Parent side: the parts in one child process (its own session, killed whole at the limit).
    Returns ``{name: result}``; a part the child did not finish has status failed or timeout."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_part_") as tmp:
        out_file = os.path.join(tmp, "result.json")
        log_file = os.path.join(tmp, "log.txt")
        cmd = [sys.executable, os.path.abspath(__file__), "--part", ",".join(p.name for p in parts),
               "--part-out", out_file] + (["--cpu-smoke"] if smoke else [])
        t0 = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
            try:
                rc = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
        seconds = time.perf_counter() - t0
        tail = open(log_file, errors="replace").read()[-3000:]
        done = {}
        if os.path.exists(out_file):
            with open(out_file) as f:
                done = json.load(f)
    out = {}
    for p in parts:
        if p.name in done:   # its results were written: it finished, whatever came after it
            wall = seconds if len(parts) == 1 else done[p.name]["part_seconds"]
            out[p.name] = {"status": "ok", "wall_s": wall, **done[p.name]}
        else:
            out[p.name] = {"status": "timeout" if rc is None else "failed", "wall_s": seconds, "limit_s": limit_s,
                           "exit_code": rc, "log_tail": tail}
    return out


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def markdown(report: dict) -> str:
    """The readable table of the numbers (the JSON has everything)."""
    parts = report["parts"]
    lines = [f"# GPU check ({report['mode']}, {report['date']})", "",
             f"Device: {parts.get('env', {}).get('device', report['mode'])}; budget {report['budget_s']} s, "
             f"used {report['wall_s']:.0f} s. Written by perf/gpu_check.py; every number is one run.", "",
             "| part | status | phase | tokens/s | model TFLOP/s | MFU | peak GiB | seconds per call |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in parts.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} (after {r['wall_s']:.0f} s) | | | | | | |")
            continue
        if name in MODELS:
            for phase in ("logprobs", "train"):
                p = r[phase]
                lines.append(f"| {name} ({r['params'] / 1e6:,.2f}M params, {r['tokens']} tokens) | ok | {phase} | "
                             f"{_fmt(p['tokens_per_s'])} | {_fmt(p['model_tflops_per_s'])} | {_fmt(p['mfu'])} | "
                             f"{_fmt(p['peak_gib'])} | {_fmt(p['seconds'])} |")
        elif name == "logsoftmax":
            for impl in ("megarl", "torch"):
                p = r[impl]
                lines.append(f"| logsoftmax {impl} ({r['tokens']} x {r['vocab']}) | ok | fwd / fwd+bwd | "
                             f"{_fmt(p['forward_tokens_per_s'])} / {_fmt(p['fwd_bwd_tokens_per_s'])} | | | "
                             f"{_fmt(p['forward_peak_gib'])} / {_fmt(p['fwd_bwd_peak_gib'])} | "
                             f"{_fmt(p['forward_s'])} / {_fmt(p['fwd_bwd_s'])} |")
        elif name == "env":
            m = r["matmul"]
            lines.append(f"| env: {m['n']}^3 {m['dtype']} matmul | ok | | | {_fmt(m['tflops'])} | "
                         f"{_fmt(m['fraction_of_peak'])} | | {_fmt(m['seconds_each'])} |")
        elif name == "cuda_ipc":
            lines.append(f"| cuda_ipc ({r['transport']}, {r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors, "
                         f"{len(r['mismatched'])} mismatched) | ok | copy / end to end GB/s | "
                         f"{_fmt(r['copy_gbps'])} / {_fmt(r['end_to_end_gbps'])} | | | {_fmt(r['peak_gib'])} | "
                         f"{_fmt(r['sync_s'])} |")
        elif name == "engine_as_worker":
            lines.append(f"| engine_as_worker ({r['backend']}) | ok | build as is: {r['build_as_is']}; then "
                         f"forward_logprobs: {r['forward_logprobs']}; train_step: {r['train_step']} | | | | | |")
    lines += ["", "MFU: model FLOPs (megarl.planner.flops, causal attention, every token of each sequence) over "
              "the bf16 dense peak of megarl.planner.hardware.GPUS; n/a on CPU. Peak GiB: torch's peak allocated "
              "device memory of the phase (CPU: the process's peak resident memory)."]
    if "env" in parts and parts["env"]["status"] == "ok":
        e = parts["env"]
        lines += ["", "Versions: " + ", ".join(f"{k} {e[k]}" for k in
                                              ("python", "torch", "cuda", "megatron-core", "mbridge", "transformers"))
                  + f"; Transformer Engine: {e['transformer_engine']}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run every part at tiny sizes on the CPU")
    ap.add_argument("--out", help=f"JSON results (and .md beside it); default {os.path.relpath(DEFAULT_OUT, ROOT)} "
                    f"({os.path.relpath(DEFAULT_SMOKE_OUT, ROOT)} with --cpu-smoke)")
    ap.add_argument("--budget-s", type=float, default=470.0, help="wall-clock budget for all parts together")
    ap.add_argument("--parts", help=f"comma-separated subset of {','.join(p.name for p in PARTS)}")
    ap.add_argument("--part", help=argparse.SUPPRESS)        # internal: run one part in this process
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        run_parts_here(args.part.split(","), args.cpu_smoke, args.part_out)
        return 0
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"gpu_check: skipped: no CUDA device (torch {torch.__version__} sees none); nothing was run or written. "
              "Run it on the lent GPU machine (perf/README.md), or use --cpu-smoke to exercise every part on CPU.")
        return 0
    names = args.parts.split(",") if args.parts else [p.name for p in PARTS]
    unknown = sorted(set(names) - {p.name for p in PARTS})
    if unknown:
        ap.error(f"--parts: unknown {unknown}; known: {', '.join(p.name for p in PARTS)}")
    out = args.out or (DEFAULT_SMOKE_OUT if args.cpu_smoke else DEFAULT_OUT)
    t_start = time.perf_counter()
    report = {"mode": "cpu-smoke" if args.cpu_smoke else "gpu",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "budget_s": args.budget_s, "parts": {}}
    chosen = [p for p in PARTS if p.name in names]
    # On the GPU each part gets a process and a time limit of its own. The CPU smoke runs them all
    # in one process: the same code, one import of megatron instead of seven (2 cores).
    for group in [chosen] if args.cpu_smoke else [[p] for p in chosen]:
        left = args.budget_s - (time.perf_counter() - t_start)
        limit = min(sum(p.smoke_limit_s if args.cpu_smoke else p.limit_s for p in group), left)
        if limit < 5:
            for p in group:
                report["parts"][p.name] = {"status": "skipped", "wall_s": 0.0, "reason": "budget spent"}
                print(f"gpu_check: {p.name}: skipped (budget of {args.budget_s:.0f} s spent)", flush=True)
            continue
        for name, r in run_parts(group, args.cpu_smoke, limit).items():
            report["parts"][name] = r
            print(f"gpu_check: {name}: {r['status']} in {r['wall_s']:.1f} s", flush=True)
            if r["status"] != "ok":
                print(r["log_tail"], flush=True)
    report["wall_s"] = time.perf_counter() - t_start
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    md = markdown(report)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0 if all(r["status"] == "ok" for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
