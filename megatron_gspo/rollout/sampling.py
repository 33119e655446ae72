"""Token sampling from full-vocabulary logits: temperature and nucleus (top-p)."""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> torch.Tensor:
    """One token id per row of ``logits`` [n, V]; temperature 0 means greedy."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
