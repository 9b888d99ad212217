"""Metrics sinks, the run console and plots."""
import io
import logging
import os
import subprocess
import sys
import warnings

import pytest
from helpers import write_jsonl

from megarl.observability import MetricsLogger, PhaseTimer, gpu_stats, read_jsonl
from megarl.observability.plot import plot_run


def test_jsonl_table_and_resume_truncation(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, tensorboard=False, total_steps=3, stream=out)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": 0.1 * step, "time/train_s": 2.0})
    log.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["reward/mean"] == 0.2
    assert "step 2/3" in out.getvalue() and "  reward  mean=0.2000\n" in out.getvalue()
    # resuming at step 2 drops steps >= 2 so no step is logged twice
    MetricsLogger(tmp_path, tensorboard=False, stdout=False, resume_step=2).close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


def test_table_groups_keys_by_prefix_and_wraps():
    out = io.StringIO()
    log = MetricsLogger("unused", tensorboard=False, jsonl=False, total_steps=2, stream=out)
    metrics = {f"actor/metric_{i:02d}": float(i) for i in range(20)}
    log.log(1, {**metrics, "time/train_s": 2.0, "loss": 1.0})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2")
    assert lines[1].startswith("  actor  metric_00=0.0000  metric_01=1.0000")
    assert " " * 9 + "loss=1.0000" in lines                  # no prefix: an empty group label
    assert lines[-1] == "  time   train_s=2.0000"
    assert all(len(line) <= 110 for line in lines) and len(lines) < 10
    assert sum(line.count("=") for line in lines) == 22      # every key once


def test_failed_step_writes_the_metrics_it_reached(tmp_path):
    class Alarm(RuntimeError):
        metrics = {"rollout/logprob_diff_mean": 0.5}

    log = MetricsLogger(tmp_path, tensorboard=False, stdout=False)
    with log.step(1) as m:
        m["reward/mean"] = 1.0
    with pytest.raises(Alarm), log.step(2) as m:
        m["reward/mean"] = 0.5
        raise Alarm("weights out of sync")
    with pytest.raises(KeyError), log.step(3):
        raise KeyError("nothing reached: no row")
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/mean": 1.0}, {"step": 2, "reward/mean": 0.5, "rollout/logprob_diff_mean": 0.5}]


QUIET_RUN = r"""
import logging, os, sys, warnings
from megarl.observability.console import run_console
with run_console(sys.argv[1], "info", verbose=sys.argv[2] == "1") as console:
    print("progress", file=console, flush=True)
    logging.getLogger("megarl").info("one line of megarl")
    logging.getLogger("megarl.rewards.pool").debug("below the level")
    print("a library's print")
    os.write(2, b"C-level stderr\n")
    logging.getLogger("vllm").warning("a library's warning")
    warnings.warn("a library warning")
    os.system("echo child process")
print("after the run")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_run_console_sends_other_output_to_the_log(tmp_path, verbose):
    proc = subprocess.run([sys.executable, "-c", QUIET_RUN, str(tmp_path), str(int(verbose))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    others = ["a library's print", "C-level stderr", "a library's warning", "a library warning", "child process"]
    assert "progress" in terminal and "megarl: one line of megarl" in terminal and "after the run" in terminal
    assert "below the level" not in terminal
    if verbose:
        assert all(o in terminal for o in others) and not (tmp_path / "driver.log").exists()
    else:
        log = (tmp_path / "driver.log").read_text()
        assert not any(o in terminal for o in others), terminal
        assert all(o in log for o in others) and "one line of megarl" in log and "below the level" not in log


def test_run_console_restores_descriptors_after_an_error(tmp_path, capfd):
    from megarl.observability.console import run_console

    with pytest.raises(ValueError), run_console(tmp_path, "warning"):
        os.write(1, b"into the file\n")
        raise ValueError("boom")
    os.write(1, b"back on the terminal\n")
    assert capfd.readouterr().out == "back on the terminal\n"
    log = (tmp_path / "driver.log").read_text()
    assert "into the file" in log and "ValueError: boom" in log
    assert warnings.showwarning.__module__ != "megarl.observability.console"
    assert not any(str(tmp_path) in str(getattr(getattr(h, "stream", None), "name", ""))
                   for h in logging.getLogger().handlers)


def test_tensorboard_events_written(tmp_path):
    log = MetricsLogger(tmp_path, stdout=False)
    log.log(1, {"loss": 1.5})
    log.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_phase_timer_accumulates():
    timer = PhaseTimer()
    with timer("generate"):
        pass
    with timer("generate"):
        pass
    stats = timer.pop()
    assert list(stats) == ["time/generate_s"] and stats["time/generate_s"] >= 0
    assert timer.pop() == {}


def test_plot_writes_png(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [
        {"step": s, "reward/mean": s / 10, "response_length/mean": 30 + s, "time/generate_s": 1.0} for s in range(1, 6)])
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_gpu_stats_empty_without_gpu():
    assert gpu_stats() == {}
