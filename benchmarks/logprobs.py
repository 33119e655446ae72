"""Benchmark: chunked fp32 token_logprobs vs the naive log_softmax(logits.float()).gather path.

Both paths run forward + backward on the same bf16 logits in the same process; figures are
printed as ratios ours/naive. Peak extra memory is measured from just before the op (logits
and targets already allocated) to its peak, and includes the bf16 gradient of the logits that
both paths must produce. On CUDA it comes from torch.cuda.max_memory_allocated; on CPU from the
process RSS sampled by a background thread about every millisecond (an approximation: a peak
shorter than a sample can be missed, and allocator caching can hide reuse).

Example (small): python benchmarks/logprobs.py --tokens 512 --vocab 32000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run as a script from a checkout: import this checkout's package, not an installed copy.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_gspo.loss import gspo_loss, token_logprobs  # noqa: E402
from megatron_gspo.preflight.measure import (  # noqa: E402
    naive_logprobs,
    peak_extra_memory,
    sync,
)

GiB = 1024**3


def fwd_bwd(fn: Callable, x: torch.Tensor, targets: torch.Tensor, g: torch.Tensor):
    x.grad = None
    lp = fn(x, targets)
    lp.backward(g)
    return lp.detach()


def measure(name, fn, x, targets, g, repeats, device):
    """One memory-measured run (which also warms up), then ``repeats`` timed runs."""
    x.grad = None
    extra, lp = peak_extra_memory(lambda: fwd_bwd(fn, x, targets, g), device)
    times = []
    for _ in range(repeats):
        x.grad = None
        gc.collect()
        sync(device)
        start = time.perf_counter()
        fwd_bwd(fn, x, targets, g)
        sync(device)
        times.append(time.perf_counter() - start)
    grad = x.grad
    x.grad = None
    median = statistics.median(times)
    print(
        f"{name:>6}: fwd+bwd median {median:8.3f} s over {repeats}, "
        f"peak extra {extra / GiB:6.3f} GiB"
    )
    return median, extra, lp, grad


def time_gspo(tokens: int, device: torch.device, repeats: int) -> float:
    """GSPO loss forward + backward on the same number of tokens (64 sequences)."""
    b = 64
    t = max(1, tokens // b)
    g = torch.Generator().manual_seed(1)
    olp = (-torch.rand(b, t, generator=g) * 3).to(device)
    lp = (olp + torch.randn(b, t, generator=g).to(device) * 1e-3).requires_grad_()
    adv = torch.randn(b, generator=g).to(device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    mask[:, : t // 4] = False  # prompt tokens
    times = []
    for i in range(repeats + 3):
        lp.grad = None
        sync(device)
        start = time.perf_counter()
        loss, _ = gspo_loss(lp, olp, adv, mask)
        loss.backward()
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (auto)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 2).to(dtype).to(device)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    grad_out = torch.randn(args.tokens, generator=g).to(device)
    x = logits.requires_grad_()

    method = (
        "torch.cuda.max_memory_allocated"
        if device.type == "cuda"
        else "sampled process RSS (psutil, ~1 ms), peak minus RSS just before the op"
    )
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    print(f"logits [{args.tokens}, {args.vocab}] {dtype} on {device}{threads}")
    print(f"logits size {x.numel() * x.element_size() / GiB:.3f} GiB; peak memory: {method}")
    print("peak extra includes the gradient of the logits (same dtype as the logits) in both")

    def ours(z, t):
        return token_logprobs(z, t, chunk_size=args.chunk_size)

    t_naive, m_naive, lp_naive, grad_naive = measure(
        "naive", naive_logprobs, x, targets, grad_out, args.repeats, device
    )
    del grad_naive
    gc.collect()
    t_ours, m_ours, lp_ours, grad_ours = measure(
        "ours", ours, x, targets, grad_out, args.repeats, device
    )
    del grad_ours
    diff = (lp_ours - lp_naive).abs().max().item()
    t_gspo = time_gspo(args.tokens, device, max(args.repeats, 10))

    print(f"max |logprob ours - naive|: {diff:.3e}")
    print(f"time ratio (ours/naive): {t_ours / t_naive:.3f}")
    print(f"peak-extra-memory ratio (ours/naive): {m_ours / m_naive:.3f}")
    print(
        f"gspo_loss fwd+bwd [64 x {max(1, args.tokens // 64)}]: {t_gspo * 1e3:.3f} ms = "
        f"{t_gspo / t_ours:.2e} of token_logprobs fwd+bwd"
    )


if __name__ == "__main__":
    main()
