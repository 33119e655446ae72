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
    from megatron_gspo.rollout.vllm.single_node import (
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


# One step off-policy with weights updated under the episodes in flight (rollout.in_flight_updates:
# keep), corrected as recipes/tiny-moe-async.yaml corrects its stale batches.
IN_FLIGHT = {
    "rollout": {"max_staleness": 1, "in_flight_updates": {"mode": "keep"}},
    "train": {"off_policy_correction": {"mode": "mis", "level": "sequence"}},
}
# The same with partial batches: 32 groups in flight, each step trains on the first 16 done.
IN_FLIGHT_GROUPS = {
    **IN_FLIGHT,
    "rollout": {
        "max_staleness": 1,
        "in_flight_updates": {"mode": "keep", "groups_in_flight": 32},
    },
}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 40 steps of learning, 5-13 min each on CI's 2 busy cores
@requires_vllm
@pytest.mark.parametrize(
    "sections",
    # The longest first: CI's slow tier hands this file's worker another file when two of its
    # tests are left, and the rest of the file then runs ahead of that one.
    [IN_FLIGHT_GROUPS, IN_FLIGHT, {}],
    ids=["in-flight-groups", "in-flight-keep", "on-policy"],
)
def test_the_vllm_multi_turn_recipe_learns(server, tmp_path, sections):
    """Through the CLI, as a user runs it against tools/serve_vllm.py's server."""
    url, key = server
    in_flight = bool(sections)
    data = _recipe(tmp_path / "run", run={"checkpoint_every": 100}, **sections)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    # 40 steps: in six runs of the three variants (two CI runs) the median reward of steps
    # 31-40 was 0.101 to 0.122 above the first five steps' (0.15 to 0.18 at 45, 0.27 to 0.34
    # at 60); 60 steps cost CI 27 min of its slow tier.
    steps = 40
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
    assert last > first + 0.06, f"no learning: reward {first:.3f} -> {last:.3f}"
    if in_flight:
        # Whether a sync lands under an episode is timing: where generation outruns the
        # training step (CI saw it on every step of a run) the next batch is done before the
        # sync and nothing spans. test_in_flight_vllm.py proves keep's spanning; here the run
        # must learn and stay within one version of the policy.
        spanning = [r.get("episodes_spanning_versions", 0.0) for r in records]
        print(f"episodes spanning two versions: up to {max(spanning):.0%} of a step's")
        assert all(r.get("staleness_max", 0) <= 1 for r in records)
        if sections is IN_FLIGHT_GROUPS:
            dropped = records[-1]["rollout_groups_dropped"]
            carried = sum(r["rollout_groups_carried"] for r in records) / len(records)
            print(f"groups dropped {dropped:.0f}; carried to the next step {carried:.1f} a step")
    # vLLM's own record of the weights it holds: the trainer's version after the last step.
    from megatron_gspo.rollout.vllm.rl_api import Servers

    assert Servers(VLLMClient([url], api_key=key), timeout_s=30).versions() == {url: steps}


@pytest.mark.slow
@requires_vllm
def test_sigterm_during_an_in_flight_sync_exits_75_and_resumes_the_batch_it_spanned(
    server, tmp_path
):
    """SIGTERM while the servers are paused under a sync (keep: requests frozen): the sync
    completes, the servers are resumed and hold the last step's version, the run exits 75 with
    a checkpoint holding the batch generated across the sync, and the resumed run trains on
    exactly that batch (the same tokens' versions)."""
    import json
    import signal
    import time

    from megatron_gspo.rollout.vllm.rl_api import Servers

    url, key = server
    run = tmp_path / "run"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(run, run={"checkpoint_every": 100}, **IN_FLIGHT)))
    env = {**os.environ, "MEGATRON_GSPO_VLLM_URLS": url, "MEGATRON_GSPO_VLLM_KEY": key}
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(path)]
    servers = Servers(VLLMClient([url], api_key=key), timeout_s=30)
    # The module's server holds the version an earlier test's run left (60 after the learning
    # test): a label no run writes, so that only this run's syncs count below.
    servers.set_version("before-sigterm-test")
    # Its output goes to a file: a pipe nobody reads while polling would fill and stop it.
    log = (tmp_path / "train.log").open("w")
    proc = subprocess.Popen(
        [*cmd, "--steps", "50"], env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    seen = None
    try:
        # The first sync after a trained step (version 0 is the start-up sync's).
        while not (isinstance(seen, int) and seen >= 1) or servers.versions()[url] != "partial":
            label = servers.versions()[url]
            seen = label if isinstance(label, int) else seen
            assert proc.poll() is None and time.monotonic() < deadline, "no sync after a step"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 75, (tmp_path / "train.log").read_text()[-4000:]
    step = int((run / "checkpoints" / "latest").read_text())
    assert step == seen + 1, f"the sync under way was to version {seen + 1}, saved at {step}"
    assert servers.versions() == {url: step} and servers.is_paused() == {url: False}
    state = json.loads(
        (run / "checkpoints" / f"iter_{step:07d}" / "trainer_state.json").read_text()
    )
    [queued] = state["rollout_queue"]
    assert queued["step"] == step + 1
    # What the batch says of its tokens' versions, as the trainer counts them (run/loop.py).
    episodes = [e for g in queued["episodes"] for e in g]
    spanning = ages = 0
    by_age: dict[int, int] = {}
    for e in episodes:
        own = [v for v, m in zip(e["token_versions"], e["mask"], strict=True) if m and v >= 0]
        spanning += len(set(own)) > 1
        for v in own:
            by_age[step - v] = by_age.get(step - v, 0) + 1
            ages += 1
    resumed = subprocess.run(
        [*cmd, "--steps", str(step + 1)], env=env, capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    record = run_metrics(run)[-1]
    assert record["step"] == step + 1
    assert record["episodes_spanning_versions"] == pytest.approx(spanning / len(episodes))
    for age, n in by_age.items():
        assert record[f"tokens_by_age/{age}"] == pytest.approx(n / ages), age
    assert servers.versions() == {url: step + 1}
