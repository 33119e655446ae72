"""The python tool's settings (``rollout.multi_turn.env_kwargs.python``) and what a run of it
gives back, shared by its two backends: the local sandbox (:mod:`.bwrap`) and a remote
code-execution service (:mod:`.remote`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PythonResult", "PythonToolConfig", "observation_text"]


class PythonToolConfig(BaseModel):
    """``rollout.multi_turn.env_kwargs.python``."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["local", "http"] = "local"
    # local: bwrap, or the old protections alone (a warning on every run).
    sandbox: Literal["bwrap", "unsafe_local"] = "bwrap"
    # http: the service's base URL (POST {url}/run_code), and the environment variable holding
    # its bearer token, if it wants one.
    url: str | None = None
    api_key_env: str | None = None
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(512, ge=64)
    file_size_mb: int = Field(16, ge=1)
    max_processes: int = Field(32, ge=1)
    max_output_chars: int = Field(1000, ge=1)
    # Modules of this environment the code may import (bound read-only), e.g. [numpy, sympy].
    packages: list[str] = []
    # The interpreter inside the sandbox (default: /usr/bin/python3 where the trainer runs as
    # root, which an unprivileged uid can read; else this interpreter's base).
    interpreter: str | None = None

    def model_post_init(self, _context) -> None:
        if self.backend == "http" and not self.url:
            raise ValueError("rollout.multi_turn.env_kwargs.python: backend http needs url")


@dataclass(frozen=True)
class PythonResult:
    ok: bool
    output: str
    seconds: float


def observation_text(text: str, errors: str, config: PythonToolConfig) -> str:
    """stdout's start and stderr's end, each at most ``max_output_chars``."""
    n = config.max_output_chars
    body = text if len(text) <= n else f"{text[:n]}... [{len(text) - n} chars cut]"
    if errors.strip():
        tail = errors.strip()
        if len(tail) > n:
            tail = f"[{len(tail) - n} chars cut] ...{tail[-n:]}"
        body += ("\n" if body else "") + "stderr:\n" + tail
    return body
