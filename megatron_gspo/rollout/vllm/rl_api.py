"""Trainer side: vLLM's RL API of a set of servers (``vllm/entrypoints/rl/online``, served with
``VLLM_SERVER_DEV_MODE=1``), called with the job's key.

:class:`Servers` is what the weight sync and the engine speak: it fans each call out to every
server and implements vLLM's trainer-side client protocol (``VLLMWeightSyncClient``:
``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), so vLLM's own trainer engines (NCCL on GPUs) drive many servers as
they drive one. Each server's workers take group ranks of their own: ``rank_offset`` in an init
payload is rewritten per server (``offsets``).

The calls that change a server's state are never retried (a second ``/start_weight_update``
is refused while one is active); reads are, like every other request of the client.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_gspo.rollout.vllm.errors import VLLMRequestError
from megatron_gspo.rollout.vllm.http_client import VLLMClient
from megatron_gspo.rollout.vllm.versions import parse_version

__all__ = ["PauseMode", "Servers"]

PauseMode = str  # "abort" | "wait" | "keep"


class Servers:
    """The RL routes of every server of ``client``; each call returns once all have answered
    (concurrently), raising the first failure, named by server."""

    def __init__(
        self, client: VLLMClient, *, timeout_s: float, urls: list[str] | None = None
    ) -> None:
        self.client, self.timeout_s = client, timeout_s
        self.urls = list(client.urls if urls is None else urls)
        # Group rank of each server's first worker (set by whoever forms a transfer group).
        self.offsets: dict[str, int] = {}

    def only(self, urls: list[str]) -> Servers:
        """The same routes for some of the servers (a sync's targets)."""
        return Servers(self.client, timeout_s=self.timeout_s, urls=urls)

    def _all(self, call: Callable[[str], Any]) -> dict[str, Any]:
        results = self.each(call)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
        return results

    def each(self, call: Callable[[str], Any]) -> dict[str, Any]:
        """``call(url)`` on every server concurrently: its result, or the exception it raised
        (in the servers' order; nothing raised here)."""

        def guarded(url: str) -> Any:
            try:
                return call(url)
            except Exception as e:  # noqa: BLE001 - returned to the caller, by server
                return e

        if len(self.urls) == 1:
            return {self.urls[0]: guarded(self.urls[0])}
        with ThreadPoolExecutor(len(self.urls), thread_name_prefix="vllm-rl") as pool:
            futures = {url: pool.submit(guarded, url) for url in self.urls}
            return {url: f.result() for url, f in futures.items()}

    def _post(self, url: str, path: str, body: dict | None = None) -> Any:
        return self.client.call(url, path, body, timeout=self.timeout_s, retries=0)

    # -- vLLM's VLLMWeightSyncClient protocol ------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        def init(url: str) -> None:
            info = dict(init_info)
            if "rank_offset" in info and url in self.offsets:
                info["rank_offset"] = self.offsets[url]
            self._post(url, "/init_weight_transfer_engine", {"init_info": info})

        self._all(init)

    def start_weight_update(self) -> None:
        self._all(lambda url: self._post(url, "/start_weight_update"))

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all(lambda url: self._post(url, "/update_weights", {"update_info": update_info}))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._all(lambda url: self._post(url, "/finish_weight_update", body))

    # -- around an update --------------------------------------------------------------------

    def pause(self, mode: PauseMode = "wait", *, clear_cache: bool = True) -> None:
        flag = "true" if clear_cache else "false"
        self._all(lambda url: self._post(url, f"/pause?mode={mode}&clear_cache={flag}"))

    def abort_all(self) -> None:
        """End every request in flight, frozen ones included, leaving the pause state as it
        is (``/pause?mode=abort`` on a server paused with ``keep`` lets them run instead)."""
        self._all(lambda url: self._post(url, "/abort_requests", {}))

    def resume(self) -> None:
        self._all(lambda url: self._post(url, "/resume"))

    def is_paused(self) -> dict[str, bool]:
        return self._all(lambda url: bool(self._get(url, "/is_paused")["is_paused"]))

    def set_version(self, label: str) -> None:
        self._all(lambda url: self._post(url, "/update_weight_version", {"new_version": label}))

    def versions(self) -> dict[str, int | str | None]:
        """Every server's weights version (``parse_version`` of its ``/weight_info``)."""
        return self._all(self._version)

    def versions_each(self) -> dict[str, object]:
        """Every server's weights version, or the exception reading it raised."""
        return self.each(self._version)

    def _version(self, url: str) -> int | str | None:
        return parse_version(self._get(url, "/weight_info")["weight_version"])

    def world_sizes(self) -> dict[str, int]:
        """How many workers each server has (each joins a transfer group)."""
        return self._all(lambda url: int(self._get(url, "/get_world_size")["world_size"]))

    def _get(self, url: str, path: str) -> dict[str, Any]:
        answer = self.client.call(url, path, method="GET")
        if not isinstance(answer, dict):
            raise VLLMRequestError(f"vLLM server {url}: {path} answered {answer!r}")
        return answer
