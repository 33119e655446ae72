"""The one mapping between Hugging Face tensors (Qwen3, Qwen3-MoE, DeepSeek-V3) and full
Megatron tensors.

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
  (Megatron's ``pre_mlp_layernorm``); HF's MoE router is ``mlp.gate``. Multi-latent
  attention (``q_a_proj`` -> ``linear_q_down_proj``, ``q_a_layernorm`` -> ``q_layernorm``,
  ``q_b_proj`` -> ``linear_q_up_proj``, ``kv_a_proj_with_mqa`` -> ``linear_kv_down_proj``,
  ``kv_a_layernorm`` -> ``kv_layernorm``, ``kv_b_proj`` -> ``linear_kv_up_proj``) is copied
  as is: HF's ``rope_interleave: true`` rows are in the order Megatron's MLA reads. DeepSeek's
  ``mlp.gate.e_score_correction_bias`` is the router's ``expert_bias`` (a buffer, in fp32)
  and its ``shared_experts`` a SwiGLU MLP like the others.

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
from megatron_gspo.runtime.errors import InputError

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
    # The shape of each HF tensor (the Megatron tensor stacks them along dim 0).
    hf_shapes: tuple[tuple[int, ...], ...] = ()
    # Kept in fp32 whatever the model's dtype (DeepSeek-V3's expert-score correction bias).
    fp32: bool = False


def _attention_maps(cfg: ModelConfig, m: str, h: str, i: int) -> list[TensorMap]:
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.mla is not None:
        return _mla_maps(cfg, m, h, i)
    d, groups = cfg.head_dim, cfg.num_query_groups
    return [
        TensorMap(
            f"{m}.self_attention.linear_qkv.weight",
            tuple(f"{h}.self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
            i,
            ((heads * d, hidden), (groups * d, hidden), (groups * d, hidden)),
        ),
        TensorMap(
            f"{m}.self_attention.linear_proj.weight",
            (f"{h}.self_attn.o_proj.weight",),
            "copy",
            i,
            ((hidden, heads * d),),
        ),
        TensorMap(
            f"{m}.self_attention.q_layernorm.weight",
            (f"{h}.self_attn.q_norm.weight",),
            "copy",
            i,
            ((d,),),
        ),
        TensorMap(
            f"{m}.self_attention.k_layernorm.weight",
            (f"{h}.self_attn.k_norm.weight",),
            "copy",
            i,
            ((d,),),
        ),
    ]


def _mla_maps(cfg: ModelConfig, m: str, h: str, i: int) -> list[TensorMap]:
    """Multi-latent attention: plain copies (HF's rope_interleave layout is Megatron's)."""
    mla, hidden, heads = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    a, b = f"{m}.self_attention", f"{h}.self_attn"
    pairs = []
    if mla.q_lora_rank is None:
        pairs.append(("linear_q_proj", "q_proj", (heads * q_head, hidden)))
    else:
        pairs += [
            ("linear_q_down_proj", "q_a_proj", (mla.q_lora_rank, hidden)),
            ("q_layernorm", "q_a_layernorm", (mla.q_lora_rank,)),
            ("linear_q_up_proj", "q_b_proj", (heads * q_head, mla.q_lora_rank)),
        ]
    kv_up = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    pairs += [
        (
            "linear_kv_down_proj",
            "kv_a_proj_with_mqa",
            (mla.kv_lora_rank + mla.qk_rope_head_dim, hidden),
        ),
        ("kv_layernorm", "kv_a_layernorm", (mla.kv_lora_rank,)),
        ("linear_kv_up_proj", "kv_b_proj", (kv_up, mla.kv_lora_rank)),
        ("linear_proj", "o_proj", (hidden, heads * mla.v_head_dim)),
    ]
    return [
        TensorMap(f"{a}.{ours}.weight", (f"{b}.{theirs}.weight",), "copy", i, (shape,))
        for ours, theirs, shape in pairs
    ]


def _layer_maps(cfg: ModelConfig, i: int) -> list[TensorMap]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    hidden = cfg.hidden_size
    maps = [
        TensorMap(
            f"{m}.input_layernorm.weight",
            (f"{h}.input_layernorm.weight",),
            "copy",
            i,
            ((hidden,),),
        ),
        *_attention_maps(cfg, m, h, i),
        TensorMap(
            f"{m}.pre_mlp_layernorm.weight",
            (f"{h}.post_attention_layernorm.weight",),
            "copy",
            i,
            ((hidden,),),
        ),
    ]
    if i not in cfg.moe_layers:
        return maps + _mlp_maps(f"{m}.mlp", f"{h}.mlp", i, hidden, cfg.ffn_hidden_size)
    experts = cfg.num_experts
    maps.append(
        TensorMap(
            f"{m}.mlp.router.weight", (f"{h}.mlp.gate.weight",), "copy", i, ((experts, hidden),)
        )
    )
    if cfg.moe_router_expert_bias:
        maps.append(
            TensorMap(
                f"{m}.mlp.router.expert_bias",
                (f"{h}.mlp.gate.e_score_correction_bias",),
                "copy",
                i,
                ((experts,),),
                fp32=True,
            )
        )
    for e in range(experts):
        maps += _mlp_maps(
            f"{m}.mlp.experts.local_experts.{e}",
            f"{h}.mlp.experts.{e}",
            i,
            hidden,
            cfg.moe_ffn_hidden_size,
        )
    if cfg.moe_shared_expert_intermediate_size:
        maps += _mlp_maps(
            f"{m}.mlp.shared_experts",
            f"{h}.mlp.shared_experts",
            i,
            hidden,
            cfg.moe_shared_expert_intermediate_size,
        )
    return maps


def _mlp_maps(m: str, h: str, i: int, hidden: int, ffn: int) -> list[TensorMap]:
    return [
        TensorMap(
            f"{m}.linear_fc1.weight",
            (f"{h}.gate_proj.weight", f"{h}.up_proj.weight"),
            "gate_up",
            i,
            ((ffn, hidden), (ffn, hidden)),
        ),
        TensorMap(
            f"{m}.linear_fc2.weight", (f"{h}.down_proj.weight",), "copy", i, ((hidden, ffn),)
        ),
    ]


class HFMapping:
    """Names, shapes and layout transforms of one model configuration.

    Pure: no I/O, no process groups. Build one per configuration and reuse it (the name tables
    are computed once). Full tensors hold the tokenizer's vocabulary only: the rows Megatron
    pads it with (``ModelConfig.padded_vocab_size``) are added and removed where a model or
    checkpoint is read or written (:mod:`megatron_gspo.weights.shards`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    @cached_property
    def maps(self) -> list[TensorMap]:
        """Every full Megatron tensor in model order (embedding, layer 0, ..., output)."""
        cfg = self.cfg
        vocab = ((cfg.vocab_size, cfg.hidden_size),)
        maps = [
            TensorMap(
                "embedding.word_embeddings.weight",
                ("model.embed_tokens.weight",),
                "copy",
                None,
                vocab,
            )
        ]
        for i in range(cfg.num_layers):
            maps += _layer_maps(cfg, i)
        maps.append(
            TensorMap(
                "decoder.final_layernorm.weight",
                ("model.norm.weight",),
                "copy",
                None,
                ((cfg.hidden_size,),),
            )
        )
        if cfg.untie_embeddings_and_output_weights:
            maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "copy", None, vocab))
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
        return {h: shape for m in self.maps for h, shape in zip(m.hf, m.hf_shapes, strict=True)}

    @cached_property
    def megatron_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every full Megatron tensor."""
        return {
            m.megatron: (sum(s[0] for s in m.hf_shapes), *m.hf_shapes[0][1:]) for m in self.maps
        }

    def hf_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype HF tensor ``name`` has in a checkpoint of a model in ``dtype``."""
        return torch.float32 if self.by_hf[name].fp32 else dtype

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
            raise InputError(
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
