"""How a rollout batch is cut for one update: mini-batches (one optimizer step each), and
each mini-batch's micro-batches for every data-parallel rank.

The plan is computed identically on every rank from the whole batch, so the global sequence
count needs no communication; this rank's micro-batches are then built (padded to one shape
where the layout exchanges activations whose shape it cannot tell, split over context-parallel
ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_gspo.config import Recipe
from megatron_gspo.parallel import ParallelGroups
from megatron_gspo.parallel.context import split_microbatch
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.trainer.packing import (
    MicroBatch,
    Sample,
    build_microbatch,
    microbatch_width,
    plan_microbatches,
)

__all__ = ["MiniBatchPlan", "StepPlanner"]


@dataclass(frozen=True)
class MiniBatchPlan:
    samples: list[Sample]
    # Sample indices of every data-parallel rank's micro-batches (the same on all ranks).
    per_rank: list[list[list[int]]]
    # This rank's micro-batches (the same count on every data-parallel rank).
    microbatches: list[MicroBatch]
    num_sequences: int


class StepPlanner:
    def __init__(
        self, recipe: Recipe, groups: ParallelGroups, config, device: torch.device
    ) -> None:
        """``config`` is the model's Megatron ``TransformerConfig``; micro-batches are built on
        the CPU and moved to ``device``, the model's."""
        self.recipe, self.groups, self.device = recipe, groups, device
        # Context parallelism splits every sequence into 2 x CP chunks, sequence parallelism
        # each CP rank's share over the TP ranks: pad sequences and rows to multiples.
        parallel = recipe.parallel
        self.cp_size = parallel.context_parallel_size
        self.segment_multiple = 2 * self.cp_size if self.cp_size > 1 else 1
        self.pad_multiple = self.segment_multiple * (
            parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
        )
        # One shape per mini-batch where ranks exchange activations of a shape they cannot
        # tell each other: pipeline stages without variable_seq_lengths, and the allgather
        # expert dispatcher (alltoall, the GPU default, takes uneven splits).
        self.fixed_shapes = (
            config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths
        ) or (
            config.expert_model_parallel_size > 1
            and config.moe_token_dispatcher_type == "allgather"
        )

    def plan(self, samples: list[Sample], mini_batches: int | None = None) -> list[MiniBatchPlan]:
        """``mini_batches`` defaults to the recipe's ``train.mini_batches``."""
        train = self.recipe.train
        parts = train.mini_batches if mini_batches is None else mini_batches
        n = len(samples)
        if n < parts:
            raise InputError(f"{n} samples cannot be split into train.mini_batches={parts}")
        bounds = [round(k * n / parts) for k in range(parts + 1)]
        plans = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            mini = samples[a:b]
            per_rank = plan_microbatches(
                mini,
                dp_size=self.groups.dp_size,
                packing=train.packing,
                micro_batch_tokens=train.micro_batch_tokens,
                micro_batch_size=train.micro_batch_size,
                segment_multiple=self.segment_multiple if train.packing else 1,
            )
            plans.append(MiniBatchPlan(mini, per_rank, self._build(mini, per_rank), len(mini)))
        return plans

    def _build(self, samples: list[Sample], per_rank: list[list[list[int]]]) -> list[MicroBatch]:
        """This rank's micro-batch tensors, padded to one shape where the layout needs it."""
        train = self.recipe.train
        width = rows = None
        if self.fixed_shapes:
            # Over every rank's micro-batches: expert dispatch gathers across ranks.
            width = max(
                microbatch_width(
                    samples, idx, packing=train.packing, segment_multiple=self.segment_multiple
                )
                for rank in per_rank
                for idx in rank
            )
            rows = None if train.packing else train.micro_batch_size
        cp_rank = parallel_state.get_context_parallel_rank()
        return [
            split_microbatch(
                build_microbatch(
                    samples,
                    idx,
                    packing=train.packing,
                    pad_to_multiple=self.pad_multiple,
                    width=width,
                    rows=rows,
                    segment_multiple=self.segment_multiple,
                ),
                self.cp_size,
                cp_rank,
            ).to(self.device)
            for idx in per_rank[self.groups.dp_rank]
        ]
