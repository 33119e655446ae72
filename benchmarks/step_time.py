"""The embedded default's step, and where its time goes: today's code paths against the ones
they replaced, in one run.

Trains ``recipes/tiny-moe.yaml`` (its model, prompts, rewards, batch and optimizer) for
``--steps`` steps in a fresh process per variant, through the real loop, and reports the
median step after the first ``--warmup``, split into generation (the embedded engine's
sampling), old log-probs (the pre-update forward), training (the update's forward, backward
and optimizer steps) and the rest (scoring, packing, the weight sync, metrics). Variants, all
with the same seeds and draws:

``packed segment loop, platform mode everywhere``
    what the local path ran before: packed attention one segment at a time, and the CPU
    platform's torch function mode on every torch call (the baseline);
``batched segments, platform mode everywhere``
    one attention call per layer for all the segments of a micro-batch;
``batched segments, platform mode scoped``
    and the function mode out of the forward, backward and decode (today's default).

What cannot be switched off (the changes measured by the first run of this benchmark before
them, docs/benchmarks.md) is said there. The last line:
``step_time: <X> s a step (generation <G>, old log-probs <O>, training <T>), <R>x samples/s of
the packed segment loop`` (today's default against the baseline).

    python benchmarks/step_time.py [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "packed segment loop, platform mode everywhere": ("loop", False),
    "batched segments, platform mode everywhere": ("batched", False),
    "batched segments, platform mode scoped": ("batched", True),
}

# Run in a fresh process per variant: the switches are read when the model first runs.
CHILD = """
import sys
sys.path.insert(0, {root!r})
from megatron_gspo.model.attention import SegmentAttention
from megatron_gspo.parallel import platform
SegmentAttention.packed_impl = {impl!r}
platform.SCOPED = {scoped!r}
from megatron_gspo.config import Recipe
from megatron_gspo.run.loop import train
import yaml
recipe = Recipe.model_validate(yaml.safe_load(open({recipe!r})))
train(recipe, output_dir={out!r}, steps={steps}, resume=False)
"""


def run_variant(name: str, args, work: Path) -> dict:
    impl, scoped = VARIANTS[name]
    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    out = work / name.replace(" ", "_").replace(",", "")
    data["run"].update(
        output_dir=str(out), checkpoint_every=10_000, plot_every=0, tensorboard=False
    )
    recipe = work / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump(data))
    code = CHILD.format(
        root=str(ROOT), impl=impl, scoped=scoped, recipe=str(recipe), out=str(out),
        steps=args.steps,
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    if proc.returncode:
        raise SystemExit(f"{name}: the run failed\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = records[args.warmup :]

    def median(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in kept)

    step = median("step_time_s")
    old, update = median("time_old_logprobs_s"), median("time_update_s")
    rollout = median("time_rollout_s")
    samples = statistics.median(
        data["rollout"]["prompts_per_step"] * data["rollout"]["group_size"] / r["step_time_s"]
        for r in kept
    )
    reward = sum(r["reward_mean"] for r in records[-5:]) / 5
    return {
        "step": step,
        # time_rollout_s is sampling and scoring; scoring the tiny task is ~ms
        "generation": rollout,
        "old": old,
        "training": update,
        "rest": step - rollout - old - update,
        "samples_per_s": samples,
        "reward": reward,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VARIANTS:
            results[name] = r = run_variant(name, args, Path(tmp))
            print(
                f"{name}: {r['step']:.3f} s a step (generation {r['generation']:.3f}, old "
                f"log-probs {r['old']:.3f}, training {r['training']:.3f}, rest {r['rest']:.3f}); "
                f"{r['samples_per_s']:.0f} samples/s; reward of the last 5 steps {r['reward']:.3f}",
                flush=True,
            )
    base = results["packed segment loop, platform mode everywhere"]
    now = results["batched segments, platform mode scoped"]
    ratio = now["samples_per_s"] / base["samples_per_s"]
    print(
        f"step_time: {now['step']:.3f} s a step (generation {now['generation']:.3f}, old "
        f"log-probs {now['old']:.3f}, training {now['training']:.3f}), {ratio:.2f}x samples/s "
        "of the packed segment loop"
    )


if __name__ == "__main__":
    main()
