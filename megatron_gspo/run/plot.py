"""Plots of a run's metrics (``megatron-gspo plot RUN_DIR``): one panel for each kind of figure
the run recorded, and none for the rest.

During training they are drawn by :class:`BackgroundPlots`, in a thread, so that a step never
waits for one (drawing all sixteen panels took 0.5 s, longer than four steps of the tiny
recipe). Figures are built without pyplot's global state, which threads cannot share.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from megatron_gspo.run.metrics import read_metrics


@dataclass(frozen=True)
class Panel:
    title: str
    # Each series the run recorded is drawn ("name*": every recorded series whose name starts
    # with "name", e.g. eval_pass@4).
    series: tuple[str, ...]
    # Counts of things that may never happen in a run (failed scores, stale samples): a panel
    # whose series are all zero says nothing and is left out.
    events: bool = False


PANELS = [
    Panel("reward", ("reward_mean", "eval_reward_mean", "eval_mean@*", "eval_pass@*")),
    Panel("clip fraction", ("clip_fraction",)),
    Panel("approx. KL (k3)", ("approx_kl",)),
    Panel("entropy", ("entropy",)),
    Panel("response length", ("response_length_mean",)),
    Panel("routing", ("routing_flip_rate", "rollout_routing_disagreement")),
    Panel("staleness (versions)", ("staleness_mean", "staleness_max"), events=True),
    Panel("train vs rollout KL (k3)", ("rollout_kl_k3", "rollout_sampler_kl")),
    Panel("importance weight", ("is_weight_mean", "is_masked_fraction", "is_truncated_fraction")),
    Panel(
        "dynamic sampling", ("filtered_groups_fraction", "train_groups_without_signal"), events=True
    ),
    Panel("overlong responses", ("overlong_fraction", "overlong_penalty_mean"), events=True),
    Panel("gradient norm", ("grad_norm",)),
    Panel("episodes", ("turns_mean", "model_token_fraction")),
    Panel("turn rewards", ("turn_reward_mean/*",)),
    Panel(
        "failed scores",
        (
            "reward_errors",
            "reward_timeouts",
            "env_errors",
            "env_timeouts",
            "groups_dropped_on_error",
        ),
        events=True,
    ),
    Panel("tools", ("tool_calls_mean", "tool_errors", "tool_time_s", "episodes_in_flight_max")),
]
MAX_COLUMNS = 4


def panels_with_data(records: list[dict]) -> list[tuple[Panel, dict[str, list]]]:
    """The panels the run has figures for, each with its series' (step, value) points."""
    out = []
    for panel in PANELS:
        lines = {}
        for key in _expand(panel.series, records):
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                lines[key] = points
        if panel.events and not any(v for points in lines.values() for _, v in points):
            continue
        if lines:
            out.append((panel, lines))
    return out


def layout(n: int) -> tuple[int, int]:
    """(rows, columns) for ``n`` panels: four across at most, a square up to four."""
    columns = min(MAX_COLUMNS, n) if n > 4 else min(2, n) if n > 1 else 1
    return -(-n // columns), columns


log = logging.getLogger(__name__)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "plots" / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    panels = panels_with_data(records)
    rows, columns = layout(max(1, len(panels)))
    fig = Figure(figsize=(4.25 * columns, 3.2 * rows + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (panel, lines) in zip(axes.flat, panels, strict=False):
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        for key, points in lines.items():
            marker = "." if len(points) < 50 else None
            ax.plot(*zip(*points, strict=True), marker=marker, label=key)
        if len(lines) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"{Path(run_dir).name}: {len(records)} steps")
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)
    return out


class BackgroundPlots:
    """Draws ``RUN_DIR/plots/training.png`` in a thread whenever asked (a request made while
    one is being drawn is drawn once after it); :meth:`close` draws the last one and waits.
    A failed plot is a warning: it never ends a training run."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._wanted = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="plots", daemon=True)
        self._thread.start()

    def request(self) -> None:
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stop:
                return
            self._draw()

    def _draw(self) -> None:
        try:
            plot_run(self.run_dir)
        except Exception as e:  # noqa: BLE001 - a failed plot must not end a training run
            log.warning("plotting failed: %s", e)

    def close(self, *, final: bool = True) -> None:
        self._stop = True
        self._wanted.set()
        self._thread.join()
        if final:
            self._draw()


def _expand(keys: tuple[str, ...], records: list[dict]) -> list[str]:
    out = []
    for key in keys:
        if key.endswith("*"):
            out += sorted({k for r in records for k in r if k.startswith(key[:-1])})
        else:
            out.append(key)
    return out
