"""In-flight weight updates (``rollout.in_flight_updates``) without a server: the recipe's
rules, versions per token from an engine's answer through episodes, checkpoints, samples,
packing, the context-parallel split, pipeline stages and the rollout queue to the trainer's
split mismatch figures, the queue's schedule (no waiting for a batch's tail before a sync, no
batch beyond the staleness bound), and the engine's deadline for a sync under way.

The same against a real vLLM server: tests/test_in_flight_vllm.py."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from megatron_gspo.config import Recipe
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.pipeline import RolloutPipeline
from megatron_gspo.rollout.protocol import Completion
from megatron_gspo.run.loop import staleness_metrics
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import rollout_batch, tiny_recipe
from tests.support.steps import LINEAR_ADAM
from tests.support.waiting import eventually


def test_the_recipe_refuses_in_flight_updates_an_engine_cannot_do():
    base = tiny_recipe().model_dump()
    for rollout, named in (
        ({"max_staleness": 0, "engine": "vllm"}, "max_staleness 0"),
        ({"max_staleness": 1, "engine": "local"}, "engine 'local'"),
    ):
        data = {**base, "rollout": {**base["rollout"], **rollout}}
        data["rollout"]["in_flight_updates"] = {"mode": "keep"}
        with pytest.raises(ValueError, match="in_flight_updates") as e:
            Recipe.model_validate(data)
        assert named in str(e.value)
    data = {**base, "rollout": {**base["rollout"], "max_staleness": 1, "engine": "vllm"}}
    data["rollout"]["in_flight_updates"] = {"mode": "wait"}
    with pytest.raises(ValueError, match="keep"):
        Recipe.model_validate(data)


# -- versions per token ------------------------------------------------------------------------


def _turn(ids, versions) -> Completion:
    c = Completion(ids, [-0.5] * len(ids), "length", token_versions=versions)
    c.stamp("ignored: the tokens say it")
    return c


def test_an_episodes_tokens_keep_their_versions_through_a_checkpoint():
    e = Episode()
    e.add_model_turn(_turn([3, 4, 5], [4, 4, 5]))  # the weights changed under this turn
    e.add_observation([9, 9])
    e.add_model_turn(_turn([6, 7], [5, 5]))
    assert e.versions == [4, 5], "a turn's version is its oldest token's"
    assert e.token_versions == [4, 4, 5, -1, -1, 5, 5]
    assert e.spans_versions
    back = Episode.from_json(e.to_json())
    assert back.token_versions == e.token_versions and back.versions == e.versions
    # A queue saved before versions per token: each token takes its turn's.
    old = e.to_json()
    del old["token_versions"]
    assert Episode.from_json(old).token_versions == [4, 4, 4, -1, -1, 5, 5]
    one = Episode.from_completion(Completion([1, 2], [-1.0, -1.0], "stop", policy_version=3))
    assert one.token_versions == [3, 3] and not one.spans_versions


def _spanning(seed: int):
    """The fixture's samples: a third sampled by version 5 (the policy's) alone, a third by
    version 4 alone, a third begun on 4 and finished on 5 (an in-flight update half-way)."""
    out = []
    for i, s in enumerate(rollout_batch(seed=seed)):
        n = len(s.response_ids)
        versions = [[5] * n, [4] * n, [4] * (n // 2) + [5] * (n - n // 2)][i % 3]
        out.append(dataclasses.replace(s, policy_version=min(versions), token_versions=versions))
    return out


def test_versions_and_the_update_mark_reach_every_packed_token():
    from megatron_gspo.trainer.packing import _sequence_arrays

    s = _spanning(seed=2)[2]
    *_, versions, after = _sequence_arrays(s)
    p, n = len(s.prompt_ids), len(s.response_ids)
    assert versions == [-1] * (p - 1) + s.token_versions
    assert after == [0] * (p - 1) + [0] * (n // 2) + [1] * (n - n // 2)
    masked = dataclasses.replace(s, response_mask=[1] * (n - 1) + [0])
    *_, versions, _ = _sequence_arrays(masked)
    assert versions[-1] == -1, "an environment token has no version"


def _metrics(rank: int, world: int, recipe: Recipe, samples, version, weights=None):
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.trainer.policy import Policy
    from megatron_gspo.trainer.step import GSPOTrainer
    from megatron_gspo.weights import gather_full_state_dict

    policy = Policy(recipe, init_parallel(recipe.parallel))
    if weights is not None:
        policy.load_full_state_dict(weights)
    trainer = GSPOTrainer(policy)
    metrics = trainer.compute_old_logprobs(trainer.plan(samples), version)
    policy.train(False)
    reference = []
    if world > 1:  # the plain forward below is one rank's
        return metrics, reference, None
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            n = ids.shape[1] - 1
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = policy.model(ids[:, :-1], torch.arange(n)[None], mask)[0].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            reference.append(lp[len(s.prompt_ids) - 1 :])
    return metrics, reference, gather_full_state_dict(policy.model)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_the_mismatch_of_tokens_after_an_update_is_reported_apart(packing):
    """``rollout_kl_k3_after_update`` is k3's mean over the tokens sampled after the weights
    changed under their episode, ``_before_update`` over the rest; ``rollout_sampler_kl``
    leaves them out (their cache came from older weights: not the engine's own error)."""
    samples = _spanning(seed=11)
    recipe = tiny_recipe(optimizer=LINEAR_ADAM, train={"mini_batches": 1, "packing": packing})
    metrics, reference, _ = run_distributed(_metrics, 1, recipe, samples, 5)[0]
    d = torch.cat(
        [
            ref.double() - torch.tensor(s.rollout_logprobs).double()
            for s, ref in zip(samples, reference, strict=True)
        ]
    )
    k3 = d.exp() - 1 - d
    versions = torch.tensor([v for s in samples for v in s.token_versions])
    first = torch.tensor([s.policy_version for s in samples for _ in s.token_versions])
    after = versions > first
    on = (versions == 5) & ~after
    for name, mask in (
        ("rollout_kl_k3_after_update", after),
        ("rollout_kl_k3_before_update", ~after),
        ("rollout_sampler_kl", on),
    ):
        want = float(k3[mask].mean())
        assert abs(metrics[name] - want) <= 1e-5 * want, f"{name}: {metrics[name]} != {want}"
    assert metrics["rollout_sampler_kl_tokens"] == float(on.sum())


@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"context_parallel_size": 2}, id="cp2"),
        pytest.param({"pipeline_model_parallel_size": 2}, id="pp2"),
    ],
)
def test_the_split_figures_of_a_parallel_layout_equal_one_ranks(parallel):
    samples = _spanning(seed=11)
    one_rank = tiny_recipe(optimizer=LINEAR_ADAM, train={"mini_batches": 1})
    one, _, weights = run_distributed(_metrics, 1, one_rank, samples, 5)[0]
    recipe = tiny_recipe(optimizer=LINEAR_ADAM, parallel=parallel, train={"mini_batches": 1})
    results = run_distributed(_metrics, 2, recipe, samples, 5, weights)
    two = next(m for m, *_ in results if "rollout_kl_k3_after_update" in m)
    for name in ("rollout_kl_k3_after_update", "rollout_kl_k3_before_update"):
        assert abs(two[name] - one[name]) <= 1e-5 * one[name], (name, two[name], one[name])


def test_staleness_counts_the_oldest_token_and_tokens_by_age():
    samples = _spanning(seed=3)
    m = staleness_metrics(samples, current_version=5)
    assert m["staleness_max"] == 1.0
    assert m["episodes_spanning_versions"] == pytest.approx(
        sum(len(set(s.token_versions)) > 1 for s in samples) / len(samples)
    )
    tokens = [v for s in samples for v in s.token_versions]
    assert m["tokens_by_age/0"] == pytest.approx(tokens.count(5) / len(tokens))
    assert m["tokens_by_age/1"] == pytest.approx(tokens.count(4) / len(tokens))


# -- the queue ---------------------------------------------------------------------------------


class _HeldRollout:
    """Batches that run until the test lets them end, each episode's first token stamped with
    the version the engine held when the batch started and its last with the one it holds
    when the batch ends (the test sets ``version``, as a sync does)."""

    def __init__(self) -> None:
        self.version, self.started = 0, []
        self.release = {step: threading.Event() for step in range(1, 10)}

    def __call__(self, step: int, prompts):
        start = self.version
        self.started.append((step, start))
        assert self.release[step].wait(30)
        c = _turn([1, 2], [start, self.version])
        return [[Episode.from_completion(c)]], {}


def test_in_flight_the_queue_syncs_under_a_batch_and_starts_the_next_beside_it():
    """max_staleness 1: after the sync to version v the batch of step v + 2 starts at once,
    beside the tail of step v + 1's, whose tokens then come from two versions; nothing
    waits before the sync, and no batch is staler than the bound."""
    rollout = _HeldRollout()
    queue = RolloutPipeline(rollout, lambda step: [], max_staleness=1, next_step=1, in_flight=True)
    try:
        queue.resume(version=0)  # batches 1 and 2 on version 0 (2 is trained at step 2: lag 1)
        assert eventually(lambda: len(rollout.started) == 2), rollout.started
        rollout.release[1].set()
        queue.take(1, current_version=0)
        start = time.perf_counter()
        queue.pause()  # batch 2 is still running
        assert time.perf_counter() - start < 1.0, "the sync waited for generation"
        rollout.version = 1  # the sync, with batch 2 in flight
        queue.resume(version=1)  # batch 3 may start now: trained at step 3, lag 1
        assert eventually(lambda: (3, 1) in rollout.started), "batch 3 waited for batch 2"
        assert len(rollout.started) == 3, "a batch beyond the staleness bound started"
        queue.waited()  # from here: the wait for batch 2 alone
        threading.Timer(0.3, rollout.release[2].set).start()
        [[episode]] = queue.take(2, current_version=1).episodes
        assert episode.token_versions == [0, 1] and episode.spans_versions
        assert queue.waited() >= 0.25, "the trainer's wait for batch 2 was not counted"
    finally:
        for event in rollout.release.values():
            event.set()
        queue.close()


def test_a_checkpoint_taken_with_a_batch_in_flight_holds_it_finished_and_resumes_it():
    """The save waits for the batch generated across the sync and keeps its tokens' versions;
    a queue restored from it hands out the same batch."""
    rollout = _HeldRollout()
    queue = RolloutPipeline(rollout, lambda step: [], max_staleness=1, next_step=1, in_flight=True)
    try:
        queue.resume(version=0)
        rollout.release[1].set()
        queue.take(1, current_version=0)
        queue.pause()
        rollout.version = 1
        threading.Timer(0.2, rollout.release[2].set).start()
        saved = queue.state()  # waits for batch 2, begun on version 0
    finally:
        for event in rollout.release.values():
            event.set()
        queue.close()
    assert [b["step"] for b in saved][0] == 2
    later = _HeldRollout()
    for event in later.release.values():
        event.set()
    again = RolloutPipeline(later, lambda step: [], max_staleness=1, next_step=2, in_flight=True)
    try:
        again.restore(saved[:1])
        [[episode]] = again.take(2, current_version=1).episodes
    finally:
        again.close()
    assert episode.token_versions == [0, 1], "the versions did not survive the checkpoint"


def test_drained_the_queue_waits_for_generation_before_the_sync():
    rollout = _HeldRollout()
    queue = RolloutPipeline(rollout, lambda step: [], max_staleness=1, next_step=1)
    try:
        queue.resume(version=0)
        rollout.release[1].set()
        queue.take(1, current_version=0)
        assert eventually(lambda: len(rollout.started) == 2)
        queue.waited()
        threading.Timer(0.3, rollout.release[2].set).start()
        queue.pause()  # until batch 2 has ended
        assert queue.waited() >= 0.2, "the sync did not wait for the batch in flight"
        rollout.version = 1
        queue.resume(version=1)
        [[episode]] = queue.take(2, current_version=1).episodes
        assert episode.token_versions == [0, 0]
    finally:
        for event in rollout.release.values():
            event.set()
        queue.close()


# -- the engine --------------------------------------------------------------------------------


def test_generation_waits_for_a_sync_under_way_until_its_deadline():
    from megatron_gspo.config import ModelConfig, VLLMConfig
    from megatron_gspo.rollout.vllm.engine import VLLMEngine
    from megatron_gspo.rollout.vllm.errors import VLLMRequestError

    engine = VLLMEngine(
        VLLMConfig(urls=["http://127.0.0.1:9"], sync_timeout_s=0.3),
        ModelConfig(**tiny_recipe().model.model_dump()),
        in_flight="keep",
    )
    engine._weights_ready.clear()  # a sync under way that never ends
    with pytest.raises(VLLMRequestError, match="sync_timeout_s = 0.3"):
        engine.wait_for_weights()
    # One that ends: the waiter wakes to its outcome.
    waiter = threading.Thread(target=engine.wait_for_weights)
    engine.config = engine.config.model_copy(update={"sync_timeout_s": 10})
    waiter.start()
    engine._failed_sync = None
    engine._weights_ready.set()
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    engine._failed_sync = 7
    with pytest.raises(VLLMRequestError, match="version 7 failed"):
        engine.wait_for_weights()


class _RecordingServers:
    """The routes a sync walks, recorded in order (no server); ``/weight_info`` reports the
    version the last finished update named."""

    urls = ["http://server"]

    def __init__(self):
        self.calls, self.held = [], None

    def versions(self):
        return {self.urls[0]: self.held}

    def finish_weight_update(self, version):
        self.held = int(version)
        self.calls.append(("finish_weight_update", (version,), {}))

    def __getattr__(self, route):
        return lambda *args, **kwargs: self.calls.append((route, args, kwargs))


class _NoBytes:
    connects = 0

    def connect(self, servers):
        self.connects += 1

    def send(self, servers, tensors, version):
        from megatron_gspo.rollout.vllm.weight_sync import SyncReport

        return SyncReport(version)


@pytest.mark.parametrize("mode", [None, "keep", "resubmit"])
def test_a_first_sync_clears_the_prefix_cache_and_keep_keeps_it_after(mode):
    """A keep sync leaves the cache (the frozen requests go on over it), but an engine's first
    sync clears it: a server that outlives a run holds that run's blocks under the salts the
    next run reuses (``weights-0``, ...), computed by other weights."""
    from megatron_gspo.rollout.vllm.weight_sync import WeightSync

    servers = _RecordingServers()
    sync = WeightSync(servers, _NoBytes(), in_flight=mode)
    for version in range(3):
        sync.push(iter(()), version)
    pauses = [(args[0], kwargs["clear_cache"]) for r, args, kwargs in servers.calls if r == "pause"]
    paused = WeightSync.PAUSE_MODES[mode]
    assert pauses == [(paused, True), (paused, mode != "keep"), (paused, mode != "keep")]


def test_a_server_that_changed_hands_gets_its_transfer_group_formed_again():
    """Another trainer's sync (a requeued job on the disk path re-initialises the engine, which
    drops the group) or a restart leaves the servers on another version than this driver's
    last sync: the next sync forms the group again before sending, instead of broadcasting
    into a group no worker holds any more."""
    from megatron_gspo.rollout.vllm.weight_sync import WeightSync

    servers, transport = _RecordingServers(), _NoBytes()
    sync = WeightSync(servers, transport)
    sync.push(iter(()), 1)
    sync.push(iter(()), 2)
    assert transport.connects == 1, "the group was formed again for no reason"
    servers.held = 7  # someone else synced version 7
    sync.push(iter(()), 3)
    assert transport.connects == 2
    servers.held = None  # the server restarted on its checkpoint
    sync.push(iter(()), 4)
    assert transport.connects == 3 and servers.held == 4


# -- the token route's answers (rollout/vllm/in_flight.py), without a server -------------------


def _choice(ids, spans, reason="stop", logprobs=None, index=0):
    logprobs = logprobs if logprobs is not None else [-0.25] * len(ids)
    return {
        "index": index,
        "token_ids": ids,
        "logprobs": {"content": [{"logprob": lp} for lp in logprobs]},
        "weight_versions": [{"start": a, "end": b, "version": v} for a, b, v in spans],
        "finish_reason": reason,
    }


def test_a_choices_version_spans_label_each_token():
    from megatron_gspo.rollout.vllm.in_flight import parse_choice

    c = parse_choice(
        "u", _choice([5, 6, 7, 8, 9], [(0, 2, "3"), (2, 5, "4")], logprobs=[-1, None, -2, -3, -4])
    )
    assert c.token_versions == [3, 3, 4, 4, 4]
    assert c.logprobs[1] == float("-inf") and c.logprobs[0] == -1.0  # vLLM's None is -inf
    started_with = parse_choice("u", _choice([5, 6], [(0, 2, "default")]))
    assert started_with.token_versions == [-1, -1], "the server's own checkpoint is version -1"
    assert parse_choice("u", _choice([], [], reason="length")).token_versions == []


@pytest.mark.parametrize(
    "choice, says",
    [
        (_choice([5, 6], [(0, 1, "3"), (1, 2, "partial")]), "half-finished sync"),
        (_choice([5, 6], []), "weight_versions"),
        ({**_choice([5, 6], [(0, 2, "3")]), "logprobs": {"content": [{"logprob": -1}]}}, "no"),
        (_choice([5, 6], [(0, 2, "3")], reason="cancelled"), "finish_reason"),
    ],
)
def test_a_malformed_or_half_synced_choice_is_refused_by_name(choice, says):
    from megatron_gspo.rollout.vllm.errors import VLLMRequestError
    from megatron_gspo.rollout.vllm.in_flight import parse_choice

    with pytest.raises(VLLMRequestError, match=says):
        parse_choice("http://server:1", choice)


def test_a_resubmitted_samples_parts_join_with_their_own_routes():
    import numpy as np

    from megatron_gspo.rollout.vllm.in_flight import _join

    first = Completion([1, 2], [-0.1, -0.2], "abort", token_versions=[3, 3])
    first.routes = np.full((4, 1, 2), 7)  # prompt of 3 + 2 tokens - 1 rows
    rest = Completion([4], [-0.4], "stop", token_versions=[4])
    rest.routes = np.concatenate([np.full((4, 1, 2), 9), np.full((1, 1, 2), 5)])
    joined = _join(first, rest)
    assert joined.token_ids == [1, 2, 4] and joined.logprobs == [-0.1, -0.2, -0.4]
    assert joined.token_versions == [3, 3, 4] and joined.finish_reason == "stop"
    # The first part's rows come from the forward that sampled them, not the resubmission's.
    assert joined.routes[:, 0, 0].tolist() == [7, 7, 7, 7, 5]


class _ScriptedClient:
    """What complete_versioned asks of the HTTP client: answers in the order given, and every
    request it made."""

    model = None
    version = 4

    def __init__(self, answers, in_flight="resubmit"):
        self.answers, self.requests, self.in_flight = list(answers), [], in_flight
        self.waits = 0

    def weights_version(self):
        return self.version

    def wait_for_weights(self):
        self.waits += 1

    async def _post(self, http, url, path, body):
        self.requests.append((path, body))
        return self.answers.pop(0)


def _complete(client, prompt, params, seed=11):
    import asyncio

    from megatron_gspo.rollout.vllm.in_flight import complete_versioned

    return asyncio.run(complete_versioned(client, None, "u", prompt, params, seed))


def test_an_aborted_sample_is_resubmitted_with_its_tokens_and_the_budget_left():
    from megatron_gspo.rollout.protocol import SamplingParams
    from megatron_gspo.runtime.seeds import resubmit_seed

    params = SamplingParams(group_size=2, max_new_tokens=5, min_new_tokens=3, stop_token_ids=[0])
    client = _ScriptedClient(
        [
            {
                "choices": [
                    _choice([9, 9, 9, 0], [(0, 4, "3")], index=0),
                    _choice([7, 8], [(0, 2, "3")], reason="abort", index=1),
                ]
            },
            {"choices": [_choice([6, 0], [(0, 2, "4")])]},
        ]  # fmt: skip
    )
    done, resumed = _complete(client, [1, 2, 3], params)
    assert done.token_ids == [9, 9, 9, 0] and done.token_versions == [3, 3, 3, 3]
    assert resumed.token_ids == [7, 8, 6, 0] and resumed.token_versions == [3, 3, 4, 4]
    assert resumed.finish_reason == "stop" and client.waits == 1
    (_, first), (_, again) = client.requests
    assert first["token_ids"] == [1, 2, 3] and first["cache_salt"] == "weights-4"
    assert again["token_ids"] == [1, 2, 3, 7, 8], "not sent again as prompt + its tokens"
    sampling = again["sampling_params"]
    assert sampling["n"] == 1 and sampling["max_tokens"] == 3 and sampling["min_tokens"] == 1
    assert sampling["seed"] == resubmit_seed(11, 1, 1)


def test_an_abort_on_the_last_token_ends_by_length_and_keep_refuses_aborts():
    from megatron_gspo.rollout.protocol import SamplingParams
    from megatron_gspo.rollout.vllm.errors import VLLMRequestError

    params = SamplingParams(group_size=1, max_new_tokens=2, stop_token_ids=[0])
    client = _ScriptedClient([{"choices": [_choice([7, 8], [(0, 2, "3")], reason="abort")]}])
    [c] = _complete(client, [1], params)
    assert c.finish_reason == "length" and len(client.requests) == 1, "the budget was spent"
    keep = _ScriptedClient(
        [{"choices": [_choice([7], [(0, 1, "3")], reason="abort")]}], in_flight="keep"
    )
    with pytest.raises(VLLMRequestError, match="aborted a request in flight"):
        _complete(keep, [1], params)
