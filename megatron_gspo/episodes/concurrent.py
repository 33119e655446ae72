"""Concurrent episodes through vLLM: each episode advances on its own.

Lock-step (:mod:`.runner`) waits, at every turn, for the slowest environment call of the batch
before any episode samples its next turn. Here every episode is an asyncio task on global
rank 0: it requests its next turn from its server as soon as its environment (a tool call,
say) has answered, so environment time hides behind other episodes' generation, and a
straggler holds up only itself. Each turn is one ``/v1/completions`` request with the
episode's whole history as prompt ids (token-in, token-out; vLLM's prefix cache makes the
history cheap to read again); environment calls run in the environment's worker processes and
are awaited as futures. At most ``rollout.vllm.max_inflight`` episodes per server are in
flight at a time. Each turn goes where the fleet routes it (:mod:`megatron_gspo.rollout.vllm.
fleet`: the least loaded serving server), and an episode's turns stay on the server its first
turn went to while that serves (its prefix cache holds the episode's history); if it dies,
the episode's next turn, or the turn it had under way, goes to another.

Seeds: episode ``k`` (of the batch, group by group) samples its turn ``t`` with
``episode_turn_seed(seed, t, k)`` (:mod:`megatron_gspo.runtime.seeds`); its first turn is the
sample lock-step's first request gives it.
Every turn is stamped with the weights version its server held: the engine syncs only between
batches, with nothing in flight, so the turns of one episode share one version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megatron_gspo.data.prompts import Prompt
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.runner import (
    EpisodeSetup,
    Held,
    Verdict,
    after_reset,
    apply_verdict,
    verdict,
)
from megatron_gspo.rollout.protocol import SamplingParams, longest_completion
from megatron_gspo.runtime.seeds import episode_turn_seed

__all__ = ["ConcurrentRunner"]


class ConcurrentRunner:
    """Runs episodes on rank 0 against an engine whose episodes can each advance on their own
    (``capabilities.concurrent_episodes``: the vLLM engine): ``client`` requests one turn at a
    time (the engine's), ``versions()`` checks every server's weights version and returns them
    by URL (the engine's ``check_versions``). ``setup`` holds the environment: this runs where
    it does."""

    def __init__(
        self,
        client,
        versions: Callable[[], dict[str, Any]],
        setup: EpisodeSetup,
        *,
        max_inflight: int,
    ) -> None:
        assert setup.envs is not None and setup.render is not None and setup.decode is not None
        self.client, self.versions = client, versions
        self.setup, self.max_inflight = setup, max_inflight
        self.stats: dict[str, float] = {}

    def run(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Episode]]:
        """``group_size`` episodes for every prompt, grouped by prompt."""
        if not prompts:
            return []
        versions = self.versions()
        episodes = asyncio.run(self._run(prompts, params, versions))
        g = params.group_size
        return [episodes[k : k + g] for k in range(0, len(episodes), g)]

    async def _run(self, prompts: list[Prompt], params: SamplingParams, versions) -> list:
        gate = asyncio.Semaphore(self.max_inflight * len(self.client.fleet.urls))
        self._in_flight = self._most = 0
        g = params.group_size
        async with self.client.session() as http:
            episodes = await asyncio.gather(
                *[
                    self._episode(http, k, prompts[k // g], params, gate, versions)
                    for k in range(len(prompts) * g)
                ]
            )
        self.stats = {"episodes_in_flight_max": float(self._most)}
        return list(episodes)

    async def _episode(self, http, k: int, prompt: Prompt, params, gate, versions) -> Episode:
        limits = self.setup.limits(params.max_new_tokens)
        session = object()  # this episode's: its turns stay on one server while it serves
        async with gate:
            self._in_flight += 1
            self._most = max(self._most, self._in_flight)
            try:
                return await self._turns(http, session, k, prompt, params, limits, versions)
            finally:
                self._in_flight -= 1
                self.client.fleet.forget(session)

    async def _turns(self, http, session, k, prompt, params, limits, versions) -> Episode:
        e, envs = Episode(), self.setup.envs
        reset = asyncio.wrap_future(envs.reset(prompt.text, prompt.answer))
        state: Held | Verdict | None = None
        for turn in range(self.setup.max_turns):
            sampling = replace(params, group_size=1, seed=episode_turn_seed(params.seed, turn, k))
            ids = prompt.token_ids + e.token_ids
            url, [c] = await self.client.fleet.routed(
                lambda u, ids=ids, s=sampling: self.client.complete(http, u, ids, s, s.seed),
                session=session,
                tokens=longest_completion,
            )
            c.stamp(versions.get(url, self.client.fleet.version))
            e.add_model_turn(c)
            if state is None:
                state = after_reset(await reset)
            if isinstance(state, Verdict):
                v = state
            else:
                action = self.setup.decode(e.turn_tokens(turn))
                outcome = await asyncio.wrap_future(envs.step(state.state, action))
                v = verdict(outcome, self.setup.render)
                if outcome.ok:
                    state = Held(outcome.value.state)
            if not apply_verdict(e, len(prompt.token_ids), c, v, turn, limits):
                break
        return e
