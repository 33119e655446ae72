"""Multi-turn episodes through a real vLLM server (CPU build): concurrent episodes with a real
tool match the trainer's own log-probs token for token, the environment's tokens are exactly
the tool result's rendering, and the vLLM multi-turn recipe learns.

One server per module, serving the model of ``recipes/tiny-multi-turn-vllm.yaml`` (the trainer
sends its weights at start-up). Skips where ``vllm`` is not importable (``.ci/vllm-setup.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import Recipe
from megatron_gspo.rollout.vllm import VLLMClient
from tests.support.ranks import run_distributed
from tests.support.runs import ROOT, run_metrics
from tests.support.vllm_checks import LOGPROB_ATOL, requires_vllm

RECIPE = ROOT / "recipes" / "tiny-multi-turn-vllm.yaml"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_gspo.rollout.vllm.local_server import (
        cpu_serving_args,
        served,
        write_served_model,
    )
    from megatron_gspo.run.recipe import load_recipe

    work = tmp_path_factory.mktemp("multi-turn-vllm")
    cfg = load_recipe(RECIPE).model
    model_dir = write_served_model(work / "model", cfg)
    extra = [*cpu_serving_args(cfg.max_seq_length, max_num_seqs=256), "--seed", "0"]
    with served(model_dir, extra, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as (url, key):
        yield url, key


def _recipe(output_dir: Path, **sections) -> dict:
    data = yaml.safe_load(RECIPE.read_text())
    data["run"].update(output_dir=str(output_dir), plot_every=0, tensorboard=False)
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return data


def _tool_episodes(rank, world, data: dict, url: str, key: str):
    """Episodes with a real calculator through the server, and for each model token the
    trainer's recomputed log-prob beside the server's."""
    import torch

    from megatron_gspo.data.prompts import PromptStream
    from megatron_gspo.episodes.sampling import EpisodeSampler
    from megatron_gspo.episodes.scoring import Scorer
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.vllm import VLLMEngine
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    recipe = Recipe.model_validate(data)
    policy = Policy(recipe, init_parallel(recipe.parallel))
    engine = VLLMEngine(recipe.rollout.vllm, recipe.model, policy.model, urls=[url], api_key=key)
    engine.sync_weights(0)
    stream = PromptStream(recipe.data, seed=0)
    sampler = EpisodeSampler(recipe, engine, stream)
    prompts = stream.next_batch(recipe.rollout.prompts_per_step)
    groups, stats = sampler.rollout(1, prompts)
    samples, _ = Scorer(recipe, None, stream.tokenizer.decode)(prompts, groups)
    trainer = GSPOTrainer(policy)
    worst = 0.0
    for plan in trainer.plan(samples):
        for mb, lp in trainer._logprob_pass(plan):
            diff = ((lp - mb.old_logprobs) * mb.loss_mask).abs().max()
            worst = max(worst, float(diff))
    sampler.close()
    tok = stream.tokenizer
    episodes = [
        {
            "ids": e.token_ids,
            "mask": e.mask,
            "turns": [tok.decode(e.turn_tokens(k)) for k in range(e.num_turns)],
            "tool_calls": e.info.get("tool_calls", 0.0),
        }
        for g in groups
        for e in g
    ]
    return worst, episodes, stats, torch.tensor(0)


@requires_vllm
def test_concurrent_tool_episodes_score_what_was_sampled(server, tmp_path):
    url, key = server
    env = {"env": "tests.support.faulty_envs:CalculatorEveryTurn", "env_kwargs": {"calls": 2}}
    data = _recipe(
        tmp_path / "run",
        rollout={"prompts_per_step": 4, "group_size": 4, "multi_turn": {**env, "max_turns": 3}},
    )
    worst, episodes, stats, _ = run_distributed(_tool_episodes, 1, data, url, key)[0]
    print(f"max |trainer - vLLM| log-prob over model tokens: {worst:.2e}")
    assert worst < LOGPROB_ATOL, f"recomputed log-probs differ from vLLM's by {worst:.2e}"
    assert stats["episodes_in_flight_max"] >= 2
    from megatron_gspo.data.tasks import SyntheticTask

    tok = SyntheticTask("relay_digits", turns=3).tokenizer
    with_tool = [e for e in episodes if e["tool_calls"] > 0]
    assert with_tool, "no episode reached a tool call"
    for e in with_tool:
        # The environment tokens are the calculator's answer to each turn, tokenized as it is:
        # nothing of the model's turn was decoded and encoded again.
        observations, run = [], []
        for t, m in zip(e["ids"], e["mask"], strict=True):
            if m == 0:
                run.append(t)
            elif run:
                observations.append(run)
                run = []
        want = [tok.encode(str(len(text) * 7)) for text in e["turns"][: len(observations)]]
        assert observations == want, (observations, want, e["turns"])


@pytest.mark.slow
@requires_vllm
def test_the_vllm_multi_turn_recipe_learns(server, tmp_path):
    """Through the CLI, as a user runs it against tools/serve_vllm.py's server."""
    url, key = server
    data = _recipe(tmp_path / "run", run={"checkpoint_every": 100})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    steps = 60
    env = {**os.environ, "MEGATRON_GSPO_VLLM_URLS": url, "MEGATRON_GSPO_VLLM_KEY": key}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(path), "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = run_metrics(tmp_path / "run")
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sorted(r["reward_mean"] for r in records[-10:])[5]  # median of the last ten
    print(f"reward {first:.3f} -> {last:.3f}; turns {records[-1]['turns_mean']:.2f}")
    assert all(r["turns_mean"] >= 1 and r["model_token_fraction"] <= 1 for r in records)
    assert records[-1]["episodes_in_flight_max"] > 1
    assert last > first + 0.15, f"no learning: reward {first:.3f} -> {last:.3f}"
    # vLLM's own record of the weights it holds: the trainer's version after the last step.
    from megatron_gspo.rollout.vllm.routes import Servers

    assert Servers(VLLMClient([url], api_key=key), timeout_s=30).versions() == {url: steps}
