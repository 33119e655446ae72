"""Megatron-Core weight layouts: parallel shards and the single-rank (full) layout."""

from megatron_gspo.weights.shards import (
    ShardInfo,
    gather_full_state_dict,
    load_full_state_dict,
    shard_infos,
    slice_full,
    weight_tensors,
)

__all__ = [
    "ShardInfo",
    "gather_full_state_dict",
    "load_full_state_dict",
    "shard_infos",
    "slice_full",
    "weight_tensors",
]
