"""Synthetic rollout batches and small recipes for training-step tests."""

from __future__ import annotations

import random

from megatron_gspo.config import Recipe
from megatron_gspo.trainer.packing import Sample
from tests.support.tiny import TINY_MOE


def rollout_batch(
    num_prompts: int = 4, group: int = 4, vocab: int = 64, seed: int = 0, skew: bool = True
) -> list[Sample]:
    """Groups of responses of uneven length with rewards and rollout log-probs."""
    rng = random.Random(seed)
    samples = []
    for p in range(num_prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(group):
            n = max(1, int(rng.lognormvariate(1.5, 0.7))) if skew else rng.randint(2, 8)
            n = min(n, 20)
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(vocab) for _ in range(n)],
                    advantage=rng.gauss(0, 1),
                    rollout_logprobs=[-rng.uniform(2.0, 6.0) for _ in range(n)],
                    prompt_index=p,
                )
            )
    return samples


def episode_batch(
    num_prompts: int = 4, group: int = 4, vocab: int = 64, seed: int = 0, turn_credit: bool = True
) -> list[Sample]:
    """Groups of multi-turn episodes: 1 to 3 model turns with environment turns between them
    (masked out), rollout log-probs on model tokens, and per-turn advantages."""
    rng = random.Random(seed)
    samples = []
    for p in range(num_prompts):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 6))]
        for _ in range(group):
            ids, mask, lps, adv = [], [], [], []
            turns = rng.randint(1, 3)
            for k in range(turns):
                n = rng.randint(1, 6)
                turn_adv = rng.gauss(0, 1)
                ids += [rng.randrange(vocab) for _ in range(n)]
                mask += [1] * n
                lps += [-rng.uniform(2.0, 6.0) for _ in range(n)]
                adv += [turn_adv] * n
                if k + 1 < turns:
                    o = rng.randint(2, 5)
                    ids += [rng.randrange(vocab) for _ in range(o)]
                    mask += [0] * o
                    lps += [0.0] * o
                    adv += [0.0] * o
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=ids,
                    response_mask=mask,
                    advantage=rng.gauss(0, 1),
                    token_advantages=adv if turn_credit else None,
                    rollout_logprobs=lps,
                    prompt_index=p,
                )
            )
    return samples


def tiny_recipe(**sections) -> Recipe:
    base = {
        "model": TINY_MOE.model_dump(),
        "optimizer": {"lr": 1e-2, "clip_grad": 0.0},
        "train": {"mini_batches": 2, "micro_batch_tokens": 64, "micro_batch_size": 2},
        "memory": {"use_distributed_optimizer": False},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Recipe.model_validate(base)
