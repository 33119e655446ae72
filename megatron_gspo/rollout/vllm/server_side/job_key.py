"""Inside vLLM's API server: an ASGI middleware that closes every route but ``/health`` to
callers without the job's key.

vLLM's own ``--api-key`` guards only the OpenAI routes (``/v1/...``); the RL routes the weight
sync needs (``/pause``, ``/init_weight_transfer_engine``, ``/update_weights``, ...) and the
other development-mode routes stay open, and ``/collective_rpc`` calls any worker method. Servers
started by :mod:`..server_command` load this with ``--middleware`` and take the key from
``VLLM_API_KEY`` in their environment (never the command line, which other users of a node can
read). ``/health`` stays open for launchers' readiness checks; it reveals nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

KEY_ENV = "VLLM_API_KEY"
OPEN_PATHS = frozenset({"/health"})


class JobKeyMiddleware:
    def __init__(self, app) -> None:
        key = os.environ.get(KEY_ENV, "")
        if not key:
            raise RuntimeError(
                f"{KEY_ENV} is not set: a server with weight-update routes must have a job key"
            )
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                digest = hashlib.sha256(token.encode()).digest()
                return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._digest)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this server needs the job's key"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})
