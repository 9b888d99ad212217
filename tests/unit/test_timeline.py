"""The timeline: busy/idle/overlap seconds per step window, its file, resume, threads and the plot."""
import json
import threading
import time

import pytest

from megarl.cli import main as cli_main
from megarl.observability.plot import _lane_order, plot_timeline, timeline_figure
from megarl.observability.timeline import Timeline, read_timeline

# Two windows, [100, 110] and [110, 120]; numbers are seconds after `base`.
SPANS = [("engine0", "generate", 100, 104), ("engine0", "score", 103, 105),   # one lane, overlapping
         ("engine1", "generate", 101, 107), ("engine1", "generate", 115, 118),
         ("rank0", "train", 104, 108), ("rank0", "sync", 109, 111),         # sync straddles 110
         ("rank1", "logprobs", 95, 102), ("rank1", "train", 104, 108),      # logprobs starts before 100
         ("driver", "pause", 102, 103)]


def record_all(timeline: Timeline, base: float):
    for lane, phase, start, end in SPANS:
        timeline.record(lane, phase, base + start, base + end)


def test_busy_idle_overlap_by_hand():
    tl = Timeline(None)
    record_all(tl, 0.0)
    m1 = tl.step_metrics(1, 100.0, 110.0)
    # engine0 [100,105]; engine1 [101,107]; rank0 [104,108]+[109,110]; rank1 [100,102]+[104,108];
    # engines [100,107] = 7; ranks [100,102]+[104,108]+[109,110] = 7; both: [100,102]+[104,107] = 5
    assert m1 == {
        "timeline/step_s": 10.0, "timeline/generate_s": 7.0, "timeline/train_s": 7.0, "timeline/overlap_s": 5.0,
        "timeline/engine0_busy_s": 5.0, "timeline/engine0_idle_s": 5.0,
        "timeline/engine1_busy_s": 6.0, "timeline/engine1_idle_s": 4.0,
        "timeline/rank0_busy_s": 5.0, "timeline/rank0_idle_s": 5.0,
        "timeline/rank1_busy_s": 6.0, "timeline/rank1_idle_s": 4.0,
        "timeline/driver_busy_s": 1.0, "timeline/driver_idle_s": 9.0}
    # spans ended by 100 are forgotten once the window [100, 110] is measured: none here; by 110:
    # all but rank0's sync (till 111) and engine1's second generate
    m2 = tl.step_metrics(2, 110.0, 120.0)
    assert len(tl._spans) == 2
    assert m2 == {
        "timeline/step_s": 10.0, "timeline/generate_s": 3.0, "timeline/train_s": 1.0, "timeline/overlap_s": 0.0,
        "timeline/engine0_busy_s": 0.0, "timeline/engine0_idle_s": 10.0,
        "timeline/engine1_busy_s": 3.0, "timeline/engine1_idle_s": 7.0,
        "timeline/rank0_busy_s": 1.0, "timeline/rank0_idle_s": 9.0,
        "timeline/rank1_busy_s": 0.0, "timeline/rank1_idle_s": 10.0,
        "timeline/driver_busy_s": 0.0, "timeline/driver_idle_s": 10.0}
    tl.step_metrics(3, 120.0, 130.0)
    assert tl._spans == []


def test_open_spans_count_up_to_the_window_end_then_in_the_next_window():
    tl = Timeline(None)
    with tl.spans(["rank0", "rank1"], "train"):
        now = time.monotonic()
        m1 = tl.step_metrics(1, now, now + 4.0)
    end = tl._spans[0][3]
    assert [sp[:2] for sp in tl._spans] == [("rank0", "train"), ("rank1", "train")] and tl._spans[1][3] == end
    assert m1["timeline/rank0_busy_s"] == m1["timeline/rank1_busy_s"] == m1["timeline/train_s"] == (now + 4.0) - now
    m2 = tl.step_metrics(2, now, end + 1.0)   # the closed span, clipped to the window
    assert m2["timeline/rank0_busy_s"] == m2["timeline/train_s"] == end - now
    assert m2["timeline/rank0_idle_s"] == pytest.approx(1.0, abs=1e-9)


def test_file_lines_clipped_per_window(tmp_path):
    path = tmp_path / "run" / "timeline.jsonl"
    tl = Timeline(path)
    record_all(tl, tl.t0)
    tl.step_metrics(1, tl.t0 + 100, tl.t0 + 110)
    tl.step_metrics(2, tl.t0 + 110, tl.t0 + 120)

    def span(step, lane, phase, start, end):
        return {"step": step, "lane": lane, "phase": phase, "start": start, "end": end}

    assert read_timeline(path) == [
        {"step": 1, "start": 100.0, "end": 110.0},
        span(1, "engine0", "generate", 100.0, 104.0), span(1, "rank1", "logprobs", 100.0, 102.0),
        span(1, "engine1", "generate", 101.0, 107.0), span(1, "driver", "pause", 102.0, 103.0),
        span(1, "engine0", "score", 103.0, 105.0),
        span(1, "rank0", "train", 104.0, 108.0), span(1, "rank1", "train", 104.0, 108.0),
        span(1, "rank0", "sync", 109.0, 110.0),
        {"step": 2, "start": 110.0, "end": 120.0},
        span(2, "rank0", "sync", 110.0, 111.0), span(2, "engine1", "generate", 115.0, 118.0)]


def test_resume_drops_later_steps_and_continues_the_clock(tmp_path):
    path = tmp_path / "timeline.jsonl"
    tl = Timeline(path)
    for step in (1, 2, 3):
        tl.record("engine0", "generate", tl.t0 + 10 * step, tl.t0 + 10 * step + 4.5)
        tl.step_metrics(step, tl.t0 + 10 * step, tl.t0 + 10 * step + 10)
    with open(path, "a") as fh:
        fh.write('{"step": 4, "lane": "eng')          # killed while writing
    assert [r["step"] for r in read_timeline(path)] == [1, 1, 2, 2, 3, 3]
    before = time.monotonic()
    resumed = Timeline(path, resume_step=2)
    after = time.monotonic()
    assert read_timeline(path) == [{"step": 1, "start": 10.0, "end": 20.0},
                                   {"step": 1, "lane": "engine0", "phase": "generate", "start": 10.0, "end": 14.5}]
    # times continue after the last kept line (20 s) instead of restarting at 0
    assert before - 20.0 <= resumed.t0 <= after - 20.0
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"timeline.jsonl: line 2 is not JSON"):
        Timeline(path, resume_step=2)


def test_two_threads_record_concurrently(tmp_path):
    tl = Timeline(tmp_path / "timeline.jsonl")
    base = time.monotonic()
    barrier = threading.Barrier(2)

    def engine():
        barrier.wait()
        for i in range(1000):
            tl.record("engine0", "generate", base + i, base + i + 0.5)

    def ranks():
        barrier.wait()
        for _ in range(1000):
            with tl.span("rank0", "train"):
                pass

    threads = [threading.Thread(target=engine), threading.Thread(target=ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tl._spans) == 2000 and tl._open == {}
    timed = sum(1 for lane, _, s, e in tl._spans if lane == "rank0" and e > s)
    m = tl.step_metrics(1, base, base + 1000)
    assert m["timeline/engine0_busy_s"] == pytest.approx(500.0, abs=1e-6)
    lanes = [r.get("lane") for r in read_timeline(tmp_path / "timeline.jsonl")]
    assert lanes.count("engine0") == 1000 and lanes.count("rank0") == timed > 0 and lanes.count(None) == 1


def test_plot_timeline_draws_one_row_per_lane(tmp_path, capsys):
    assert plot_timeline(tmp_path) is None                      # no timeline: nothing written
    tl = Timeline(tmp_path / "timeline.jsonl")
    record_all(tl, tl.t0)
    tl.step_metrics(1, tl.t0 + 100, tl.t0 + 110)
    tl.step_metrics(2, tl.t0 + 110, tl.t0 + 120)
    png = plot_timeline(tmp_path)
    assert png == tmp_path / "timeline.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = read_timeline(tmp_path / "timeline.jsonl")
    fig = timeline_figure(rows)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["engine0", "engine1", "rank0", "rank1", "driver"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["generate", "logprobs", "pause", "score",
                                                                   "train", "sync"]
    assert [t.get_text() for t in ax.texts] == [" 1", " 2"] and ax.get_xlim() == (100.0, 120.0)
    last = timeline_figure(rows, last_steps=1).axes[0]          # only step 2's lanes and line
    assert [t.get_text() for t in last.get_yticklabels()] == ["engine1", "rank0"]
    assert [t.get_text() for t in last.texts] == [" 2"]
    assert sorted(["rank1", "engine10", "driver", "engine2", "rank0"], key=_lane_order) == \
        ["engine2", "engine10", "rank0", "rank1", "driver"]

    # `megarl plot` writes both figures and names both
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    assert cli_main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"written {tmp_path / 'curves.png'}",
                                                    f"written {tmp_path / 'timeline.png'}"]
