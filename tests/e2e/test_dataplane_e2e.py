"""The data plane through a real run: the forward passes' per-token outputs stay on the training
ranks and in Ray's object store, the samples' token ids and vLLM log-probs go from the engines'
objects to the ranks, and nothing is left behind.

One launch (tests/e2e/dataplane_runs.py): one WorkerGroup of 2 training ranks (DP 2) and 2 vLLM
engines (rollout.dp 2), the tied tiny llama, 2 steps of GRPO with everything that reads the old
log-prob pass: 2 mini-batches (so the pass runs), a reference model with KL as a per-token reward
(its log-probs stay on the ranks too; the k1 ``actor/kl`` read-out sums old - ref there; the
per-token rewards' advantages are computed on rank 0 from both passes' objects), and IcePop's
rollout correction (weights and kept tokens computed on the ranks, per sequence).

Checked: vLLM's log-probs agree with the old pass's on the ranks to fp32 precision at both steps
(the ids the ranks fetched are the sampled ones), every reader of the pass reported. Lifetime: the
ranks hold the same number of object references at each step's policy update (each DP leader's
objects of the passes, while the step holds them), none after its weight sync (released when its
training ends) and none after the run. Then, on the same workers, 8 steps (LIFETIME) of each of
trainer.mode on_policy and async (the old pass and IcePop's objects on the ranks): neither the
ranks' references nor the controller's nor the engines' grow over those steps (async drops stale
groups too), and none are left after each step's training or after each run. In async the ranks
read the samples' ids and log-probs from the engines' objects too, and vLLM's log-probs agree with
the ranks' to 1e-4 at every step. The numbers equal those of the design that sent every tensor
through the controller (perf/ab_commits.py, bit for bit).
"""
import os
import subprocess
import sys

import pytest
from e2e_common import HERE, metrics, ray_tmpdir, recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ALGORITHM = """  name: grpo
  mini_batches: 2
  kl_coef: 0.01
  kl_mode: reward
  rollout_correction: icepop
  correction_low: 0.5
  correction_high: 2.0"""

LIFETIME = 8


def check_lifetime(stdout: str) -> None:
    """LIFETIME steps a mode: at each policy update the ranks hold the step's objects and nothing
    older (no more in the second half of the steps than in the first: the count follows the step's
    micro-batches), none after each weight sync and none after the run; the controller's and the
    engines' references do not grow either."""
    lines = {line.split()[1]: line.split()[2:] for line in stdout.splitlines() if line.startswith("life ")}
    assert sorted(lines) == ["async", "on_policy"], stdout[-3000:]
    for mode, words in lines.items():
        counts: dict = {}
        for word in words:   # "key v v .. key v v ..": a list of ints under each key
            if word.lstrip("-").isdigit():
                counts[key].append(int(word))
            else:
                key = word
                counts[key] = []
        ranks, synced, controller, engines = (counts[k] for k in ("ranks", "ranks_synced", "controller", "engines"))
        assert len(ranks) == len(synced) == len(controller) == len(engines) == LIFETIME + 1, (mode, counts)
        print(f"{mode}: references at each step's update (ranks) or after its sync, then after the run: ranks "
              f"{ranks}, ranks after the sync {synced}, controller {controller}, engines {engines}")
        half = LIFETIME // 2
        assert min(ranks[:-1]) > 0 and max(ranks[half:-1]) <= max(ranks[:half]) and ranks[-1] == 0, (mode, ranks)
        assert max(synced) == 0, (mode, synced)   # a step's objects are released by the end of its training
        assert max(controller[half:-1]) <= max(controller[:half]), (mode, controller)
        assert max(engines[half:-1]) <= max(engines[:half]), (mode, engines)
        # the samples' ids and log-probs are the engines' objects while a step runs (async: the buffered ones too)
        assert min(engines[:-1]) > 0 and engines[-1] == 0, (mode, engines)


def test_forward_outputs_stay_on_the_ranks_and_nothing_grows(tmp_path):
    text = recipe(ALGORITHM, steps=2, rollout_extra="  dp: 2", trainer_extra="  min_lr: 2.0e-3")
    text = "topology:\n  world_size: 2\n" + text
    recipe_file = write_recipe(tmp_path, "main", text)
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    proc = subprocess.run([sys.executable, str(HERE / "dataplane_runs.py"), str(recipe_file), str(tmp_path / "runs"),
                           "--lifetime", str(LIFETIME)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the object references the training ranks hold at each step's policy update, then after the run
    refs = {line.split()[1]: [int(x) for x in line.split()[3:]] for line in proc.stdout.splitlines()
            if line.startswith("done ")}
    during, after = refs["main"][:-1], refs["main"][-1]
    assert len(during) == 2 and during[0] > 0 and during == [during[0]] * 2 and after == 0, refs   # no growth
    [synced] = [[int(x) for x in line.split()[2:]] for line in proc.stdout.splitlines() if line.startswith("synced ")]
    assert synced == [0, 0], synced   # released by the end of the step's training, before its weight sync
    check_lifetime(proc.stdout)
    runs = tmp_path / "runs"
    rows = metrics(runs / "main")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/old_logprob_pass"] == 1 and r["actor/optimizer_steps"] == 2
        assert r["actor/kl"] != 0 and "rollout_corr/weight_mean" in r, sorted(r)
        assert len([k for k in r if k.startswith("rollout_corr/")]) == 6, sorted(r)
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
        assert r["rollout/num_samples"] == 16 and r["response_length/mean"] > 0
    # async (max_staleness 0: each step's tokens are of the version it trains, stale groups dropped):
    # the ranks read the ids and log-probs the engines put (the old pass runs on those ids); vLLM's
    # log-probs agree with the ranks' to fp32 precision at every step (samples resumed after a sync:
    # tests/unit/test_modes.py)
    rows = metrics(runs / "async")
    diffs = [r["rollout/logprob_diff_max"] for r in rows]
    assert len(rows) == LIFETIME and all(d is not None and d < 1e-4 for d in diffs), diffs
    print(f"async: {sum(r['async/dropped_stale'] for r in rows)} stale groups dropped over {LIFETIME} steps; "
          f"vLLM vs ranks' log-probs, max per step up to {max(diffs):.1e}")
