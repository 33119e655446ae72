"""Timing and peak memory on the device in use, the device's ceilings, and the loss layer
against the naive log-softmax.

Everything takes a ``torch.device``: the same code measures a GPU (CUDA events of time via
``synchronize``, ``torch.cuda.max_memory_allocated``) and a CPU (wall time, the process RSS
sampled by a thread).
"""

from __future__ import annotations

import gc
import statistics
import threading
import time
from collections.abc import Callable

import psutil
import torch

from megatron_gspo.loss import token_logprobs


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_times(
    fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int = 1
) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def median_time(fn: Callable[[], object], device: torch.device, *, repeats: int, warmup: int = 1):
    return statistics.median(run_times(fn, device, repeats=repeats, warmup=warmup))


class RssSampler:
    """Peak resident set size of this process, sampled in a background thread (about every
    millisecond: a peak shorter than a sample can be missed)."""

    def __init__(self, interval_s: float = 1e-3) -> None:
        self.interval_s = interval_s
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> RssSampler:
        self.baseline = self.process.memory_info().rss
        self.peak = self.baseline
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.baseline


def peak_extra_memory(fn: Callable[[], object], device: torch.device) -> tuple[int, object]:
    """Bytes ``fn()`` adds at its peak to what was allocated before it, and its result: from
    the CUDA allocator on a GPU, from the sampled process RSS on a CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, out
    with RssSampler() as sampler:
        out = fn()
    return sampler.extra, out


# Ceilings are the best of their runs: the rate the device reaches, not a typical one (on a
# shared CPU a median measures the neighbours).


def matmul_tflops(n: int, device: torch.device, *, repeats: int) -> float:
    """bf16 ``[n, n] @ [n, n]``: the matrix rate the step's MFU is measured against."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    t = min(run_times(lambda: a @ b, device, repeats=repeats, warmup=2))
    return 2 * n**3 / t / 1e12


def copy_gbps(nbytes: int, device: torch.device, *, repeats: int) -> float:
    """A device-to-device copy of ``nbytes``; counts the bytes read and written (2 x nbytes)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = min(run_times(lambda: dst.copy_(src), device, repeats=repeats, warmup=2))
    return 2 * nbytes / t / 1e9


def naive_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What ``token_logprobs`` replaces: a full fp32 log-softmax, then the target's entry."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _fwd_bwd(fn, x: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x.grad = None
    lp = fn(x, targets)
    lp.backward(grad)
    return lp.detach()


def logprobs_vs_naive(
    tokens: int, vocab: int, device: torch.device, *, repeats: int, chunk_size: int | None = None
) -> dict[str, float]:
    """Forward and backward of ``token_logprobs`` and of :func:`naive_logprobs` on the same
    bf16 logits: median times, peak extra memory (the logits' bf16 gradient included in
    both), their ratios, and the largest difference of the log-probs."""
    g = torch.Generator(device).manual_seed(0)
    x = (torch.randn(tokens, vocab, generator=g, device=device) * 2).to(torch.bfloat16)
    x.requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    grad = torch.randn(tokens, generator=g, device=device)

    def ours(z, t):
        return token_logprobs(z, t, chunk_size=chunk_size)

    out: dict[str, float] = {}
    results = {}
    for name, fn in (("naive", naive_logprobs), ("ours", ours)):
        # The memory-measured run is also the warm-up of the timed ones.
        extra, lp = peak_extra_memory(lambda fn=fn: _fwd_bwd(fn, x, targets, grad), device)
        x.grad = None
        seconds = median_time(
            lambda fn=fn: _fwd_bwd(fn, x, targets, grad), device, repeats=repeats, warmup=0
        )
        x.grad = None
        results[name] = lp
        out[f"{name} fwd+bwd ms"] = seconds * 1e3
        out[f"{name} peak extra MiB"] = extra / 2**20
    out["time ratio"] = out["ours fwd+bwd ms"] / out["naive fwd+bwd ms"]
    out["memory ratio"] = out["ours peak extra MiB"] / max(out["naive peak extra MiB"], 1e-9)
    out["max |ours - naive|"] = float((results["ours"] - results["naive"]).abs().max())
    return out
