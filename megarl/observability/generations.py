"""What the policy wrote, readable: ``<run_dir>/generations.jsonl`` and ``megarl samples``.

Every ``logging.samples_every`` steps (default 1), ``logging.samples_per_step`` samples (default
2) are decoded on the controller and appended as one line ``{"step": N, "samples": [...]}``: the best-rewarded sample first, then the
worst, then the second best, and so on (a reward hack shows up among the best, a broken chat
template among both). Each sample: its id, reward, response length in tokens, version gap (policy
versions between the one that sampled it and the one trained), the prompt and the response decoded
with their special tokens (so a template's markers stay visible), and the response's token ids.
Agent trajectories (``rollout.agent: tools``) also get ``turns``: the response cut into the runs
the model sampled (``model``) and the tool results the loop inserted (``tool``), in order, each
with its text and ids. The same samples go to the run's trackers as a table (TensorBoard: text
under the tag ``generations``). On resume, lines of steps >= the resumed step are dropped.

``megarl samples RUN_DIR [--step N] [--best | --worst] [-n K]`` prints a step's samples.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["GenerationLog", "pick_samples", "format_samples", "main"]


def pick_samples(rewards: list[float], count: int) -> list[int]:
    """Indices of ``count`` samples: best, worst, second best, second worst, ... (the first of
    equal rewards first)."""
    order = sorted(range(len(rewards)), key=lambda i: (-rewards[i], i))
    picked, lo, hi = [], 0, len(order) - 1
    while len(picked) < min(count, len(order)):
        picked.append(order[lo])
        lo += 1
        if len(picked) < count and lo <= hi:
            picked.append(order[hi])
            hi -= 1
    return picked


class GenerationLog:
    def __init__(self, run_dir: str | Path, tokenizer, per_step: int, resume_step: int, table_sink=None,
                 every: int = 1):
        """``table_sink(step, samples)``: e.g. :meth:`MetricsLogger.add_samples`; None: file only.
        ``every``: steps between two writes (steps that are multiples of it)."""
        from megarl.observability.jsonl import keep_steps_before, read_jsonl

        self.path = Path(run_dir) / "generations.jsonl"
        self.tokenizer, self.per_step, self.table_sink, self.every = tokenizer, per_step, table_sink, every
        if self.path.exists():
            keep_steps_before(self.path, read_jsonl(self.path), resume_step)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def record(self, step: int, rollout, i: int, ids: list[int], logprobs: list[float] | None = None) -> dict:
        """Sample ``i`` of ``rollout``, whose response ids are ``ids`` and vLLM's log-probs of them
        ``logprobs`` (NaN for inserted tool tokens)."""
        ids = list(ids)
        versions = rollout.token_versions[i] if rollout.token_versions else None
        rec = {"id": rollout.sample_ids[i] if rollout.sample_ids else str(i),
               "reward": rollout.rewards[i] if rollout.rewards else None, "length": len(ids),
               "gap": step - 1 - versions.min() if versions else 0,
               "prompt": self._decode(rollout.prompt_ids[i]), "response": self._decode(ids), "response_ids": ids,
               "prompt_ids": list(rollout.prompt_ids[i]),
               "logprobs": [float(x) for x in logprobs] if logprobs is not None else None}
        if rollout.loss_masks:
            turns, mask = [], rollout.loss_masks[i]
            for t, (token, sampled) in enumerate(zip(ids, mask)):
                role = "model" if sampled else "tool"
                if not turns or turns[-1]["role"] != role:
                    turns.append({"role": role, "ids": []})
                turns[-1]["ids"].append(token)
            for turn in turns:
                turn["text"] = self._decode(turn["ids"])
            rec["turns"] = turns
        return rec

    def write(self, step: int, rollout) -> None:
        if self.per_step <= 0 or len(rollout) == 0 or step % self.every:
            return
        rewards = rollout.rewards or [0.0] * len(rollout)
        picked = pick_samples(rewards, self.per_step)
        # the ids and log-probs, fetched in one get each for the samples that only the object store holds
        samples = [self.record(step, rollout, i, ids, lp) for i, ids, lp in
                   zip(picked, rollout.responses(picked), rollout.vllm_logprobs(picked))]
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")
        if self.table_sink is not None:
            self.table_sink(step, samples)


def format_samples(step: int, samples: list[dict], markdown: bool = False) -> str:
    fence = "```" if markdown else ""
    out = []
    for s in samples:
        reward = "n/a" if s.get("reward") is None else f"{s['reward']:.4g}"
        out.append(f"step {step}  sample {s['id']}  reward {reward}  length {s['length']} tokens  "
                   f"version gap {s['gap']}")
        out.append("--- prompt ---")
        out += [fence, s["prompt"], fence] if markdown else [s["prompt"]]
        if s.get("turns"):
            for turn in s["turns"]:
                out.append(f"--- {turn['role']} ({len(turn['ids'])} tokens) ---")
                out += [fence, turn["text"], fence] if markdown else [turn["text"]]
        else:
            out.append("--- response ---")
            out += [fence, s["response"], fence] if markdown else [s["response"]]
        out.append("")
    return "\n".join(out)


def main(run_dir: str, step: int | None = None, order: str | None = None, count: int | None = None,
         stream=None) -> int:
    import sys

    stream = stream or sys.stdout
    path = Path(run_dir) / "generations.jsonl"
    if not path.is_file():
        print(f"megarl samples: {path} does not exist (runs write it when logging.samples_per_step > 0)",
              file=sys.stderr)
        return 1
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        print(f"megarl samples: {path} holds no step yet", file=sys.stderr)
        return 1
    by_step = {line["step"]: line["samples"] for line in lines}
    if step is None:
        step = max(by_step)
    if step not in by_step:
        print(f"megarl samples: no step {step} in {path} (steps {min(by_step)}..{max(by_step)})", file=sys.stderr)
        return 1
    samples = list(by_step[step])
    if order in ("best", "worst"):
        samples.sort(key=lambda s: (s.get("reward") is None, s.get("reward") or 0.0), reverse=order == "best")
    if count is not None:
        samples = samples[:count]
    print(format_samples(step, samples), file=stream)
    return 0
