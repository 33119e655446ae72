"""How the loop samples a step's episodes: sampling parameters, seeds, where episodes run.

The embedded engines run episodes in lock-step (:mod:`.runner`). With
``rollout.max_staleness: 0`` every rank runs them together: the engine's ``generate`` is
collective (the embedded engine decodes on every rank; the generation worker samples on rank 0
and shares the result), and the environment's answers are computed on rank 0 and broadcast turn
by turn. With ``K >= 1`` rank 0 runs them alone, in the rollout pipeline's thread
(``generate_rank0``), and the finished batch is broadcast when a step takes it.

Multi-turn episodes through vLLM advance each on its own (:mod:`.concurrent`), on rank 0; with
``K = 0`` the finished batch is broadcast to every rank.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import Prompt, PromptStream
from megatron_gspo.episodes.concurrent import ConcurrentRunner
from megatron_gspo.episodes.environment import EnvironmentPool
from megatron_gspo.episodes.episode import Episode
from megatron_gspo.episodes.group_pool import GroupPool
from megatron_gspo.episodes.pipeline import OnPolicyRollouts, RolloutPipeline
from megatron_gspo.episodes.render import TurnRenderer
from megatron_gspo.episodes.runner import EpisodeRunner, EpisodeSetup
from megatron_gspo.rollout.protocol import SamplingParams
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.rank0 import on_rank0
from megatron_gspo.runtime.seeds import request_seed, step_seed

__all__ = ["EpisodeSampler"]

Sampled = tuple[list[list[Episode]], dict[str, float]]


class _Shared:
    """A rank-0 runner's episodes (and stats) given to every rank (collective)."""

    def __init__(self, inner) -> None:
        self.inner, self.stats = inner, {}

    def run(self, prompts: list[Prompt], params: SamplingParams) -> list[list[Episode]]:
        episodes, self.stats = on_rank0(lambda: (self.inner.run(prompts, params), self.inner.stats))
        return episodes


class EpisodeSampler:
    """The step's episodes from the recipe's engine and environment (constructed on every rank;
    the environment's workers run on global rank 0)."""

    def __init__(self, recipe: Recipe, engine, stream: PromptStream) -> None:
        self.recipe, self.engine, self.stream = recipe, engine, stream
        r = recipe.rollout
        stop = tuple(r.stop_token_ids or [stream.tokenizer.eos_id])
        self.params = SamplingParams(
            group_size=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=stop,
            return_routes=recipe.wants_rollout_routes,
        )
        self.multi = r.multi_turn
        self.envs: EnvironmentPool | None = None
        render: TurnRenderer | None = None
        if self.multi is not None and dist.get_rank() == 0:
            self.envs = EnvironmentPool(
                self.multi.env,
                self.multi.env_kwargs,
                timeout_s=recipe.reward.timeout_s,
                workers=self.multi.workers,
            )
            stop_text = stream.tokenizer.token_text(stop[0]) if stream.chat else None
            render = TurnRenderer(
                stream.tokenizer, stream.chat, role=self.multi.observation_role, stop_text=stop_text
            )
            self.envs.start()
        self.setup = EpisodeSetup(
            multi_turn=self.multi is not None,
            max_turns=self.multi.max_turns if self.multi is not None else 1,
            max_seq_length=recipe.model.max_seq_length,
            end_on_cut_turn=self.multi.end_on_cut_turn if self.multi is not None else True,
            envs=self.envs,
            render=render,
            decode=stream.tokenizer.decode if dist.get_rank() == 0 else None,
        )

    def runner(self, *, alone: bool):
        """An episode runner (``run(prompts, params) -> episodes``) for every rank together,
        or for rank 0 ``alone`` (None elsewhere)."""
        rank0 = dist.get_rank() == 0
        if alone and not rank0:
            return None
        caps = self.engine.capabilities
        if alone and not caps.rank0_generation:
            raise InputError(
                f"rollout.engine {self.recipe.rollout.engine!r} cannot sample from rank 0 alone, "
                "which rollout.max_staleness >= 1 needs"
            )
        if self.multi is not None and caps.concurrent_episodes:
            concurrent = None
            if rank0:
                concurrent = ConcurrentRunner(
                    self.engine.client,
                    self.engine.check_versions,
                    self.setup,
                    max_inflight=self.recipe.rollout.vllm.max_inflight,
                )
            return concurrent if alone else _Shared(concurrent)
        return EpisodeRunner(
            self.engine.generate_rank0 if alone else self.engine.generate,
            self.setup,
            share=(lambda fn: fn()) if alone else on_rank0,
        )

    def step_seed(self, step: int, salt: int = 0) -> int:
        """The sampling seed of a step's rollout batch (:mod:`megatron_gspo.runtime.seeds`)."""
        return step_seed(self.recipe.rollout.seed, step, salt)

    def rollout(self, step: int, prompts: list[Prompt], *, salt: int = 0) -> Sampled:
        """The step's episodes and how they were sampled, on every rank (collective); ``salt``
        varies the seed for more batches within a step (dynamic sampling)."""
        runner = self.runner(alone=False)
        params = replace(self.params, seed=self.step_seed(step, salt))
        return runner.run(prompts, params), dict(runner.stats)

    def rollouts(self, *, next_step: int) -> OnPolicyRollouts | RolloutPipeline | GroupPool:
        """On-policy sampling (``max_staleness: 0``) or the asynchronous pipeline."""

        def draw(step: int) -> list[Prompt]:
            return self.stream.next_batch(self.recipe.rollout.prompts_per_step)

        k = self.recipe.rollout.max_staleness
        if k == 0:
            return OnPolicyRollouts(self.rollout, draw)
        runner = self.runner(alone=True)
        in_flight = self.recipe.rollout.in_flight_updates

        def ahead(step: int, prompts: list[Prompt]) -> Sampled:
            # In flight, batches run side by side: each its own runner (they keep counts).
            own = self.runner(alone=True) if in_flight is not None else runner
            episodes = own.run(prompts, replace(self.params, seed=self.step_seed(step)))
            return episodes, dict(own.stats)

        groups = None if in_flight is None else in_flight.groups_in_flight
        if groups is not None:
            return GroupPool(
                self._one_group if runner is not None else None,
                draw,
                per_step=self.recipe.rollout.prompts_per_step,
                groups_in_flight=groups,
                max_staleness=k,
                next_step=next_step,
                wait_timeout_s=_group_deadline(self.recipe),
            )
        return RolloutPipeline(
            ahead if runner is not None else None,
            draw,
            max_staleness=k,
            next_step=next_step,
            in_flight=in_flight is not None,
        )

    def _one_group(self, step: int, index: int, prompt: Prompt) -> tuple[list[Episode], dict]:
        """The group of prompt ``index`` of step ``step``'s draw, seeded as in a whole batch."""
        runner = self.runner(alone=True)
        seed = request_seed(self.step_seed(step), index, self.params.group_size)
        [episodes] = runner.run([prompt], replace(self.params, seed=seed))
        return episodes, dict(runner.stats)

    def close(self) -> None:
        if self.envs is not None:
            self.envs.close()


def _group_deadline(recipe: Recipe) -> float:
    """The longest a group may take once started: each turn's request and environment call
    within their deadlines, and a sync it may wait for (rollout.vllm, reward.timeout_s)."""
    turns = recipe.rollout.multi_turn.max_turns if recipe.rollout.multi_turn else 1
    vllm = recipe.rollout.vllm
    return turns * (vllm.request_timeout_s + recipe.reward.timeout_s) + vllm.sync_timeout_s
