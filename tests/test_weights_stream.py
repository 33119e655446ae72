"""Streaming the full tensors to rank 0 gives what the all-ranks gather gives, in model order."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import ModelConfig, ParallelConfig
from tests.support.ranks import run_distributed
from tests.support.tiny import TINY_DENSE, TINY_MOE


def _stream_and_gather(rank, world, cfg: ModelConfig, parallel: ParallelConfig):
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.weights import gather_full_state_dict
    from megatron_gspo.weights.hf import HFMapping
    from megatron_gspo.weights.stream import iter_full_tensors

    init_parallel(parallel)
    torch.manual_seed(100 + rank)  # every rank's shards differ
    model = build_model(cfg, parallel)
    streamed = [(n, t.clone()) for n, t in iter_full_tensors(model, HFMapping(cfg), dst=0)]
    return streamed, gather_full_state_dict(model)


@pytest.mark.parametrize(
    "cfg,parallel",
    [
        (TINY_DENSE, ParallelConfig(tensor_model_parallel_size=2)),
        (TINY_MOE, ParallelConfig(expert_model_parallel_size=2)),
        (TINY_MOE, ParallelConfig(pipeline_model_parallel_size=2)),
    ],
    ids=["dense-tp2", "moe-ep2", "moe-pp2"],
)
def test_streamed_tensors_equal_the_gathered_state_dict(cfg, parallel):
    results = run_distributed(_stream_and_gather, 2, cfg, parallel)
    streamed, full = results[0]
    assert results[1][0] == [], "only the destination rank receives tensors"
    names = [n for n, _ in streamed]
    assert len(names) == len(set(names)) == len(full), (sorted(names), sorted(full))
    for name, tensor in streamed:
        assert torch.equal(tensor, full[name]), f"{name} differs from the gathered tensor"
