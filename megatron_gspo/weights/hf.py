"""The one mapping between Hugging Face Qwen3 / Qwen3-MoE tensors and full Megatron tensors.

"Full" Megatron means the names and shapes of our ``GPTModel`` built with TP=PP=EP=1 (see
:mod:`megatron_gspo.weights.shards` for the step from there to a parallel rank). Conversion,
checkpoint export and the weight sync to a rollout engine all go through this module, tensor by
tensor, so no caller ever needs the whole model in memory.

Layouts that differ between the two sides:

* ``linear_qkv`` fuses HF's ``q_proj``, ``k_proj``, ``v_proj`` per query group: Megatron's
  ``SelfAttention.get_query_key_value_tensors`` views the output as
  ``[groups, (heads_per_group + 2) * head_dim]`` and splits each group into
  ``heads_per_group * head_dim`` query rows, ``head_dim`` key rows and ``head_dim`` value rows.
  In HF query head ``h`` attends with key/value head ``h // heads_per_group``.
* ``linear_fc1`` stacks SwiGLU's ``[gate; up]`` (Megatron applies ``silu`` to the first half).
* Everything else is a rename. ``post_attention_layernorm`` is the norm before the MLP
  (Megatron's ``pre_mlp_layernorm``); HF's MoE router is ``mlp.gate``.

On the HF side this module speaks the per-expert layout that ``save_pretrained`` of
transformers 5.x writes to safetensors (and 4.x wrote): ``mlp.experts.{e}.gate_proj.weight``,
``up_proj``, ``down_proj``. transformers 5.x keeps experts *in memory* fused as 3-D parameters
``mlp.experts.gate_up_proj`` ``[E, 2*I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``;
:func:`split_fused_experts` turns those into the per-expert names so a checkpoint holding them
converts too.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from megatron_gspo.config import ModelConfig

__all__ = [
    "HFMapping",
    "TensorMap",
    "split_fused_experts",
]

Kind = Literal["copy", "qkv", "gate_up"]


@dataclass(frozen=True)
class TensorMap:
    """One full Megatron tensor and the HF tensors it is made of (in fusion order)."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind
    # Layer index, or None for embeddings, final norm and output layer: readers load by layer.
    layer: int | None


def _layer_maps(cfg: ModelConfig, i: int) -> list[TensorMap]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    maps = [
        TensorMap(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",), "copy", i),
        TensorMap(
            f"{m}.self_attention.linear_qkv.weight",
            tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
            i,
        ),
        TensorMap(
            f"{m}.self_attention.linear_proj.weight", (f"{h}.self_attn.o_proj.weight",), "copy", i
        ),
        TensorMap(
            f"{m}.self_attention.q_layernorm.weight", (f"{h}.self_attn.q_norm.weight",), "copy", i
        ),
        TensorMap(
            f"{m}.self_attention.k_layernorm.weight", (f"{h}.self_attn.k_norm.weight",), "copy", i
        ),
        TensorMap(
            f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",), "copy", i
        ),
    ]
    if cfg.is_moe:
        maps.append(TensorMap(f"{m}.mlp.router.weight", (f"{h}.mlp.gate.weight",), "copy", i))
        for e in range(cfg.num_experts):
            me, he = f"{m}.mlp.experts.local_experts.{e}", f"{h}.mlp.experts.{e}"
            maps += _mlp_maps(me, he, i)
    else:
        maps += _mlp_maps(f"{m}.mlp", f"{h}.mlp", i)
    return maps


def _mlp_maps(m: str, h: str, i: int) -> list[TensorMap]:
    return [
        TensorMap(
            f"{m}.linear_fc1.weight", (f"{h}.gate_proj.weight", f"{h}.up_proj.weight"), "gate_up", i
        ),
        TensorMap(f"{m}.linear_fc2.weight", (f"{h}.down_proj.weight",), "copy", i),
    ]


class HFMapping:
    """Names, shapes and layout transforms of one model configuration.

    Pure: no I/O, no process groups. Build one per configuration and reuse it (the name tables
    are computed once).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    @cached_property
    def maps(self) -> list[TensorMap]:
        """Every full Megatron tensor in model order (embedding, layer 0, ..., output)."""
        cfg = self.cfg
        maps = [
            TensorMap(
                "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", None
            )
        ]
        for i in range(cfg.num_layers):
            maps += _layer_maps(cfg, i)
        maps.append(
            TensorMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None)
        )
        if cfg.untie_embeddings_and_output_weights:
            maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "copy", None))
        return maps

    @cached_property
    def by_megatron(self) -> dict[str, TensorMap]:
        return {m.megatron: m for m in self.maps}

    @cached_property
    def by_hf(self) -> dict[str, TensorMap]:
        return {h: m for m in self.maps for h in m.hf}

    @cached_property
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape every HF tensor must have, in model order."""
        c = self.cfg
        hidden, d = c.hidden_size, c.head_dim
        shapes: dict[str, tuple[int, ...]] = {}
        suffix_shapes = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (c.num_attention_heads * d, hidden),
            "self_attn.k_proj.weight": (c.num_query_groups * d, hidden),
            "self_attn.v_proj.weight": (c.num_query_groups * d, hidden),
            "self_attn.o_proj.weight": (hidden, c.num_attention_heads * d),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
            "mlp.gate.weight": (c.num_experts or 0, hidden),
        }
        ffn = c.moe_ffn_hidden_size if c.is_moe else c.ffn_hidden_size
        for m in self.maps:
            for name in m.hf:
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    shapes[name] = (c.vocab_size, hidden)
                elif name == "model.norm.weight":
                    shapes[name] = (hidden,)
                elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                    shapes[name] = (ffn, hidden)
                elif name.endswith("down_proj.weight"):
                    shapes[name] = (hidden, ffn)
                else:
                    shapes[name] = suffix_shapes[name.split(".", 3)[3]]
        return shapes

    @cached_property
    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every full Megatron tensor."""
        out = {}
        for m in self.maps:
            shapes = [self.hf_shapes[h] for h in m.hf]
            out[m.megatron] = (sum(s[0] for s in shapes), *shapes[0][1:])
        return out

    # -- layout transforms ------------------------------------------------------------------

    def _qkv_split_sizes(self) -> tuple[int, int]:
        c = self.cfg
        return c.num_attention_heads // c.num_query_groups, c.head_dim

    def to_megatron(self, m: TensorMap, hf_tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """The full Megatron tensor ``m.megatron`` from its HF tensors (in ``m.hf`` order)."""
        tensors = list(hf_tensors)
        if m.kind == "copy":
            return tensors[0]
        if m.kind == "gate_up":
            return torch.cat(tensors, dim=0)
        q, k, v = tensors
        hpg, d = self._qkv_split_sizes()
        groups = self.cfg.num_query_groups
        hidden = q.shape[-1]
        fused = torch.cat(
            [
                q.reshape(groups, hpg * d, hidden),
                k.reshape(groups, d, hidden),
                v.reshape(groups, d, hidden),
            ],
            dim=1,
        )
        return fused.reshape(groups * (hpg + 2) * d, hidden)

    def to_hf(self, megatron_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of one full Megatron tensor; what weight sync calls per tensor.

        Returns contiguous tensors (views are copied) so that callers may serialize them.
        """
        m = self.by_megatron.get(megatron_name)
        if m is None:
            raise KeyError(f"no Hugging Face counterpart for Megatron tensor {megatron_name!r}")
        expected = self.megatron_shapes[megatron_name]
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"Megatron tensor {megatron_name!r} has shape {tuple(tensor.shape)}, "
                f"the config says {expected}"
            )
        if m.kind == "copy":
            parts = [tensor]
        elif m.kind == "gate_up":
            parts = list(tensor.chunk(2, dim=0))
        else:
            hpg, d = self._qkv_split_sizes()
            groups = self.cfg.num_query_groups
            grouped = tensor.reshape(groups, (hpg + 2) * d, -1)
            q, k, v = grouped.split([hpg * d, d, d], dim=1)
            parts = [x.reshape(-1, tensor.shape[-1]) for x in (q, k, v)]
        return [(name, p.contiguous()) for name, p in zip(m.hf, parts, strict=True)]

    def iter_megatron(
        self, get_hf: Callable[[str], torch.Tensor], maps: Iterable[TensorMap] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(full Megatron name, tensor)``, fetching HF tensors on demand by name."""
        for m in self.maps if maps is None else maps:
            yield m.megatron, self.to_megatron(m, (get_hf(h) for h in m.hf))

    def iter_hf(
        self, megatron_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(HF name, tensor)`` for a stream of full Megatron tensors.

        Names with no HF counterpart are refused, except the output layer of a tied model
        (pipeline-parallel last stages keep a copy of the embedding there).
        """
        for name, tensor in megatron_tensors:
            if name == "output_layer.weight" and not self.cfg.untie_embeddings_and_output_weights:
                continue
            yield from self.to_hf(name, tensor)


_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def split_fused_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Per-expert HF tensors from transformers 5.x's fused 3-D expert parameters.

    ``gate_up_proj`` is ``[E, 2*I, H]`` with gate rows first; ``down_proj`` is ``[E, H, I]``.
    Any other name is returned unchanged.
    """
    m = _FUSED_EXPERTS.match(name)
    if m is None:
        return [(name, tensor)]
    prefix, kind = m.groups()
    out = []
    for e in range(tensor.shape[0]):
        if kind == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", tensor[e]))
        else:
            gate, up = tensor[e].chunk(2, dim=0)
            out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
    return out


def fused_expert_source(name: str) -> tuple[str, int, str] | None:
    """For a per-expert HF name, the fused 5.x parameter holding it: (name, expert, part)."""
    m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    if m is None:
        return None
    prefix, e, part = m.groups()
    fused = f"{prefix}.down_proj" if part == "down" else f"{prefix}.gate_up_proj"
    return fused, int(e), part
