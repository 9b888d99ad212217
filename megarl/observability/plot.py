"""``megarl plot RUN_DIR``: PNG curves from <run_dir>/metrics.jsonl, and a Gantt chart from
<run_dir>/timeline.jsonl when the run wrote one.

Curves (``curves.png``, :func:`plot_run`): four panels: reward (mean, and accuracy when logged),
response length (mean, max), KL, and seconds per phase; for megarl sft / rm runs: train and
held-out loss, pair accuracy and margin (rm), grad norm, and seconds per phase. Missing metrics leave their panel empty
with a note, never an error.

Timeline (``timeline.png``, :func:`plot_timeline`): one row per lane (rollout engines on top, then
training ranks, then any other lane such as the driver), one bar per span coloured by phase, a thin
vertical line at each step's start labelled with the step. Only the last ``last_steps`` steps (20
by default) are drawn: a long run's spans would be thinner than a pixel, and the overlap pattern
of a steady state repeats every step.
"""
from __future__ import annotations

import re
from pathlib import Path

from megarl.observability.jsonl import read_jsonl
from megarl.observability.timeline import ENGINE_PREFIX, RANK_PREFIX, read_timeline

PANELS = [
    ("reward", ["reward/mean", "reward/accuracy", "reward_model/score_mean", "reward/gsm8k_lenient_mean"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("KL to reference", ["actor/kl", "kl/mean"]),
    ("agent tool use", ["agent/tool_call_rate", "agent/turns_mean", "agent/malformed_calls_per_traj"]),
    ("seconds per phase", None),   # every time/*_s key
]
POSTTRAIN_PANELS = [   # megarl sft / rm runs (no reward/mean)
    ("loss", ["train/loss", "eval/loss"]),
    ("reward model pairs", ["train/accuracy", "eval/accuracy", "eval/margin_mean"]),
    ("optimizer", ["train/grad_norm"]),
    ("seconds per phase", None),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.exists():
        raise FileNotFoundError(f"{metrics_file} not found: is {run_dir} a megarl run folder?")
    rows = read_jsonl(metrics_file)
    if not rows:
        raise ValueError(f"{metrics_file} holds no steps yet")
    # the agent panel only for runs that logged it (a 2 x 2 grid otherwise)
    panels = [(t, k) for t, k in PANELS if t != "agent tool use" or any(x in r for r in rows for x in k)]
    if not any("reward/mean" in r for r in rows) and any("train/loss" in r for r in rows):
        panels = POSTTRAIN_PANELS
    fig, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(11, 3.5 * ((len(panels) + 1) // 2)))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax, (title, keys) in zip(axes.flat, panels):
        keys = keys or sorted({k for r in rows for k in r if k.startswith("time/")})
        drawn = False
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=key)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


PHASE_COLOURS = {"generate": "tab:blue", "score": "tab:olive", "logprobs": "tab:cyan",
                 "critic": "tab:purple", "train": "tab:orange", "sync": "tab:red",
                 "eval": "tab:green", "pause": "tab:gray"}
"""The controller's phases; any other phase takes a colour from ``OTHER_COLOURS`` in order."""
OTHER_COLOURS = ["tab:brown", "tab:pink", "gold", "navy", "lime", "teal", "maroon", "black"]


def _lane_order(lane: str) -> tuple:
    """engine0, engine1, ..., engine10 (numerically), then rank*, then the others by name."""
    group = 0 if lane.startswith(ENGINE_PREFIX) else 1 if lane.startswith(RANK_PREFIX) else 2
    number = re.search(r"(\d+)$", lane)
    return group, lane[:number.start()] if number else lane, int(number.group(1)) if number else -1


def timeline_figure(rows: list[dict], last_steps: int = 20):
    """The Gantt chart of timeline-file lines (:func:`megarl.observability.timeline.read_timeline`)
    as a matplotlib Figure, the last ``last_steps`` steps only. Lane names are the y tick labels,
    the first lane on top."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if last_steps < 1:
        raise ValueError(f"last_steps must be >= 1, got {last_steps}")
    steps = sorted({r["step"] for r in rows})[-last_steps:]
    kept = [r for r in rows if r["step"] >= steps[0]] if steps else []
    windows = [r for r in kept if "lane" not in r]
    spans = [r for r in kept if "lane" in r]
    lanes = sorted({r["lane"] for r in spans}, key=_lane_order)
    phases = list(dict.fromkeys(r["phase"] for r in spans))
    others = iter(OTHER_COLOURS * (len(phases) // len(OTHER_COLOURS) + 1))
    colours = {phase: PHASE_COLOURS.get(phase) or next(others) for phase in phases}

    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.4 * len(lanes)))
    for y, lane in enumerate(lanes):
        for phase in phases:
            bars = [(r["start"], r["end"] - r["start"]) for r in spans if r["lane"] == lane and r["phase"] == phase]
            if bars:
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours[phase], edgecolor="none")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)   # first lane on top
    for window in windows:
        ax.axvline(window["start"], color="black", lw=0.5, alpha=0.6)
        ax.text(window["start"], 1.0, f" {window['step']}", transform=ax.get_xaxis_transform(),
                ha="left", va="bottom", fontsize=7)
    if windows:
        ax.set_xlim(min(w["start"] for w in windows), max(w["end"] for w in windows))
    ax.set_xlabel("seconds since the run started")
    ax.legend(handles=[Patch(color=colours[p], label=p) for p in phases], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=8, title="phase")
    shown = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
    ax.set_title(f"timeline, {shown} (step starts marked)", pad=14)
    fig.tight_layout()
    return fig


def plot_timeline(run_dir: str | Path, out: str | Path | None = None, last_steps: int = 20) -> Path | None:
    """Writes ``out`` (default <run_dir>/timeline.png) from <run_dir>/timeline.jsonl; None, and no
    file, when the run has no timeline or it holds no step yet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    timeline_file = run_dir / "timeline.jsonl"
    if not timeline_file.exists():
        return None
    rows = read_timeline(timeline_file)
    if not rows:
        return None
    fig = timeline_figure(rows, last_steps)
    out = Path(out) if out else run_dir / "timeline.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
