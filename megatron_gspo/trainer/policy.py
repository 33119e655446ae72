"""The trainable policy of this rank: Megatron model stage, DDP wrapper, optimizer, schedule."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_gspo.config import Recipe
from megatron_gspo.model import build_model
from megatron_gspo.model.router_stats import RouterStats
from megatron_gspo.parallel import ParallelGroups
from megatron_gspo.weights import load_full_state_dict
from megatron_gspo.weights.dist_ckpt import load_model_weights


class Policy:
    """Owns everything that changes when the policy is updated."""

    def __init__(self, recipe: Recipe, groups: ParallelGroups) -> None:
        self.recipe = recipe
        self.groups = groups
        replay = recipe.train.routing_replay != "none"
        if replay:
            # Megatron keeps replay instances in one class-level list; start it empty.
            RouterReplay.clear_global_router_replay_instances()
        self.model = build_model(
            recipe.model,
            recipe.parallel,
            recipe.precision,
            memory=recipe.memory,
            routing_replay=replay,
        )
        self.config = self.model.config
        # Megatron keeps expert weights in an optimizer of their own only under expert
        # parallelism, so a checkpoint's optimizer layout would change with EP. Marking them
        # expert-parallel at EP=1 too (their gradients are then reduced over the expert
        # data-parallel group, which at EP=1 is the data-parallel group) keeps one layout, and
        # lets a run resume with another EP size.
        for name, param in self.model.named_parameters():
            if ".experts." in name:
                param.allreduce = False
        distributed_optimizer = recipe.memory.use_distributed_optimizer
        self.ddp = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
            ),
            self.model,
        )
        opt = recipe.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.min_lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                bf16=recipe.precision.bf16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=distributed_optimizer,
            ),
            [self.ddp],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if opt.warmup_steps else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=max(opt.warmup_steps + 1, 1_000_000_000),
            lr_decay_style="constant",
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        self.router_stats = RouterStats(self.model) if recipe.model.is_moe else None
        # loss.kl_coef: a frozen copy of the initial weights in the same layout (no DDP, no
        # optimizer); reset_reference() after loading initial weights, checkpoints keep it.
        self.reference = None
        if recipe.loss.kl_coef > 0:
            self.reference = build_model(
                recipe.model, recipe.parallel, recipe.precision, memory=recipe.memory
            )
            self.reference.requires_grad_(False)
            self.reference.eval()
            self.reset_reference()

    def reset_reference(self) -> None:
        """Make the reference policy the current weights (at the start of a run)."""
        if self.reference is not None:
            with torch.no_grad():
                self.reference.load_state_dict(self.model.state_dict())

    def run_schedule(
        self,
        forward_step: Callable[[Iterator, torch.nn.Module], Any],
        microbatches: Iterable,
        num_microbatches: int,
        *,
        seq_length: int,
        micro_batch_size: int,
        forward_only: bool,
        model: torch.nn.Module | None = None,
    ) -> list[dict]:
        """Megatron's forward/backward schedule (pipelined when PP > 1) over micro-batches.

        Returns what the last stage's loss functions reported, one dict per micro-batch
        (an empty list on other stages).
        """
        if not forward_only:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[self.ddp if model is None else model],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )
        if not forward_only:
            finalize_model_grads([self.ddp])
        return out

    def gradients_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (collective over the world)."""
        bad = torch.zeros(1)
        for buffers in (self.ddp.buffers, self.ddp.expert_parallel_buffers):
            for buffer in buffers:
                if not bool(torch.isfinite(buffer.grad_data).all()):
                    bad.fill_(1.0)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    def optimizer_step(self) -> dict[str, float]:
        """One optimizer step, skipped (weights, Adam states and schedule untouched) when a
        gradient anywhere is NaN or inf: a non-finite loss or gradient never reaches the
        weights, and so never a checkpoint."""
        if not self.gradients_finite():
            self.optimizer.zero_grad()
            return {
                "grad_norm": float("nan"),
                "update_skipped": 1.0,
                "lr": self.optimizer.param_groups[0]["lr"],
            }
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_skipped": 0.0 if ok else 1.0,
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def load_weights(self, checkpoint_dir: str | Path) -> None:
        """Model weights from a Megatron distributed checkpoint, in this rank's layout."""
        path = Path(checkpoint_dir)
        if not (path / "metadata.json").is_file():
            raise FileNotFoundError(f"{path}: not a Megatron distributed checkpoint")
        from megatron_gspo.weights.model_check import check_checkpoint_model, recorded_model

        check_checkpoint_model(path, self, recorded=recorded_model(path), any_vocab_rows=True)
        load_model_weights(self.model, path)
        self.optimizer.reload_model_params()
        self.reset_reference()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Set the weights from a single-rank state dict; the optimizer's copies follow."""
        load_full_state_dict(self.model, full)
        self.optimizer.reload_model_params()
        self.reset_reference()

    def train(self, mode: bool = True) -> None:
        self.ddp.train(mode)
