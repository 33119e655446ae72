"""The order preflight runs its parts in, on the device this process has.

Each part runs on a GPU where there is one and on the CPU otherwise; the parts that need CUDA
(NCCL across GPUs, FP8) say why they were skipped. The log-prob comparison runs before the
slice is built, and the FP8 slice after the bf16 one is freed: each takes the GPU's memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_gspo.config import ParallelConfig, Recipe
from megatron_gspo.preflight import env
from megatron_gspo.preflight.measure import copy_gbps, logprobs_vs_naive, matmul_tflops
from megatron_gspo.preflight.report import FP8_STEP, LOGPROBS, STEP, Part, Report, Skip
from megatron_gspo.preflight.sizes import (
    QWEN3_30B_A3B_LAYERS,
    SIZES,
    LayerChoice,
    Size,
    fitting_layers,
    slice_recipe,
)
from megatron_gspo.runtime.errors import InputError

# token_logprobs and the naive path compute the same fp32 log-softmax; they differ by fp32
# summation order only.
LOGPROBS_TOLERANCE = 1e-3


class PreflightError(InputError):
    """Preflight cannot start here (a GPU size without a GPU)."""


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _describe(recipe: Recipe, size: Size, choice: LayerChoice) -> dict[str, object]:
    m = recipe.model
    shape = (
        f"hidden {m.hidden_size}, {m.num_attention_heads} query heads / {m.num_query_groups} "
        f"key-value groups x {m.head_dim}, {m.num_experts} experts top-{m.moe_router_topk} x "
        f"{m.moe_ffn_hidden_size}, vocabulary {m.vocab_size}, bf16"
    )
    if size.gpu is None:
        why = "the CPU size (the same structure, shrunk)"
    else:
        why = (
            f"the most that fit one {size.gpu.upper()} with Adam: planned {choice.planned_gib:.1f}"
            f" of {choice.capacity_gib:.1f} GiB (bf16 weights, fp32 grads, fp32 master and "
            f"Adam m, v, activations of {size.micro_batch_tokens}-token micro-batches, logits, "
            "runtime, FP8 weight copies); one more would not fit"
        )
    return {
        "slice": shape,
        "layers": f"{choice.layers} of {QWEN3_30B_A3B_LAYERS}",
        "why these layers": why,
        "batch": f"{size.sequences} x ({size.prompt_len} prompt + {size.response_len} response)",
    }


def _check_memory(size: Size, choice: LayerChoice, device: torch.device) -> None:
    if device.type != "cuda" or size.gpu is None:
        return
    have = torch.cuda.get_device_properties(device).total_memory / 1024**3
    if have < choice.planned_gib:
        raise RuntimeError(
            f"the {size.name} slice is planned for {choice.planned_gib:.1f} GiB; this GPU has "
            f"{have:.1f} GiB (try --size h100)"
        )


def run_preflight(
    size_name: str,
    *,
    recipe: Recipe | None = None,
    on_part: Callable[[Report, Part], None] | None = None,
) -> Report:
    """Every part at ``size_name``; what failed is in the report, not raised. ``on_part`` is
    called with each part as it ends."""
    size = SIZES[size_name]
    if size.gpu is not None and not torch.cuda.is_available():
        raise PreflightError(
            f"--size {size_name} needs a CUDA GPU and this machine has none; "
            "--size tiny runs the parts a CPU can"
        )
    device = _device()
    report = Report(size_name, on_part=on_part)
    report.device = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with report.part("environment") as part:
        part.figures.update(env.device_summary(device))
        te, te_text = env.transformer_engine()
        fp8_ok, fp8_why = env.fp8_support(te, device)
        part.figures["transformer-engine"] = te_text
        part.figures["FP8"] = "supported" if fp8_ok else f"unavailable: {fp8_why}"
        part.figures["vllm"] = env.vllm_summary()
    if recipe is not None:
        with report.part("recipe") as part:
            figures, missing = env.recipe_report(recipe)
            part.figures.update(figures)
            if missing:
                part.status = "missing"
    with report.part("nccl all-reduce") as part:
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if gpus < 2:
            raise Skip(f"needs 2 or more CUDA GPUs; this node has {gpus}")
        bus = env.allreduce_bus_gbps(gpus, backend="nccl", nbytes=size.allreduce_bytes, iters=20)
        nominal = env.nominal_link_gbps(torch.cuda.get_device_name(device))
        part.figures.update({"GPUs": gpus, "message MiB": size.allreduce_bytes / 2**20})
        part.figures["bus GB/s"] = bus
        part.figures["nominal NVLink GB/s per direction"] = nominal or "unknown for this GPU"
        if nominal:
            part.figures["of nominal"] = bus / nominal

    matmul = float("nan")
    with report.part("ceilings") as part:
        reps = size.ceiling_repeats
        matmul = matmul_tflops(size.matmul_n, device, repeats=reps)
        part.figures[f"matmul bf16 {size.matmul_n}^3 TFLOP/s"] = matmul
        part.figures[f"copy {size.copy_bytes / 2**20:.0f} MiB GB/s (read + write)"] = copy_gbps(
            size.copy_bytes, device, repeats=reps
        )
    with report.part(LOGPROBS) as part:
        part.figures["logits"] = f"{size.logprob_tokens} x {size.logprob_vocab} bf16"
        part.figures.update(
            logprobs_vs_naive(
                size.logprob_tokens, size.logprob_vocab, device, repeats=size.logprob_repeats
            )
        )
        if not part.figures["max |ours - naive|"] <= LOGPROBS_TOLERANCE:
            raise RuntimeError(
                f"token_logprobs differs from the naive log-softmax by "
                f"{part.figures['max |ours - naive|']:.3g} (> {LOGPROBS_TOLERANCE})"
            )
    _slice_parts(report, size, device, matmul, fp8_ok, fp8_why)
    return report


def _slice_parts(report: Report, size: Size, device, matmul: float, fp8_ok, fp8_why) -> None:
    from megatron_gspo.parallel import destroy_parallel, init_parallel
    from megatron_gspo.preflight.step import SliceStep, layer_spec, rollout_batch

    bf16 = fp8 = None
    bf16_seconds = float("nan")
    try:
        with report.part(STEP) as part:
            choice = fitting_layers(size, local_attention=layer_spec() == "local")
            recipe = slice_recipe(size, choice.layers)
            part.figures.update(_describe(recipe, size, choice))
            part.figures["layer spec"] = layer_spec()
            _check_memory(size, choice, device)
            groups = init_parallel(ParallelConfig())
            samples = rollout_batch(size, recipe.model.vocab_size)
            bf16 = SliceStep(recipe, groups)
            # Megatron's local layers run the slice's 128 experts one after another and its
            # attention sequence by sequence: on an H200 a warm-up and 3 steps took over 4
            # minutes, so one timed step there.
            repeats = size.repeats if part.figures["layer spec"] != "local" else 1
            part.figures.update(bf16.run(samples, repeats=repeats, matmul_tflops=matmul))
            bf16_seconds = part.figures["step s"]
        with report.part("embedded engine") as part:
            if bf16 is None:
                raise Skip(f"no policy: the {STEP} part did not build one")
            part.figures.update(bf16.decode(size, repeats=repeats))
        if bf16 is not None:
            bf16.close()
            bf16 = None
        with report.part(FP8_STEP) as part:
            if not fp8_ok:
                raise Skip(fp8_why)
            if report.parts[STEP].status != "ok":
                raise Skip(f"nothing to compare with: the {STEP} part did not run")
            fp8 = SliceStep(slice_recipe(size, choice.layers, fp8=True), groups)
            part.figures.update(fp8.run(samples, repeats=size.repeats, matmul_tflops=matmul))
            part.figures["fp8/bf16 step time"] = part.figures["step s"] / bf16_seconds
    finally:
        for s in (bf16, fp8):
            if s is not None:
                s.close()
        destroy_parallel()
