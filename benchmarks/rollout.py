"""Embedded-engine throughput with and without Megatron's KV cache.

Generates 256 new tokens for a batch of prompts with the tiny recipe's model, once with the
static KV cache and once recomputing the whole sequence at every step, and prints tokens per
second of each and their ratio. Sampling is seeded, so both produce the same tokens.

    python benchmarks/rollout.py [--prompts 16] [--new-tokens 256]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()

    from megatron_gspo.config import Recipe
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout import RolloutRequest, SamplingParams
    from megatron_gspo.rollout.local import LocalEngine

    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    data["model"]["max_seq_length"] = args.new_tokens + 64
    recipe = Recipe.model_validate(data)
    init_parallel(recipe.parallel)
    model = build_model(recipe.model, recipe.parallel)
    prompts = [[1] + [3 + (i * 7 + j) % 10 for j in range(4 + i % 5)] for i in range(args.prompts)]
    # No stop token: every sequence runs the full length.
    params = SamplingParams(group_size=1, max_new_tokens=args.new_tokens, seed=0)
    request = RolloutRequest(prompts, params)
    outputs = {}
    for use_cache in (True, False):
        engine = LocalEngine(model, use_cache=use_cache)
        t = time.perf_counter()
        result = engine.generate(request)
        elapsed = time.perf_counter() - t
        outputs[use_cache] = (elapsed, result)
        name = "cache" if use_cache else "no cache"
        print(
            f"{name:>8}: {result.num_tokens} tokens in {elapsed:.2f} s = "
            f"{result.num_tokens / elapsed:,.0f} tokens/s"
        )
    (tc, rc), (tn, rn) = outputs[True], outputs[False]
    same = [c.token_ids for g in rc.completions for c in g] == [
        c.token_ids for g in rn.completions for c in g
    ]
    print(f"cache/no-cache throughput ratio: {tn / tc:.2f}x (same tokens: {same})")


if __name__ == "__main__":
    main()
