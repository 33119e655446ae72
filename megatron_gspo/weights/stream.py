"""Stream the full (single-rank) tensors of a parallel model to one rank, one tensor at a time.

:func:`~megatron_gspo.weights.shards.gather_full_state_dict` hands every rank the whole model,
which is fine for tests and small models but not for a weight sync of a 30B MoE after every
step. Here only the destination rank ever holds a full tensor, and only one at a time:

1. Once per call, every rank tells the others which full tensors it holds (names only). The
   owner of a name is the lowest global rank that holds a shard of it.
2. Then, in the model's order (:attr:`HFMapping.maps`), each tensor is assembled by its
   (expert-)tensor-parallel group with an all-gather (see ``shards.unshard_tp``), and the
   owner sends it to the destination with a point-to-point ``send``.

Every rank runs the same sequence of blocking operations in the same global order, so the
tensor that the destination waits for next is always one whose owner can make progress: no
deadlock, whatever the TP/PP/EP layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_gspo.weights.hf import HFMapping
from megatron_gspo.weights.shards import shard_infos, unshard_tp, weight_tensors

__all__ = ["iter_full_tensors"]


def iter_full_tensors(
    model: torch.nn.Module, mapping: HFMapping, *, dst: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(full Megatron name, full tensor)`` on rank ``dst``, in model order.

    Collective over the whole world: every rank must exhaust the iterator (on ranks other than
    ``dst`` it yields nothing but takes part in the gathers and sends). ``model`` is this
    rank's ``GPTModel`` stage. The output layer of a tied model is skipped (the embedding is
    the same tensor). Tensors on ``dst`` live on its parameters' device.
    """
    infos = shard_infos(model)
    params = weight_tensors(model)
    local = {info.full_name: (params[name], info) for name, info in infos.items()}
    rank = dist.get_rank()
    held: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(held, sorted(local))
    owner: dict[str, int] = {}
    for r, names in enumerate(held):
        for n in names:
            owner.setdefault(n, r)
    tied = not mapping.cfg.untie_embeddings_and_output_weights
    missing = [m.megatron for m in mapping.maps if m.megatron not in owner]
    if missing:
        raise KeyError(f"no rank holds these model tensors: {missing[:5]}")
    device = next(model.parameters()).device
    for m in mapping.maps:
        name = m.megatron
        if tied and name == "output_layer.weight":
            continue
        full = None
        if name in local:
            param, info = local[name]
            full = unshard_tp(param.detach(), info)
        src = owner[name]
        if src == dst:
            if rank == dst:
                yield name, full
        elif rank == src:
            dist.send(full.contiguous(), dst=dst)
        elif rank == dst:
            dtype = torch.float32 if m.fp32 else model.config.params_dtype
            buf = torch.empty(mapping.megatron_shapes[name], dtype=dtype, device=device)
            dist.recv(buf, src=src)
            yield name, buf
