"""The vLLM rollout engine: vLLM servers that this trainer samples from and keeps in sync.

The HTTP boundary splits the modules in two. Trainer side (this folder; every module's first
line says "Trainer side"):

* :mod:`.engine`: :class:`VLLMEngine`, the rollout engine (generation, versions, sync driver);
* :mod:`.http_client`: HTTP to the servers (completions, RL-route calls, health), retried;
  :mod:`.errors` what it raises; :mod:`.in_flight` generation across weight updates;
* :mod:`.rl_api`: vLLM's RL API (pause, weight updates, versions) of every server, and
  :mod:`.versions` the version labels it reads;
* :mod:`.weight_sync`: the sync through those routes, in memory or by disk
  (:mod:`.hf_export` writes the disk fallback's checkpoint);
* :mod:`.server_command`: the command line and environment every server is started with, and
  :mod:`.single_node`: servers on this machine for single-node runs, tests and benchmarks.

Inside vLLM's processes (:mod:`.server_side`): the project's vLLM plugin, the weight transfer
engine it registers, the job-key middleware of the API server and the CPU rotary correction.
Both sides import :mod:`.wire`: the manifest, buckets and process group of the in-memory sync.
"""

from megatron_gspo.rollout.vllm.engine import VLLMEngine
from megatron_gspo.rollout.vllm.errors import VLLMRequestError, VLLMUnavailableError
from megatron_gspo.rollout.vllm.http_client import (
    URLS_ENV,
    VLLMClient,
    resolve_urls,
    wait_until_healthy,
)

__all__ = [
    "URLS_ENV",
    "VLLMClient",
    "VLLMEngine",
    "VLLMRequestError",
    "VLLMUnavailableError",
    "resolve_urls",
    "wait_until_healthy",
]
