"""What one training run holds, built at start-up in dependency order and released at its end.

The loop (:mod:`megatron_gspo.run.loop`) reads as the algorithm; this module is where its parts
come from: the process groups, the prompts, the reward functions, the policy and its trainer,
the rollout engine and the episodes it samples, checkpoints (and resuming from one), metrics.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist
import yaml

from megatron_gspo.config import Recipe
from megatron_gspo.data.prompts import PromptStream
from megatron_gspo.episodes.dynamic_sampling import fill_with_signal
from megatron_gspo.episodes.sampling import EpisodeSampler
from megatron_gspo.episodes.scoring import Scorer
from megatron_gspo.parallel import ParallelGroups
from megatron_gspo.rewards.computer import RewardComputer
from megatron_gspo.rollout import make_engine
from megatron_gspo.run.checkpoint import Checkpointer
from megatron_gspo.run.evaluation import eval_prompts, evaluate, is_eval_step
from megatron_gspo.run.kl_guard import RolloutKLGuard
from megatron_gspo.run.metrics import MetricsLogger
from megatron_gspo.run.rundir import Start, begin
from megatron_gspo.trainer.packing import Sample
from megatron_gspo.trainer.policy import Policy
from megatron_gspo.trainer.step import GSPOTrainer

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """The parts of a run, on every rank (rank 0 alone owns the reward and environment
    workers and writes the metrics)."""

    def __init__(self, recipe: Recipe, run_dir: Path, groups: ParallelGroups) -> None:
        """The parts, before any is loaded (the recipe passed :mod:`megatron_gspo.run.checks`)."""
        self.recipe, self.run_dir, self.groups = recipe, run_dir, groups
        self.rank0 = dist.get_rank() == 0
        max_prompt_tokens = recipe.model.max_seq_length - recipe.rollout.max_new_tokens
        self.stream = PromptStream(
            recipe.data, seed=recipe.rollout.seed, max_prompt_tokens=max_prompt_tokens
        )
        tokenizer = self.stream.tokenizer
        self.eval_set = eval_prompts(recipe, max_prompt_tokens) if recipe.eval.every else []
        self.rewards = None
        if self.rank0 and recipe.reward.functions:
            self.rewards = RewardComputer(recipe.reward)
            self.rewards.start()
        self.policy = Policy(recipe, groups)
        self.trainer = GSPOTrainer(self.policy)
        self.engine = make_engine(recipe, self.policy)
        self.sampler = EpisodeSampler(recipe, self.engine, self.stream)
        self.scorer = Scorer(recipe, self.rewards, tokenizer.decode if self.rank0 else None)
        self.checkpoints = Checkpointer(
            run_dir / "checkpoints",
            self.policy,
            keep=recipe.run.keep_checkpoints,
            async_save=recipe.run.async_save,
        )
        # Stops a run whose sampler keeps disagreeing with the trainer; its streak is saved.
        self.kl_guard = RolloutKLGuard.from_recipe(recipe)
        self.start, self.best_eval = 0, None
        self._queued: list = []

    def resume(self, start: Start) -> None:
        """The weights (and data position, queued rollouts) to start from: the checkpoint of
        ``start.step`` (:mod:`megatron_gspo.run.rundir` chose and verified it), else
        ``run.init_from``; then the engine samples from them."""
        if start.step:
            state = self.checkpoints.load(start.step, manifest=start.manifest)
            self.start, self.stream.position = start.step, state["data_position"]
            self.stream.skipped = state.get("prompts_skipped", 0)
            self.best_eval = state.get("eval_best")
            self._queued = state.get("rollout_queue", [])
            self.kl_guard.restore(state.get("kl_guard_streak"))
            log.info("resumed from %s at step %d", self.checkpoints.dir, self.start)
        elif self.recipe.run.init_from:
            self.policy.load_weights(self.recipe.run.init_from)
            log.info("initial weights from %s", self.recipe.run.init_from)
        # Whatever a server loaded at start-up, it samples from the trainer's weights from
        # here on; the weights version is the number of steps applied.
        self.engine.sync_weights(self.start)

    def begin(self, start: Start) -> None:
        """Just before the first step: the run directory's earlier steps past the checkpoint
        forgotten, metrics opened, the rollouts set up (the checkpoint's queue restored)."""
        if self.rank0:
            begin(self.run_dir, start)
            (self.run_dir / "recipe.yaml").write_text(
                yaml.safe_dump(self.recipe.model_dump(mode="json"), sort_keys=False)
            )
        self.logger = MetricsLogger(
            self.run_dir,
            enabled=self.rank0,
            tensorboard=self.recipe.run.tensorboard,
            wandb_project=self.recipe.run.wandb_project,
            config=self.recipe.model_dump(),
        )
        self.rollouts = self.sampler.rollouts(next_step=self.start + 1)
        self.rollouts.restore(self._queued)

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

    def probe_sampler(self, samples: list[Sample]) -> dict[str, float]:
        """Right after a weight sync of an off-policy run: the engine and the trainer score a
        few of the step's sequences with the weights both now hold (``rollout_sampler_kl``
        over them; :mod:`megatron_gspo.run.kl_guard`). On-policy runs need no probe: each
        batch's tokens were sampled by the weights the trainer scores them with."""
        n = self.recipe.rollout.sampler_probe
        if not self.recipe.rollout.max_staleness or not n or not samples:
            return {}
        chosen = samples[:: max(1, len(samples) // n)][:n]  # across groups, not one prompt's
        scored = self.engine.score([s.prompt_ids + s.response_ids for s in chosen])
        probes = [
            replace(s, rollout_logprobs=lp[len(s.prompt_ids) - 1 :], routes=None)
            for s, lp in zip(chosen, scored, strict=True)
        ]
        return self.trainer.sampler_kl(probes)

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
                "kl_guard_streak": self.kl_guard.state(),
            },
            best=best,
        )

    def close(self) -> None:
        # A save still being written is finished first: the run's last checkpoint is whole.
        self.checkpoints.close()
        self.rollouts.close()
        self.logger.close()
        self.engine.close()
        self.sampler.close()
        if self.rewards is not None:
            self.rewards.close()
