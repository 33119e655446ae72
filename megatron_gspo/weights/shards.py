"""Where each tensor of a parallel Megatron model sits in the single-rank ("full") model.

A full state dict uses the names and shapes of the same model built with TP=PP=EP=1, except
that the embedding and output layer hold the tokenizer's vocabulary only: the rows Megatron
pads it with depend on TP (``ModelConfig.padded_vocab_size``), so they are added when a full
tensor is sliced into a shard (as zeros: nothing reads them) and dropped when shards are
gathered. This module maps a rank's local weight names to full names (pipeline layer offset,
global expert index) and slices full tensors into the rank's shard (tensor and expert-tensor
parallelism, including the fused ``[gate; up]`` layout of SwiGLU's ``linear_fc1``). Gathering
is the inverse. The weights are the parameters and the router's ``expert_bias`` buffer (aux-
loss-free balancing moves it outside the optimizer, and it is part of the model).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

_LAYER = re.compile(r"^(.*?\bdecoder\.layers\.)(\d+)(\..*)$")
_EXPERT = re.compile(r"^(.*\.local_experts\.)(\d+)(\..*)$")


@dataclass(frozen=True)
class ShardInfo:
    """How one local parameter relates to its full tensor."""

    full_name: str
    # Dimension split over the (expert-)tensor-parallel group, or None if replicated there.
    partition_dim: int | None
    tp_rank: int
    tp_size: int
    # SwiGLU's linear_fc1 stacks [gate; up]; each TP shard is [gate_r; up_r].
    gated: bool
    is_expert: bool
    # Embedding and output layer: the full tensor's rows (the tokenizer's vocabulary) and the
    # model's (padded for TP); None for other tensors.
    vocab: tuple[int, int] | None = None


# The vocabulary-parallel tensors, whose rows Megatron pads for TP.
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")
# Buffers that are weights: Megatron updates them outside the optimizer, checkpoints keep them.
_WEIGHT_BUFFERS = ("router.expert_bias",)


def weight_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by local name: its parameters and weight buffers."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith(_WEIGHT_BUFFERS))
    return out


def _layer_offset(model: torch.nn.Module) -> int:
    return get_transformer_layer_offset(model.config)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad])


def shard_infos(model: torch.nn.Module) -> dict[str, ShardInfo]:
    """For each local parameter name of ``model`` (a GPTModel stage), its :class:`ShardInfo`."""
    config = model.config
    offset = _layer_offset(model)
    num_local_experts = (config.num_moe_experts or 0) // config.expert_model_parallel_size
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    infos: dict[str, ShardInfo] = {}
    for name, param in weight_tensors(model).items():
        full = name
        m = _LAYER.match(full)
        if m:
            full = f"{m[1]}{int(m[2]) + offset}{m[3]}"
        is_expert = ".experts." in full
        m = _EXPERT.match(full)
        if m:
            full = f"{m[1]}{ep_rank * num_local_experts + int(m[2])}{m[3]}"
        if is_expert:
            tp_rank = parallel_state.get_expert_tensor_parallel_rank()
            tp_size = parallel_state.get_expert_tensor_parallel_world_size()
        else:
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
        split = getattr(param, "tensor_model_parallel", False) and tp_size > 1
        vocab = None
        if full in VOCAB_TENSORS:
            vocab = (model.vocab_size_unpadded, model.vocab_size)
        infos[name] = ShardInfo(
            full_name=full,
            partition_dim=param.partition_dim if split else None,
            tp_rank=tp_rank,
            tp_size=tp_size,
            gated=config.gated_linear_unit and name.endswith("linear_fc1.weight"),
            is_expert=is_expert,
            vocab=vocab,
        )
    return infos


def slice_full(tensor: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's shard of a full tensor."""
    if info.vocab is not None:
        tensor = pad_rows(tensor, info.vocab[1])
    if info.partition_dim is None:
        return tensor
    dim, r, n = info.partition_dim, info.tp_rank, info.tp_size
    if info.gated:
        gate, up = tensor.chunk(2, dim=dim)
        return torch.cat([gate.chunk(n, dim=dim)[r], up.chunk(n, dim=dim)[r]], dim=dim)
    return tensor.chunk(n, dim=dim)[r]


def load_full_state_dict(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shards of ``full`` (single-rank names and shapes) into ``model``."""
    params = weight_tensors(model)
    for name, info in shard_infos(model).items():
        if info.full_name not in full:
            raise KeyError(f"full state dict has no tensor '{info.full_name}' (for '{name}')")
        local = slice_full(full[info.full_name], info)
        if local.shape != params[name].shape:
            raise ValueError(
                f"'{info.full_name}': shard shape {tuple(local.shape)} does not match "
                f"parameter '{name}' of shape {tuple(params[name].shape)}"
            )
        with torch.no_grad():
            params[name].copy_(local)


def _tp_group(info: ShardInfo) -> dist.ProcessGroup:
    if info.is_expert:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def unshard_tp(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The full tensor from this rank's (expert-)tensor-parallel shard; collective over that
    group, and the inverse of :func:`slice_full`."""
    full = local if info.partition_dim is None else _gather_tp(local, info)
    return full if info.vocab is None else full[: info.vocab[0]]


def _gather_tp(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(info.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=_tp_group(info))
    dim = info.partition_dim
    if info.gated:
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts), strict=True)
        return torch.cat([*gates, *ups], dim=dim)
    return torch.cat(parts, dim=dim)


def gather_full_state_dict(
    model: torch.nn.Module, *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """The full (single-rank) state dict, or gradients, assembled on every rank.

    Collective over the whole world: every rank must call it. Meant for tests, conversion of
    small models and weight sync of one tensor at a time, not for holding a large model.
    """
    infos = shard_infos(model)
    local: dict[str, torch.Tensor] = {}
    for name, param in weight_tensors(model).items():
        info = infos[name]
        # Megatron's DDP accumulates into main_grad; plain modules into grad.
        value = getattr(param, "main_grad", param.grad) if grads else param.data
        if value is None:
            value = torch.zeros_like(param)
        local[info.full_name] = unshard_tp(value.detach(), info)
    # Experts and pipeline stages: every rank holds a disjoint set of full names; exchange them.
    # The same full tensor may be held by several ranks (data/tensor replicas); they agree.
    gathered: list[dict[str, torch.Tensor]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    full: dict[str, torch.Tensor] = {}
    for part in gathered:
        for k, v in part.items():
            full.setdefault(k, v)
    return full
