"""SIGTERM (Slurm pre-emption, ``scontrol requeue``, a time limit): finish the step, save,
exit 75."""

from __future__ import annotations

import signal

# The exit status of a run stopped by SIGTERM after saving a checkpoint (EX_TEMPFAIL): "resume
# me". The sbatch recipes requeue on it; launch passes it on through torchrun, which would
# report any non-zero rank as a failure, by looking for the marker the run leaves.
EXIT_PREEMPTED = 75
PREEMPTED_MARKER = ".preempted"

_sigterm_received = False


def _on_sigterm(signum, frame) -> None:
    global _sigterm_received
    _sigterm_received = True


def catch_sigterm() -> None:
    """From now on SIGTERM (Slurm pre-emption, ``scontrol requeue``, a time limit) only sets a
    flag that the trainer reads: it finishes the step, saves and exits 75, or, before its
    first step, exits 75 having written nothing. Installed first thing, so that a SIGTERM
    during start-up (imports, process groups, loading) is not the end of the process."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def sigterm_received() -> bool:
    return _sigterm_received
