"""What a reshardable checkpoint costs: save, load and size, fully_reshardable against
dp_reshardable, in one run.

Trains one GSPO step of a Qwen3-style MoE (so Adam's moments exist) at 2 data-parallel ranks
with the distributed optimizer, the layout where the two formats differ (``dp_reshardable``
writes each rank's flat optimizer shard as it is, and resumes on the same DP size only;
``fully_reshardable``, the project's format, writes the optimizer's states per parameter, so a
run resumes on any TP/PP/EP/DP layout). Each save goes through the project's ``Checkpointer``
(the same atomic rename, manifest and SHA-256 as in training) and each load verifies it, so the
figures are what a run pays. Prints per format the medians over the repeats, and last:
``checkpoint: fully_reshardable save <S> s load <L> s <M> MB; ratio to dp_reshardable: save
<a>x, load <b>x, size <c>x``.

    python benchmarks/checkpoint_format.py [--repeats 3] [--layers 4] [--hidden 256] [--dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("dp_reshardable", "fully_reshardable")


def moe_recipe(args, run_dir: Path) -> dict:
    """The tiny recipe with a larger MoE (``args.layers``, ``args.hidden``): its checkpoint
    takes longer to write than a step takes (benchmarks/checkpoint.py uses it too)."""
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    data["model"].update(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        head_dim=args.hidden // 8,
        vocab_size=4096,
        num_experts=8,
        moe_ffn_hidden_size=2 * args.hidden,
    )
    data["run"].update(output_dir=str(run_dir), tensorboard=False, plot_every=0)
    return data


def recipe_data(args, run_dir: Path) -> dict:
    data = moe_recipe(args, run_dir)
    data["model"]["max_seq_length"] = 512
    data["memory"] = {"use_distributed_optimizer": True}
    return data


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    from benchmarks._ranks import join_world

    join_world(rank, world, port)
    import torch.distributed as dist

    from benchmarks.train_step import skewed_samples
    from megatron_gspo.config import Recipe
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.run.checkpoint import Checkpointer
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    base = Path(args.dir)
    recipe = Recipe.model_validate(recipe_data(args, base / "run"))
    policy = Policy(recipe, init_parallel(recipe.parallel))
    GSPOTrainer(policy).step(skewed_samples(16, recipe.model.vocab_size))
    params = sum(p.numel() for p in policy.model.parameters())
    out = {"params_rank0": params}
    for fmt in FORMATS:
        saves, loads = [], []
        for i in range(args.repeats):
            ckpts = Checkpointer(base / fmt, policy, keep=1, optimizer_format=fmt)
            dist.barrier()
            t = time.perf_counter()
            path = ckpts.save(i + 1, {})
            dist.barrier()
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            ckpts.load(i + 1)
            dist.barrier()
            loads.append(time.perf_counter() - t)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out[fmt] = (statistics.median(saves), statistics.median(loads), size / 1e6)
    if rank == 0:
        results.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    if args.dir is None:  # removed at exit; --dir keeps what was written
        args.dir = tempfile.mkdtemp(prefix="ckpt-bench-")
        atexit.register(shutil.rmtree, args.dir, ignore_errors=True)

    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks._ranks import run_ranks

    got = run_ranks(rank_main, 2, args)
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, 8 experts, "
        f"{got['params_rank0'] / 1e6:.1f}M parameters; "
        f"DP2 with the distributed optimizer; writing to {args.dir}"
    )
    print(f"{'format':<20}{'save s':>9}{'load s':>9}{'MB':>9}")
    for fmt in FORMATS:
        save, load, mb = got[fmt]
        print(f"{fmt:<20}{save:>9.3f}{load:>9.3f}{mb:>9.1f}")
    (ds, dl, dm), (fs, fl, fm) = got["dp_reshardable"], got["fully_reshardable"]
    print(
        f"checkpoint: fully_reshardable save {fs:.2f} s load {fl:.2f} s {fm:.0f} MB; "
        f"ratio to dp_reshardable: save {fs / ds:.2f}x, load {fl / dl:.2f}x, size {fm / dm:.2f}x"
    )


if __name__ == "__main__":
    main()
