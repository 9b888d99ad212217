"""``megarl plot RUN_DIR``: PNG curves from <run_dir>/metrics.jsonl.

Four panels: reward (mean, and accuracy when logged), response length (mean, max), KL, and
seconds per phase. Missing metrics leave their panel empty with a note, never an error.
"""
from __future__ import annotations

from pathlib import Path

from megarl.observability.metrics import read_jsonl

PANELS = [
    ("reward", ["reward/mean", "reward/accuracy"]),
    ("response length", ["response_length/mean", "response_length/max"]),
    ("KL to reference", ["actor/kl", "kl/mean"]),
    ("seconds per phase", None),   # every time/*_s key
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
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS):
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
