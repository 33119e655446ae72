"""What a node has: versions, the device, Transformer Engine and FP8, vLLM, a recipe's optional
packages, and NCCL's all-reduce across the node's GPUs.

Imports nothing heavier than torch at module level: the all-reduce ranks are spawned
processes that import this module.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time

import psutil
import torch

from megatron_gspo.runtime.extras import recipe_needs

GIB = 1024**3

# NVLink bandwidth per direction of one GPU of an SXM board (the figure nccl-tests' all-reduce
# bus bandwidth is compared with), by the name torch reports without "NVIDIA ".
NVLINK_GBPS = {
    "H200": 450.0,
    "H100 80GB HBM3": 450.0,
    "A100-SXM4-80GB": 300.0,
    "A100-SXM4-40GB": 300.0,
}


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_summary(device: torch.device) -> dict[str, object]:
    """torch, CUDA, the device and its memory, the GPUs on the node, Megatron-Core."""
    out: dict[str, object] = {
        "torch": torch.__version__,
        "CUDA": torch.version.cuda or "none",
        "GPUs": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "megatron-core": _version("megatron-core") or "not installed",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out["device"] = props.name
        out["compute capability"] = f"{props.major}.{props.minor}"
        out["device memory GiB"] = props.total_memory / GIB
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        out["NCCL"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        out["device"] = f"cpu ({torch.get_num_threads()} threads)"
        out["device memory GiB"] = psutil.virtual_memory().total / GIB
    return out


def transformer_engine() -> tuple[object | None, str]:
    """(the imported ``transformer_engine.pytorch`` or None, what to report about it)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None, "not installed (pip install 'megatron-gspo[gpu]')"
    try:
        import transformer_engine.pytorch as te
    except Exception as e:  # noqa: BLE001 - a broken build raises anything from its loader
        return None, f"installed, import fails: {str(e).splitlines()[0]}"
    return te, _version("transformer-engine") or _version("transformer_engine") or "installed"


def fp8_support(te, device: torch.device) -> tuple[bool, str]:
    """Whether FP8 training can run here, and why not."""
    why = []
    if device.type != "cuda":
        why.append("no CUDA GPU")
    if te is None:
        why.append("transformer_engine not importable (pip install 'megatron-gspo[gpu]')")
    if why:
        return False, "; ".join(why)
    try:
        from transformer_engine.pytorch.fp8 import check_fp8_support
    except ImportError:
        # TE releases that moved the check: the hardware rule it applies (Ada, Hopper, later).
        major, minor = torch.cuda.get_device_capability(device)
        ok = (major, minor) >= (8, 9)
        return ok, "" if ok else f"compute capability {major}.{minor} < 8.9"
    ok, reason = check_fp8_support()
    return bool(ok), "" if ok else str(reason)


def vllm_summary() -> str:
    """vLLM's installed version against the range the ``gpu`` extra pins (from this package's
    own metadata, so the range is written once, in pyproject.toml)."""
    version = _version("vllm")
    if version is None or importlib.util.find_spec("vllm") is None:
        return "not installed (rollout nodes: pip install 'megatron-gspo[gpu]')"
    from packaging.requirements import Requirement

    wanted = None
    for line in importlib.metadata.requires("megatron-gspo") or []:
        req = Requirement(line)
        if req.name == "vllm":
            wanted = req.specifier
    if wanted is None:
        return f"{version} (no supported range found in megatron-gspo's metadata)"
    verdict = "supported" if wanted.contains(version, prereleases=True) else "NOT supported"
    return f"{version} ({verdict}: {wanted})"


def recipe_report(recipe) -> tuple[dict[str, object], list[str]]:
    """A recipe's optional packages: the figures to report, and one line per missing one."""
    needs = recipe_needs(recipe)
    missing = [n.message for n in needs if not n.installed]
    figures: dict[str, object] = {
        "needs": ", ".join(f"{n.module} [{n.extra}]" for n in needs) or "nothing optional",
        "missing": "; ".join(missing) or "none",
    }
    return figures, missing


def _allreduce_rank(rank, world, port, backend, nbytes, iters, queue) -> None:
    import torch.distributed as dist

    try:
        device = torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        dist.destroy_process_group()
        queue.put((rank, seconds, None))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which names the rank
        queue.put((rank, None, f"{type(e).__name__}: {e}"))


def allreduce_bus_gbps(
    world: int, *, backend: str, nbytes: int, iters: int, timeout_s: float = 300
) -> float:
    """Bus bandwidth (nccl-tests' convention: bytes / time x 2 (n - 1) / n) of an all-reduce
    of ``nbytes`` of bf16 over ``world`` processes on this node, one GPU each with NCCL."""
    import queue as queue_module

    import torch.multiprocessing as mp

    from megatron_gspo.runtime.procs import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, world, port, backend, nbytes, iters, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    times, errors = [], []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(world):
            rank, seconds, error = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if error:
                errors.append(f"rank {rank}: {error}")
            else:
                times.append(seconds)
    except queue_module.Empty:
        errors.append(f"no result from every rank within {timeout_s:.0f} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("; ".join(errors))
    return nbytes / max(times) * 2 * (world - 1) / world / 1e9


def nominal_link_gbps(device_name: str) -> float | None:
    return NVLINK_GBPS.get(device_name.removeprefix("NVIDIA ").strip())
