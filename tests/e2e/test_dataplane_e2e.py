"""Issue 36: the forward passes' per-token outputs stay on the training ranks and in Ray's object
store, the samples' token ids and vLLM log-probs go from the engines' objects to the ranks
(``trainer.data_plane: object_store``), and the run is the same as with every tensor through the
controller (``controller``, the previous design).

One launch (tests/e2e/plane_parity.py): one WorkerGroup of 2 training ranks (DP 2) and 2 vLLM
engines (rollout.dp 2), the tied tiny llama, 2 steps of GRPO with everything that reads the old
log-prob pass: 2 mini-batches (so the pass runs), a reference model with KL as a per-token reward
(its log-probs stay on the ranks too; the k1 ``actor/kl`` read-out sums old - ref there; the
per-token rewards' advantages are computed on rank 0 from both passes' objects), and
IcePop's rollout correction (weights and kept tokens computed on the ranks, per sequence as the
controller did).
Run once per data plane from the same weights and optimizer state.

Checked: every metric of both steps is equal, the weights' checksums exactly; the mismatch
metrics ``rollout_corr/*`` are now sums per sample added up on the controller instead of one sum
over the step (float64, other order): equal to 1e-12 relative. Lifetime: the ranks hold the same
number of object references after each step's weight sync (24 here: each DP leader's objects of
the passes, while the step holds them; 0 on the controller plane) and none after the run. Then,
on the same workers, 20 steps of each of trainer.mode on_policy and async (object-store plane,
the old pass and IcePop's objects on the ranks): neither the ranks' references nor the
controller's grow over the 20 steps (async drops stale groups too), and the ranks hold none after
each run. In async the ranks read the samples' ids and log-probs from the engines' objects too, and
vLLM's log-probs agree with the ranks' to 1e-4 at every step.
"""
import math
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
# what does not depend on timing (wall seconds, engine business) or on the number of syncs
SAME = ("step", "actor/", "reward/", "response_length/", "offpolicy/", "rollout/logprob_diff", "rollout/num_samples",
        "rollout/distinct_frac", "sync/verified_params", "sync/bytes")


LIFETIME = 20


def check_lifetime(stdout: str) -> None:
    """20 steps a mode: after each weight sync the ranks hold the step's objects and nothing older
    (no more in the last 10 steps than in the first 10: the count follows the step's micro-batches),
    none after the run; the controller's and the engines' references do not grow either."""
    lines = {line.split()[1]: line.split() for line in stdout.splitlines() if line.startswith("life ")}
    assert sorted(lines) == ["async", "on_policy"], stdout[-3000:]
    for mode, words in lines.items():
        at, et = words.index("controller"), words.index("engines")
        ranks, controller, engines = ([int(x) for x in words[a + 1:b]]
                                      for a, b in ((2, at), (at, et), (et, len(words))))
        assert len(ranks) == len(controller) == len(engines) == LIFETIME + 1, (mode, words)
        print(f"{mode}: references after each step's sync, then after the run: ranks {ranks}, controller "
              f"{controller}, engines {engines}")
        assert min(ranks[:-1]) > 0 and max(ranks[10:-1]) <= max(ranks[:10]) and ranks[-1] == 0, (mode, ranks)
        assert max(controller[10:-1]) <= max(controller[:10]), (mode, controller)
        assert max(engines[10:-1]) <= max(engines[:10]), (mode, engines)
        # the samples' ids and log-probs are the engines' objects while a step runs (async: the buffered ones too)
        assert min(engines[:-1]) > 0 and engines[-1] == 0, (mode, engines)


def test_forward_outputs_through_the_object_store_change_no_number(tmp_path):
    text = recipe(ALGORITHM, steps=2, rollout_extra="  dp: 2", trainer_extra="  min_lr: 2.0e-3")
    text = "topology:\n  world_size: 2\n" + text
    recipe_file = write_recipe(tmp_path, "parity", text)
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    proc = subprocess.run([sys.executable, str(HERE / "plane_parity.py"), str(recipe_file), str(tmp_path / "runs"),
                           "--lifetime", str(LIFETIME)], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # the object references the training ranks hold after each step's weight sync, then after the run
    refs = {line.split()[1]: [int(x) for x in line.split()[3:]] for line in proc.stdout.splitlines()
            if line.startswith("done ")}
    during, after = refs["object_store"][:-1], refs["object_store"][-1]
    assert len(during) == 2 and during[0] > 0 and during == [during[0]] * 2 and after == 0, refs   # no growth
    assert refs["controller"] == [0, 0, 0], refs
    check_lifetime(proc.stdout)
    runs = tmp_path / "runs"
    new, old = metrics(runs / "object_store"), metrics(runs / "controller")
    assert [r["step"] for r in new] == [r["step"] for r in old] == [1, 2]
    for a, b in zip(new, old):
        assert a["actor/old_logprob_pass"] == 1 and a["actor/optimizer_steps"] == 2
        assert a["actor/kl"] != 0 and "rollout_corr/weight_mean" in a, sorted(a)
        exact = {k: a[k] for k in a if k.startswith(SAME)}
        assert len(exact) > 30 and exact == {k: b.get(k) for k in exact}, \
            {k: (a[k], b.get(k)) for k in exact if a[k] != b.get(k)}
        close = [k for k in a if k.startswith("rollout_corr/")]
        assert len(close) == 6 and all(math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-15) for k in close), \
            {k: (a[k], b[k]) for k in close}
    # async (max_staleness 0: each step's tokens are of the version it trains, stale groups dropped):
    # the ranks read the ids and log-probs the engines put (the old pass runs on those ids); vLLM's
    # log-probs agree with the ranks' to fp32 precision at every step (samples resumed after a sync:
    # tests/unit/test_modes.py)
    rows = metrics(runs / "async")
    diffs = [r["rollout/logprob_diff_max"] for r in rows]
    assert len(rows) == LIFETIME and all(d is not None and d < 1e-4 for d in diffs), diffs
    print(f"async: {sum(r['async/dropped_stale'] for r in rows)} stale groups dropped over {LIFETIME} steps; "
          f"vLLM vs ranks' log-probs, max per step up to {max(diffs):.1e}")
    # the sample log (per-sample gaps from the ranks' read-outs) and the samples themselves
    for name in ("samples.jsonl", "generations.jsonl"):
        assert (runs / "object_store" / name).read_text() == (runs / "controller" / name).read_text(), name
