"""Check a Megatron checkpoint against its HF source: every weight, and log-probs of a few prompts.

1. Weights: the checkpoint is loaded into a model at the given layout and exported back to HF
   names (the engine's exporter, collective); each tensor is compared with the HF folder's
   (FP8 dequantised). Any difference is a failure, reported with the tensor's name.
2. Log-probs: a reference engine at the layout is loaded from the checkpoint
   (:func:`~megarl.conversion.megatron_ckpt.load_megatron_checkpoint`, strict: every parameter is
   overwritten) and its log-probs of the prompts' tokens are compared with transformers' (fp32,
   eager attention) on the HF folder; the max abs difference must be under ``tol``.

Shape legend: L tokens of one prompt.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megarl.conversion.megatron_ckpt import build_model_from_checkpoint, load_megatron_checkpoint, read_meta
from megarl.models.safetensors_io import HFCheckpoint

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    return",
                   "Question: what is 12 times 7? Answer:")
DEFAULT_TOL = {"float32": 1e-4, "bfloat16": 0.1}


@dataclass
class VerifyResult:
    weight_diffs: dict = field(default_factory=dict)
    """HF name -> max abs difference, for the tensors that differ (empty: all equal)."""
    num_weights: int = 0
    logprob_max_diff: float = float("nan")
    tol: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.weight_diffs and self.logprob_max_diff <= self.tol

    def summary(self) -> str:
        lines = [f"weights: {self.num_weights - len(self.weight_diffs)}/{self.num_weights} identical"]
        for name, diff in sorted(self.weight_diffs.items(), key=lambda kv: -kv[1])[:20]:
            lines.append(f"  MISMATCH {name}: max abs diff {diff:.3e}")
        lines.append(f"log-probs: max abs diff {self.logprob_max_diff:.3e} (tolerance {self.tol:.1e})")
        lines.append("verify: " + ("PASSED" if self.ok else "FAILED"))
        return "\n".join(lines)


def compare_weights(model, hf_folder: str) -> tuple[dict, int]:
    """(name -> max abs diff of differing tensors, number of tensors) (collective; rank 0 compares)."""
    from megarl.policy.export import export_hf_weights

    reader = HFCheckpoint(hf_folder) if dist.get_rank() == 0 else None
    diffs, count = {}, 0
    for name, tensor in export_hf_weights(model):
        count += 1
        if reader is None:
            continue
        if name not in reader:
            diffs[name] = float("inf")
            continue
        ref = reader.read(name)
        if tuple(ref.shape) != tuple(tensor.shape):
            diffs[name] = float("inf")
        elif not torch.equal(ref.to(tensor.dtype), tensor):
            diffs[name] = (ref.double() - tensor.double()).abs().max().item()
    box = [diffs]
    dist.broadcast_object_list(box, src=0)
    return box[0], count


def prompt_ids(folder: str, prompts, vocab: int) -> list[torch.Tensor]:
    """Token ids of the prompts (the folder's tokenizer; random ids if it has none)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        ids = [torch.tensor(tok(p)["input_ids"], dtype=torch.long) for p in prompts]
    except Exception:   # no tokenizer files: still compare on fixed random tokens
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, vocab, (12,), generator=g) for _ in prompts]
    return [x[x < vocab] if x.numel() > 2 else torch.arange(2, 10) for x in ids]


def hf_logprobs(folder: str, ids) -> torch.Tensor:
    """transformers' log-probs of tokens 1.. of each prompt (fp32), concatenated."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for x_L in ids:
            logp = torch.log_softmax(model(x_L[None]).logits[0].double(), dim=-1)
            out.append(logp[:-1].gather(1, x_L[1:, None])[:, 0])
    del model
    gc.collect()
    return torch.cat(out)


def engine_logprobs(engine, ids) -> torch.Tensor:
    from megarl.policy import SequenceBatch

    outs = engine.forward_logprobs([SequenceBatch(list(ids), [1] * len(ids))])
    return torch.cat([o.logprobs_R for o in outs]).double()


def verify(hf_folder: str, ckpt: str, groups, prompts=DEFAULT_PROMPTS, tol: float | None = None) -> VerifyResult:
    """Both checks at ``groups``' layout (collective); every rank returns the same result."""
    from megarl.policy import ModelOptions, reference_model

    meta = read_meta(ckpt)
    result = VerifyResult(tol=DEFAULT_TOL[meta["dtype"]] if tol is None else tol)
    model = build_model_from_checkpoint(ckpt, groups)
    result.weight_diffs, result.num_weights = compare_weights(model, hf_folder)
    del model
    gc.collect()
    vocab = int(read_config_vocab(ckpt))
    ids = prompt_ids(ckpt, prompts, vocab)
    ref = hf_logprobs(hf_folder, ids) if dist.get_rank() == 0 else None
    engine = reference_model(ModelOptions(path=hf_folder, dtype="float32"), groups)
    load_megatron_checkpoint(engine, ckpt)
    got = engine_logprobs(engine, ids)
    del engine
    gc.collect()
    box = [(got - ref).abs().max().item() if ref is not None else None]
    dist.broadcast_object_list(box, src=0)
    result.logprob_max_diff = box[0]
    return result


def read_config_vocab(folder: str) -> int:
    import json
    import os

    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["vocab_size"]
