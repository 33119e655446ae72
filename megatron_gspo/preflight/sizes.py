"""What preflight runs at each size: a Qwen3-30B-A3B-shaped slice that one GPU holds with its
optimizer, how many of its layers fit, and the FLOPs of a GSPO step on it.

The slice keeps every width of Qwen3-30B-A3B (hidden 2048, 32 query heads over 4 key/value
groups of width 128, 128 experts of width 768, top-8, vocabulary 151936) and drops layers:
the 48 layers take 30.5 B parameters, 18 bytes each with bf16 weights, fp32 main gradients
and fp32 Adam states (~550 GB), where one GPU has 80 or 141 GB. ``fitting_layers`` keeps
as many as ``megatron-gspo plan``'s estimate fits on one GPU, with room for the FP8 step's
weight copies. ``tiny`` is the same structure at a CPU's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_gspo.config import ModelConfig, Recipe
from megatron_gspo.launch.plan import GIB, plan_memory
from megatron_gspo.model.counts import active_parameters, count_parameters
from megatron_gspo.runtime.errors import InputError

# The released config.json of Qwen/Qwen3-30B-A3B (recipes/qwen3-30b-a3b-gspo.yaml).
QWEN3_30B_A3B_LAYERS = 48
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_attention_heads=32,
    num_query_groups=4,
    head_dim=128,
    vocab_size=151936,
    num_experts=128,
    moe_ffn_hidden_size=768,
    moe_router_topk=8,
    rotary_base=1_000_000.0,
    norm_epsilon=1e-6,
)
# The same structure shrunk: 8 query heads a key/value group, heads x head width twice the
# hidden size, 128 experts top-8 of 3/8 the hidden width, an untied output layer.
TINY_SLICE = dict(QWEN3_30B_A3B, hidden_size=64, num_attention_heads=8, num_query_groups=1)
TINY_SLICE.update(head_dim=16, vocab_size=2048, moe_ffn_hidden_size=24)

# TE's FP8 linear layers keep an FP8 copy of each weight and of its transpose (1 byte each)
# beside the bf16 weights; the plan does not count them.
FP8_BYTES_PER_LAYER_PARAM = 2


@dataclass(frozen=True)
class Size:
    name: str
    shape: dict
    gpu: str | None  # the plan's GPU (its memory decides the layers); None: ``layers``
    layers: int
    matmul_n: int
    copy_bytes: int
    logprob_tokens: int
    logprob_vocab: int
    sequences: int  # of the GSPO step's batch
    prompt_len: int
    response_len: int
    micro_batch_tokens: int
    decode_batch: int
    decode_prompt: int
    decode_new: int
    allreduce_bytes: int
    repeats: int  # timed runs of the step and the engine (after one warm-up)
    ceiling_repeats: int  # timed matrix products and copies (the best counts)
    logprob_repeats: int  # timed log-prob passes, each way (the median counts)


_GPU = dict(
    shape=QWEN3_30B_A3B,
    layers=0,
    matmul_n=8192,
    copy_bytes=4 * GIB,
    logprob_tokens=8192,
    logprob_vocab=151936,
    # 16 responses of 1536 tokens after 512-token prompts: 32768 tokens, 4 micro-batches.
    sequences=16,
    prompt_len=512,
    response_len=1536,
    micro_batch_tokens=8192,
    decode_batch=64,
    decode_prompt=128,
    decode_new=256,
    allreduce_bytes=GIB,
    repeats=3,
    ceiling_repeats=20,
    logprob_repeats=5,
)
SIZES = {
    "tiny": Size(
        name="tiny",
        shape=TINY_SLICE,
        gpu=None,
        layers=2,
        matmul_n=512,
        copy_bytes=64 * 2**20,
        # The fp32 log-softmax of 2048 x 8192 takes 64 MiB: above glibc's largest mmap
        # threshold (32 MiB), so freed memory leaves the RSS the CPU measurement reads.
        logprob_tokens=2048,
        logprob_vocab=8192,
        sequences=8,
        prompt_len=16,
        response_len=48,
        micro_batch_tokens=256,
        decode_batch=64,
        decode_prompt=8,
        decode_new=8,
        allreduce_bytes=2**20,
        repeats=1,
        ceiling_repeats=10,
        logprob_repeats=2,
    ),
    "h100": Size(name="h100", gpu="h100", **_GPU),
    "h200": Size(name="h200", gpu="h200", **_GPU),
}


def slice_recipe(size: Size, layers: int, *, fp8: bool = False) -> Recipe:
    """One rank, bf16 (FP8 GEMMs where ``fp8``), one mini-batch: the old-log-prob pass and
    one optimizer step per GSPO step; no recompute, no distributed optimizer (DP1)."""
    return Recipe.model_validate(
        {
            "model": {
                **size.shape,
                "num_layers": layers,
                "max_seq_length": max(size.prompt_len + size.response_len, size.decode_prompt)
                + size.decode_new,
                "params_dtype": "bfloat16",
            },
            "precision": {"bf16": True, "fp8": "hybrid" if fp8 else None},
            "train": {"mini_batches": 1, "micro_batch_tokens": size.micro_batch_tokens},
            "memory": {"use_distributed_optimizer": False},
            # A small step: the weights change, the figures do not depend on by how much.
            "optimizer": {"lr": 1e-6, "clip_grad": 1.0},
            "loss": {"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4},
        }
    )


@dataclass(frozen=True)
class LayerChoice:
    layers: int
    planned_gib: float  # the plan's total for the bf16 step, FP8 copies added
    capacity_gib: float


def local_attention_bytes(size: Size) -> int:
    """What the local layers' attention (no Transformer Engine) keeps per layer for backward
    beyond the plan's fused-attention estimate: each sequence's fp32 softmax and its bf16 copy,
    heads x length^2 x 6 bytes, for one micro-batch's sequences (one micro-batch is in flight
    at a time on one rank)."""
    m = size.shape
    length = size.prompt_len + size.response_len
    per_micro = max(1, size.micro_batch_tokens // length)
    return m["num_attention_heads"] * length**2 * 6 * per_micro


def fitting_layers(size: Size, *, local_attention: bool = False) -> LayerChoice:
    """The most layers (up to the full model's) whose bf16 step, by ``plan_memory`` on one
    GPU of ``size.gpu``, plus FP8 weight copies, fits the GPU; ``local_attention``: plus what
    the local layers' attention keeps (:func:`local_attention_bytes`), where Transformer
    Engine is absent."""
    if size.gpu is None:
        return LayerChoice(size.layers, float("nan"), float("nan"))
    best = None
    for layers in range(1, QWEN3_30B_A3B_LAYERS + 1):
        recipe = slice_recipe(size, layers)
        plan = plan_memory(recipe, nodes=1, gpus_per_node=1, gpu=size.gpu)
        layer_params = sum(x.total for x in count_parameters(recipe.model).layers)
        total = plan.total + FP8_BYTES_PER_LAYER_PARAM * layer_params
        if local_attention:
            total += layers * local_attention_bytes(size)
        if total > plan.capacity:
            break
        best = LayerChoice(layers, total / GIB, plan.capacity / GIB)
    if best is None:
        raise InputError(f"not one layer of the slice fits a {size.gpu.upper()}")
    return best


def forward_flops(m: ModelConfig, seq_lens: Sequence[int]) -> float:
    """Model FLOPs of one forward pass over sequences of these lengths (tokens the model reads).

    Matrix products: 2 x N x tokens, N the parameters a token multiplies (attention, router,
    its top-k experts, the output layer; not the input embedding, a lookup). Causal
    attention: per layer, QK^T and AV over each sequence's s(s+1)/2 query-key pairs, 2 x heads
    x (query/key width + value width) FLOPs a pair. Forward and backward are three times this,
    6 x N x tokens + attention: the usual MFU count (recomputation is not counted).
    """
    n = active_parameters(m) - count_parameters(m).embedding
    v_width = m.mla.v_head_dim if m.mla is not None else m.head_dim
    pairs = sum(s * (s + 1) // 2 for s in seq_lens)
    attention = 2 * pairs * m.num_attention_heads * (m.head_dim + v_width) * m.num_layers
    return 2.0 * n * sum(seq_lens) + attention


def gspo_step_flops(m: ModelConfig, seq_lens: Sequence[int]) -> float:
    """A GSPO step: the old policy's forward (log-probs), then the update's forward and
    backward."""
    return forward_flops(m, seq_lens) + 3 * forward_flops(m, seq_lens)
