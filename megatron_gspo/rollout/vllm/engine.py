"""Trainer side: :class:`VLLMEngine`, the rollout engine backed by vLLM servers.

Only global rank 0 talks to the servers. :meth:`VLLMEngine.generate` broadcasts the result (or
rank 0's error) to every rank, since every rank needs the batch; :meth:`VLLMEngine.sync_weights`
is collective because gathering the trainer's shards is.

Versions are vLLM's own: every sync ends with ``/finish_weight_update`` naming the trainer's
version, and a server reports ``partial`` while one is under way (:mod:`.weight_sync`). The
servers are a fleet (:mod:`.fleet`): probed in a thread on rank 0, and again before every
generation, a server serves only while it answers and holds the last synced version (a
half-finished sync or a restarted server makes it stale until the next sync brings it back),
requests go to the least loaded serving server and move when theirs fails, and each
completion is stamped with the version that produced it. A sync goes to every server that
answers; one that fails during it is left out and the sync done again for the others. Fewer
serving servers than ``rollout.vllm.min_servers`` raise :class:`~.fleet.FleetDownError`
(the loop checkpoints and exits 75).

With ``in_flight`` (``rollout.in_flight_updates.mode``) a sync does not wait for generation:
the pipeline's thread keeps requesting while the main thread syncs (:mod:`.in_flight`). A
request started during a sync waits until it has finished (``wait_for_weights``, at most
``sync_timeout_s``), and every token carries the version the server labelled it with.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig, VLLMConfig
from megatron_gspo.rollout.protocol import Capabilities, RolloutRequest, RolloutResult
from megatron_gspo.rollout.vllm.errors import VLLMRequestError
from megatron_gspo.rollout.vllm.fleet import DEAD, SUSPECT, Fleet, FleetDownError
from megatron_gspo.rollout.vllm.http_client import VLLMClient, resolve_urls, wait_until_healthy
from megatron_gspo.rollout.vllm.rl_api import Servers
from megatron_gspo.rollout.vllm.server_command import JOB_KEY_ENV
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.rank0 import on_rank0

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)


class VLLMEngine:
    """:class:`~megatron_gspo.rollout.protocol.RolloutEngine` backed by vLLM servers.

    ``model`` is this rank's Megatron ``GPTModel`` stage (the trainer's policy); it is read by
    :meth:`sync_weights` only. Construct on every rank; only global rank 0 opens connections.
    The job key comes from ``api_key`` or ``$MEGATRON_GSPO_VLLM_KEY``.
    """

    capabilities = Capabilities(rank0_generation=True, concurrent_episodes=True)

    def __init__(
        self,
        config: VLLMConfig,
        model_config: ModelConfig,
        model: torch.nn.Module | None = None,
        *,
        urls: Sequence[str] | None = None,
        api_key: str | None = None,
        retry_backoff_s: float = 1.0,
        wait_healthy_s: float | None = None,
        in_flight: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # The version every server holds after the last successful sync (None: none yet).
        self.version: int | None = None
        self._failed_sync: int | None = None
        self.last_sync: dict[str, float] = {}
        self.client: VLLMClient | None = None
        self.servers: Servers | None = None
        self.fleet: Fleet | None = None
        self._sync = None
        self.in_flight = in_flight
        # Set while no sync is under way: generation threads wait on it (in_flight).
        self._weights_ready = threading.Event()
        self._weights_ready.set()
        if self.rank == 0:
            self.client = VLLMClient(
                list(urls) if urls is not None else resolve_urls(config),
                model=config.model,
                api_key=api_key if api_key is not None else os.environ.get(JOB_KEY_ENV),
                request_timeout_s=config.request_timeout_s,
                max_retries=config.max_retries,
                retry_backoff_s=retry_backoff_s,
                moe_layers=model_config.moe_layers,
                in_flight=in_flight,
                wait_for_weights=self.wait_for_weights,
                weights_version=lambda: self.version,
                health_timeout_s=config.health_timeout_s,
            )
            self.fleet = self.client.fleet
            self.fleet.min_servers = config.min_servers
            self.fleet.max_seqs = config.max_seqs_per_server
            self.servers = Servers(self.client, timeout_s=config.sync_timeout_s)
        if wait_healthy_s is not None:
            self._on_rank0(lambda c: wait_until_healthy(c.urls, wait_healthy_s))
        if self.fleet is not None:
            self.fleet.start_monitor()

    def _on_rank0(self, fn):
        """``fn(client)`` on rank 0; every rank returns its result or raises its error."""
        return on_rank0(lambda: fn(self.client))

    # -- versions ----------------------------------------------------------------------------

    def server_versions(self) -> dict[str, Any]:
        """The version every server reports now (``/weight_info``; rank 0 only)."""
        assert self.servers is not None
        return self.servers.versions()

    def wait_for_weights(self) -> None:
        """Block while a sync is under way (its deadline, then an error naming it); refuse
        to go on after a failed one."""
        if not self._weights_ready.wait(self.config.sync_timeout_s):
            raise VLLMRequestError(
                f"the weight sync did not finish within rollout.vllm.sync_timeout_s = "
                f"{self.config.sync_timeout_s:g} s; generation waiting on it stops"
            )
        if self._failed_sync is not None:
            raise VLLMRequestError(
                f"the weight sync to version {self._failed_sync} failed; the servers "
                f"({', '.join(self.client.urls)}) may hold a partial update, so nothing is "
                "sampled until a sync succeeds"
            )

    def check_versions(self) -> dict[str, Any]:
        """The version of every serving server, after probing them all (rank 0): a server that
        holds another version than the last synced one is stale and gets no requests. A sync
        under way is waited for; a failed one is refused."""
        assert self.fleet is not None
        while True:
            self.wait_for_weights()
            self.fleet.probe_all()
            if self._weights_ready.is_set():  # else a sync began meanwhile: read after it
                break
        return {u: self.fleet.servers[u].version for u in self.fleet.serving()}

    # -- the engine protocol -----------------------------------------------------------------

    def generate_rank0(self, request: RolloutRequest) -> RolloutResult:
        """Sample on the servers from rank 0 alone (no collectives: it may run in a thread
        beside the trainer's); each completion is stamped with its server's weights version."""
        assert self.client is not None, "generate_rank0 runs on global rank 0"
        versions = self.check_versions()
        groups, urls = self.client.generate_on_servers(request)
        for group, url in zip(groups, urls, strict=True):
            for c in group:
                c.stamp(versions.get(url, self.version))
        return RolloutResult(groups)

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample on the servers; collective: every rank receives the same result."""
        return self._on_rank0(lambda client: self.generate_rank0(request))

    def score_rank0(self, sequences: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probs of each sequence from the servers (spread over them, so
        each server's weights are checked); rank 0 only."""
        assert self.client is not None, "score_rank0 runs on global rank 0"
        self.check_versions()
        return self.client.score(sequences)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Collective: every rank receives the servers' log-probs."""
        return self._on_rank0(lambda client: self.score_rank0(sequences))

    def sync_weights(self, version: int) -> None:
        """Push the trainer's weights to every server that answers as ``version``; a server
        that fails the sync is left out and the sync done again for the others (the trainer's
        shards gathered again). Collective."""
        if self.model is None:
            raise ValueError("VLLMEngine.sync_weights needs the policy model (model=...)")
        from megatron_gspo.weights.hf import HFMapping
        from megatron_gspo.weights.stream import iter_full_tensors

        mapping = HFMapping(self.model_config)
        self._weights_ready.clear()
        try:
            # Until every rank has the outcome; a failure leaves it set (nothing is sampled).
            self._failed_sync = version
            tried: list[list[str]] = []
            while True:
                tensors = mapping.iter_hf(iter_full_tensors(self.model, mapping, dst=0))
                outcome: tuple[str, Any] = ("ok", None)
                if self.rank == 0:
                    try:
                        tried.append(self._sync_targets())
                        # Until the outcome is known (finish): the servers' labels meanwhile
                        # are the sync's, not a reason to take them out.
                        self.fleet.syncing = True
                        report = self._sync_driver(mapping).push(tensors, version, tried[-1])
                        outcome = ("ok", report)
                    except Exception as e:  # noqa: BLE001 - reported on every rank below
                        outcome = ("error", e)
                # Other ranks (and rank 0 after a failure) still drive the gather to its end.
                for _ in tensors:
                    pass

                def finish(client: VLLMClient, outcome=outcome):
                    status, value = outcome
                    try:
                        if status == "error":
                            if self._left_out_after_failure(tried):
                                return None  # again, without the servers that failed
                            raise value
                        return self._synced(version, tried[-1], value)
                    finally:
                        self.fleet.syncing = False

                result = self._on_rank0(finish)
                if result is not None:
                    break
            self.last_sync = result
            self.version, self._failed_sync = version, None
        finally:
            # Generation waiting on the sync wakes to its outcome (check_versions refuses a
            # failed one).
            self._weights_ready.set()
        self._on_rank0(lambda client: self.fleet.check_minimum())

    def _sync_targets(self) -> list[str]:
        """The servers a sync goes to: every one that answers a probe now."""
        assert self.fleet is not None
        self.fleet.probe_all()
        targets = [u for u in self.fleet.sync_targets() if self.fleet.state(u) != SUSPECT]
        if not targets:
            self.fleet.check_minimum()
            raise FleetDownError(f"no vLLM server answers: {self.fleet.states()}")
        return targets

    def _left_out_after_failure(self, tried: list[list[str]]) -> bool:
        """After a failed sync: whether some of its servers stopped answering (then the sync
        is done again without them); False when every one still answers (the failure is not
        a server's, and is raised)."""
        assert self.fleet is not None
        if not tried:  # no server answered to start with: nothing to leave out
            return False
        self.fleet.probe_all()
        gone = [u for u in tried[-1] if self.fleet.state(u) in (SUSPECT, DEAD)]
        for url in gone:
            self.fleet.mark_lost(url, "failed during a weight sync")
        if gone:
            log.warning("weight sync: %s stopped answering; syncing the others", ", ".join(gone))
        return bool(gone) and len(tried) <= len(self.fleet.urls)

    def _synced(self, version: int, targets: list[str], report) -> dict[str, float]:
        """After a sync: the servers that report ``version`` serve, the rest are stale; the
        step's sync and fleet figures."""
        assert self.fleet is not None and self.servers is not None
        held = self.servers.only(targets).versions_each()
        for url, v in held.items():
            if isinstance(v, BaseException):
                self.fleet.mark_lost(url, f"no version after the sync: {v}")
        self.fleet.synced(
            version, {u: v for u, v in held.items() if not isinstance(v, BaseException)}
        )
        return {**report.metrics(), **self.fleet.take_metrics()}

    def step_metrics(self) -> dict[str, float]:
        """The last sync's figures and the fleet's (servers serving, requests moved, servers
        rejoined), the same on every rank."""
        return dict(self.last_sync)

    def _sync_driver(self, mapping):
        """The sync through vLLM's RL routes, with the transport the servers were started for
        (:mod:`.weight_sync`), built once."""
        from megatron_gspo.rollout.vllm import weight_sync as sync

        if self._sync is not None:
            return self._sync
        assert self.servers is not None
        dtype = self.model.config.params_dtype
        cfg = self.config
        if cfg.weight_sync == "disk":
            if cfg.sync_dir is None:
                raise InputError("rollout.vllm.weight_sync=disk needs rollout.vllm.sync_dir")
            transport = sync.DiskTransport(self.model_config, cfg.sync_dir, dtype=dtype)
        elif torch.cuda.is_available():
            dtypes = {h: mapping.hf_dtype(h, dtype) for h in mapping.hf_shapes}
            transport = sync.NcclTransport(
                sync.MegatronSource(mapping.hf_shapes, dtypes),
                timeout_s=cfg.sync_timeout_s,
                host=sync.sync_host(cfg.sync_host, self.client.urls),
            )
        else:
            transport = sync.GlooTransport(
                mapping.hf_shapes,
                dtype=dtype,
                fp32={h for h in mapping.hf_shapes if mapping.by_hf[h].fp32},
                bucket_bytes=int(cfg.bucket_mb * 2**20),
                timeout_s=cfg.sync_timeout_s,
                host=sync.sync_host(cfg.sync_host, self.client.urls),
            )
        self._sync = sync.WeightSync(self.servers, transport, in_flight=self.in_flight)
        return self._sync

    def close(self) -> None:
        """Stop probing the servers; the servers themselves belong to whoever started them."""
        if self.fleet is not None:
            self.fleet.close()
