"""Inside every vLLM process: the project's vLLM plugin (entry point group
``vllm.general_plugins``, in pyproject.toml).

vLLM loads general plugins in every one of its processes (the API server, the engine core, each
worker) before it builds the worker and its weight transfer engine, so what is registered here
is in place wherever a server started with ``--weight-transfer-config '{"backend": ...}'`` looks
for it:

* the weight transfer engine ``gspo`` (:mod:`.transfer_engine`: buckets over gloo, or a checkpoint
  directory);
* on vLLM's CPU build, the correction of its rotary kernel for multi-latent attention
  (:mod:`.cpu_rope`). ``MEGATRON_GSPO_CPU_ROPE_FIX=0`` leaves vLLM's kernel alone, to see
  whether an installed vLLM still needs the correction.

Every step is idempotent and imports nothing of vLLM's heavier parts; a failure here would stop
the server from starting, so nothing here may raise for a setup it does not apply to.
"""

from __future__ import annotations

import os

__all__ = ["ENGINES", "register"]

ENGINES = {"gspo": ("megatron_gspo.rollout.vllm.server_side.transfer_engine", "GspoEngine")}
ROPE_FIX_ENV = "MEGATRON_GSPO_CPU_ROPE_FIX"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    for name, (module, cls) in ENGINES.items():
        # A process may load plugins again, or inherit the registry through fork.
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, module, cls)
    if os.environ.get(ROPE_FIX_ENV, "1") != "0":
        from megatron_gspo.rollout.vllm.server_side.cpu_rope import fix_cpu_rotary_embedding

        fix_cpu_rotary_embedding()
