"""Process-level plumbing every layer may use: rank-0 work, processes, worker pools, user
code, extras, the error types."""
