"""Rollout routing replay (R3) and the rollout routing disagreement.

The rollout engine's routes (which experts each token was sent to, per MoE layer) travel with
the samples to every router of the trainer. Checked here: the embedded engine's routes are the
ones its forward used; with ``train.routing_replay: rollout`` every training forward routes
exactly the replayed experts; ``rollout_routing_disagreement`` counts each route the trainer's
own router would have chosen differently (before replay overrides it); layouts that cut the
tokens another way (TP+SP, EP, PP, CP) equal one rank; bad routes are refused by name.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from megatron_gspo.config import ParallelConfig, Recipe
from megatron_gspo.rollout import RolloutRequest, SamplingParams
from megatron_gspo.rollout.protocol import Completion
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import rollout_batch, tiny_recipe
from tests.support.steps import LINEAR_ADAM, max_rel_weight_diff, train_steps
from tests.support.tiny import TINY_MOE

K = TINY_MOE.moe_router_topk
LAYERS = TINY_MOE.num_layers


def random_routes(samples, seed: int):
    """Every sample with random (sorted, distinct) routes for each token and layer."""
    g = np.random.default_rng(seed)
    for s in samples:
        scores = g.random((s.num_tokens, LAYERS, TINY_MOE.num_experts))
        s.routes = np.sort(np.argsort(scores, axis=-1)[..., :K], axis=-1).astype(np.uint8)
    return samples


# ------------------------------------------------------------------------------------------
# The embedded engine records its own routes
# ------------------------------------------------------------------------------------------


def _engine_routes(rank, world, request):
    from megatron_gspo.model import build_model
    from megatron_gspo.model.routes import RouteRecorder
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine

    init_parallel(ParallelConfig())
    model = build_model(TINY_MOE, ParallelConfig())
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    result = LocalEngine(model).generate(request)
    # What the routers choose in one teacher-forced forward of each sequence it read.
    recorder = RouteRecorder(model)
    model.eval()
    forced = []
    with torch.no_grad():
        for prompt, group in zip(request.prompts, result.completions, strict=True):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids[:-1]])
                n = ids.shape[1]
                recorder.start()
                model(ids, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).triu(1))
                (forward,) = recorder.stop()  # [layers, s, 1, k]
                forced.append(forward[:, :, 0].transpose(0, 1).numpy())
    return result, forced


def test_the_embedded_engine_returns_the_routes_its_forwards_used():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    params = SamplingParams(
        group_size=2, max_new_tokens=6, stop_token_ids=(0,), seed=3, return_routes=True
    )
    result, forced = run_distributed(_engine_routes, 1, RolloutRequest(prompts, params))[0]
    flat = [(p, c) for p, g in zip(prompts, result.completions, strict=True) for c in g]
    for (prompt, c), want in zip(flat, forced, strict=True):
        assert c.routes.shape == (len(prompt) + len(c.token_ids) - 1, LAYERS, K)
        assert c.routes.dtype == np.uint8
        assert (np.diff(c.routes.astype(int), axis=-1) > 0).all(), "rows not sorted, distinct"
        # Left padding and the KV cache change shapes, not which experts win here.
        np.testing.assert_array_equal(c.routes, want)
    # Without the flag no routes travel.
    params = SamplingParams(group_size=1, max_new_tokens=2, seed=3)
    plain, _ = run_distributed(_engine_routes, 1, RolloutRequest(prompts, params))[0]
    assert all(c.routes is None for g in plain.completions for c in g)


# ------------------------------------------------------------------------------------------
# Replay forces the rollout's routes; the disagreement counts the router's own choice
# ------------------------------------------------------------------------------------------


def _replay_and_count(rank, world, recipe: Recipe, samples, changes):
    """Routes := the trainer's own (one forward per sample, as its micro-batches of one are),
    then ``changes`` of them altered; one step. Returns the metrics, the routes every router
    applied in each forward, and the samples' routes."""
    from megatron_gspo.model.routes import RouteRecorder
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    policy = Policy(recipe, init_parallel(recipe.parallel))
    recorder = RouteRecorder(policy.model)
    policy.train(False)
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids[:-1]])
            n = ids.shape[1]
            recorder.start()
            policy.model(ids, torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).triu(1))
            (forward,) = recorder.stop()
            s.routes = forward[:, :, 0].transpose(0, 1).numpy().astype(np.uint8)
    policy.train(True)
    for i, t, layer in changes:  # another expert set for that token and layer
        own = samples[i].routes[t, layer]
        free = [e for e in range(TINY_MOE.num_experts) if e not in own]
        samples[i].routes[t, layer] = np.sort(np.array([own[0], free[0]]))
    recorder.start()
    metrics = GSPOTrainer(policy).step(samples)
    applied = [f[:, :, 0].transpose(0, 1).numpy() for f in recorder.stop()]
    return metrics, applied, [s.routes for s in samples]


CHANGES = [(0, 0, 0), (0, 3, 1), (5, 2, 0), (9, 1, 1), (9, 2, 1)]
# Under replay an altered route changes what the layers after it compute, and so their own
# choice; routes altered in the last MoE layer leave every other choice as it was.
LAST_LAYER_CHANGES = [(0, 3, LAYERS - 1), (5, 2, LAYERS - 1), (9, 1, LAYERS - 1)]


def _one_per_microbatch(**train):
    return tiny_recipe(
        optimizer=LINEAR_ADAM,
        train={"packing": False, "micro_batch_size": 1, **train},
        rollout={"return_routes": True},
    )


def test_disagreement_counts_exactly_the_routes_the_rollout_chose_differently():
    samples = rollout_batch(num_prompts=3, group=4, seed=2)
    routes_total = sum(s.num_tokens for s in samples) * LAYERS
    recipe = _one_per_microbatch()
    metrics, _, _ = run_distributed(_replay_and_count, 1, recipe, samples, CHANGES)[0]
    assert metrics["rollout_routing_disagreement"] == pytest.approx(len(CHANGES) / routes_total)
    per_layer = [sum(c[2] == layer for c in CHANGES) for layer in range(LAYERS)]
    tokens = sum(s.num_tokens for s in samples)
    for layer in range(LAYERS):
        got = metrics[f"rollout_routing_disagreement/layer_{layer}"]
        assert got == pytest.approx(per_layer[layer] / tokens), f"layer {layer}"
    unchanged, _, _ = run_distributed(_replay_and_count, 1, recipe, samples, [])[0]
    assert unchanged["rollout_routing_disagreement"] == 0.0


@pytest.mark.parametrize(
    "changes", [[], LAST_LAYER_CHANGES], ids=["trainer-routes", "altered-routes"]
)
def test_replay_routes_every_forward_through_the_rollout_experts(changes):
    samples = rollout_batch(num_prompts=3, group=4, seed=2)
    recipe = _one_per_microbatch(routing_replay="rollout")
    metrics, applied, routes = run_distributed(_replay_and_count, 1, recipe, samples, changes)[0]
    # Micro-batches of one sample, in order: the old-policy pass, then the two mini-batches.
    assert len(applied) == 2 * len(samples)
    for f, got in enumerate(applied):
        np.testing.assert_array_equal(got, routes[f % len(samples)], err_msg=f"forward {f}")
    # The router's own choice before replay: 0 where the routes are its own, else the count.
    routes_total = sum(s.num_tokens for s in samples) * LAYERS
    want = len(changes) / routes_total
    assert metrics["rollout_routing_disagreement"] == pytest.approx(want)
    # The flip rate is the router's own choice too: replay does not hide it.
    assert metrics["routing_flip_rate"] > 0


def _applied_routes(rank, world, recipe: Recipe, samples):
    """One step; the routes every router applied, one [s, b, layers, k] array per forward."""
    from megatron_gspo.model.routes import RouteRecorder
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer

    policy = Policy(recipe, init_parallel(recipe.parallel))
    recorder = RouteRecorder(policy.model)
    recorder.start()
    GSPOTrainer(policy).step(samples)
    return [f.permute(1, 2, 0, 3).numpy() for f in recorder.stop()]


def test_replay_follows_every_token_through_padded_micro_batches():
    """Rows of a padded micro-batch reach the router sequence-major: token (s, b)."""
    samples = random_routes(rollout_batch(num_prompts=3, group=4, seed=4), seed=3)
    recipe = tiny_recipe(
        optimizer=LINEAR_ADAM,
        train={"packing": False, "micro_batch_size": 4, "routing_replay": "rollout"},
    )
    applied = run_distributed(_applied_routes, 1, recipe, samples)[0]
    # The plan of one rank: each mini-batch's samples in order, four to a micro-batch.
    mini = [samples[:6], samples[6:]]
    micro = [m[i : i + 4] for m in mini for i in range(0, len(m), 4)]
    assert len(applied) == 2 * len(micro), "an old-policy and a training forward each"
    for f, got in enumerate(applied):
        for b, sample in enumerate(micro[f % len(micro)]):
            n = sample.num_tokens
            np.testing.assert_array_equal(got[:n, b], sample.routes, err_msg=f"forward {f} b {b}")


# ------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replay_single_rank():
    recipe = tiny_recipe(
        optimizer=LINEAR_ADAM,
        loss={"eps_low": 0.02, "eps_high": 0.02},
        train={"routing_replay": "rollout"},
    )
    samples = random_routes(rollout_batch(), seed=1)
    metrics, start, weights = run_distributed(train_steps, 1, recipe, samples, 2)[0]
    return recipe, samples, metrics, weights, start


@pytest.mark.parametrize(
    "parallel,world",
    [
        pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2, id="tp2-sp"),
        pytest.param({"expert_model_parallel_size": 2}, 2, id="ep2-dp2"),
        pytest.param({"pipeline_model_parallel_size": 2}, 2, id="pp2"),
        pytest.param({"context_parallel_size": 2}, 2, id="cp2"),
        # A 24-token budget gives one rank a filler micro-batch, which routes too.
        pytest.param(
            {"expert_model_parallel_size": 2, "micro_batch_tokens": 24}, 2, id="ep2-dp2-filler"
        ),
    ],
)
def test_rollout_replay_under_each_layout_equals_single_rank(replay_single_rank, parallel, world):
    """Random routes, far from the router's own choice: a route handed to the wrong token or
    layer anywhere changes the loss and the update."""
    recipe, samples, ref, ref_weights, start = replay_single_rank
    data = recipe.model_dump()
    parallel = dict(parallel)
    if "micro_batch_tokens" in parallel:
        data["train"]["micro_batch_tokens"] = parallel.pop("micro_batch_tokens")
    data["parallel"].update(parallel)
    metrics, _, weights = run_distributed(
        train_steps, world, Recipe.model_validate(data), samples, 2, start
    )[0]
    keys = ("loss", "clip_fraction", "approx_kl", "rollout_routing_disagreement")
    for step, (m, r) in enumerate(zip(metrics, ref, strict=True)):
        for key in keys:
            assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (
                f"step {step + 1} {key}: {m[key]} != single-rank {r[key]}"
            )
    assert ref[0]["rollout_routing_disagreement"] > 0.3, "random routes should mostly differ"
    err = max_rel_weight_diff(weights, ref_weights, start)
    assert err <= 1e-4, f"updated weights differ from single rank by {err:.2e} (relative)"


# ------------------------------------------------------------------------------------------
# Bad routes, configuration, transport
# ------------------------------------------------------------------------------------------


def test_routes_that_do_not_fit_the_sequence_are_refused_by_name():
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.episodes.episode import Episode
    from megatron_gspo.episodes.scoring import checked_routes

    recipe = tiny_recipe(train={"routing_replay": "rollout"})
    prompt = Prompt(text="123", answer="x", token_ids=[1, 2, 3])
    ok = np.zeros((3 + 4 - 1, LAYERS, K), dtype=np.uint8)
    ok[..., 1] = 1
    c = Completion(token_ids=[4, 5, 6, 7], logprobs=[0.0] * 4, finish_reason="stop", routes=ok)
    assert np.array_equal(checked_routes(Episode.from_completion(c), prompt, recipe), ok)
    # One row short (the engine left out the prompt's first token), as seen elsewhere.
    c.routes = ok[1:]
    with pytest.raises(ValueError, match=r"routes of shape \(5, 2, 2\).*\[6, 2, 2\]"):
        checked_routes(Episode.from_completion(c), prompt, recipe)
    c.routes = ok + 9
    with pytest.raises(ValueError, match="outside"):
        checked_routes(Episode.from_completion(c), prompt, recipe)
    c.routes = None
    with pytest.raises(ValueError, match="returned no expert routes"):
        checked_routes(Episode.from_completion(c), prompt, recipe)


def test_routing_replay_settings():
    assert tiny_recipe(train={"routing_replay": True}).train.routing_replay == "old_policy"
    assert tiny_recipe(train={"routing_replay": False}).train.routing_replay == "none"
    assert tiny_recipe(train={"routing_replay": "rollout"}).wants_rollout_routes
    assert tiny_recipe(rollout={"return_routes": True}).wants_rollout_routes
    assert not tiny_recipe().wants_rollout_routes
    dense = {"num_experts": None, "moe_ffn_hidden_size": None, "ffn_hidden_size": 64}
    with pytest.raises(ValueError, match="rollout.return_routes needs an MoE model"):
        tiny_recipe(model=dense, rollout={"return_routes": True})


def test_routes_survive_the_checkpointed_rollout_queue():
    routes = np.arange(2 * LAYERS * K, dtype=np.uint8).reshape(2, LAYERS, K)
    c = Completion([4, 5], [-1.0, -2.0], "length", policy_version=3, routes=routes)
    back = Completion.from_json(c.to_json())
    np.testing.assert_array_equal(back.routes, routes)
    assert back.routes.dtype == routes.dtype and back.policy_version == 3
    assert Completion.from_json(Completion([4], [0.0], "stop").to_json()).routes is None


def _vllm_choice(routes: np.ndarray | None) -> dict:
    """A /v1/completions choice as vLLM writes it (routed_experts: base64 of np.save)."""
    choice = {"index": 0, "token_ids": [4, 5], "finish_reason": "length"}
    choice["logprobs"] = {"token_logprobs": [-1.0, -2.0]}
    if routes is not None:
        buf = io.BytesIO()
        np.save(buf, routes)
        choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
    return choice


def test_vllm_routes_keep_the_moe_layers_sorted_and_missing_ones_name_the_flag():
    from megatron_gspo.rollout.vllm.errors import VLLMRequestError
    from megatron_gspo.rollout.vllm.http_client import VLLMClient

    # vLLM's layer axis counts every decoder layer; here layer 1 is dense (its slot is 0s).
    raw = np.array([[[3, 1], [0, 0], [2, 0]], [[1, 2], [0, 0], [3, 2]]], dtype=np.uint8)
    client = VLLMClient(["http://127.0.0.1:1"], moe_layers=[0, 2])
    got = client._routes("http://x", _vllm_choice(raw))
    np.testing.assert_array_equal(got, [[[1, 3], [0, 2]], [[1, 2], [2, 3]]])
    with pytest.raises(VLLMRequestError, match="--enable-return-routed-experts"):
        client._routes("http://x", _vllm_choice(None))


def test_a_cpu_vllm_server_asked_for_routes_is_refused_before_it_starts():
    from megatron_gspo.rollout.vllm.server_command import server_env

    with pytest.raises(ValueError, match="CPU build refuses"):
        server_env("key", {}, cpu=True, return_routes=True)
    env = server_env("key", {}, cpu=False, return_routes=True)
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
