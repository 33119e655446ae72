"""``megatron-gspo`` whose generation worker samples from perturbed weights: a sampler that
disagrees with its trainer, for the tests of ``rollout.max_rollout_kl`` (test_kl_guard.py).

    PERTURB_VERSIONS=all|V[,V...] python -m tests.support.perturbed_sampler train RECIPE ...

The recipe must use the generation worker (``rollout.local_worker: true``). Each weights
snapshot the trainer sends it (version V: the weights after V updates, which step V + 1 samples
from) gets Gaussian noise of ``SCALE`` times each tensor's standard deviation, for the listed
versions; the trainer keeps its own weights. Everything else is the real command line.
"""

from __future__ import annotations

import os
import sys

import torch

from megatron_gspo.rollout.local_worker import LocalWorkerEngine

SCALE = 5.0


def _perturbed(full: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    out = {}
    for name, t in full.items():
        spread = t.float().std() if t.numel() > 1 else t.float().abs()
        out[name] = t + SCALE * spread * torch.randn(t.shape, generator=g).to(t.dtype)
    return out


def _install() -> None:
    chosen = os.environ.get("PERTURB_VERSIONS", "all")
    versions = None if chosen == "all" else {int(v) for v in chosen.split(",")}
    call = LocalWorkerEngine._call

    def _call(self, message, timeout=3600.0):
        if message is not None and message[0] == "weights":
            version, full = message[1]
            if versions is None or version in versions:
                message = ("weights", (version, _perturbed(full, version)))
        return call(self, message, timeout)

    LocalWorkerEngine._call = _call


if __name__ == "__main__":
    _install()
    from megatron_gspo.cli import main

    sys.exit(main())
