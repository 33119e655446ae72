"""Training-step throughput: packed vs padded micro-batches on skewed response lengths.

Runs the tiny recipe's model on one rank, on a batch whose response lengths are lognormal (a
few long responses among many short ones, as RL rollouts are), and prints tokens per second of
a full GSPO step (old log-prob pass + update) for both layouts, their ratio, and the loss
difference (the two layouts must give the same result).

    python benchmarks/train_step.py [--samples 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def skewed_samples(n: int, vocab: int, seed: int = 0):
    from megatron_gspo.trainer.packing import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
        length = min(400, max(4, int(rng.lognormvariate(3.6, 0.9))))
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=[rng.randrange(3, vocab) for _ in range(length)],
                advantage=rng.gauss(0.0, 1.0),
                prompt_index=i // 8,
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()

    from megatron_gspo.config import Recipe
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict

    base = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    base["model"]["max_seq_length"] = 512
    base["train"].update(
        mini_batches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        micro_batch_size=args.micro_batch_size,
    )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    samples = skewed_samples(args.samples, base["model"]["vocab_size"])
    real_tokens = sum(s.num_tokens for s in samples)
    lengths = sorted(len(s.response_ids) for s in samples)
    print(
        f"{len(samples)} samples, response lengths median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}; {real_tokens} real tokens per step"
    )
    groups = init_parallel(Recipe.model_validate(base).parallel)
    weights = None
    results = {}
    for packing in (False, True):
        data = {**base, "train": {**base["train"], "packing": packing}}
        policy = Policy(Recipe.model_validate(data), groups)
        if weights is None:
            weights = gather_full_state_dict(policy.model)
        policy.load_full_state_dict(weights)
        trainer = GSPOTrainer(policy)
        trainer.step(samples)  # warm-up (and the first update)
        policy.load_full_state_dict(weights)
        times, losses = [], []
        for _ in range(args.repeats):
            policy.load_full_state_dict(weights)
            t = time.perf_counter()
            m = trainer.step(samples)
            times.append(time.perf_counter() - t)
            losses.append(m["loss"])
        name = "packed" if packing else "padded"
        results[name] = (statistics.median(times), losses[0])
        print(
            f"{name:>7}: step {results[name][0]:.3f} s (median of {args.repeats}), "
            f"{real_tokens / results[name][0]:,.0f} tokens/s, loss {losses[0]:.6f}"
        )
    (tp, lp), (tk, lk) = results["padded"], results["packed"]
    print(f"packed/padded throughput ratio: {tp / tk:.2f}x")
    print(f"|loss packed - loss padded|: {abs(lk - lp):.2e}")


if __name__ == "__main__":
    main()
