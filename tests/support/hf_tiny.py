"""Tiny random-weight Qwen3 / Qwen3-MoE checkpoints: a reference no one here wrote."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

TOKENS_SHAPE = (2, 16)
VOCAB = 128


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights far from initialization so that every layout mistake shows in the logits.

    Norm weights are spread around 1 (a swapped q_norm/k_norm or a mis-split head changes the
    result) and the router is sharp enough that the top-2 choice differs between tokens.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


# The sizes both tiny MoE families share, so their tests exercise the same shapes.
_TINY_MOE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def make_hf_moe(
    path: Path,
    seed: int = 0,
    rope_theta: float = 10000.0,
    save_kwargs: dict | None = None,
    **config,
) -> torch.nn.Module:
    """Qwen3-MoE; ``config`` overrides (an odd vocabulary, mlp_only_layers, norm_topk_prob)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **{
            **_TINY_MOE,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            "rope_theta": rope_theta,
            "dtype": "float32",
            "attn_implementation": "eager",
            **config,
        }
    )
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path, **(save_kwargs or {}))
    return model


def make_hf_deepseek(path: Path, seed: int = 2, **config) -> torch.nn.Module:
    """A tiny DeepSeek-V3: multi-latent attention, a dense layer then an MoE layer with a
    shared expert, sigmoid routing whose choice depends on the correction bias and on the
    groups (8 experts in 4 groups, the best 2 groups, top-4), routed scaling 2.5."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **{
            **_TINY_MOE,
            "num_key_value_heads": 4,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "max_position_embeddings": 64,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "num_nextn_predict_layers": 0,
            "dtype": "float32",
            "attn_implementation": "eager",
            **config,
        }
    )
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    # The correction bias is a buffer: as large as the scores' spread, so it changes routes.
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path)
    return model


def make_hf_dense(path: Path, seed: int = 1) -> torch.nn.Module:
    """Dense Qwen3 with tied embeddings, as the small Qwen3 checkpoints have."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        dtype="float32",
        attn_implementation="eager",
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    _randomize(model, seed)
    model.save_pretrained(path)
    return model


def tokens(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, TOKENS_SHAPE, generator=g)


def hf_logits(model: torch.nn.Module, toks: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=toks).logits.float()


def read_hf_dir(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[k] = st.get_tensor(k)
    return out
