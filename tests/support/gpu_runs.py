"""One computation of the GPU tier in a fresh process, on CUDA or (``--cpu``) with CUDA hidden,
so that a test can compare the two on one machine.

    python -m tests.support.gpu_runs WHAT OUT.pt [--cpu] [--weights IN.pt]

``--cpu`` hides every GPU before torch is imported: the CPU platform layer then runs the same
code the CPU tests run. ``--weights`` starts from the full weights another run saved (models
initialized on two devices differ). The result is a dict saved with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
import sys


def _recipe(**sections):
    from tests.support.rl_fixtures import tiny_recipe

    # Adam with an epsilon far above every gradient: the first update is lr/eps x gradient,
    # so equal updates mean equal gradients.
    return tiny_recipe(
        optimizer={"lr": 5e3, "adam_eps": 1e4, "clip_grad": 0.0},
        train={"mini_batches": 1},
        **sections,
    )


def step(weights):
    """One GSPO step of the tiny MoE on a fixed batch: metrics, weights before and after."""
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict
    from tests.support.rl_fixtures import rollout_batch

    recipe = _recipe()
    policy = Policy(recipe, init_parallel(recipe.parallel))
    if weights is not None:
        policy.load_full_state_dict(weights)
    before = gather_full_state_dict(policy.model)
    metrics = GSPOTrainer(policy).step(rollout_batch(seed=3))
    after = gather_full_state_dict(policy.model)
    device = str(next(policy.model.parameters()).device)
    return {"metrics": metrics, "before": before, "after": after, "device": device}


def decode(weights):
    """Greedy decoding of the embedded engine (fp32): the tokens and their log-probs."""
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout import RolloutRequest, SamplingParams
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.weights import gather_full_state_dict, load_full_state_dict
    from tests.support.tiny import TINY_MOE

    recipe = _recipe()
    init_parallel(recipe.parallel)
    model = build_model(TINY_MOE, recipe.parallel)
    if weights is not None:
        load_full_state_dict(model, weights)
    params = SamplingParams(group_size=1, temperature=0.0, max_new_tokens=12, seed=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    result = LocalEngine(model).generate(RolloutRequest(prompts, params))
    return {
        "tokens": [g[0].token_ids for g in result.completions],
        "logprobs": [g[0].logprobs for g in result.completions],
        "weights": gather_full_state_dict(model),
        "device": str(next(model.parameters()).device),
    }


WHAT = {"step": step, "decode": decode}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=sorted(WHAT))
    parser.add_argument("out")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--weights")
    args = parser.parse_args()
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    weights = torch.load(args.weights) if args.weights else None
    result = WHAT[args.what](weights)
    torch.save(_to_cpu(result), args.out)
    return 0


def _to_cpu(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_to_cpu(v) for v in x)
    return x


if __name__ == "__main__":
    sys.exit(main())
