"""Rollout routing replay (R3) against the behaviour-vs-trainer log-prob mismatch.

The tiny MoE recipe samples with its embedded engine and trains with GSPO and
``train.routing_replay: rollout``. At every step the pre-update policy's log-probs of the
batch are computed twice, on the same samples and weights: with the rollout's routes replayed
and with the routers' own choice; each is compared with the sampler's log-probs as the
``rollout_kl_k3`` metric is (token mean of ``exp(d) - 1 - d``). Two sources of mismatch:

- ``bf16 sampler``: the engine samples from a bf16 copy of the weights (synced every step),
  the trainer computes in fp32, as an inference engine in bf16 beside an fp32 trainer does;
- ``one step stale``: the engine is fp32 but the batch trains one update after it was sampled
  (``rollout.max_staleness: 1``).

The mismatch left under replay is the part no routing explains. ``rollout_routing_disagreement``
(the trainer's own routes against the sampler's) is printed too.

The last line: ``routing_replay: rollout_kl_k3 replayed / own routes: bf16 sampler <r1>,
one step stale <r2>``.

    python benchmarks/routing_replay.py [--steps 30] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_for(seed: int, steps: int):
    from megatron_gspo.config import Recipe

    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    data["train"]["routing_replay"] = "rollout"
    data["rollout"]["seed"] = seed
    data["parallel"]["seed"] = 1234 + seed
    data["run"]["steps"] = steps
    return Recipe.model_validate(data)


def run(scenario: str, seed: int, steps: int) -> dict[str, list[float]]:
    import torch

    from megatron_gspo.config import ParallelConfig, PrecisionConfig
    from megatron_gspo.data.prompts import PromptStream
    from megatron_gspo.episodes.episode import single_turn
    from megatron_gspo.episodes.scoring import Scorer
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rewards.computer import RewardComputer
    from megatron_gspo.rollout import RolloutRequest, SamplingParams
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict, load_full_state_dict

    recipe = recipe_for(seed, steps)
    torch.manual_seed(seed)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    trainer = GSPOTrainer(policy)
    r = recipe.rollout
    stream = PromptStream(
        recipe.data, seed=r.seed, max_prompt_tokens=recipe.model.max_seq_length - r.max_new_tokens
    )
    rewards = RewardComputer(recipe.reward)
    precision = PrecisionConfig(bf16=scenario == "bf16")
    sampler = build_model(recipe.model, ParallelConfig(), precision)
    engine = LocalEngine(sampler)

    def sample(step: int):
        load_full_state_dict(sampler, gather_full_state_dict(policy.model))
        prompts = stream.next_batch(r.prompts_per_step)
        params = SamplingParams(
            group_size=r.group_size,
            temperature=r.temperature,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=(stream.tokenizer.eos_id,),
            seed=r.seed * 1_000_003 + step,
            return_routes=True,
        )
        result = engine.generate(RolloutRequest([p.token_ids for p in prompts], params))
        return Scorer(recipe, rewards, stream.tokenizer.decode)(prompts, single_turn(result))[0]

    out: dict[str, list[float]] = {"own": [], "replayed": [], "disagreement": []}
    pending = sample(0) if scenario == "stale" else None
    for step in range(1, steps + 1):
        if scenario == "stale":
            samples, pending = pending, sample(step)
        else:
            samples = sample(step)
        # Own routes last: the disagreement read below is the unreplayed pass's.
        for mode, key in (("rollout", "replayed"), ("none", "own")):
            trainer.replay = mode  # the same batch and weights, routed both ways
            policy.router_stats.clear()
            measured = trainer.compute_old_logprobs(trainer.plan(samples))
            out[key].append(measured["rollout_kl_k3"])
        differ, compared = policy.router_stats.disagreement.sum(dim=1).tolist()
        out["disagreement"].append(differ / compared)
        trainer.replay = "rollout"
        trainer.step(samples)
    rewards.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    ratios = {}
    for scenario, name in (("bf16", "bf16 sampler"), ("stale", "one step stale")):
        own, replayed, disagreement = [], [], []
        for seed in args.seeds:
            got = run(scenario, seed, args.steps)
            own += got["own"]
            replayed += got["replayed"]
            disagreement += got["disagreement"]
        a, b = statistics.mean(own), statistics.mean(replayed)
        ratios[name] = b / a
        print(
            f"{name}: rollout_kl_k3 own routes {a:.3e}, replayed {b:.3e} (ratio {b / a:.2f}); "
            f"routing disagreement {statistics.mean(disagreement):.3f}; "
            f"{len(own)} steps over seeds {args.seeds}",
            flush=True,
        )
    print(
        "routing_replay: rollout_kl_k3 replayed / own routes: "
        + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
    )


if __name__ == "__main__":
    main()
