"""What one training run holds, built at start-up in dependency order and released at its end.

The loop (:mod:`megatron_gspo.train`) reads as the algorithm; this module is where its parts
come from: the process groups, the prompts, the reward functions, the policy and its trainer,
the rollout engine and the episodes it samples, checkpoints (and resuming from one), metrics.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_gspo.checkpoint import Checkpointer
from megatron_gspo.config import Recipe
from megatron_gspo.data.packing import Sample
from megatron_gspo.data.prompts import PromptStream
from megatron_gspo.data.rewards import RewardComputer
from megatron_gspo.dynamic_sampling import fill_with_signal
from megatron_gspo.episodes.sampling import EpisodeSampler
from megatron_gspo.episodes.scoring import Scorer
from megatron_gspo.evaluation import eval_prompts, evaluate, is_eval_step
from megatron_gspo.metrics import MetricsLogger
from megatron_gspo.parallel import ParallelGroups
from megatron_gspo.policy import Policy
from megatron_gspo.rollout import make_engine
from megatron_gspo.train_step import GSPOTrainer

__all__ = ["Session"]

log = logging.getLogger(__name__)


def _check_recipe(recipe: Recipe) -> int:
    """What the loop needs of the recipe beyond its schema; the prompt token budget."""
    if recipe.data is None:
        raise ValueError("the recipe has no data section (data.task or data.path)")
    if recipe.rollout.max_new_tokens >= recipe.model.max_seq_length:
        raise ValueError(
            f"rollout.max_new_tokens ({recipe.rollout.max_new_tokens}) leaves no room for a "
            f"prompt within model.max_seq_length ({recipe.model.max_seq_length})"
        )
    return recipe.model.max_seq_length - recipe.rollout.max_new_tokens


class Session:
    """The parts of a run, on every rank (rank 0 alone owns the reward and environment
    workers and writes the metrics)."""

    def __init__(
        self, recipe: Recipe, run_dir: Path, groups: ParallelGroups, *, resume: bool
    ) -> None:
        self.recipe, self.run_dir, self.groups = recipe, run_dir, groups
        self.rank0 = dist.get_rank() == 0
        max_prompt_tokens = _check_recipe(recipe)
        self.stream = PromptStream(
            recipe.data, seed=recipe.rollout.seed, max_prompt_tokens=max_prompt_tokens
        )
        tokenizer = self.stream.tokenizer
        if tokenizer.vocab_size > recipe.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                f"{recipe.model.vocab_size}"
            )
        self.eval_set = eval_prompts(recipe, max_prompt_tokens) if recipe.eval.every else []
        self.rewards = None
        if self.rank0 and recipe.reward.functions:
            self.rewards = RewardComputer(recipe.reward)
            self.rewards.start()
        self.policy = Policy(recipe, self.groups)
        self.trainer = GSPOTrainer(self.policy)
        self.engine = make_engine(recipe, self.policy)
        self.sampler = EpisodeSampler(recipe, self.engine, self.stream)
        self.scorer = Scorer(recipe, self.rewards, tokenizer.decode if self.rank0 else None)
        self.checkpoints = Checkpointer(
            run_dir / "checkpoints", self.policy, keep=recipe.run.keep_checkpoints
        )
        self.start, self.best_eval = 0, None
        state = self._resume_or_init(resume)
        # Whatever a server loaded at start-up, it samples from the trainer's weights from
        # here on; the weights version is the number of steps applied.
        self.engine.sync_weights(self.start)
        self.logger = MetricsLogger(
            run_dir,
            enabled=self.rank0,
            tensorboard=recipe.run.tensorboard,
            wandb_project=recipe.run.wandb_project,
            resume_step=self.start,
            config=recipe.model_dump(),
        )
        self.rollouts = self.sampler.rollouts(next_step=self.start + 1)
        if state is not None:
            self.rollouts.restore(state.get("rollout_queue", []))

    def _resume_or_init(self, resume: bool) -> dict[str, Any] | None:
        latest = self.checkpoints.latest_step() if resume else None
        if latest is not None:
            state = self.checkpoints.load(latest)
            self.start, self.stream.position = latest, state["data_position"]
            self.stream.skipped = state.get("prompts_skipped", 0)
            self.best_eval = state.get("eval_best")
            log.info("resumed from %s at step %d", self.checkpoints.dir, self.start)
            return state
        if self.recipe.run.init_from:
            self.policy.load_weights(self.recipe.run.init_from)
            log.info("initial weights from %s", self.recipe.run.init_from)
        return None

    # -- the loop's parts ----------------------------------------------------------------------

    def fill(self, step: int, samples: list[Sample], metrics: dict[str, float]) -> list[Sample]:
        """DAPO's dynamic sampling, where the recipe asks for it: more prompts until enough
        groups carry a signal."""
        ds = self.recipe.rollout.dynamic_sampling
        if ds is None:
            return samples

        def more(round_: int) -> list[Sample]:
            prompts = self.stream.next_batch(self.recipe.rollout.prompts_per_step)
            episodes, _ = self.sampler.rollout(step, prompts, salt=round_)
            return self.scorer(prompts, episodes)[0]

        samples, filled = fill_with_signal(
            samples, more, want=self.recipe.rollout.prompts_per_step, max_rounds=ds.max_rounds
        )
        metrics.update(filled)
        return samples

    def evaluate(self, step: int) -> dict[str, float]:
        """The eval metrics on the weights the engine holds (no generation in flight)."""
        alone = self.recipe.rollout.max_staleness > 0
        return evaluate(
            self.sampler.runner(alone=alone),
            self.eval_set,
            self.stream.tokenizer.decode if self.rank0 else None,
            self.rewards,
            self.recipe,
            step=step,
            params=self.sampler.params,
        )

    def is_eval_step(self, step: int, total: int) -> bool:
        return is_eval_step(self.recipe, step, total)

    def save(self, step: int, *, best: bool) -> None:
        # Batches already generated for later steps are saved, so a resumed run trains on
        # exactly what this one would have.
        self.checkpoints.save(
            step,
            {
                "data_position": self.stream.position,
                "prompts_skipped": self.stream.skipped,
                "rollout_queue": self.rollouts.state(),
                "eval_best": self.best_eval,
            },
        )
        if best:
            self.checkpoints.mark_best(step)

    def close(self) -> None:
        self.rollouts.close()
        self.logger.close()
        self.engine.close()
        self.sampler.close()
        if self.rewards is not None:
            self.rewards.close()
