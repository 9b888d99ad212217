"""TRL's GRPOTrainer on the benchmark's prompts: the baseline side of perf/bench_grpo_cpu.py.

Runs inside the separate TRL virtual environment that bench_grpo_cpu.py builds (it imports
nothing of megarl's package but the reward module, loaded from its file: the same scoring rule
on both sides). Writes one JSON line per optimizer step to ``--out``: the step's wall seconds
(``on_step_begin`` -> ``on_step_end``: generation, scoring and the update, as TRL runs them
inside one training step), the seconds of TRL's own profiled phases in that step (its
``profiling/Time taken`` blocks: ``transformers.generate``, ``_prepare_inputs`` (generation +
scoring + any extra log-prob pass), ``_calculate_rewards``, ``compute_loss``), and the step's
mean completion length and reward as TRL logs them.

    python trl_grpo_driver.py --model DIR --data prompts.jsonl --out steps.jsonl --steps 6 \
        --prompts 8 --n 4 --max-new 96 --lr 1e-6 --dtype float32 --reward-module megarl/rewards/math.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections import defaultdict


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="jsonl with prompt, answer (megarl's prompt dataset format)")
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--max-new", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--reward-module", required=True, help="path of megarl/rewards/math.py")
    p.add_argument("--reward", default="gsm8k_lenient_reward")
    a = p.parse_args()

    import torch
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("bench_reward", a.reward_module)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = getattr(module, a.reward)

    rows = [json.loads(line) for line in open(a.data) if line.strip()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                              for r in rows])

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(score(t, gold)) for t, gold in zip(texts, answer)]

    phases: dict = defaultdict(float)   # TRL's profiled blocks of the current step

    def record(self, duration: float) -> None:
        phases[self.name.split(".", 1)[-1] if self.name.startswith("GRPOTrainer.") else self.name] += duration

    profiling.ProfilingContext._log_metrics = record

    class Steps(TrainerCallback):
        def __init__(self):
            self.t0, self.logged = 0.0, {}

        def on_step_begin(self, args, state, control, **kw):
            phases.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.row = {"step": state.global_step, "step_s": time.perf_counter() - self.t0,
                        "phases": {k: round(v, 3) for k, v in phases.items()}}

        def on_log(self, args, state, control, logs=None, **kw):
            if "completions/mean_length" not in (logs or {}):   # the end-of-training summary
                return
            row = dict(self.row)
            row.update({"mean_response_length": (logs or {}).get("completions/mean_length"),
                        "reward": (logs or {}).get("reward")})
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    dtype = getattr(torch, a.dtype)
    batch = a.prompts * a.n
    cfg = GRPOConfig(
        output_dir=a.workdir, max_steps=a.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=a.n, steps_per_generation=1, num_iterations=1, max_completion_length=a.max_new,
        temperature=a.temperature, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, beta=0.0, epsilon=a.clip, loss_type="dapo", scale_rewards="group",
        use_cpu=True, bf16=a.dtype == "bfloat16", model_init_kwargs={"dtype": dtype}, shuffle_dataset=False,
        logging_steps=1, report_to=[], save_strategy="no", seed=a.seed, dataloader_num_workers=0,
        log_completions=False, disable_dropout=True)
    trainer = GRPOTrainer(model=a.model, reward_funcs=reward, args=cfg, train_dataset=data, callbacks=[Steps()])
    trainer.train()


if __name__ == "__main__":
    main()
