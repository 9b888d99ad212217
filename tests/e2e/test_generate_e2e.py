"""``megarl generate`` on the e2e recipe: vLLM only, through the training run's rollout module.

Checked: one JSONL row per prompt x ``rollout.n`` with the reward of the configured reward function,
which reads a column of the prompts file (``bonus``: extra columns reach the reward as keywords),
and a quiet terminal (megarl's own lines; vLLM's output is in <run_dir>/logs/driver.log). The file
also has 3 prompts over rollout.max_prompt_tokens, which ``data.overlong_prompts=skip`` drops,
saying how many: no sample comes from them.
"""
import os
import subprocess
import sys

import pytest
from e2e_common import HERE, ray_tmpdir, recipe, write_recipe
from helpers import read_jsonl, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_generate_writes_scored_samples_quietly(tmp_path):
    path = write_recipe(tmp_path, "gen", recipe("  name: grpo", steps=1))
    bonus = {f"What is {i} + {i}?": 10.0 * i for i in range(3)}   # the last 2 rows are the held-out prompts
    data = tmp_path / "prompts.jsonl"
    long = [{"prompt": f"Add {i}: " + " + ".join(["12345"] * 80), "answer": "0", "data_source": "e2e", "bonus": -1.0}
            for i in range(3)]                                          # > rollout.max_prompt_tokens=128
    rows = [{"prompt": q, "answer": "0", "data_source": "e2e", "bonus": b} for q, b in bonus.items()]
    write_jsonl(data, [long[0], rows[0], long[1], rows[1], rows[2], long[2]])
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "generate", str(path), f"data.task={data}",
                           "data.reward=rewards_for_tests:column_reward", "data.overlong_prompts=skip",
                           "--num-prompts", "2"],
                          capture_output=True, text=True, env=env, timeout=900)
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-5000:]
    rows = read_jsonl(tmp_path / "gen" / "generations.jsonl")
    assert len(rows) == 2 * 4 and all(r["num_tokens"] > 0 for r in rows), rows
    # column_reward: the row's bonus column (with data_source, in the reward worker) + response length parity
    assert [r["reward"] for r in rows] == [bonus[r["prompt"]] + len(r["response"]) % 2 for r in rows], rows
    assert len({r["prompt"] for r in rows}) == 2
    assert "data.overlong_prompts=skip: dropped 3 of 6 prompts of" in terminal, terminal[-3000:]
    # megarl's lines only: "megarl: ..." and the continuation line of each sample shown
    assert all(line.startswith(("megarl: ", ">>> ")) for line in terminal.splitlines()), terminal
    assert "vllm" in (tmp_path / "gen" / "logs" / "driver.log").read_text().lower()
