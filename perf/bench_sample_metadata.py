"""What the controller holds of a response: its token ids (as Ray hands them over: a list of Python
ints) vs its text (what the engines send instead with ``trainer.data_plane: object_store``).

Text of this repository (docs/architecture.md and README.md) is tokenized with a fixture model's
tokenizer and cut into responses of ``--tokens`` tokens; for each form the script measures the
Python heap a controller holds for it after unpickling (tracemalloc) and its pickled size (the
bytes on the wire), per token, side by side, and prints the ratios. Also the source of
:data:`megarl.planner.memory.TEXT_BYTES_PER_TOKEN`.

    python perf/bench_sample_metadata.py [--model fixture:smollm2] [--tokens 700]
"""
from __future__ import annotations

import argparse
import pickle
import sys
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def held_bytes(objects: list) -> float:
    """Heap bytes of each object once unpickled (a fresh copy, as a Ray result is), averaged."""
    blobs = [pickle.dumps(o, protocol=5) for o in objects]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    copies = [pickle.loads(b) for b in blobs]
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del copies
    return held / len(objects)


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from megarl.models.fixtures import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="fixture:smollm2")
    ap.add_argument("--tokens", type=int, default=700, help="tokens a response (DeepSeek-V3's recipe mean: 701)")
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    ids = tok("".join((ROOT / f).read_text() for f in ("docs/architecture.md", "README.md"))).input_ids
    n = args.tokens
    responses = [list(ids[i:i + n]) for i in range(0, len(ids) - n + 1, n)]
    texts = tok.batch_decode(responses, skip_special_tokens=True)
    rows = {"ids (list of int)": responses, "text (str)": texts}
    held = {k: held_bytes(v) / n for k, v in rows.items()}
    wire = {k: sum(len(pickle.dumps(o, protocol=5)) for o in v) / len(v) / n for k, v in rows.items()}
    print(f"{len(responses)} responses of {n} tokens, {args.model}'s tokenizer (vocabulary {len(tok)})\n")
    print("| form | held by the controller (B/token) | pickled (B/token) |\n|---|---|---|")
    for k in rows:
        print(f"| {k} | {held[k]:.2f} | {wire[k]:.2f} |")
    a, b = rows
    print(f"ids / text: held {held[a] / held[b]:.2f}x, pickled {wire[a] / wire[b]:.2f}x")


if __name__ == "__main__":
    main()
