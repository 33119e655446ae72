"""The vLLM rollout engine: a client of vLLM servers that this trainer keeps in sync.

One role a module:

* :mod:`.client`: HTTP (completions, worker RPCs, health);
* :mod:`.engine`: :class:`VLLMEngine`, the rollout engine (generation, versions, sync driver);
* :mod:`.routes`: vLLM's RL API (pause, weight updates, versions) of every server;
* :mod:`.sync`: the trainer's side of the weight sync through those routes, in memory or by disk;
* :mod:`.transport`: the manifest, buckets and process group both sides share;
* :mod:`.engines`: the weight transfer engine that runs inside every vLLM server on a CPU, and
  :mod:`.plugin`, which registers it (with the MLA rotary correction) in every vLLM process;
* :mod:`.auth`: the middleware that closes the server's routes to callers without the job key;
* :mod:`.server`: the command line and environment every server is started with;
* :mod:`.export`: the disk fallback's Hugging Face checkpoint.
"""

from megatron_gspo.rollout.vllm.client import (
    URLS_ENV,
    VLLMClient,
    VLLMRequestError,
    VLLMUnavailableError,
    resolve_urls,
    wait_until_healthy,
)
from megatron_gspo.rollout.vllm.engine import VLLMEngine

__all__ = [
    "URLS_ENV",
    "VLLMClient",
    "VLLMEngine",
    "VLLMRequestError",
    "VLLMUnavailableError",
    "resolve_urls",
    "wait_until_healthy",
]
