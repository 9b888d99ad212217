"""The same short GRPO runs on an earlier commit and on the working tree, metric by metric.

A change that should not move the numerics (a refactor, a data-path move) is checked here: each
case trains the e2e recipe (tests/e2e/e2e_common.py: 4 prompts x 4 samples, 3 steps, fixed seeds)
once with ``--base``'s code (a ``git worktree`` in a temp folder, run with this venv) and once
with the working tree's, then prints, per case, how many metric values are identical, the largest
relative difference of every metric that is not (timings left out), and whether the per-step
``actor/weight_checksum`` (the sum of every parameter after the update) and rewards are equal.

    python perf/ab_commits.py --base HEAD                 # all cases
    python perf/ab_commits.py --base HEAD~2 tp1 r3_moe
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "e2e"))

CASES = {   # name -> overrides of the e2e recipe
    "tp1": ["model.path=fixture:tiny-qwen2"],
    "dp2_2engines": ["model.path=fixture:tiny-qwen2", "topology.world_size=2", "rollout.dp=2"],
    "r3_moe": ["model.path=fixture:tiny-qwen3_moe", "algorithm.router_replay=r3"],
    "bf16_tis": ["model.path=fixture:tiny-qwen2", "model.dtype=bfloat16", "trainer.logprob_diff_threshold=null",
                 "data.prompts_per_step=2"],
    "one_step_off": ["model.path=fixture:tiny-qwen2", "trainer.mode=one_step_off"],
    "kl_loss": ["model.path=fixture:tiny-qwen2", "algorithm.kl_coef=0.05", "algorithm.kl_mode=loss"],
    # a critic (GAE) and a KL reward: with the object store the advantages are computed on rank 0
    "ppo_kl_reward": ["model.path=fixture:tiny-qwen2", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
                      "algorithm.kl_mode=reward", "algorithm.mini_batches=2"],
    # the agent loop on SmolLM2 with the calculator (configs/agent_calculator.yaml's task, reward and tool):
    # trajectories joined and put into the object store by the controller, tool tokens masked
    "agent": ["model.path=fixture:smollm2", "rollout.agent=tools", "rollout.tools=calculator", "rollout.max_turns=2",
              "rollout.max_prompt_tokens=448", "rollout.max_response_tokens=48", "data.task=calculator",
              "data.difficulty=1", "data.prompts_per_step=2", "data.reward=calculator_bonus", "trainer.lr=2.0e-5",
              "trainer.max_tokens_per_micro_batch=1024", "trainer.logprob_diff_threshold=null"],
    # speculative rollouts (exact): a pool of 3 prompts, 4 a step, so steps 2 and 3 verify drafts
    "speculative_exact": ["model.path=fixture:tiny-qwen2", "rollout.speculative=exact", "data.num_prompts=3"],
}
TIMINGS = ("time/", "throughput/", "timeline/", "sync/seconds", "sync/engine", "sync/vllm_load_seconds",
           "rollout/busy_ratio", "rollout/engine", "memory/", "gpu/", "spec/residual_s", "spec/verify_s")


def run(code: Path, work: Path, name: str) -> list[dict]:
    from e2e_common import recipe

    run_dir = work / code.name / name
    cfg = work / f"{name}.yaml"
    cfg.write_text(recipe("  name: grpo", steps=3).replace("{model}", "fixture:tiny-qwen2")
                   .replace("{run_dir}", str(run_dir)))
    env = dict(os.environ, PYTHONPATH=f"{code}:{code / 'tests' / 'e2e'}")
    log = work / f"{code.name}_{name}.log"
    with log.open("w") as f:
        rc = subprocess.call([sys.executable, "-m", "megarl.cli", "train", str(cfg), *CASES[name]], cwd=work,
                             env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"{name} on {code}: exit {rc}; see {log}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(old: list[dict], new: list[dict]) -> tuple[int, dict]:
    same, worst = 0, {}
    for a, b in zip(old, new):
        for k in sorted(set(a) | set(b)):
            if k.startswith(TIMINGS):
                continue
            x, y = a.get(k, "missing"), b.get(k, "missing")
            if x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
                same += 1
            elif isinstance(x, (int, float)) and isinstance(y, (int, float)):
                worst[k] = max(worst.get(k, 0.0), abs(x - y) / max(abs(x), abs(y), 1e-300))
            else:
                worst[k] = f"{x!r} vs {y!r}"
    return same, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    p.add_argument("cases", nargs="*", help=f"default: all of {list(CASES)}")
    a = p.parse_args()
    unknown = sorted(set(a.cases) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}; expected some of {list(CASES)}")
    work = Path(tempfile.mkdtemp(prefix="ab-", dir="/tmp"))
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(base), a.base], check=True,
                   stdout=subprocess.DEVNULL)
    rev = subprocess.run(["git", "-C", str(base), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    print(f"ab: base {a.base} ({rev}) vs the working tree; runs in {work}", flush=True)
    try:
        for name in a.cases or CASES:
            old, new = run(base, work, name), run(ROOT, work, name)
            same, worst = compare(old, new)
            sums = [(x.get("actor/weight_checksum"), y.get("actor/weight_checksum")) for x, y in zip(old, new)]
            rewards = [(x.get("reward/mean"), y.get("reward/mean")) for x, y in zip(old, new)]
            print(f"{name}: {len(old)} vs {len(new)} steps, {same} metric values identical; differing (largest "
                  f"relative difference): {worst or 'none'}\n  weight checksums per step identical: "
                  f"{len(old) == len(new) and all(x == y for x, y in sums)}; rewards identical: "
                  f"{len(old) == len(new) and all(x == y for x, y in rewards)}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


if __name__ == "__main__":
    main()
