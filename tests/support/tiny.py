"""Tiny models and batches shared by the tests."""

from __future__ import annotations

import torch

from megatron_gspo.config import ModelConfig

TINY_MOE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_seq_length=32,
    num_experts=4,
    moe_ffn_hidden_size=48,
    moe_router_topk=2,
    # The load-balancing loss is a non-linear function of the tokens each rank sees, so a
    # data-parallel split changes it; the layout tests switch it off, and test it on where the
    # layout keeps it (test_train_step.py: TP+SP, PP, and global_aux_loss under DP and EP).
    moe_aux_loss_coeff=0.0,
    rotary_base=10000,
)

TINY_DENSE = ModelConfig(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    vocab_size=64,
    max_seq_length=32,
    ffn_hidden_size=64,
    rotary_base=10000,
)


def token_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
