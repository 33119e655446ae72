"""Plots of a run's metrics (``megatron-gspo plot RUN_DIR``)."""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.run.metrics import read_metrics

# (title, series): a panel plots each series that the run recorded ("name*": every recorded
# series whose name starts with "name", e.g. eval_pass@4).
PANELS = [
    ("reward", ["reward_mean", "eval_reward_mean", "eval_mean@*", "eval_pass@*"]),
    ("clip fraction", ["clip_fraction"]),
    ("approx. KL (k3)", ["approx_kl"]),
    ("entropy", ["entropy"]),
    ("response length", ["response_length_mean"]),
    ("routing", ["routing_flip_rate", "rollout_routing_disagreement"]),
    ("staleness (versions)", ["staleness_mean", "staleness_max"]),
    ("train vs rollout KL (k3)", ["rollout_kl_k3", "rollout_sampler_kl"]),
    ("importance weight", ["is_weight_mean", "is_masked_fraction", "is_truncated_fraction"]),
    ("dynamic sampling", ["filtered_groups_fraction", "train_groups_without_signal"]),
    ("overlong responses", ["overlong_fraction", "overlong_penalty_mean"]),
    ("gradient norm", ["grad_norm"]),
    ("episodes", ["turns_mean", "model_token_fraction"]),
    ("turn rewards", ["turn_reward_mean/*"]),
    ("failed scores", [
        "reward_errors", "reward_timeouts", "env_errors", "env_timeouts",
        "groups_dropped_on_error",
    ]),
    ("tools", ["tool_calls_mean", "tool_errors", "tool_time_s", "episodes_in_flight_max"]),
]  # fmt: skip
COLUMNS = 4


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "plots" / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = -(-len(PANELS) // COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(17, 3.2 * rows), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        drawn = 0
        for key in _expand(keys, records):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                marker = "." if len(points) < 50 else None
                ax.plot(*zip(*points, strict=True), marker=marker, label=key)
                drawn += 1
        if drawn > 1:
            ax.legend(fontsize="small")
        elif not drawn:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{Path(run_dir).name}: {len(records)} steps")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(out)
    return out


def _expand(keys: list[str], records: list[dict]) -> list[str]:
    out = []
    for key in keys:
        if key.endswith("*"):
            out += sorted({k for r in records for k in r if k.startswith(key[:-1])})
        else:
            out.append(key)
    return out
