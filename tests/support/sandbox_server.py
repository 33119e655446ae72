"""A small code-execution service that speaks SandboxFusion's ``POST /run_code``, for the tests
of the python tool's remote backend. It runs each request's code in the project's local
sandbox (bwrap), so the same attacks meet the same walls through either backend; and it can be
told to misbehave (``mode``: "ok", "hang", "garbage", "error")."""

from __future__ import annotations

import threading

from megatron_gspo.toolbox.python_config import PythonToolConfig
from megatron_gspo.toolbox.sandbox import run_python
from tests.support.json_http import JsonHandler, LocalServer


class SandboxServer:
    def __init__(self) -> None:
        self.mode, self.calls = "ok", 0
        server = self

        class Handler(JsonHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                server.calls += 1
                body = self.read_json()
                if self.path != "/run_code" or body.get("language") != "python":
                    self.send_json(404, {"detail": "not found"})
                    return
                if server.mode == "hang":
                    threading.Event().wait(600)
                if server.mode == "garbage":
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"<html>not json")
                    return
                if server.mode == "error":
                    error = {"status": "SandboxError", "message": "no runner available"}
                    self.send_json(200, error)
                    return
                config = PythonToolConfig(
                    timeout_s=float(body["run_timeout"]),
                    memory_mb=int(body["memory_limit_MB"]),
                    max_output_chars=100_000,
                )
                result = run_python(body["code"], config)
                timed_out = result.output.startswith("timed out")
                run = {
                    "status": "TimeLimitExceeded" if timed_out else "Finished",
                    "execution_time": result.seconds,
                    "return_code": 0 if result.ok else 1,
                    "stdout": result.output if result.ok else "",
                    "stderr": "" if result.ok else result.output,
                }
                status = "Success" if result.ok else "Failed"
                self.send_json(200, {"status": status, "message": "", "run_result": run})

        self._server = LocalServer(Handler)
        self.url = self._server.root

    def close(self) -> None:
        self._server.close()
