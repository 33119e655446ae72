"""Episodes without a model: the runner, environments in their workers, rendering, credit,
and the scoring of failed samples."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.data.tasks import SyntheticTask
from megatron_gspo.episodes.environment import EnvironmentPool, check_environment
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.render import TurnRenderer
from megatron_gspo.episodes.runner import EpisodeRunner, EpisodeSetup
from megatron_gspo.loss.advantages import group_advantages, returns_to_go, turn_advantages
from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)
from tests.support.qwen_style import make_tokenizer_dir

TASK = SyntheticTask("relay_digits", min_len=1, max_len=3, turns=3)
TOK = TASK.tokenizer
EQ = TOK.encode("=")[0]


def copying_policy(chatty_from: int | None = None, layers: int = 2):
    """A fake engine that copies the digits before the context's last "=" and stops; from
    turn ``chatty_from`` on it never stops. Routes: every row read by the forward of turn k
    is k (so an episode's routes show which forward read each token)."""
    calls = []

    def generate(request) -> RolloutResult:
        turn = len(calls)
        calls.append(request)
        groups = []
        for context in request.prompts:
            end = len(context) - 1
            start = max(i for i in range(end) if context[i] in (TOK.BOS, TOK.EOS)) + 1
            ids = context[start:end] + [TOK.EOS]
            reason = "stop"
            if chatty_from is not None and turn >= chatty_from:
                ids, reason = [TOK.encode("9")[0]] * request.params.max_new_tokens, "length"
            routes = None
            if request.params.return_routes:
                routes = np.full((len(context) + len(ids) - 1, layers, 2), turn, dtype=np.uint8)
            groups.append(
                [
                    Completion(ids, [-0.5] * len(ids), reason, policy_version=turn, routes=routes)
                    for _ in range(request.params.group_size)
                ]
            )
        return RolloutResult(groups)

    return generate, calls


def prompts(n: int = 2) -> list[Prompt]:
    out = []
    for i in range(n):
        r = TASK.example(i, seed=0)
        out.append(Prompt(r["prompt"], r["answer"], [TOK.BOS, *TOK.encode(r["prompt"])]))
    return out


PARAMS = SamplingParams(group_size=2, max_new_tokens=4, stop_token_ids=(TOK.EOS,), seed=5)


@pytest.fixture(scope="module")
def relay():
    pool = EnvironmentPool("relay_digits", {}, timeout_s=30.0, workers=2)
    yield pool
    pool.close()


def setup(envs, **kw) -> EpisodeSetup:
    return EpisodeSetup(
        multi_turn=True,
        max_turns=kw.pop("max_turns", 3),
        max_seq_length=kw.pop("max_seq_length", 64),
        end_on_cut_turn=kw.pop("end_on_cut_turn", True),
        envs=envs,
        render=TOK.encode,
        decode=TOK.decode,
    )


def runner(generate, envs, **kw) -> EpisodeRunner:
    return EpisodeRunner(generate, setup(envs, **kw))


def test_a_policy_that_reads_observations_completes_every_turn(relay):
    generate, calls = copying_policy()
    ps = prompts()
    groups = runner(generate, relay).run(ps, replace_params(return_routes=True))
    assert [len(g) for g in groups] == [2, 2]
    e = groups[0][0]
    parts = ps[0].answer.split("|")
    # model turn, observation, model turn, observation, model turn; never re-tokenized.
    want, mask, turns = [], [], []
    for k, part in enumerate(parts):
        ids = TOK.encode(part) + [TOK.EOS]
        want += ids
        mask += [1] * len(ids)
        turns += [k] * len(ids)
        if k + 1 < len(parts):
            obs = TOK.encode(parts[k + 1] + "=")
            want += obs
            mask += [0] * len(obs)
            turns += [k] * len(obs)
    assert e.token_ids == want and e.mask == mask and e.turn_ids == turns
    assert e.logprobs == [-0.5 if m else 0.0 for m in mask]
    assert e.turn_rewards == [1.0, 1.0, 1.0] and e.end == "done" and e.versions == [0, 1, 2]
    # Turn 0 samples group_size per prompt; later turns one per live episode, other seeds.
    assert calls[0].params.group_size == 2 and len(calls[0].prompts) == 2
    assert calls[1].params.group_size == 1 and len(calls[1].prompts) == 4
    assert len({c.params.seed for c in calls}) == 3
    # Routes: each token's row from the forward that first read it, covering every token
    # the model reads.
    p, n0 = len(ps[0].token_ids), len(parts[0]) + 1
    assert e.routes.shape[0] == p + len(e.token_ids) - 1
    assert (e.routes[: p + n0 - 1] == 0).all() and (e.routes[p + n0 - 1] == 1).all()
    assert (e.routes[-1] == 2).all()


def replace_params(**kw) -> SamplingParams:
    from dataclasses import replace

    return replace(PARAMS, **kw)


def test_episodes_end_at_the_turn_limit_the_budget_or_a_cut_turn(relay):
    generate, _ = copying_policy()
    e = runner(generate, relay, max_turns=2).run(prompts(1), PARAMS)[0][0]
    assert e.num_turns == 2 and e.end == "max_turns" and len(e.turn_rewards) == 2
    assert e.mask[-1] == 1, "an observation no model turn reads was appended"
    generate, _ = copying_policy()
    # Room for the prompt and one turn only: the next observation and turn would not fit.
    e = runner(generate, relay, max_seq_length=12).run(prompts(1), PARAMS)[0][0]
    assert e.num_turns == 1 and e.end == "budget"
    generate, _ = copying_policy(chatty_from=1)
    e = runner(generate, relay).run(prompts(1), PARAMS)[0][0]
    assert e.num_turns == 2 and e.end == "length" and e.truncated
    # Where the task tolerates a cut turn, the episode goes on.
    generate, _ = copying_policy(chatty_from=1)
    e = runner(generate, relay, end_on_cut_turn=False).run(prompts(1), PARAMS)[0][0]
    assert e.num_turns == 3 and e.end == "done" and e.truncated


def test_single_turn_is_the_engines_completions_as_they_are():
    generate, _ = copying_policy()
    r = EpisodeRunner(generate, EpisodeSetup(multi_turn=False, max_seq_length=64))
    groups = r.run(prompts(), PARAMS)
    e = groups[1][1]
    assert e.mask == [1] * len(e.token_ids) and e.num_turns == 1 and e.turn_rewards == []


@pytest.mark.parametrize(
    "env, kwargs, end, message",
    [
        ("tests.support.faulty_envs:FlakyRelay", {"raise_on": ""}, "env_error", "broke on"),
        ("tests.support.faulty_envs:FlakyRelay", {"hang_on": ""}, "env_timeout", "within 1 s"),
        ("tests.support.faulty_envs:Unpicklable", {}, "env_error", "reset"),
        ("tests.support.faulty_envs:BadStep", {}, "env_error", "not an environment Step"),
    ],
    ids=["raises", "hangs", "unpicklable-state", "malformed-step"],
)
def test_a_failing_environment_ends_its_episode_and_nothing_else(env, kwargs, end, message):
    pool = EnvironmentPool(env, kwargs, timeout_s=1.0, workers=2)
    try:
        generate, _ = copying_policy()
        groups = runner(generate, pool).run(prompts(), PARAMS)
    finally:
        pool.close()
    for e in [e for g in groups for e in g]:
        assert e.end == end and message in e.failure, (e.end, e.failure)
        assert e.num_turns == 1 and e.token_ids, "the first turn is still the model's"


def test_environment_names_and_kwargs_are_checked_at_start():
    with pytest.raises(ValueError, match="unknown environment 'relay'"):
        check_environment("relay", {})
    with pytest.raises(ValueError, match="cannot import 'nowhere:Env'"):
        check_environment("nowhere:Env", {})
    with pytest.raises(ValueError, match=r"cannot take kwargs \['colour'\]"):
        check_environment("relay_digits", {"colour": 1})


def test_episode_json_round_trip_keeps_every_field():
    e = Episode()
    e.add_model_turn(Completion([4, 5, 2], [-1.0, -2.0, -0.1], "stop", 3, np.ones((5, 2, 2))))
    e.add_observation([6, 13])
    e.turn_rewards.append(0.5)
    e.end, e.failure = "env_error", "boom"
    back = Episode.from_json(e.to_json())
    assert {k: v for k, v in vars(back).items() if k != "routes"} == {
        k: v for k, v in vars(e).items() if k != "routes"
    }
    assert np.array_equal(back.routes, e.routes)


# ------------------------------------------------------------------------------------------
# Rendering with a chat template
# ------------------------------------------------------------------------------------------


def test_an_observation_gets_the_templates_own_glue(tmp_path):
    from megatron_gspo.data.chat import ChatTemplate
    from megatron_gspo.data.tokenizer import load_tokenizer

    directory = make_tokenizer_dir(tmp_path / "tok")
    tok = load_tokenizer(directory)
    chat = ChatTemplate(directory, system_prompt=None, kwargs={})
    render = TurnRenderer(tok, chat, role="tool", stop_text="<|im_end|>")
    assert (render.before, render.after) == (
        "\n<|im_start|>tool\n",
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    # The model's turn (ids, ending in its stop token) plus the rendered observation read as
    # the template renders the whole conversation.
    answer = tok.encode("12") + [tok.eos_id]
    history = chat.render_messages(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "12"},
            {"role": "tool", "content": "7"},
        ],
        add_generation_prompt=True,
    )
    prefix = chat.render_messages([{"role": "user", "content": "q"}], add_generation_prompt=True)
    assert tok.encode(prefix) + answer + render("7") == tok.encode(history)
    with pytest.raises(ValueError, match="not with the stop token '<eos>'"):
        TurnRenderer(tok, chat, stop_text="<eos>")


# ------------------------------------------------------------------------------------------
# Credit
# ------------------------------------------------------------------------------------------


def test_returns_to_go():
    assert returns_to_go([1.0, 0.0, 2.0], 0.5) == [3.5, 2.5, 2.5]
    assert returns_to_go([], 1.0) == []


def test_turn_advantages_by_hand():
    # One group of 3 episodes with 2, 1 and 2 turns.
    returns = [[3.0, 1.0], [1.0], [2.0, 2.0]]
    adv = turn_advantages(returns, 3, eps=0.0)
    m0, s0 = 2.0, 1.0  # turn 1: {3, 1, 2}, sample std 1
    m1, s1 = 1.5, math.sqrt(0.5)  # turn 2: {1, 2}
    expected = [[(3 - m0) / s0, (1 - m1) / s1], [(1 - m0) / s0], [(2 - m0) / s0, (2 - m1) / s1]]
    for got, want in zip(adv, expected, strict=True):
        assert got == pytest.approx(want)
    # A turn reached by one episode of its group has no baseline; equal returns no signal.
    assert turn_advantages([[1.0, 5.0], [2.0]], 2)[0][1] == 0.0
    assert turn_advantages([[1.0], [1.0]], 2) == [[0.0], [0.0]]


def test_one_turn_credit_is_the_group_advantage():
    rewards = torch.randn(12, generator=torch.Generator().manual_seed(0))
    by_turn = turn_advantages([[float(r)] for r in rewards], 4)
    assert [a[0] for a in by_turn] == pytest.approx(group_advantages(rewards, 4).tolist())


# ------------------------------------------------------------------------------------------
# Scoring: failed samples, dropped groups, the error-fraction stop
# ------------------------------------------------------------------------------------------


def _score(rank, world, recipe_data: dict, groups_json, prompt_list, reward_name=None):
    """Score given episodes on one rank (the Scorer broadcasts from rank 0)."""
    from megatron_gspo.episodes.scoring import Scorer
    from megatron_gspo.rewards.computer import RewardComputer

    recipe = Recipe.model_validate(recipe_data)
    import torch.distributed as dist  # noqa: F401 - the process group exists (run_distributed)

    groups = [[Episode.from_json(e) for e in g] for g in groups_json]
    rewards = RewardComputer(recipe.reward) if recipe.reward.functions else None
    try:
        samples, metrics = Scorer(recipe, rewards, TOK.decode)(prompt_list, groups)
    except ValueError as e:
        return "error", str(e)
    finally:
        if rewards is not None:
            rewards.close()
    return [(s.prompt_index, s.advantage, s.token_advantages, s.response_mask) for s in samples], (
        metrics
    )


def _relay_recipe(**sections) -> dict:
    from tests.support.rl_fixtures import tiny_recipe

    data = tiny_recipe().model_dump()
    data["data"] = {"task": "relay_digits", "task_options": {"turns": 3}}
    data["rollout"].update(group_size=2, multi_turn={"env": "relay_digits", "max_turns": 3})
    data["reward"].update(functions=[])
    for name, values in sections.items():
        data[name].update(values)
    return data


def _episode(rewards: list[float], failure: str | None = None) -> dict:
    e = Episode()
    for k, r in enumerate(rewards):
        e.add_model_turn(Completion([4 + k, 2], [-1.0, -1.0], "stop", 0))
        e.turn_rewards.append(r)
        if k + 1 < len(rewards):
            e.add_observation([5, 13])
    if failure:
        e.end, e.failure = "env_error", failure
    return e.to_json()


def test_drop_group_takes_out_exactly_the_groups_with_a_failure():
    from tests.support.ranks import run_distributed

    groups = [
        [_episode([1.0, 0.0]), _episode([0.0, 1.0])],
        [_episode([1.0], failure="step: boom"), _episode([0.5, 0.5])],
        [_episode([0.0, 0.0, 1.0]), _episode([1.0, 1.0, 1.0])],
    ]
    ps = prompts(3)
    data = _relay_recipe(reward={"max_error_fraction": 0.5})
    samples, metrics = run_distributed(_score, 1, data, groups, ps)[0]
    assert [s[0] for s in samples] == [0, 0, 2, 2]
    assert metrics["groups_dropped_on_error"] == 1 and metrics["env_errors"] == 1
    assert metrics["turns_mean"] == pytest.approx(13 / 6)
    # Zero instead: every group stays, the failed episode scored on what it had.
    data = _relay_recipe(reward={"max_error_fraction": 0.5, "on_error": "zero"})
    samples, metrics = run_distributed(_score, 1, data, groups, ps)[0]
    assert [s[0] for s in samples] == [0, 0, 1, 1, 2, 2]
    assert metrics["groups_dropped_on_error"] == 0
    # Too many failures: the run stops, naming the first.
    data = _relay_recipe(reward={"max_error_fraction": 0.1})
    status, message = run_distributed(_score, 1, data, groups, ps)[0]
    assert status == "error" and "1 of 6 samples" in message and "boom" in message


def test_turn_level_credit_reaches_each_token_of_its_turn():
    from tests.support.ranks import run_distributed

    groups = [[_episode([1.0, 0.0]), _episode([0.0, 1.0])]]
    data = _relay_recipe(loss={"name": "gspo_token", "advantage_level": "turn"})
    samples, _ = run_distributed(_score, 1, data, groups, prompts(1))[0]
    (_, adv_a, tok_a, mask_a), (_, adv_b, _, _) = samples
    # Episode totals are equal (1 and 1): no sequence-level signal at all.
    assert adv_a == adv_b == 0.0
    # Returns-to-go: a = [1, 0], b = [1, 1]: turn 1 equal (0), turn 2 a below b.
    turn2 = -0.5 / (math.sqrt(0.5) + 1e-6)  # {0, 1}: mean 0.5, sample std sqrt(1/2)
    want = [0.0, 0.0, 0.0, 0.0, turn2, turn2]
    assert tok_a == pytest.approx(want) and mask_a == [1, 1, 0, 0, 1, 1]


# ------------------------------------------------------------------------------------------
# Concurrent episodes (the vLLM engine's runner), against an engine that answers in-process
# ------------------------------------------------------------------------------------------


class _Session:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class FakeServers:
    """Two "servers" answering each request with the copying policy after a short wait."""

    urls = ["http://a", "http://b"]

    def __init__(self, **policy) -> None:
        from megatron_gspo.rollout.vllm.fleet import Fleet, Health

        self.generate, self.calls = copying_policy(**policy)
        self.busy = {url: 0 for url in self.urls}
        self.most = 0
        self.served: list[tuple[str, tuple]] = []  # (server, the prompt ids it was sent)
        self.dead: set[str] = set()
        self.fleet = Fleet(
            self.urls,
            lambda url, deadline: Health(None) if url in self.dead else Health(200, 7),
            health_timeout_s=1,
        )

    def session(self) -> _Session:
        return _Session()

    async def complete(self, http, url, prompt, params, seed):
        self.busy[url] += 1
        self.most = max(self.most, self.busy[url])
        self.served.append((url, tuple(prompt)))
        await asyncio.sleep(0.01)
        self.busy[url] -= 1
        if url in self.dead:
            from megatron_gspo.rollout.vllm.errors import VLLMUnavailableError

            raise VLLMUnavailableError(f"vLLM server {url} unavailable: ConnectError")
        return self.generate(RolloutRequest([prompt], replace(params, seed=seed))).completions[0]


def test_concurrent_episodes_follow_the_same_rules_and_bound_what_is_in_flight(relay):
    from megatron_gspo.episodes.concurrent import ConcurrentRunner

    servers = FakeServers()
    concurrent = ConcurrentRunner(
        servers, lambda: {url: 7 for url in servers.urls}, setup(relay), max_inflight=2
    )
    ps = prompts(4)
    groups = concurrent.run(ps, PARAMS)
    generate, _ = copying_policy()
    lockstep = runner(generate, relay).run(ps, PARAMS)
    # The copying policy answers alike whatever the seed: the two runners' episodes agree.
    for got, want in zip(sum(groups, []), sum(lockstep, []), strict=True):
        assert (got.token_ids, got.mask, got.turn_ids) == (want.token_ids, want.mask, want.turn_ids)
        assert got.turn_rewards == want.turn_rewards == [1.0, 1.0, 1.0] and got.end == "done"
        assert got.versions == [7, 7, 7]
    assert concurrent.stats["episodes_in_flight_max"] == 4  # 2 per server
    assert servers.most <= 2
    # Seeds: episode k samples turn t with episode_turn_seed(seed, t, k) = turn_seed(...) + k.
    seeds = sorted({c.params.seed for c in servers.calls})
    assert PARAMS.seed in seeds and PARAMS.seed + 7 in seeds


def _recording(servers: FakeServers) -> dict[object, list[str]]:
    """The server of each turn, by episode (the runner's session object for it)."""
    sent: dict[object, list[str]] = {}
    acquire = servers.fleet.acquire

    def recording(session=None, seqs=1):
        url = acquire(session, seqs)
        if url is not None:
            sent.setdefault(session, []).append(url)
        return url

    servers.fleet.acquire = recording
    return sent


def test_an_episodes_turns_stay_on_its_server_and_move_only_when_it_dies(relay):
    from megatron_gspo.episodes.concurrent import ConcurrentRunner

    def run(servers):
        sent = _recording(servers)
        versions = {url: 7 for url in servers.urls}
        runner = ConcurrentRunner(servers, lambda: versions, setup(relay), max_inflight=2)
        return runner.run(prompts(4), PARAMS), sent

    healthy, sent = run(FakeServers())
    assert len(sent) == 8 and all(len(urls) == 3 for urls in sent.values())
    assert all(len(set(urls)) == 1 for urls in sent.values()), "an episode changed server"
    assert {urls[0] for urls in sent.values()} == {"http://a", "http://b"}, "not spread"

    servers = FakeServers()
    original = servers.complete

    async def dies_after_its_first_turns(http, url, prompt, params, seed):
        if url == "http://b" and sum(u == url for u, _ in servers.served) >= 4:
            servers.dead.add(url)  # killed: it refuses from here on
        return await original(http, url, prompt, params, seed)

    servers.complete = dies_after_its_first_turns
    moved, sent = run(servers)
    for got, want in zip(sum(moved, []), sum(healthy, []), strict=True):
        assert (got.token_ids, got.mask, got.end) == (want.token_ids, want.mask, want.end)
    from_b = [urls for urls in sent.values() if urls[0] == "http://b"]
    assert from_b and all(urls[-1] == "http://a" for urls in from_b), sent
    assert all(len(set(urls)) == 1 for urls in sent.values() if urls[0] == "http://a")
    assert servers.fleet.take_metrics()["fleet_failovers"] >= len(from_b)


def test_concurrent_episodes_end_alone_on_a_failing_environment():
    from megatron_gspo.episodes.concurrent import ConcurrentRunner

    pool = EnvironmentPool(
        "tests.support.faulty_envs:FlakyRelay", {"hang_on": ""}, timeout_s=1.0, workers=2
    )
    servers = FakeServers()
    try:
        groups = ConcurrentRunner(
            servers, lambda: {url: None for url in servers.urls}, setup(pool), max_inflight=8
        ).run(prompts(2), PARAMS)
    finally:
        pool.close()
    for e in sum(groups, []):
        assert e.end == "env_timeout" and e.num_turns == 1 and e.versions == [None]
