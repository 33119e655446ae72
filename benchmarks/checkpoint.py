"""How long a checkpoint stops training: synchronous against asynchronous saves, in one run.

One rank trains a Qwen3-style MoE whose checkpoint (weights and Adam's moments) takes longer to
write than a training step takes (``--hidden``, ``--layers``; the step a small batch), and
checkpoints every ``--every`` steps through the project's ``Checkpointer``, as the loop does:
first with synchronous saves (the step loop waits for the write, the hashing, the manifest
and the rename), then with ``run.async_save`` (Megatron-Core's asynchronous save: the loop
waits only to hand the state over, and to publish a save whose writer has finished, at the
next step). Per mode: the loop's time blocked per checkpoint, as the run's metric
``checkpoint_blocked_s`` counts it (the steps' waits; the exit's wait for the last save is
printed on its own), the whole save from its start to ``latest`` naming it, and what hashing
the files costs per GB (read from the page cache, right after the write, as the writer does).
Temporary checkpoints are removed at the end unless ``--dir`` names where to keep them.

The last line: ``async_save: training blocked <X> s per checkpoint synchronous, <Y> s
asynchronous, ratio <X/Y>``.

    python benchmarks/checkpoint.py [--steps 24] [--every 3] [--layers 4] [--hidden 384]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_data(args, run_dir: Path) -> dict:
    from benchmarks.checkpoint_format import moe_recipe

    data = moe_recipe(args, run_dir)
    data["model"]["max_seq_length"] = 128
    return data


def run_mode(policy, trainer, batch, base: Path, async_save: bool, args) -> dict:
    from megatron_gspo.run.checkpoint import Checkpointer

    ckpts = Checkpointer(base / ("async" if async_save else "sync"), policy, keep=2,
                         async_save=async_save)  # fmt: skip
    blocked, waited, spans, started, step_s = 0.0, 0.0, [], {}, []
    saves = 0
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        ckpts.poll()  # publishing a finished save is blocked time too
        trainer.step(batch)
        step_s.append(time.perf_counter() - t)
        if step % args.every == 0:
            t = time.perf_counter()
            ckpts.wait()  # the save before, still being written
            waited += time.perf_counter() - t
            started[step] = time.perf_counter()
            ckpts.save(step, {})
            saves += 1
        blocked += ckpts.take_blocked_s()
        latest = ckpts.latest_step()
        if latest in started:  # published: the save is done
            spans.append(time.perf_counter() - started.pop(latest))
    # The end of the run waits for the last save: after the last step, so it blocks no
    # training; it delays the exit, and is printed on its own.
    t = time.perf_counter()
    ckpts.wait()
    end = time.perf_counter() - t + ckpts.take_blocked_s()
    latest = ckpts.latest_step()
    if latest in started:
        spans.append(time.perf_counter() - started.pop(latest))
    return {
        "blocked": (blocked + waited) / saves,
        "waited": waited / saves,
        "end": end,
        "span": statistics.median(spans),
        "step": statistics.median(step_s),
        "path": ckpts.dir / f"iter_{latest:07d}",
    }


def hash_rate(path: Path) -> tuple[float, float]:
    """Seconds per GB to hash a checkpoint's files from the page cache, and its GB."""
    from megatron_gspo.weights.manifest import sha256_of

    files = [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files) / 1e9
    for p in files:  # into the page cache, as right after a write
        p.read_bytes()
    t = time.perf_counter()
    for p in files:
        sha256_of(p)
    return (time.perf_counter() - t) / size, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where to write and keep (default: a temp dir)")
    args = ap.parse_args()

    base = Path(args.dir or tempfile.mkdtemp(prefix="async-save-"))
    try:
        measure(args, base)
    finally:
        if args.dir is None:  # 1.5 GB of checkpoints a run
            shutil.rmtree(base, ignore_errors=True)


def measure(args, base: Path) -> None:
    from benchmarks.train_step import skewed_samples
    from megatron_gspo.config import Recipe
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    recipe = Recipe.model_validate(recipe_data(args, base / "run"))
    policy = Policy(recipe, init_parallel(recipe.parallel))
    trainer = GSPOTrainer(policy)
    batch = [s for s in skewed_samples(args.samples, recipe.model.vocab_size)]
    for s in batch:  # short responses: a step well under a save
        s.response_ids = s.response_ids[:16]
    params = sum(p.numel() for p in policy.model.parameters())
    results = {m: run_mode(policy, trainer, batch, base, m, args) for m in (False, True)}
    per_gb, size = hash_rate(results[True]["path"])
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, 8 experts, {params / 1e6:.1f}M "
        f"parameters; checkpoint {size:.2f} GB; a checkpoint every {args.every} steps; "
        f"writing to {base}"
    )
    for mode, r in (("synchronous", results[False]), ("asynchronous", results[True])):
        print(
            f"{mode}: training blocked {r['blocked']:.2f} s per checkpoint over {args.steps} "
            f"steps (of which {r['waited']:.2f} waiting for the save before); the exit waited "
            f"{r['end']:.2f} s for the last save; a save takes {r['span']:.2f} s until it is "
            f"latest; a step {r['step']:.2f} s"
        )
    print(f"hashing: {per_gb:.2f} s per GB (page cache, one core)")
    x, y = results[False]["blocked"], results[True]["blocked"]
    print(
        f"async_save: training blocked {x:.2f} s per checkpoint synchronous, {y:.2f} s "
        f"asynchronous, ratio {x / y:.2f}"
    )


if __name__ == "__main__":
    main()
