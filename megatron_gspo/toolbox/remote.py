"""The python tool on a remote code-execution service (``env_kwargs.python.backend: http``).

The service speaks SandboxFusion's API: ``POST {url}/run_code`` with ``{"code", "language":
"python", "run_timeout", "memory_limit_MB"}``, answering ``{"status": "Success" | "Failed" |
"SandboxError", "message", "run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error",
"return_code", "stdout", "stderr", "execution_time"}}``. Of the tool's limits only two travel:
the run timeout and the memory limit (``timeout_s``, ``memory_mb``), the only ones that API
takes; file size, processes and CPU seconds are the service's own to set. The deadline is the
tool's timeout plus a margin for the round trip, the output is cut as the local backend cuts
it, and a failure (the code's, the service's, or no answer in time) is an error observation,
counted like any failed tool call.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from megatron_gspo.toolbox.python_config import PythonResult, PythonToolConfig, observation_text

__all__ = ["ROUND_TRIP_S", "run_remote"]

# What the HTTP round trip may add to the tool's own timeout before the call counts as lost.
ROUND_TRIP_S = 10.0


def run_remote(code: str, config: PythonToolConfig) -> PythonResult:
    assert config.url is not None
    body = {
        "code": code,
        "language": "python",
        "run_timeout": config.timeout_s,
        "memory_limit_MB": config.memory_mb,
    }
    request = urllib.request.Request(
        config.url.rstrip("/") + "/run_code",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if config.api_key_env:
        request.add_header("Authorization", f"Bearer {os.environ.get(config.api_key_env, '')}")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=config.timeout_s + ROUND_TRIP_S) as reply:
            answer = json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return _failed(f"the sandbox service answered HTTP {e.code}", start)
    except (OSError, ValueError) as e:
        return _failed(f"the sandbox service at {config.url} did not answer: {e}", start)
    seconds = time.monotonic() - start
    status = answer.get("status")
    run = answer.get("run_result") or {}
    if status == "SandboxError" or not isinstance(run, dict):
        return PythonResult(False, f"sandbox error: {answer.get('message', '')}"[:500], seconds)
    if run.get("status") == "TimeLimitExceeded":
        return PythonResult(False, f"timed out after {config.timeout_s:g} s (killed)", seconds)
    text = observation_text(str(run.get("stdout") or ""), str(run.get("stderr") or ""), config)
    return PythonResult(status == "Success" and run.get("return_code") == 0, text, seconds)


def _failed(message: str, start: float) -> PythonResult:
    return PythonResult(False, message, time.monotonic() - start)
