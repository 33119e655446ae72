"""The trainer's side of the weight sync to vLLM servers: in memory (collective) or by disk.

Both take the trainer's full tensors under Hugging Face names, produced on global rank 0 by
the same mapping the converter uses (:class:`~megatron_gspo.weights.hf.HFMapping` over
:func:`~megatron_gspo.weights.stream.iter_full_tensors`: the TP/EP/PP shards are gathered one
tensor at a time), and leave every server holding the new weights and reporting their version.

Collective (the default)
    Once: ask every server who its workers are and what they serve (``gspo_describe``), check
    the manifest against it (names, shapes; the tensors go in the server's dtype), and form the
    sync group (``gspo_init_sync``, see :mod:`.transport`). Each sync: ask every server to
    receive (``gspo_receive_weights``, in a thread per server, since that call returns only when
    its workers have loaded everything), then pack the tensors into buckets and broadcast them,
    one bucket in flight while the next is gathered and packed. No file is written.

Disk (the fallback)
    Rank 0 writes a Hugging Face checkpoint under ``rollout.vllm.sync_dir`` (a directory the
    servers see) and every server reloads it (``gspo_load_from_path``, which applies the same
    MoE fix as the collective path).

A failure names the server (and, for the collective path, the bucket being sent); afterwards the
group is dropped and formed again at the next sync.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.rollout.vllm.client import VLLMClient, VLLMRequestError, VLLMUnavailableError
from megatron_gspo.rollout.vllm.transport import (
    DTYPES,
    Manifest,
    SyncGroup,
    plan_manifest,
    view,
)
from megatron_gspo.runtime.errors import UserError

__all__ = ["CollectiveSync", "DiskSync", "SyncReport", "check_manifest", "sync_host"]

log = logging.getLogger(__name__)


class WeightSyncError(UserError, RuntimeError):
    """A weight sync failed; the message names the server and what was being sent."""


@dataclass
class SyncReport:
    """What one sync moved and where its time went (seconds, on the trainer's rank 0)."""

    version: int
    bytes: int = 0
    gather_s: float = 0.0
    pack_s: float = 0.0
    transport_s: float = 0.0
    server_load_s: float = 0.0
    total_s: float = 0.0
    workers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync_s": self.total_s,
            "weight_sync_mb": self.bytes / 1e6,
            "weight_sync_gather_s": self.gather_s,
            "weight_sync_pack_s": self.pack_s,
            "weight_sync_transport_s": self.transport_s,
            "weight_sync_server_load_s": self.server_load_s,
        }


def sync_host(configured: str | None) -> str:
    """The address servers reach the trainer's rank 0 at."""
    return configured or os.environ.get("MASTER_ADDR") or socket.gethostname()


def _served_shapes(served: dict[str, list]) -> dict[str, tuple[int, ...]]:
    """Per-expert names for checkpoints that store experts fused (transformers 5 layout)."""
    from megatron_gspo.weights.hf import split_fused_experts

    shapes: dict[str, tuple[int, ...]] = {}
    for name, (shape, _dtype) in served.items():
        for n, t in split_fused_experts(name, torch.empty(shape, device="meta")):
            shapes[n] = tuple(t.shape)
    return shapes


def check_manifest(manifest: Manifest, served: dict[str, list] | None, url: str) -> None:
    """Refuse a manifest that does not match what a server serves, naming the tensor."""
    if served is None:
        log.warning("%s: cannot read the served checkpoint's tensor list; not checked", url)
        return
    shapes = _served_shapes(served)
    sent = {e.name: e.shape for b in manifest.buckets for e in b}
    for name, shape in sent.items():
        if name not in shapes:
            raise WeightSyncError(f"vLLM server {url} serves no tensor {name!r} (trainer sends it)")
        if tuple(shapes[name]) != tuple(shape):
            raise WeightSyncError(
                f"vLLM server {url}: tensor {name!r} has shape {list(shapes[name])} there, the "
                f"trainer sends {list(shape)}"
            )
    missing = sorted(set(shapes) - set(sent))
    if missing:
        raise WeightSyncError(
            f"vLLM server {url} serves {len(missing)} tensor(s) the trainer does not send, "
            f"e.g. {missing[0]!r}"
        )


class CollectiveSync:
    """Rank 0's end of the in-memory sync (gloo between CPUs, NCCL between GPUs)."""

    def __init__(
        self,
        client: VLLMClient,
        hf_shapes: dict[str, tuple[int, ...]],
        *,
        fp32: Collection[str] = (),
        bucket_bytes: int,
        timeout_s: float,
        host: str,
        backend: str | None = None,
    ) -> None:
        self.client = client
        self.hf_shapes = hf_shapes
        self.fp32 = frozenset(fp32)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.host = host
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.group: SyncGroup | None = None
        self.manifest: Manifest | None = None
        self.dtype: torch.dtype | None = None

    def connect(self) -> None:
        """Describe, check and form the group with every worker of every server."""
        described = {url: self.client.rpc(url, "gspo_describe") for url in self.client.urls}
        dtypes = {w["dtype"] for workers in described.values() for w in workers}
        if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
            raise WeightSyncError(
                f"vLLM servers serve dtypes {sorted(dtypes)}; expected one of "
                f"{sorted(DTYPES)} shared by all"
            )
        self.dtype = DTYPES[dtypes.pop()]
        manifest = plan_manifest(
            self.hf_shapes.items(), self.dtype, self.bucket_bytes, fp32=self.fp32
        )
        for url, workers in described.items():
            check_manifest(manifest, workers[0]["tensors"], url)
        offsets, size = {}, 1
        for url, workers in described.items():
            offsets[url] = size
            size += len(workers)
        token = uuid.uuid4().hex
        store = SyncGroup.serve_store(self.host, size, self.timeout_s)
        request = {
            "host": self.host,
            "port": store.port,
            "world_size": size,
            "token": token,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
            "manifest": manifest.to_json(),
        }
        with ThreadPoolExecutor(len(described), thread_name_prefix="sync-init") as pool:
            futures = {
                url: pool.submit(
                    self.client.rpc,
                    url,
                    "gspo_init_sync",
                    {**request, "rank_offset": offsets[url]},
                    timeout=self.timeout_s,
                )
                for url in described
            }
            group = SyncGroup.join(
                host=self.host,
                port=store.port,
                rank=0,
                world_size=size,
                token=token,
                backend=self.backend,
                timeout_s=self.timeout_s,
                store=store,
            )
            for url, f in futures.items():
                try:
                    f.result(timeout=self.timeout_s)
                except Exception as e:
                    raise WeightSyncError(
                        f"vLLM server {url} did not join the sync group: {e}"
                    ) from e
        self.group, self.manifest = group, manifest
        log.info(
            "weight sync group: %d server(s), %d worker(s), %d bucket(s) of <= %.0f MB, %s",
            len(described),
            size - 1,
            len(manifest.buckets),
            self.bucket_bytes / 1e6,
            self.backend,
        )

    def push(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        """Send one sync (consumes ``tensors``: HF name and full tensor, in model order)."""
        if self.group is None:
            self.connect()
        assert self.group is not None and self.manifest is not None and self.dtype is not None
        report = SyncReport(version=version, bytes=self.manifest.total_bytes)
        start = time.perf_counter()
        pool = ThreadPoolExecutor(len(self.client.urls), thread_name_prefix="sync")
        futures = {
            url: pool.submit(
                self.client.rpc,
                url,
                "gspo_receive_weights",
                {"version": version},
                timeout=self.timeout_s,
            )
            for url in self.client.urls
        }
        try:
            self._send(tensors, report)
            report.workers = {url: f.result(timeout=self.timeout_s) for url, f in futures.items()}
        except BaseException as e:
            self.group = None
            raise self._failure(e, futures) from e
        finally:
            pool.shutdown(wait=False)
        for url, workers in report.workers.items():
            held = {w.get("version") for w in workers}
            if held != {version}:
                raise WeightSyncError(
                    f"vLLM server {url} reports weights version(s) {sorted(map(str, held))} "
                    f"after sync {version}"
                )
        loads = [w.get("load_s", 0.0) for ws in report.workers.values() for w in ws]
        report.server_load_s = max(loads, default=0.0)
        report.total_s = time.perf_counter() - start
        return report

    def _send(self, tensors: Iterator[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        """Pack and broadcast bucket by bucket; two send buffers alternate, so bucket k+1 is
        gathered and packed while bucket k is on the wire (and no bucket pays for touching
        fresh memory: receivers need fresh buffers, senders do not)."""
        group, manifest = self.group, self.manifest
        size = max(manifest.bucket_nbytes)
        buffers = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(2)]
        inflight: list = [None, None]
        self._sending = ""
        for k, entries in enumerate(manifest.buckets):
            slot = k % 2
            if inflight[slot] is not None:
                t0 = time.perf_counter()
                inflight[slot].wait()
                report.transport_s += time.perf_counter() - t0
            buf = buffers[slot][: manifest.bucket_nbytes[k]]
            for entry in entries:
                t0 = time.perf_counter()
                name, tensor = next(tensors)
                t1 = time.perf_counter()
                if name != entry.name or tuple(tensor.shape) != entry.shape:
                    raise WeightSyncError(
                        f"trainer produced {name!r} {list(tensor.shape)} where the manifest "
                        f"has {entry.name!r} {list(entry.shape)}"
                    )
                view(buf, entry).copy_(tensor)
                report.gather_s += t1 - t0
                report.pack_s += time.perf_counter() - t1
            n = len(manifest.buckets)
            self._sending = f"bucket {k + 1}/{n} ({entries[0].name} .. {entries[-1].name})"
            inflight[slot] = group.broadcast(buf)
        t0 = time.perf_counter()
        for work in inflight:
            if work is not None:
                work.wait()
        report.transport_s += time.perf_counter() - t0

    def _failure(self, error: BaseException, futures) -> WeightSyncError:
        """Name the servers that failed (their HTTP calls tell which) and the bucket in flight."""
        problems = []
        for url, f in futures.items():
            try:
                f.result(timeout=10)
            except FutureTimeout:
                problems.append(f"{url}: no answer")
            except (VLLMRequestError, VLLMUnavailableError) as e:
                problems.append(str(e))
            except Exception as e:  # noqa: BLE001 - reported, not raised
                problems.append(f"{url}: {type(e).__name__}: {e}")
        where = getattr(self, "_sending", "") or "before the first bucket"
        servers = "; ".join(problems) or "no server reported an error"
        return WeightSyncError(
            f"weight sync failed while sending {where}: {type(error).__name__}: {error} "
            f"[servers: {servers}]"
        )


class DiskSync:
    """Rank 0 writes a Hugging Face checkpoint that every server reloads."""

    def __init__(self, client: VLLMClient, model_config, sync_dir: str | Path) -> None:
        self.client = client
        self.model_config = model_config
        self.sync_dir = Path(sync_dir)
        self.current: Path | None = None

    def push(
        self, tensors: Iterator[tuple[str, torch.Tensor]], version: int, dtype: torch.dtype
    ) -> SyncReport:
        from megatron_gspo.rollout.vllm.export import write_hf_checkpoint

        start = time.perf_counter()
        target = self.sync_dir / f"step-{version:06d}"
        shutil.rmtree(target, ignore_errors=True)
        write_hf_checkpoint(target, self.model_config, tensors, dtype=dtype)
        written = time.perf_counter()
        report = SyncReport(version=version, gather_s=written - start)
        report.bytes = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        with ThreadPoolExecutor(len(self.client.urls), thread_name_prefix="sync") as pool:
            futures = {
                url: pool.submit(
                    self.client.rpc,
                    url,
                    "gspo_load_from_path",
                    {"path": str(target), "version": version},
                )
                for url in self.client.urls
            }
            for url, f in futures.items():
                try:
                    report.workers[url] = f.result()
                except Exception as e:
                    raise WeightSyncError(f"vLLM server {url} failed to load {target}: {e}") from e
        report.server_load_s = time.perf_counter() - written
        previous, self.current = self.current, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        report.total_s = time.perf_counter() - start
        return report
