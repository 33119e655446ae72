"""Router statistics and routing replay for the MoE policy.

The routing flip rate is the fraction of (token, layer) pairs whose top-k expert set differs
between the old policy (the forward that produced the old log-probs) and the policy being
trained. GSPO's paper motivates sequence-level ratios with it: on Qwen3-30B-A3B about 10% of
routes change per update, which makes token-level ratios noisy for MoE. The rollout routing
disagreement is the same comparison between the pre-update policy and the rollout engine's
routes (``megatron_gspo.model.routes``), per MoE layer.

Routing replay uses Megatron-Core's own ``RouterReplay``: the training forward of a micro-batch
is forced to use the old-policy forward's experts (R2) or the rollout's (R3). Both statistics
are about the router's *own* choice: under replay it is read before the replayed experts
replace it, so they mean the same with replay on or off.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_gspo.model.routes import moe_layer_index, moe_layers, topk_indices


class RouterStats:
    """Watches every router of a model stage through forward hooks.

    ``record(key, rollout)`` keeps the routes of the next forward under ``key`` (a micro-batch
    id) and, given the rollout engine's routes of the same tokens (one ``[tokens, k]`` tensor
    per router, :func:`~megatron_gspo.model.routes.routes_for_routers`), counts per MoE layer
    those that differ; ``compare(key)`` counts the routes of the next forward that differ from
    the recorded ones. Expert load (tokens routed to each expert, summed over layers)
    accumulates in both modes. Padding tokens (the router's padding mask) count in none.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        # From the model's config: a pipeline stage of dense layers has no router to ask, and
        # the counts are reduced over every stage.
        self.num_experts = model.config.num_moe_experts or 0
        self.layer_index = moe_layer_index(self.routers)
        # The model's MoE layers (0-based), on every stage.
        self.moe_layer_numbers = moe_layers(model.config)
        self.num_moe_layers = len(self.moe_layer_numbers)
        self._recorded: dict[Hashable, list[torch.Tensor]] = {}
        self._mode: tuple[str, Hashable] | None = None
        self._seen: list[torch.Tensor] = []
        self._rollout: list[torch.Tensor] | None = None
        # The router's own top-k of the forward in progress, where replay overrides it.
        self._natural: dict[int, torch.Tensor] = {}
        self.reset_counts()
        self.clear()
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))
            if getattr(router, "router_replay", None) is not None:
                self._watch_replay(layer, router.router_replay)

    def reset_counts(self) -> None:
        """Start counting flips and expert load afresh (the training forwards of a step)."""
        self.flipped = 0
        self.compared = 0
        self.expert_load = torch.zeros(max(self.num_experts, 1), dtype=torch.float64)

    def clear(self) -> None:
        """Start a step: forget recorded routes and the rollout disagreement counts."""
        self._recorded.clear()
        # Per MoE layer of the model: routes that differ from the rollout's, routes compared.
        self.disagreement = torch.zeros(2, max(self.num_moe_layers, 1), dtype=torch.float64)

    def record(self, key: Hashable, rollout: list[torch.Tensor] | None = None) -> None:
        self._mode, self._seen, self._rollout = ("record", key), [], rollout

    def compare(self, key: Hashable) -> None:
        self._mode, self._seen = ("compare", key), []

    def recorded_indices(self, key: Hashable) -> list[torch.Tensor] | None:
        return self._recorded.get(key)

    def done(self) -> None:
        """Close the forward started by ``record`` or ``compare``."""
        if self._mode and self._mode[0] == "record":
            self._recorded[self._mode[1]] = self._seen
        self._mode, self._rollout = None, None
        self._natural.clear()

    def _watch_replay(self, layer: int, replay: RouterReplay) -> None:
        """Keep the router's own top-k when Megatron's replay is about to replace it."""
        replay_topk = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default=None):
            if self._mode is not None and replay.router_replay_action is not None:
                _, own = default(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self._natural[layer] = own.sort(dim=-1).values.to(torch.int16)
            return replay_topk(scores, topk, num_groups, group_topk, default)

        replay.get_replay_topk = get_replay_topk

    def _hook(self, layer: int):
        def hook(module, inputs, outputs) -> None:
            if self._mode is None:
                return
            _, routing_map = outputs
            padding = inputs[1] if len(inputs) > 1 else None
            real = None if padding is None else ~padding.reshape(-1)
            counted = routing_map if real is None else routing_map[real]
            self.expert_load += counted.sum(0).to(self.expert_load)
            idx = self._natural.pop(layer, None)
            if idx is None:
                idx = topk_indices(routing_map, module.topk)
            if self._mode[0] == "record":
                self._seen.append(idx)
                if self._rollout is not None:
                    differ = (self._rollout[layer].sort(dim=-1).values != idx).any(-1)
                    differ = differ if real is None else differ[real]
                    moe_layer = self.layer_index[layer]
                    self.disagreement[0, moe_layer] += int(differ.sum())
                    self.disagreement[1, moe_layer] += differ.shape[0]
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
