"""The multi-turn part of the reproduction study: GSPO, GSPO-token with turn-level credit and
GRPO on the tiny multi-turn task; writes its section of ``docs/study.md`` and its plot.

``recipes/tiny-multi-turn.yaml`` (the tiny MoE from scratch, 3 turns of ``relay_digits``, the
later digits revealed only by the environment), every method with the same seeds, each run a
``megatron-gspo train`` of its own (two at a time, one thread each, resumable: finished runs
are skipped). Methods: GSPO (one advantage per episode), GSPO-token with
``loss.advantage_level: turn`` (GSPO's sequence ratio and clip, each turn's tokens weighted by
its group-normalised return-to-go) and GRPO with the same turn-level credit (token ratios and
clip 0.2/0.27). The section's verdicts are computed from the runs.

The last line: ``study_multi_turn: <runs> runs, <minutes> min; docs/study.md``.

    python benchmarks/study_multi_turn.py [--steps 150] [--seeds 0 1 2] [--jobs 2]
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

from benchmarks.study import DOCS, _metrics, _pm, _smooth, run_all  # noqa: E402

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
BEGIN, END = "<!-- multi-turn study -->", "<!-- /multi-turn study -->"


def recipe(method: str, seed: int, steps: int) -> dict:
    data = yaml.safe_load((ROOT / "recipes" / "tiny-multi-turn.yaml").read_text())
    data["rollout"]["seed"] = seed
    data["parallel"]["seed"] = 1234 + seed
    for section, values in METHODS[method].items():
        data.setdefault(section, {}).update(values)
    data["run"].update(
        steps=steps,
        output_dir=str(RUNS / method / f"seed{seed}"),
        checkpoint_every=25,
        keep_checkpoints=1,
        plot_every=0,
        tensorboard=False,
    )
    return data


def _final(records: list[dict], key: str) -> float:
    tail = records[-max(1, len(records) // 10) :]
    values = [r[key] for r in tail if r.get(key) is not None]
    return statistics.mean(values) if values else float("nan")


def _first_reaching(records: list[dict], level: float) -> int | None:
    smooth = _smooth([r["reward_mean"] for r in records])
    return next((i + 1 for i, x in enumerate(smooth) if x >= level), None)


def plot(runs: dict[str, list[list[dict]]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward_mean", "reward (sum of 3 turns)"),
        ("turn_reward_mean/turn_3", "turn 3 reward"),
        ("turns_mean", "model turns per episode"),
        ("clip_fraction_tok", "clipped tokens"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(20, 4.2), constrained_layout=True)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for method, seeds in runs.items():
            curves = [_smooth([r.get(key) or 0.0 for r in rec], 5) for rec in seeds if rec]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            x = list(range(1, n + 1))
            (line,) = ax.plot(x, [statistics.mean(c[i] for c in curves) for i in range(n)])
            line.set_label(LABELS[method])
            lo = [min(c[i] for c in curves) for i in range(n)]
            hi = [max(c[i] for c in curves) for i in range(n)]
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("tiny multi-turn task: mean over seeds (line) and range (band), 5-step smoothing")
    out = DOCS / "study_multi_turn.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def section(args) -> list[str]:
    runs = {m: [_metrics(RUNS / m / f"seed{s}") for s in args.seeds] for m in METHODS}
    done = {m: [r for r in seeds if len(r) >= args.steps] for m, seeds in runs.items()}
    png = plot(runs)
    lines = [
        BEGIN,
        "## Multi-turn: turn-level credit",
        "",
        "Written by `python benchmarks/study_multi_turn.py` from the runs under",
        "`runs/study/multi_turn/` (this machine, 2 CPU cores).",
        "",
        "- Task: `recipes/tiny-multi-turn.yaml`: the tiny MoE from scratch copies a 1-3 digit",
        "  string in each of 3 turns; the strings after the first are revealed only by the",
        "  environment's turn (`relay_digits`), each turn rewarded by `digit_match` (reward up",
        "  to 3). A turn cut at 4 tokens goes on to the next observation",
        "  (`end_on_cut_turn: false`).",
        f"- {args.steps} steps, seeds {args.seeds}, the recipe's settings otherwise; methods:",
        "  GSPO (one advantage per episode), GSPO-token with `advantage_level: turn` (each turn",
        "  weighted by its group-normalised return-to-go), GRPO with the same turn credit",
        "  (token-level clip 0.2/0.27).",
        "",
        f"![multi-turn]({png.name})",
        "",
        "| method | final reward, mean (min-max) | turn 3 reward | turns per episode | "
        "first step at reward 1.0 | clipped tokens | clipped sequences |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    final: dict[str, float] = {}
    for m, seeds in done.items():
        if not seeds:
            continue
        rewards = [_final(r, "reward_mean") for r in seeds]
        final[m] = statistics.mean(rewards)
        reach = [_first_reaching(r, 1.0) for r in seeds]
        lines.append(
            f"| {LABELS[m]} | {_pm(rewards)} | "
            f"{statistics.mean(_final(r, 'turn_reward_mean/turn_3') for r in seeds):.3f} | "
            f"{statistics.mean(_final(r, 'turns_mean') for r in seeds):.2f} | "
            f"{', '.join(str(x) if x else 'never' for x in reach)} | "
            f"{statistics.mean(_final(r, 'clip_fraction_tok') for r in seeds):.2e} | "
            f"{statistics.mean(_final(r, 'clip_fraction_seq') for r in seeds):.2e} |"
        )
    lines.append("")
    if "gspo" in final and "gspo_token_turn" in final:
        a, b = final["gspo_token_turn"], final["gspo"]
        ours = [_final(r, "reward_mean") for r in done["gspo_token_turn"]]
        theirs = [_final(r, "reward_mean") for r in done["gspo"]]
        wins = sum(x > y for x, y in zip(ours, theirs, strict=False))
        verdict = (
            "turn-level credit ends higher"
            if a > b + 0.05
            else "turn-level credit ends lower"
            if a < b - 0.05
            else "the two end within 0.05 of each other"
        )
        settled = (
            "the seeds' ranges do not overlap"
            if min(ours) > max(theirs) or max(ours) < min(theirs)
            else "the seeds' ranges overlap, so these few seeds do not settle it"
        )
        clip_a = statistics.mean(_final(r, "clip_fraction_seq") for r in done["gspo_token_turn"])
        clip_b = statistics.mean(_final(r, "clip_fraction_seq") for r in done["gspo"])
        lines += [
            f"Verdict, from these runs: GSPO-token with turn credit {a:.3f} against GSPO "
            f"{b:.3f} (final reward, mean over seeds): {verdict} on the mean, higher on "
            f"{wins} of {min(len(ours), len(theirs))} seeds compared seed by seed; {settled}. "
            f"It clips {clip_a:.3f} of sequences against GSPO's {clip_b:.3f}. The two differ in "
            "what the "
            "first turns are credited with: under GSPO every token of an episode carries the "
            "whole episode's advantage, under turn credit a turn's tokens carry what followed "
            "it only, measured against the same turn of the group's other episodes.",
            "",
        ]
    lines.append(END)
    return lines


def report(args) -> Path:
    out = DOCS / "study.md"
    text = out.read_text() if out.is_file() else ""
    new = "\n".join(section(args))
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + new + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + new + "\n"
    out.write_text(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    runs = [recipe(m, s, args.steps) for m in METHODS for s in args.seeds]
    start = time.time()
    if not args.report_only:
        run_all(runs, args.jobs)
    out = report(args)
    minutes = (time.time() - start) / 60
    print(f"study_multi_turn: {len(runs)} runs, {minutes:.0f} min; {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
