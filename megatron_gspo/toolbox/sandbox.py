"""Running a model's Python code where it can reach nothing it mustn't.

Code a model writes under RL is an adversary's code: a policy finds any path to its reward
(reading a data file's answers, rewriting a checkpoint, killing a sibling). The ``python``
tool therefore runs it in one of (``rollout.multi_turn.env_kwargs.python``, validated as
:class:`PythonToolConfig`):

``backend: local`` (the default), inside bubblewrap (``bwrap``, Debian's ``bubblewrap``)
    A fresh interpreter (``python -I``) that sees a read-only view of what it needs (``/usr``,
    ``/lib``, the interpreter's prefix, the ``packages`` the recipe lets it import) and nothing
    else of the machine: not the checkout, the data, the run directory or ``/home``; a private
    writable scratch directory as its working directory and a private ``/tmp``; its own PID
    namespace (no other process visible or reachable), no network (not even the host's
    loopback), no capabilities, ``--die-with-parent``. Where the trainer runs as root, bwrap is
    started as an unprivileged uid of its own (the code owns nothing on the host, and the
    process limit counts its processes alone). Limits: wall clock (the whole sandbox is killed),
    memory (address space), CPU seconds, file size, processes, output.
``backend: http``
    A SandboxFusion-compatible code-execution service (its ``POST /run_code``), for clusters
    whose trainer nodes must not run model code at all (:mod:`.remote`).

Where bwrap is missing or the kernel refuses its namespaces, the tool runs nothing: every call
is an error observation naming why and what to install. ``sandbox: unsafe_local`` runs the code
anyway with the old protections only (a private network namespace, rlimits; the filesystem and
processes in view), with a warning when the tool is made (once per environment worker).

What this promises: the code cannot read, write or signal anything of the host beyond its
scratch directory and the read-only system files an interpreter needs, cannot reach the network,
and cannot outlive its deadline or exceed its limits. What it does not: a kernel exploit
(bwrap's namespaces are the kernel's), side channels, or the CPU time of other jobs on the node.
"""

from __future__ import annotations

from megatron_gspo.toolbox.bwrap import run_local
from megatron_gspo.toolbox.python_config import PythonResult, PythonToolConfig
from megatron_gspo.toolbox.remote import run_remote

__all__ = ["run_python"]


def run_python(code: str, config: PythonToolConfig | None = None) -> PythonResult:
    """Run ``code``; ``ok`` is False for a non-zero exit, a timeout, a limit, or no sandbox."""
    config = config or PythonToolConfig()
    if config.backend == "http":
        return run_remote(code, config)
    return run_local(code, config)
