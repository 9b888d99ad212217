"""Metrics sinks and plots."""
import io
import json

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
    assert "step 2/3" in out.getvalue() and "reward/mean" in out.getvalue()
    # resuming at step 2 drops steps >= 2 so no step is logged twice
    MetricsLogger(tmp_path, tensorboard=False, stdout=False, resume_step=2).close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


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
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "reward/mean": s / 10, "response_length/mean": 30 + s, "time/generate_s": 1.0}) + "\n"
        for s in range(1, 6)))
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_gpu_stats_empty_without_gpu():
    assert gpu_stats() == {}
