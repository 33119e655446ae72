"""The embedded engine in a process of its own, holding a snapshot of the trainer's weights.

For asynchronous rollouts (``rollout.max_staleness >= 1``) with ``rollout.engine: local``:
generating in the trainer's process would run the model's collectives while the trainer runs
its own, and would read weights mid-update. Instead global rank 0 starts one generation worker:
a single-rank (TP=PP=EP=1) copy of the Megatron model in a spawned process with its own
one-process world, sampling with :class:`~megatron_gspo.rollout.local.LocalEngine` exactly as
the in-process engine does. :meth:`LocalWorkerEngine.sync_weights` gathers the trainer's full
tensors to rank 0 (the same stream the vLLM sync uses) and sends the snapshot; a generation in
progress finishes on the snapshot it started with. Small runs only: the worker holds the whole
model, and generation is not split over data-parallel ranks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gspo.config import ModelConfig, PrecisionConfig
from megatron_gspo.rollout.protocol import Capabilities, RolloutRequest, RolloutResult
from megatron_gspo.runtime.procs import kill_at_exit
from megatron_gspo.runtime.rank0 import on_rank0

__all__ = ["LocalWorkerEngine"]


def _serve(
    model_config: ModelConfig, precision: PrecisionConfig, requests, replies, parent_pid: int
) -> None:
    from megatron_gspo.runtime.procs import die_with_parent

    die_with_parent(parent_pid)
    # A world of one of its own, whatever the trainer's environment says.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.rollout.local import LocalEngine
    from megatron_gspo.weights import load_full_state_dict

    parallel = ParallelConfig()
    init_parallel(parallel)
    model = build_model(model_config, parallel, precision)
    engine = LocalEngine(model)
    replies.put(("ready", None))
    while True:
        kind, payload = requests.get()
        try:
            if kind == "stop":
                replies.put(("ok", None))
                return
            if kind == "weights":
                version, full = payload
                load_full_state_dict(model, full)
                engine.sync_weights(version)
                replies.put(("ok", None))
            elif kind == "generate":
                replies.put(("ok", engine.generate(payload)))
            elif kind == "score":
                replies.put(("ok", engine.score(payload)))
            else:
                raise ValueError(f"unknown request {kind!r}")
        except Exception as e:  # noqa: BLE001 - sent back to the trainer
            replies.put(("error", f"{type(e).__name__}: {e}"))


class LocalWorkerEngine:
    """:class:`~megatron_gspo.rollout.protocol.RolloutEngine` over a generation worker process.

    Construct on every rank (``model`` is this rank's stage); only rank 0 owns the worker.
    """

    capabilities = Capabilities(rank0_generation=True)

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        precision: PrecisionConfig | None = None,
        *,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.version: int | None = None
        self._lock = threading.Lock()
        self._proc = None
        if self.rank == 0:
            ctx = mp.get_context("spawn")
            self._requests, self._replies = ctx.Queue(), ctx.Queue()
            self._proc = ctx.Process(
                target=_serve,
                args=(
                    model_config,
                    precision or PrecisionConfig(),
                    self._requests,
                    self._replies,
                    os.getpid(),
                ),
                daemon=True,
                name="gspo-generation-worker",
            )
            self._proc.start()
            kill_at_exit(self._proc)
            self._call(None, timeout=start_timeout_s)

    def _call(self, message: tuple[str, Any] | None, timeout: float = 3600.0) -> Any:
        with self._lock:
            if message is not None:
                self._requests.put(message)
            try:
                status, value = self._replies.get(timeout=timeout)
            except Exception as e:  # noqa: BLE001 - queue.Empty, or the worker died
                alive = self._proc is not None and self._proc.is_alive()
                raise RuntimeError(
                    f"the generation worker {'did not answer' if alive else 'died'} "
                    f"(exit code {None if alive else self._proc.exitcode})"
                ) from e
        if status == "error":
            raise RuntimeError(f"generation worker: {value}")
        return value

    def generate_rank0(self, request: RolloutRequest) -> RolloutResult:
        """Sample on the worker; rank 0 only, no collectives (safe beside the trainer's)."""
        return self._call(("generate", request))

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Collective: every rank receives rank 0's result, or raises its error."""
        return on_rank0(self.generate_rank0, request)

    def score_rank0(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs from the worker's snapshot; rank 0 only."""
        return self._call(("score", sequences))

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Collective: every rank receives rank 0's log-probs, or raises its error."""
        return on_rank0(self.score_rank0, sequences)

    def sync_weights(self, version: int) -> None:
        """Send the trainer's weights (gathered to rank 0) to the worker. Collective."""
        from megatron_gspo.weights.hf import HFMapping
        from megatron_gspo.weights.stream import iter_full_tensors

        full = {
            name: tensor.detach().to("cpu", copy=True)
            for name, tensor in iter_full_tensors(self.model, HFMapping(self.model_config), dst=0)
        }
        if not self.model_config.untie_embeddings_and_output_weights:
            full["output_layer.weight"] = full["embedding.word_embeddings.weight"]
        if self.rank == 0:
            self._call(("weights", (version, full)))
        self.version = version

    def step_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._call(("stop", None), timeout=30)
            finally:
                self._proc.join(timeout=30)
                if self._proc.is_alive():
                    self._proc.kill()
