"""Router statistics and routing replay for the MoE policy.

The routing flip rate is the fraction of (token, layer) pairs whose top-k expert set differs
between the old policy (the forward that produced the old log-probs) and the policy being
trained. GSPO's paper motivates sequence-level ratios with it: on Qwen3-30B-A3B about 10% of
routes change per update, which makes token-level ratios noisy for MoE.

Routing replay uses Megatron-Core's own ``RouterReplay``: the old-policy forward records each
router's top-k indices, and the training forward of the same micro-batch is forced to use them.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


def _topk_indices(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted expert indices of each token's route, [tokens, k] int16."""
    idx = torch.topk(routing_map.to(torch.int8), k, dim=-1).indices
    return idx.sort(dim=-1).values.to(torch.int16)


class RouterStats:
    """Watches every router of a model stage through forward hooks.

    ``record(key)`` keeps the routes of the next forward under ``key`` (a micro-batch id);
    ``compare(key)`` counts the routes of the next forward that differ from the recorded ones.
    Expert load (tokens routed to each expert, summed over layers) accumulates in both modes.
    Padding tokens (the router's padding mask) count in neither.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_experts = self.routers[0].config.num_moe_experts if self.routers else 0
        self._recorded: dict[Hashable, list[torch.Tensor]] = {}
        self._mode: tuple[str, Hashable] | None = None
        self._seen: list[torch.Tensor] = []
        self.reset_counts()
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def reset_counts(self) -> None:
        self.flipped = 0
        self.compared = 0
        self.expert_load = torch.zeros(max(self.num_experts, 1), dtype=torch.float64)

    def clear(self) -> None:
        self._recorded.clear()

    def record(self, key: Hashable) -> None:
        self._mode, self._seen = ("record", key), []

    def compare(self, key: Hashable) -> None:
        self._mode, self._seen = ("compare", key), []

    def recorded_indices(self, key: Hashable) -> list[torch.Tensor] | None:
        return self._recorded.get(key)

    def done(self) -> None:
        """Close the forward started by ``record`` or ``compare``."""
        if self._mode and self._mode[0] == "record":
            self._recorded[self._mode[1]] = self._seen
        self._mode = None

    def _hook(self, layer: int):
        def hook(module, inputs, outputs) -> None:
            if self._mode is None:
                return
            _, routing_map = outputs
            padding = inputs[1] if len(inputs) > 1 else None
            real = None if padding is None else ~padding.reshape(-1)
            counted = routing_map if real is None else routing_map[real]
            self.expert_load += counted.sum(0).to(self.expert_load)
            idx = _topk_indices(routing_map, module.topk)
            if self._mode[0] == "record":
                self._seen.append(idx)
                return
            old = self._recorded.get(self._mode[1])
            if old is not None and layer < len(old) and old[layer].shape == idx.shape:
                flips = (old[layer] != idx).any(-1)
                if real is not None:
                    flips = flips[real]
                self.flipped += int(flips.sum())
                self.compared += flips.shape[0]

        return hook


def set_replay(action: RouterReplayAction | None, indices: list[torch.Tensor] | None = None):
    """Switch Megatron's routing replay for every router of this process."""
    if action is None:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        return
    if indices is not None:
        RouterReplay.clear_global_indices()
        RouterReplay.set_replay_data([i.long() for i in indices])
    RouterReplay.set_global_router_replay_action(action)
