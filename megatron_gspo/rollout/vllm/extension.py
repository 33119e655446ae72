"""The part of the weight sync that runs inside every vLLM worker.

Servers are started with ``--worker-extension-cls
megatron_gspo.rollout.vllm.extension.WeightSyncExtension`` (see :mod:`.server`), which mixes the
methods below into each worker; the trainer reaches them through ``POST /collective_rpc``, which
runs a method on every worker of the server and returns their results in a list. vLLM passes
only string arguments there, so each method takes one JSON ``request``, and each request
carries the job's key: the server's ``VLLM_API_KEY`` (see :mod:`.auth`, which also guards the
HTTP routes). A server started without a key refuses every weight update.

What a worker does with the weights: it feeds them to vLLM's own in-place reload
(``reload_weights``: the model's ``load_weights``, layer by layer, then each layer's post-load
processing), so vLLM still fuses QKV and gate/up and shards for its own TP/EP exactly as when
it loaded the checkpoint. One correction for MoE: on a *reload*, vLLM 0.32's unquantized
fused-MoE method sees its kernel already built and skips the kernel's post-load step, which on
the CPU prepacks the expert weights into the grouped-GEMM layout (same shape, so nothing
errors: the experts silently compute with raw weights). Dropping the kernel of every fused-MoE
layer whose kernel has such a step makes the reload take the first-load path, prepack included.

One correction for multi-latent attention on vLLM's CPU build: importing this module routes
the rotary embedding of MLA's queries and keys away from a CPU kernel that misreads their
layout (:mod:`.cpu_rope`).

Versions: a worker reports the weights version it holds: ``None`` for the checkpoint it was
started with, the trainer's version after a complete sync, and ``"partial"`` from the moment a
sync starts until it completes, so a half-updated server is never mistaken for either.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gspo.rollout.vllm.auth import KEY_ENV
from megatron_gspo.rollout.vllm.cpu_rope import fix_cpu_rotary_embedding
from megatron_gspo.rollout.vllm.transport import Manifest, SyncGroup, receive_buckets

__all__ = ["PARTIAL", "WeightSyncExtension"]

PARTIAL = "partial"

# vLLM imports this module in every worker before it builds the model: the moment to correct
# its CPU rotary kernel for multi-latent attention (DeepSeek-V3 family; see cpu_rope).
fix_cpu_rotary_embedding()


@dataclass
class _SyncState:
    version: int | str | None = None
    group: SyncGroup | None = None
    manifest: Manifest | None = None
    served_tensors: dict[str, Any] | None = field(default=None)


def _check_key(given: object) -> None:
    expected = os.environ.get(KEY_ENV, "")
    if not expected:
        raise PermissionError(
            f"this vLLM server was started without a job key (${KEY_ENV}); megatron-gspo "
            "refuses weight updates on a server anyone can reach"
        )
    if not isinstance(given, str) or not hmac.compare_digest(given, expected):
        raise PermissionError("weight-sync request with a wrong job key")


def _safetensors_headers(directory: Path) -> dict[str, list] | None:
    """``{name: [shape, dtype]}`` of the checkpoint a server loaded (None if not local)."""
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    out: dict[str, list] = {}
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        out.update({k: [v["shape"], v["dtype"]] for k, v in header.items()})
    return out


def reset_fused_moe_kernels(model) -> int:
    """Drop the kernels whose post-load step a reload would skip; returns how many."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    reset = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = type(method.moe_kernel.fused_experts)
        if experts.process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
            continue  # nothing to redo: the update copies into the existing storage
        method.moe_kernel = None
        reset += 1
    return reset


class WeightSyncExtension:
    """Methods mixed into vLLM's worker class; each takes one JSON string ``request``."""

    # -- helpers (names vLLM's worker does not use) -------------------------------------

    def _gspo_state(self) -> _SyncState:
        if not hasattr(self, "_gspo_sync_state"):
            self._gspo_sync_state = _SyncState()
        return self._gspo_sync_state

    def _gspo_request(self, request: str) -> dict[str, Any]:
        req = json.loads(request)
        _check_key(req.get("key"))
        return req

    def _gspo_index(self) -> int:
        parallel = self.vllm_config.parallel_config
        return parallel.data_parallel_index * parallel.world_size + self.rank

    def _gspo_reload(self, **kwargs) -> None:
        reset_fused_moe_kernels(self.model_runner.get_model())
        self.reload_weights(**kwargs)

    # -- RPC methods --------------------------------------------------------------------

    def gspo_describe(self, request: str) -> dict[str, Any]:
        """Who this worker is and what it serves: the trainer checks its manifest against it."""
        self._gspo_request(request)
        state = self._gspo_state()
        if state.served_tensors is None:
            # Read once: a disk sync repoints the model config at the sync directory.
            state.served_tensors = _safetensors_headers(Path(self.model_config.model)) or {}
        return {
            "worker": self._gspo_index(),
            "dtype": str(self.model_config.dtype).removeprefix("torch."),
            "version": state.version,
            "model": str(self.model_config.model),
            "tensors": state.served_tensors or None,
        }

    def gspo_init_sync(self, request: str) -> dict[str, Any]:
        """Join the trainer's weight-sync group (blocks until every member has joined)."""
        req = self._gspo_request(request)
        state = self._gspo_state()
        state.group = None
        index = self._gspo_index()
        state.group = SyncGroup.join(
            host=req["host"],
            port=int(req["port"]),
            rank=int(req["rank_offset"]) + index,
            world_size=int(req["world_size"]),
            token=req["token"],
            backend=req["backend"],
            timeout_s=float(req["timeout_s"]),
        )
        state.manifest = Manifest.from_json(req["manifest"])
        return {"worker": index, "rank": state.group.rank}

    def gspo_receive_weights(self, request: str) -> dict[str, Any]:
        """Receive one sync's buckets and load them; returns the version now held."""
        req = self._gspo_request(request)
        state = self._gspo_state()
        if state.group is None or state.manifest is None:
            raise RuntimeError("no weight-sync group on this worker: gspo_init_sync first")
        version = int(req["version"])
        timings: dict[str, float] = {}
        current = {"name": None}

        def weights():
            for name, tensor in receive_buckets(state.group, state.manifest, timings):
                current["name"] = name
                yield name, tensor

        stream = weights()
        state.version = PARTIAL
        start = time.perf_counter()
        try:
            self._gspo_reload(weights_iterator=stream)
        except Exception as e:
            # Keep the sender unblocked: take the rest of the buckets, then report.
            try:
                for _ in stream:
                    pass
            except Exception:  # noqa: BLE001 - the transport itself broke; re-init needed
                state.group = None
            raise RuntimeError(f"weight sync failed at tensor {current['name']!r}: {e}") from e
        total = time.perf_counter() - start
        state.version = version
        wait = timings.get("wait_s", 0.0)
        return {
            "worker": self._gspo_index(),
            "version": version,
            "bytes": state.manifest.total_bytes,
            "receive_s": wait,
            "load_s": total - wait,
        }

    def gspo_load_from_path(self, request: str) -> dict[str, Any]:
        """The disk fallback: reload from a Hugging Face checkpoint directory."""
        req = self._gspo_request(request)
        state = self._gspo_state()
        state.version = PARTIAL
        start = time.perf_counter()
        self._gspo_reload(weights_path=req["path"])
        state.version = int(req["version"])
        return {
            "worker": self._gspo_index(),
            "version": state.version,
            "load_s": time.perf_counter() - start,
        }

    def gspo_weights_version(self, request: str) -> dict[str, Any]:
        self._gspo_request(request)
        return {"worker": self._gspo_index(), "version": self._gspo_state().version}
