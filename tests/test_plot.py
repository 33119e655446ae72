"""``megatron-gspo plot`` draws the panels a run has figures for, and no empty ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_gspo.run.plot import PANELS, layout, panels_with_data, plot_run

pytestmark = pytest.mark.timeout(120)

# A single-turn run of the tiny recipe, one step off-policy (tests/fixtures/README.md).
RUN = Path(__file__).parent / "fixtures" / "pre-layers-run"


def _sync_records() -> list[dict]:
    """The run's figures over 6 steps, as a synchronous run records them: the same keys,
    staleness 0 throughout (its samples come from the policy that trains on them)."""
    lines = (RUN / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    records = []
    for step in range(1, 7):
        record = {k: v * (1 + 0.1 * step) for k, v in first.items()}
        record.update(step=step, staleness_mean=0.0, staleness_max=0.0)
        records.append(record)
    return records


def test_a_single_turn_synchronous_run_shows_no_empty_or_flat_zero_panel():
    records = _sync_records()
    assert all(r["reward_errors"] == 0 and r["groups_dropped_on_error"] == 0 for r in records)
    titles = [panel.title for panel, _ in panels_with_data(records)]
    for absent in ("importance weight", "episodes", "turn rewards", "tools"):
        assert absent not in titles, f"{absent!r} drawn without a figure: {titles}"
    for flat in ("staleness (versions)", "failed scores"):
        assert flat not in titles, f"{flat!r} drawn for a run where it is always 0: {titles}"
    for kept in ("reward", "clip fraction", "entropy", "gradient norm"):
        assert kept in titles, titles


def test_a_panel_of_events_is_drawn_once_one_happens():
    records = _sync_records()
    records[3]["reward_errors"] = 2
    lines = dict((p.title, lines) for p, lines in panels_with_data(records))
    assert "failed scores" in lines
    assert lines["failed scores"]["reward_errors"][3] == (records[3]["step"], 2)


def test_every_panel_is_drawn_for_a_run_that_records_everything(tmp_path):
    records = []
    for step in range(1, 6):
        record = {"step": step}
        for panel in PANELS:
            for key in panel.series:
                record[key.replace("*", "1")] = float(step)
        records.append(record)
    assert [p.title for p, _ in panels_with_data(records)] == [p.title for p in PANELS]
    run = tmp_path / "all"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot_run(run)
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    "n, rows, columns", [(1, 1, 1), (2, 1, 2), (4, 2, 2), (9, 3, 4), (16, 4, 4)]
)
def test_the_grid_stays_readable_from_a_few_panels_to_all(n, rows, columns):
    assert layout(n) == (rows, columns)


def test_plot_writes_the_png_of_a_recorded_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    out = plot_run(run)
    assert out == run / "plots" / "training.png" and out.stat().st_size > 10_000
