"""Expert routes: for every token and MoE layer, the ``k`` experts a router sent it to.

Routes travel from the rollout engine to the trainer for rollout routing replay ("R3",
``train.routing_replay: rollout``) and for the ``rollout_routing_disagreement`` metric. Their
layout, one for every producer and consumer:

- a sample's routes are ``[num_tokens, num_moe_layers, k]`` integers (uint8 up to 256
  experts), row ``t`` the routing of the ``t``-th token the model reads (prompt, then response
  without its last token: ``Sample.num_tokens`` rows), the MoE layers in model order, each row
  of ``k`` ids sorted;
- a micro-batch stacks them like its other token tensors, ``[b, s, num_moe_layers, k]``;
- a router sees its stage's tokens sequence-major (``[s, b]`` flattened; under sequence
  parallelism its TP rank's chunk of ``s``), which :func:`routes_for_routers` produces for
  Megatron-Core's ``RouterReplay``.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter

__all__ = [
    "RouteRecorder",
    "check_routes",
    "filler_routes",
    "moe_layer_index",
    "moe_layers",
    "route_dtype",
    "routes_for_routers",
    "topk_indices",
]


def topk_indices(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted expert ids of each token's route, ``[tokens, k]`` int16, from a router's
    ``[tokens, experts]`` routing map."""
    idx = torch.topk(routing_map.to(torch.int8), k, dim=-1).indices
    return idx.sort(dim=-1).values.to(torch.int16)


def moe_layers(config) -> list[int]:
    """The (0-based) indices of a Megatron ``TransformerConfig``'s MoE layers."""
    freq = config.moe_layer_freq
    pattern = (
        [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else freq
    )
    return [i for i, is_moe in enumerate(pattern) if is_moe]


def moe_layer_index(routers: list[TopKRouter]) -> list[int]:
    """For each router of a model stage, its MoE layer's index among the model's MoE layers."""
    if not routers:
        return []
    layers = moe_layers(routers[0].config)
    # Megatron's layer numbers are global and start at 1.
    return [layers.index(r.layer_number - 1) for r in routers]


def check_routes(
    routes: np.ndarray, *, num_tokens: int, num_moe_layers: int, topk: int, num_experts: int,
    where: str,
) -> None:  # fmt: skip
    """Refuse routes that do not fit the sample they came with, naming it and the shapes."""
    want = (num_tokens, num_moe_layers, topk)
    if tuple(routes.shape) != want:
        raise ValueError(
            f"{where}: routes of shape {tuple(routes.shape)} do not fit the sample: need "
            f"[tokens the model reads, MoE layers, top-k] = {list(want)}"
        )
    if routes.size and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"{where}: routes name experts outside [0, {num_experts})")


def route_dtype(num_experts: int) -> np.dtype:
    """The integer type a sample's routes are kept in (vLLM's choice too)."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.int16)


def filler_routes(num_moe_layers: int, topk: int) -> np.ndarray:
    """The route of a padding token: any valid, distinct experts (padding is masked out of
    every loss and statistic; replay only needs ids it can gather)."""
    return np.broadcast_to(np.arange(topk, dtype=np.int16), (num_moe_layers, topk))


def routes_for_routers(
    routes: torch.Tensor,
    layer_index: list[int],
    *,
    sequence_parallel: bool,
    tp_rank: int,
    tp_size: int,
) -> list[torch.Tensor]:
    """A micro-batch's ``[b, s, layers, k]`` routes as each router of this stage sees its
    tokens: one ``[tokens, k]`` long tensor per router (``layer_index`` from
    :func:`moe_layer_index`)."""
    seq_major = routes.transpose(0, 1)  # [s, b, layers, k]
    if sequence_parallel:
        seq_major = seq_major.chunk(tp_size, dim=0)[tp_rank]
    flat = seq_major.reshape(-1, *routes.shape[2:])
    return [flat[:, i].long().contiguous() for i in layer_index]


class RouteRecorder:
    """Records the routes of a model's forwards through hooks on its routers (the embedded
    engine's own routing, returned with its samples).

    ``start()`` begins a recording; ``stop()`` returns one ``[layers, s, b, k]`` tensor per
    forward since (e.g. a prefill, then one decode step at a time).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self._seen: list[list[torch.Tensor]] | None = None
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def start(self) -> None:
        self._seen = [[] for _ in self.routers]

    def stop(self) -> list[torch.Tensor]:
        seen, self._seen = self._seen, None
        return [torch.stack(forward) for forward in zip(*seen, strict=True)]

    def _hook(self, layer: int):
        def hook(module, inputs, outputs) -> None:
            if self._seen is None:
                return
            _, routing_map = outputs
            s, b = inputs[0].shape[:2]
            self._seen[layer].append(topk_indices(routing_map, module.topk).view(s, b, -1))

        return hook
