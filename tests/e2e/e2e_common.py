"""Helpers of the end-to-end tests: a tied tiny model, a training subprocess, its metrics."""
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))   # tests/helpers.py, for scripts that import this file too (perf/ab_commits.py)
from helpers import read_jsonl  # noqa: E402
RECIPE = """
model:
  path: {{model}}
rollout:
  n: 4
  max_prompt_tokens: 128
  max_response_tokens: 12
{rollout_extra}
algorithm:
{algorithm}
data:
  prompts_per_step: 4
  reward: rewards_for_tests:token_parity_reward
{data_extra}
trainer:
  steps: {steps}
  lr: 2.0e-3
  run_dir: {{run_dir}}
  logprob_diff_threshold: 0.01
  max_tokens_per_micro_batch: 256
{trainer_extra}
checkpoint:
  save_every: {save_every}
  keep_last: 2
{checkpoint_extra}
logging:
  progress: false
  trackers: {trackers}
bridge:
  verify: true
"""


def recipe(algorithm: str, steps: int, save_every: int = 0, rollout_extra: str = "",
           tensorboard: bool = False, data_extra: str = "", trainer_extra: str = "",
           checkpoint_extra: str = "") -> str:
    """The e2e recipe (tied tiny llama, token-parity reward, 4 prompts x 4 samples, fp32 alarm at
    0.01) with an ``algorithm:`` section body and extra ``rollout:`` / ``data:`` / ``trainer:`` /
    ``checkpoint:`` lines; {model} and {run_dir} (also inside the extras) stay for :func:`start`
    to fill in."""
    return RECIPE.format(algorithm=algorithm, steps=steps, save_every=save_every, rollout_extra=rollout_extra,
                         trackers="[jsonl, tensorboard]" if tensorboard else "[jsonl]", data_extra=data_extra,
                         trainer_extra=trainer_extra,
                         checkpoint_extra=checkpoint_extra)


def tied_tiny_llama(folder: Path) -> Path:
    """tiny-llama with tie_word_embeddings=True (the checkpoint then has no lm_head), as SmolLM2."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.fixtures import ensure_fixture

    if folder.exists():
        return folder
    src = ensure_fixture("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))   # complete or absent
    model.save_pretrained(staging)
    AutoTokenizer.from_pretrained(src).save_pretrained(staging)
    os.replace(staging, folder)
    return folder


def session_tied_llama() -> Path:
    """The tied tiny llama of this test session (built once, in the session's temp dir)."""
    return tied_tiny_llama(Path(tempfile.gettempdir()) / f"megarl-tied-llama-{os.getpid()}")


def check_lora_export(export: Path) -> None:
    """A LoRA run's HF export (merged weights, PEFT adapter in ``adapter/``) on the tied tiny llama:
    peft's base + adapter gives the merged folder's logits (< 5e-5: merging reorders float sums;
    logits of magnitude ~3, measured 1.5e-5), and the adapter changes them (> 1e-3)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (export / "adapter" / "adapter_config.json").exists()
    ids = torch.tensor([[1, 5, 9, 22, 17, 40, 3, 8]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(session_tied_llama(), dtype=torch.float32)
        plain = base(ids).logits
        peft = PeftModel.from_pretrained(base, export / "adapter")(ids).logits
    assert (peft - plain).abs().max() > 1e-3
    assert (peft - merged).abs().max() < 5e-5, (peft - merged).abs().max()


def write_recipe(tmp_path: Path, name: str, recipe_text: str) -> Path:
    """``tmp_path/name.yaml``: ``recipe_text`` with {run_dir} (``tmp_path/name``) and {model} filled in
    (the tied tiny llama is built once per test session, in the session's temp dir)."""
    recipe = tmp_path / f"{name}.yaml"
    model = session_tied_llama()
    recipe.write_text(recipe_text.format(run_dir=tmp_path / name, model=model))
    return recipe


def ray_tmpdir() -> str:
    """Ray's socket paths must stay under 107 bytes: a short temp root, not pytest's tmp_path."""
    return tempfile.mkdtemp(prefix="ray-", dir="/tmp")


def start(tmp_path: Path, name: str, recipe_text: str, *extra: str, command: str = "train") -> subprocess.Popen:
    """``megarl train`` (or ``command``: sft, rm) of ``recipe_text`` ({run_dir} and {model} filled in)
    as a subprocess in its own session (so a test can SIGKILL the whole tree); output to
    ``tmp_path/name.log``."""
    recipe = write_recipe(tmp_path, name, recipe_text)
    env = dict(os.environ, PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}", RAY_TMPDIR=ray_tmpdir())
    log = open(tmp_path / f"{name}.log", "a")
    return subprocess.Popen([sys.executable, "-m", "megarl.cli", command, str(recipe), *extra], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def run(tmp_path: Path, name: str, recipe_text: str, *extra: str, timeout: int = 1500,
        command: str = "train") -> list[dict]:
    proc = start(tmp_path, name, recipe_text, *extra, command=command)
    assert proc.wait(timeout=timeout) == 0, (tmp_path / f"{name}.log").read_text()[-5000:]
    return metrics(tmp_path / name)


def metrics(run_dir) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl", missing_ok=True)


# multiprocessing's resource tracker (started by the reward pool's spawn context) serves the
# whole interpreter and exits with it: not a process of the run
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker",)


class ProcessWatch:
    """Every descendant of ``root`` (a pid; default this process) seen while the block runs:
    pid -> create_time, and pid -> every command line it showed (Ray workers and vLLM retitle
    themselves). Use ``with ProcessWatch(proc.pid)`` around a ``megarl`` subprocess."""

    def __init__(self, root: int | None = None):
        self.root = root

    def __enter__(self):
        self.seen, self.cmds, self._stop = {}, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        me = psutil.Process(self.root)
        while not self._stop.is_set():
            try:
                children = me.children(recursive=True)
            except psutil.Error:      # the root has exited: its orphans are still tracked by pid
                children = []
            for p in children:
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                    self.cmds.setdefault(p.pid, set()).add(" ".join(p.cmdline()) or p.name())
                except psutil.Error:
                    pass
            self._stop.wait(0.3)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def wait_gone(self, timeout: float = 15.0) -> list[str]:
        """Poll until every process seen has exited (SIGTERM/SIGKILLed ones may take a moment);
        the ones still alive after ``timeout`` seconds."""
        deadline = time.time() + timeout
        while self.alive() and time.time() < deadline:
            time.sleep(0.5)
        return self.alive()

    def alive(self) -> list[str]:
        out = []
        for pid, created in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{pid} {' | '.join(c[:150] for c in self.cmds.get(pid, ()))}")
            except psutil.Error:
                pass
        return [line for line in out if not any(h in line for h in INTERPRETER_HELPERS)]


@contextlib.contextmanager
def terminal_to(path: Path):
    """Descriptors 1 and 2 (and ``sys.stdout`` / ``sys.stderr``) into the file ``path`` while the
    block runs: what an in-process run shows on its terminal (pytest's capfd, for a module fixture;
    with ``-s`` too). Truncating the file drops what was shown so far."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, streams = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = os.fdopen(os.dup(fd), "w", buffering=1)
        yield path
    finally:
        sys.stdout.flush()
        sys.stdout.close()
        sys.stdout, sys.stderr = streams
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)
