"""GSPO (Group Sequence Policy Optimization) for Mixture-of-Experts models on Megatron-Core."""

import os as _os
import warnings as _warnings

__version__ = "0.1.0"

# Megatron-Core warns on import about each fused kernel it falls back from when Apex or
# Transformer Engine is absent: on a CPU those fallbacks are the documented path, and the
# dozen lines (again in every process that imports it) bury the command's own output.
# MEGATRON_GSPO_DEBUG=1 shows them.
if _os.environ.get("MEGATRON_GSPO_DEBUG", "") in ("", "0"):
    _warnings.filterwarnings(
        "ignore",
        message=r"(Transformer Engine and Apex are|Apex is) not installed",
        category=UserWarning,
    )
