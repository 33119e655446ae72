"""Both sides: the wire of the in-memory weight sync, a manifest of flat buckets and a process
group.

Both ends import this module: the trainer's sending rank (:mod:`.weight_sync`) and the weight
transfer engine inside every vLLM server (:mod:`.server_side.transfer_engine`).

Manifest
    The Hugging Face tensors of one sync, in the order they are sent, packed into buckets of at
    most ``bucket_bytes`` (a larger tensor gets a bucket of its own). Each entry names a tensor
    and gives its dtype, shape and byte range within its bucket; ranges are aligned so that a
    received bucket can be viewed as each dtype without a copy. The manifest depends only on
    the model's shape and the served dtype, so it is agreed once, when the group is formed, and
    every sync after that sends bytes alone.

Group
    The trainer's sending rank (group rank 0) and every worker of every server (ranks 1..N) form
    a group of their own with plain ``torch.distributed`` backends, outside both the trainer's
    world and vLLM's: a ``TCPStore`` served by the trainer, a ``PrefixStore`` named by a random
    token that only the authenticated init request carries, and a gloo (CPU) or NCCL (GPU)
    backend object whose own ``broadcast`` takes group ranks. One broadcast per bucket.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo.runtime.errors import InputError

__all__ = [
    "DTYPES",
    "Manifest",
    "SyncGroup",
    "TensorEntry",
    "plan_manifest",
    "receive_buckets",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Byte alignment of every tensor in a bucket: any dtype view is then aligned, and GPU copies
# start on a cache line.
ALIGN = 256


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise InputError(f"weight sync supports {sorted(DTYPES)}, not {name}")
    return name


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    buckets: tuple[tuple[TensorEntry, ...], ...]
    bucket_nbytes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)

    @property
    def names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b]

    def to_json(self) -> str:
        return json.dumps(
            {
                "bucket_nbytes": list(self.bucket_nbytes),
                "buckets": [
                    [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in b]
                    for b in self.buckets
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        buckets = tuple(
            tuple(TensorEntry(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in bucket)
            for bucket in raw["buckets"]
        )
        return cls(buckets, tuple(int(n) for n in raw["bucket_nbytes"]))


def expected_shapes(served: dict[str, list]) -> dict[str, tuple[int, ...]]:
    """The shapes a server expects under the names the trainer sends, from its checkpoint's
    ``{name: [shape, dtype]}``: per-expert names where it stores experts fused (the layout of
    transformers 5)."""
    from megatron_gspo.weights.hf import split_fused_experts

    shapes: dict[str, tuple[int, ...]] = {}
    for name, (shape, _dtype) in served.items():
        for n, t in split_fused_experts(name, torch.empty(shape, device="meta")):
            shapes[n] = tuple(t.shape)
    return shapes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_manifest(
    tensors: Iterable[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    bucket_bytes: int,
    *,
    fp32: Collection[str] = (),
) -> Manifest:
    """Pack ``(name, shape)`` in order into buckets of at most ``bucket_bytes``; every tensor
    in ``dtype`` but those named in ``fp32`` (kept in fp32 whatever the model's dtype)."""
    buckets: list[list[TensorEntry]] = [[]]
    sizes = [0]
    for tensor_name, shape in tensors:
        own = torch.float32 if tensor_name in fp32 else dtype
        name = dtype_name(own)
        n = own.itemsize
        for s in shape:
            n *= s
        offset = _round_up(sizes[-1], ALIGN)
        if buckets[-1] and offset + n > bucket_bytes:
            buckets.append([])
            sizes.append(0)
            offset = 0
        buckets[-1].append(TensorEntry(tensor_name, name, tuple(shape), offset, n))
        sizes[-1] = offset + n
    if not buckets[-1]:
        raise ValueError("a weight-sync manifest needs at least one tensor")
    return Manifest(tuple(tuple(b) for b in buckets), tuple(sizes))


def view(bucket: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor ``entry`` inside a received bucket (a view, no copy)."""
    flat = bucket[entry.offset : entry.offset + entry.nbytes]
    return flat.view(DTYPES[entry.dtype]).view(entry.shape)


class SyncGroup:
    """A process group of its own: the trainer's sender (rank 0) and the servers' workers."""

    def __init__(self, backend_pg, rank: int, size: int, device: torch.device) -> None:
        self._pg = backend_pg
        self.rank = rank
        self.size = size
        self.device = device

    @staticmethod
    def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """The rendezvous store, on a free port of ``host`` (its ``.port``), on the trainer."""
        return dist.TCPStore(
            host,
            0,
            world_size,
            True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    @classmethod
    def join(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        token: str,
        backend: str,
        timeout_s: float,
        store: dist.TCPStore | None = None,
    ) -> SyncGroup:
        """Join (blocks until all ``world_size`` members have); rank 0 passes its own store."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        prefixed = dist.PrefixStore(f"megatron-gspo-sync/{token}", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            device = torch.device("cpu")
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"weight sync backend must be gloo or nccl, not {backend!r}")
        group = cls(pg, rank, world_size, device)
        group._store = store  # the store must outlive the group
        return group

    def broadcast(self, tensor: torch.Tensor):
        """Start broadcasting ``tensor`` from rank 0; returns the work to ``wait()`` on."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._pg.broadcast([tensor], opts)


def receive_buckets(
    group: SyncGroup, manifest: Manifest, timings: dict[str, float] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every entry as buckets arrive; the next bucket is received while
    the caller loads the current one.

    Every bucket lands in a fresh buffer: vLLM's layerwise reload keeps references to the
    tensors it was given until their layer is complete, so a buffer must never be reused.
    """
    import time

    def start(k: int):
        buf = torch.empty(manifest.bucket_nbytes[k], dtype=torch.uint8, device=group.device)
        return buf, group.broadcast(buf)

    pending = start(0)
    for k, entries in enumerate(manifest.buckets):
        buf, work = pending
        t0 = time.perf_counter()
        work.wait()
        if timings is not None:
            timings["wait_s"] = timings.get("wait_s", 0.0) + time.perf_counter() - t0
        if k + 1 < len(manifest.buckets):
            pending = start(k + 1)
        for entry in entries:
            yield entry.name, view(buf, entry)
