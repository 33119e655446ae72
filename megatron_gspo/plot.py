"""Plots of a run's metrics (``megatron-gspo plot RUN_DIR``)."""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.metrics import read_metrics

PANELS = [
    ("reward_mean", "reward (mean)"),
    ("clip_fraction", "clip fraction"),
    ("approx_kl", "approx. KL (k3)"),
    ("entropy", "entropy"),
    ("response_length_mean", "response length"),
    ("routing_flip_rate", "routing flip rate"),
]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "plots" / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if points:
            ax.plot(*zip(*points, strict=True), marker="." if len(points) < 50 else None)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{Path(run_dir).name}: {len(records)} steps")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out
