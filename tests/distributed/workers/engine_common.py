"""Shared helpers of the engine workers: layouts, a packed test batch, HF reference log-probs.

Legend: R response tokens of a batch, L one sequence.
"""
import gc
import json
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from megarl.compat import setup_cpu

setup_cpu()

from megarl.policy import ModelOptions, SequenceBatch  # noqa: E402
from megarl.models.fixtures import ensure_fixture, tiny_config  # noqa: E402
from megarl.parallel import Topology, build_process_groups  # noqa: E402

# (sequence length, prompt length): three sequences of different lengths
SEQS = [(13, 4), (21, 7), (9, 3)]


def init():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


# spec keys that are not Topology field names: uneven first/last pipeline stages
LAYOUT_KEYS = {"first": "first_stage_layers", "last": "last_stage_layers"}


def parse_layout(spec: str, world: int) -> Topology:
    """'tp2.pp2.vpp2.ep2.etp1.cp2.sp1' (any subset, '.'-separated) -> Topology; 'first1' / 'last1':
    1 decoder layer on the first / last pipeline stage ('pp2.first1')."""
    kw = {}
    for part in filter(None, spec.split(".")):
        key = part.rstrip("0123456789")
        kw[LAYOUT_KEYS.get(key, key)] = bool(int(part[len(key):])) if key == "sp" else int(part[len(key):])
    return Topology(world_size=world, **kw)


def make_batch(vocab: int, seed: int = 0, seqs=SEQS) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n, _ in seqs]
    return ids, [p for _, p in seqs]


def micro_batches(ids, prompts, split=(2,)) -> list:
    """Split the sequences into micro-batches at the given indices."""
    bounds = [0, *split, len(ids)]
    return [SequenceBatch(ids[a:b], prompts[a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def hf_logprobs(path: str, ids, prompts) -> torch.Tensor:
    """transformers' log-probs of the response tokens, one sequence at a time (fp32 model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for x, p in zip(ids, prompts):
            logp = torch.log_softmax(model(x[None]).logits[0].double(), dim=-1)
            out.append(logp[p - 1:-1].gather(1, x[p:, None])[:, 0])
    del model
    gc.collect()
    return torch.cat(out)


def deeper_variant(family: str, num_layers: int) -> str:
    """A tiny random model of ``family`` with ``num_layers`` layers (for layouts the 2-layer fixtures
    cannot take: pp*vpp > 2, uneven pipeline stages), written by rank 0 into a temp dir shared by
    all ranks; returns the folder."""
    path = [None]
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        base = tiny_config(family)
        fields = base.to_dict()
        fields.pop("layer_types", None)   # transformers 5 derives it from num_hidden_layers
        fields["num_hidden_layers"] = num_layers
        cfg = type(base)(**fields)
        torch.manual_seed(4321)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for layer in model.model.layers:   # non-zero routing bias (DeepSeek), like the fixture
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                with torch.no_grad():
                    gate.e_score_correction_bias.normal_(0, 0.1)
        out = tempfile.mkdtemp(prefix=f"megarl-{family}-{num_layers}l-")
        model.save_pretrained(out, safe_serialization=True)
        if family == "deepseek_v3":
            cj = os.path.join(out, "config.json")
            d = json.load(open(cj))
            d.update(topk_method="noaux_tc", scoring_func="sigmoid")
            json.dump(d, open(cj, "w"))
        path[0] = out
    dist.broadcast_object_list(path, src=0)
    return path[0]


def remove_dir(path: str):
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def fixture(name: str) -> str:
    return str(ensure_fixture(name))


def groups_for(spec: str, world: int):
    return build_process_groups(parse_layout(spec, world))


def report(out: dict):
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


def dp_share(engine, n: int) -> list:
    """Global indices of this DP rank's sequences: its contiguous ``n // dp`` of the ``n``."""
    dp, dp_rank = engine.groups.topology.dp, engine.groups.dp_rank
    per = n // dp
    return list(range(dp_rank * per, (dp_rank + 1) * per))


def export(engine) -> dict:
    """A copy of the engine's weights, by HF name."""
    return {k: v.detach().clone() for k, v in engine.export_hf()}


def max_diff(a, b) -> float:
    """The largest absolute difference between two weight dicts of the same names."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k] - b[k]).abs().max().item() for k in a)


__all__ = ["init", "parse_layout", "make_batch", "micro_batches", "hf_logprobs", "deeper_variant",
           "remove_dir", "fixture", "groups_for", "report", "dp_share", "export", "max_diff", "ModelOptions",
           "SEQS"]
