"""The multi-turn part of the reproduction study: what turn-level credit buys, on two tiny
multi-turn tasks, every method with the same seeds, compared with GSPO seed by seed; writes its
section of ``docs/study.md`` and one plot per task.

Tasks: ``relay_digits`` (``recipes/tiny-multi-turn.yaml``: copy a digit string in each of 3
turns, the later strings revealed only by the environment) and ``recall_key``
(``recipes/tiny-recall-key.yaml``: turn 1 names one of two keys, rewarded only in turn 3, which
asks for the value of the key the cue chose). Methods: GSPO (one advantage per episode),
GSPO-token with ``loss.advantage_level: turn`` (GSPO's sequence ratio and clip, each turn's
tokens weighted by its group-normalised return-to-go) and GRPO with the same turn credit
(token ratios, clip 0.2/0.27). Each run is a ``megatron-gspo train`` of its own, two at a time
with one thread each, seed by seed (so a study stopped early holds whole seeds), resumable:
finished runs are skipped.

Each task runs its own number of steps (relay_digits 150, recall_key 200; ``--steps`` sets
all). Per run: the final reward (mean of the last tenth of the steps), the area under the reward
curve (mean reward over all steps) and the first step whose 10-step mean reaches the task's
threshold, a quarter of
its highest reward (never: steps + 1). Per method against GSPO: the per-seed differences, their mean
with a bootstrap 95% interval and a sign test (:mod:`benchmarks.paired`).

The last line: ``study_multi_turn: <runs> runs, <minutes> min; docs/study.md``.

    python benchmarks/study_multi_turn.py [--steps N] [--seeds 0 ... 9] [--tasks ...]
    python benchmarks/study_multi_turn.py --report-only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.paired import Paired, bootstrap_interval, paired  # noqa: E402
from benchmarks.study import DOCS, _metrics, _smooth, run_all  # noqa: E402

RUNS = ROOT / "runs" / "study" / "multi_turn"
METHODS = {
    "gspo": {"loss": {"name": "gspo", "advantage_level": "sequence"}},
    "gspo_token_turn": {"loss": {"name": "gspo_token", "advantage_level": "turn"}},
    "grpo_turn": {
        "loss": {"name": "grpo", "advantage_level": "turn", "eps_low": 0.2, "eps_high": 0.27}
    },
}
LABELS = {
    "gspo": "GSPO (sequence credit)",
    "gspo_token_turn": "GSPO-token, turn credit",
    "grpo_turn": "GRPO, turn credit",
}
TASKS = {
    "relay_digits": {
        "recipe": "tiny-multi-turn.yaml",
        "plot": "study_multi_turn.png",
        "steps": 150,
        "top": 3.0,
        "what": (
            "copy a 1-3 digit string in each of 3 turns; the strings after the first are "
            "revealed only by the environment's turn, each turn rewarded by `digit_match` "
            "(reward up to 3)"
        ),
    },
    "recall_key": {
        "recipe": "tiny-recall-key.yaml",
        "plot": "study_recall_key.png",
        # Its reward still climbs at 150 steps; by 200 every method's has flattened.
        "steps": 200,
        "top": 2.0,
        "what": (
            "two keys hold a digit each; turn 1 names one (reward 0), turn 2 copies the value "
            "shown for the named key, turn 3 must give the value of the key the cue asked for, "
            "which only an episode that named it has seen (`digit_match` in turns 2 and 3: "
            "reward up to 2)"
        ),
    },
}
FIGURES = {
    "final": ("final reward", True),
    "area": ("area under the reward curve", True),
    "reach": ("first step at the threshold", False),
}


def threshold(task: str) -> float:
    """The reward a run must reach: a quarter of the task's highest."""
    return TASKS[task]["top"] / 4


BEGIN, END = "<!-- multi-turn study -->", "<!-- /multi-turn study -->"


def recipe(task: str, method: str, seed: int, steps: int) -> dict:
    data = yaml.safe_load((ROOT / "recipes" / TASKS[task]["recipe"]).read_text())
    data["rollout"]["seed"] = seed
    data["parallel"]["seed"] = 1234 + seed
    for section, values in METHODS[method].items():
        data.setdefault(section, {}).update(values)
    data["run"].update(
        steps=steps,
        output_dir=str(RUNS / task / method / f"seed{seed}"),
        checkpoint_every=25,
        keep_checkpoints=1,
        plot_every=0,
        tensorboard=False,
    )
    return data


def figures(records: list[dict], steps: int, level: float) -> dict[str, float]:
    """One run's figures over its first ``steps`` steps."""
    rewards = [r["reward_mean"] for r in records[:steps]]
    tail = rewards[-max(1, steps // 10) :]
    reach = next((i + 1 for i, x in enumerate(_smooth(rewards)) if x >= level), steps + 1)
    return {"final": statistics.fmean(tail), "area": statistics.fmean(rewards), "reach": reach}


def _band(curves: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per step: the mean over seeds and its bootstrap 95% interval."""
    n = min(len(c) for c in curves)
    mean, lo, hi = [], [], []
    for i in range(n):
        column = [c[i] for c in curves]
        mean.append(statistics.fmean(column))
        a, b = bootstrap_interval(column, resamples=1000)
        lo.append(a)
        hi.append(b)
    return mean, lo, hi


def plot(task: str, runs: dict[str, list[list[dict]]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward_mean", "reward (episode)"),
        ("turn_reward_mean/turn_2", "turn 2 reward"),
        ("turn_reward_mean/turn_3", "turn 3 reward"),
        ("clip_fraction_tok", "clipped tokens"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 4.2), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for method, seeds in runs.items():
            curves = [_smooth([r.get(key) or 0.0 for r in rec], 5) for rec in seeds if rec]
            if not curves:
                continue
            mean, lo, hi = _band(curves)
            x = list(range(1, len(mean) + 1))
            (line,) = ax.plot(x, mean)
            line.set_label(f"{LABELS[method]} ({len(curves)} seeds)")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(
        f"{task}: mean over seeds (line) and its bootstrap 95% interval (band), 5-step smoothing"
    )
    out = DOCS / TASKS[task]["plot"]
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _interval(p: Paired, fmt: str) -> str:
    return f"{p.mean:{fmt}} [{p.low:{fmt}}, {p.high:{fmt}}]"


def task_steps(task: str, args) -> int:
    return args.steps or TASKS[task]["steps"]


def task_section(task: str, args) -> tuple[list[str], dict[str, dict[str, Paired]]]:
    spec, steps = TASKS[task], task_steps(task, args)
    runs = {m: [_metrics(RUNS / task / m / f"seed{s}") for s in args.seeds] for m in METHODS}
    # Only seeds every method finished are compared: the pairs must share their seed.
    seeds = [s for i, s in enumerate(args.seeds) if all(len(runs[m][i]) >= steps for m in METHODS)]
    done = {m: [runs[m][args.seeds.index(s)] for s in seeds] for m in METHODS}
    png = plot(task, done)
    lines = [
        f"### {task}",
        "",
        f"`recipes/{spec['recipe']}`: the tiny MoE from scratch; {spec['what']}. {steps} "
        f"steps; seeds {seeds} finished for every method ({len(seeds)} pairs); threshold "
        f"{threshold(task):g}.",
        "",
        f"![{task}]({png.name})",
        "",
    ]
    if not seeds:
        return [*lines, "No seed has finished for every method yet."], {}
    figs = {m: [figures(r, steps, threshold(task)) for r in done[m]] for m in METHODS}
    lines += [
        "| method | final reward | area | first step at threshold (never = "
        f"{steps + 1}) | turn 3 reward |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in METHODS:
        col = {k: [f[k] for f in figs[m]] for k in FIGURES}
        turn3 = [
            statistics.fmean(r.get("turn_reward_mean/turn_3") or 0.0 for r in rec[-10:])
            for rec in done[m]
        ]
        lines.append(
            f"| {LABELS[m]} | {statistics.fmean(col['final']):.3f} | "
            f"{statistics.fmean(col['area']):.3f} | {statistics.fmean(col['reach']):.1f} | "
            f"{statistics.fmean(turn3):.3f} |"
        )
    lines += [
        "",
        "Paired against GSPO (method minus GSPO, seed by seed): mean difference [bootstrap 95% "
        "interval], seeds ahead-behind, two-sided sign test p.",
        "",
        "| method | figure | difference | ahead-behind | sign p | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    comparisons: dict[str, dict[str, Paired]] = {}
    for m in METHODS:
        if m == "gspo":
            continue
        comparisons[m] = {}
        for k, (name, higher) in FIGURES.items():
            p = paired([f[k] for f in figs[m]], [f[k] for f in figs["gspo"]])
            comparisons[m][k] = p
            ahead, behind = (p.wins, p.losses) if higher else (p.losses, p.wins)
            fmt = ".1f" if k == "reach" else ".3f"
            lines.append(
                f"| {LABELS[m]} | {name} | {_interval(p, fmt)} | {ahead}-{behind} | "
                f"{p.p_sign:.3f} | {p.verdict(higher)} |"
            )
    return lines, comparisons


def _marks(task: str) -> tuple[str, str]:
    return f"<!-- multi-turn study: {task} -->", f"<!-- /multi-turn study: {task} -->"


def _blocks(text: str) -> dict[str, str]:
    """The task sections already in ``text``, each between its own marks."""
    blocks = {}
    for task in TASKS:
        begin, end = _marks(task)
        if begin in text and end in text:
            blocks[task] = text[text.index(begin) : text.index(end) + len(end)]
    return blocks


def section(args, kept: dict[str, str]) -> list[str]:
    """The whole section: ``args.tasks`` from their runs, the other tasks as ``kept`` them
    (a study of one task leaves the other's figures as they were)."""
    lines = [
        BEGIN,
        "## Multi-turn: what turn-level credit buys",
        "",
        "Written by `python benchmarks/study_multi_turn.py` from the runs under",
        "`runs/study/multi_turn/` (this machine, 2 CPU cores). Methods: GSPO (one advantage",
        "per episode), GSPO-token with `advantage_level: turn` (each turn weighted by its",
        "group-normalised return-to-go), GRPO with the same turn credit (token-level clip",
        "0.2/0.27); every method with the same seeds, compared with GSPO seed by seed. A",
        "difference is shown only where its 95% interval leaves 0 out; the sign test asks the",
        "same of the seeds' directions alone.",
        "",
    ]
    for task in TASKS:
        if task in args.tasks:
            body, _ = task_section(task, args)
            begin, end = _marks(task)
            lines += [begin, *body, end, ""]
        elif task in kept:
            lines += [kept[task], ""]
    lines.append(END)
    return lines


def report(args) -> Path:
    out = DOCS / "study.md"
    text = out.read_text() if out.is_file() else ""
    new = "\n".join(section(args, _blocks(text)))
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + new + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    out.write_text(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="every task's steps (default: its own)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    # Seed by seed: a study stopped early holds whole seeds of every task and method.
    runs = [
        recipe(task, method, seed, task_steps(task, args))
        for seed in args.seeds
        for task in args.tasks
        for method in METHODS
    ]
    start = time.time()
    if not args.report_only:
        run_all(runs, args.jobs)
    out = report(args)
    minutes = (time.time() - start) / 60
    print(f"study_multi_turn: {len(runs)} runs, {minutes:.0f} min; {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
