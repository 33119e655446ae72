"""The real Megatron-Core MoE policy under each parallel layout equals the single-rank model.

Every layout runs through Megatron's own ``get_forward_backward_func`` schedule, DDP wrapper and
``finalize_model_grads``; the reference is a plain forward/backward of the single-rank model on
the whole batch. Loss is a sum over tokens so that data-parallel halves add up exactly.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import ModelConfig, ParallelConfig
from tests.support.ranks import run_distributed
from tests.support.tiny import TINY_DENSE, TINY_MOE, token_batch

BATCH, SEQ = 4, 16


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]


def _sum_token_ce(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ce = vocab_parallel_cross_entropy(
        logits[:, :-1].float().contiguous(), tokens[:, 1:].contiguous()
    )
    return ce.sum()


def _reference(rank: int, world: int, cfg: ModelConfig, tokens: torch.Tensor):
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel

    init_parallel(ParallelConfig())
    model = build_model(cfg, ParallelConfig())
    seq = tokens.shape[1]
    logits = model(tokens, torch.arange(seq).expand_as(tokens), _causal_mask(seq))
    loss = _sum_token_ce(logits, tokens)
    loss.backward()
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    return loss.item(), weights, grads


def _parallel(rank, world, cfg, layout, weights, tokens, num_microbatches):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.weights import gather_full_state_dict, load_full_state_dict

    parallel = ParallelConfig(**layout)
    groups = init_parallel(parallel)
    model = build_model(cfg, parallel)
    load_full_state_dict(model, weights)
    ddp = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    mine = tokens.chunk(groups.dp_size)[groups.dp_rank]
    micro = mine.shape[0] // num_microbatches
    seq = tokens.shape[1]

    def forward_step(data_iterator, module):
        batch = next(data_iterator)
        out = module(batch, torch.arange(seq).expand_as(batch), _causal_mask(seq))

        def loss_func(logits):
            loss = _sum_token_ce(logits, batch)
            # Megatron averages over micro-batches and data-parallel ranks; undo it for a sum.
            scale = num_microbatches * groups.dp_size
            return loss * scale, torch.tensor(1), {"loss": loss.detach()}

        return out, loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mine.split(micro)),
        model=[ddp],
        num_microbatches=num_microbatches,
        seq_length=seq,
        micro_batch_size=micro,
        forward_only=False,
    )
    finalize_model_grads([ddp])
    loss = None
    if parallel_state.is_pipeline_last_stage():
        loss = torch.stack([o["loss"] for o in outputs]).sum()
        torch.distributed.all_reduce(loss, group=groups.dp)
        loss = loss.item()
    return loss, gather_full_state_dict(model, grads=True)


@pytest.fixture(scope="module")
def moe_reference():
    return run_distributed(_reference, 1, TINY_MOE, token_batch(BATCH, SEQ, TINY_MOE.vocab_size))[0]


def _assert_matches_reference(reference, results, what: str) -> None:
    ref_loss, _, ref_grads = reference
    losses = [r[0] for r in results if r[0] is not None]
    assert losses, "no rank reported a loss"
    for loss in losses:
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (
            f"{what}: loss {loss} != single-rank {ref_loss}"
        )
    grads = results[0][1]
    assert set(grads) == set(ref_grads), f"{what}: parameter sets differ"
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        assert err <= 1e-5, f"{what}: gradient of {name} differs by {err:.2e} (relative)"


def test_single_rank_moe_forward_backward_gives_finite_loss_and_gradients(moe_reference):
    loss, weights, grads = moe_reference
    assert torch.isfinite(torch.tensor(loss))
    expert_grads = [g for k, g in grads.items() if ".experts." in k]
    assert len(expert_grads) == TINY_MOE.num_layers * TINY_MOE.num_experts * 2
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum() for g in expert_grads) > 0, "no gradient reached the experts"


@pytest.mark.parametrize(
    "layout,num_microbatches",
    [
        pytest.param({"expert_model_parallel_size": 2}, 1, id="ep2-dp2"),
        pytest.param({"pipeline_model_parallel_size": 2}, 2, id="pp2"),
        pytest.param({"tensor_model_parallel_size": 2, "sequence_parallel": True}, 2, id="tp2-sp"),
    ],
)
def test_two_rank_moe_layout_matches_single_rank(moe_reference, layout, num_microbatches):
    tokens = token_batch(BATCH, SEQ, TINY_MOE.vocab_size)
    results = run_distributed(
        _parallel, 2, TINY_MOE, layout, moe_reference[1], tokens, num_microbatches
    )
    _assert_matches_reference(moe_reference, results, str(layout))


def test_two_rank_dense_tensor_parallel_without_sequence_parallel_matches_single_rank():
    tokens = token_batch(BATCH, SEQ, TINY_DENSE.vocab_size)
    reference = run_distributed(_reference, 1, TINY_DENSE, tokens)[0]
    results = run_distributed(
        _parallel, 2, TINY_DENSE, {"tensor_model_parallel_size": 2}, reference[1], tokens, 1
    )
    _assert_matches_reference(reference, results, "dense tp2")


def test_a_world_of_one_leaves_no_rendezvous_for_the_processes_it_starts():
    """A plain `python` run sets up its group without a port and without os.environ.

    It once wrote RANK and a MASTER_PORT its own store held into os.environ: every `train`
    a test then started inherited them and failed to bind that port (EADDRINUSE, CI).
    """
    import subprocess
    import sys

    code = (
        "import os, torch.distributed as dist\n"
        "from megatron_gspo.config import ParallelConfig\n"
        "from megatron_gspo.parallel import init_parallel\n"
        "init_parallel(ParallelConfig())\n"
        "assert dist.get_world_size() == 1 and dist.get_rank() == 0\n"
        "leaked = [k for k in ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT') "
        "if k in os.environ]\n"
        "assert not leaked, leaked\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
