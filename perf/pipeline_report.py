"""The whole post-training pipeline on CPU, read back from its run folders (issue 33's acceptance).

Run the stages first (README "Whole pipeline"), and the quickstart's first step from the base
model and from the SFT export, side by side:

    megarl sft configs/sft_arithmetic.yaml
    megarl rm configs/rm_arithmetic.yaml
    megarl train configs/rlhf_arithmetic.yaml
    megarl train configs/quickstart.yaml trainer.steps=1 trainer.run_dir=runs/qs_base
    megarl train configs/quickstart.yaml trainer.steps=1 trainer.run_dir=runs/qs_sft model.path=runs/sft_arithmetic/hf

then ``python perf/pipeline_report.py [--runs runs]``: a markdown report (held-out SFT loss by
step, the quickstart's step-1 accuracy from both models, the reward model's held-out pair
accuracy, the RLHF reward beside the verifiable accuracy of the same samples, wall times) with
this machine's CPU flags.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl, the last row of each step (a restarted run appends)."""
    by_step: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def seconds(rs: list[dict]) -> float:
    return sum(v for r in rs for k, v in r.items() if k.startswith("time/") and isinstance(v, (int, float)))


def kind(rejected: str) -> str:
    """Which of the built-in rejections ``rejected`` is (megarl.posttrain.data.builtin_rows)."""
    if "####" not in rejected:
        return "no #### line"
    last_step = rejected.rsplit("\n#### ", 1)[0].splitlines()[-1]
    final = rejected.rsplit("#### ", 1)[1].strip()
    return "a slip carried on" if last_step.rstrip(".").endswith(f"= {final}") else "a total that does not follow"


def rm_fresh_pairs(rm_dir: Path, num: int, level: int, seed: int) -> str:
    """The exported reward model, loaded by transformers' AutoModelForSequenceClassification as it
    is, on ``num`` fresh built-in pairs (another seed than training's): pair accuracy by kind of
    rejected answer (:func:`kind`)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megarl.data.packing import trim_pads
    from megarl.posttrain.data import builtin_rows, load_examples

    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    rows = builtin_rows("builtin:arithmetic_prefs", num, level, seed)
    ex = load_examples("fresh", "pairs", tok, use_chat_template=True, max_seq_tokens=1024, rows=rows)
    pad = model.config.pad_token_id
    right = {"a slip carried on": [], "a total that does not follow": [], "no #### line": []}
    with torch.no_grad():
        for i, (_, row) in enumerate(rows):
            p = ex.prompt_ids[i]
            s = [float(model(torch.tensor([trim_pads(p + r, len(p), pad)])).logits[0, 0])
                 for r in (ex.response_ids[i], ex.rejected_ids[i])]
            right[kind(row["rejected"])].append(s[0] > s[1])
    cells = [f"{k}: {sum(v)}/{len(v)} = {sum(v) / max(1, len(v)):.3f}" for k, v in right.items()]
    total = [x for v in right.values() for x in v]
    return (f"Fresh pairs (level {level}, data.seed {seed}; transformers AutoModelForSequenceClassification on the "
            f"export): pair accuracy {sum(total)}/{len(total)} = {sum(total) / len(total):.3f} ({'; '.join(cells)}).\n")


def report(runs: Path, fresh_pairs: int = 0) -> str:
    from megarl.precision import cpu_line

    out = [f"# Post-training pipeline on CPU\n\nMachine: {cpu_line()}; fp32; `python perf/pipeline_report.py`.\n"]
    sft = rows(runs / "sft_arithmetic")
    out.append("## SFT (configs/sft_arithmetic.yaml)\n\n| step | train loss | held-out loss |\n|---|---|---|")
    for r in sft:
        if "eval/loss" in r or r["step"] in (1, len(sft) - 1):
            out.append(f"| {r['step']} | {r.get('train/loss', float('nan')):.4f} | {r.get('eval/loss', float('nan')):.4f} |")
    out.append(f"\n{len([r for r in sft if r['step'] > 0])} steps, {seconds(sft):.0f} s of train + eval phases.\n")
    base, tuned = runs / "qs_base", runs / "qs_sft"
    if base.exists() and tuned.exists():
        b, t = rows(base)[0], rows(tuned)[0]
        out.append("## Quickstart step 1 (configs/quickstart.yaml, level-1 problems, gsm8k_lenient, 32 samples)\n\n"
                   "| policy | reward/accuracy | reward/mean | response length |\n|---|---|---|---|")
        for name, r in (("base SmolLM2-135M-Instruct", b), ("SFT export", t)):
            out.append(f"| {name} | {r['reward/accuracy']:.3f} | {r['reward/mean']:.3f} | "
                       f"{r['response_length/mean']:.1f} |")
        out.append("")
    rm = rows(runs / "rm_arithmetic")
    out.append("## Reward model (configs/rm_arithmetic.yaml)\n\n| step | train loss | held-out loss | held-out "
               "pair accuracy | held-out margin |\n|---|---|---|---|---|")
    for r in rm:
        if "eval/loss" in r:
            out.append(f"| {r['step']} | {r.get('train/loss', float('nan')):.4f} | {r['eval/loss']:.4f} | "
                       f"{r['eval/accuracy']:.3f} | {r['eval/margin_mean']:.3f} |")
    out.append(f"\n{len([r for r in rm if r['step'] > 0])} steps, {seconds(rm):.0f} s of train + eval phases.\n")
    if fresh_pairs:
        out.append(rm_fresh_pairs(runs / "rm_arithmetic" / "hf", fresh_pairs, level=2, seed=99))
    rl = runs / "rlhf_arithmetic"
    if rl.exists():
        out.append("## RLHF (configs/rlhf_arithmetic.yaml): reward model reward vs verifiable accuracy, same samples\n\n"
                   "| step | RM score (mean) | RM score (std) | reward after data.reward_norm (mean) | gsm8k_lenient "
                   "(mean) | reward-model pass (s) | step (s) |\n|---|---|---|---|---|---|---|")
        for r in rows(rl):
            out.append(f"| {r['step']} | {r['reward_model/score_mean']:.4f} | {r['reward_model/score_std']:.4f} | "
                       f"{r['reward/mean']:.3f} | {r['reward/gsm8k_lenient_mean']:.3f} | "
                       f"{r['time/reward_model_s']:.2f} | {r.get('timeline/step_s', float('nan')):.0f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--out", help="also write the report here")
    ap.add_argument("--fresh-pairs", type=int, default=0, help="also score this many fresh preference pairs with "
                                                                "the exported reward model in transformers")
    args = ap.parse_args()
    text = report(Path(args.runs), args.fresh_pairs)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
