"""The trainer: the policy, one update step, mini/micro-batches, step metrics."""
