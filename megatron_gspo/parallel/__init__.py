"""Process groups, the CPU platform layer and the pipeline schedule wrapper."""

from megatron_gspo.parallel.platform import cpu_platform_active, enable_cpu_platform
from megatron_gspo.parallel.setup import ParallelGroups, destroy_parallel, init_parallel

__all__ = [
    "ParallelGroups",
    "cpu_platform_active",
    "destroy_parallel",
    "enable_cpu_platform",
    "init_parallel",
]
