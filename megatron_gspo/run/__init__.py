"""The run: the loop, its session, the run directory, checks, checkpoints, evaluation, metrics."""
