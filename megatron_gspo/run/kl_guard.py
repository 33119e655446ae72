"""Stop a run whose sampler disagrees with its trainer: ``rollout.max_rollout_kl``.

The figure it watches is ``rollout_sampler_kl``: the mean k3 estimate, per token, of
KL(engine || trainer) on the *same weights* and the same tokens, so that it holds what the
engine computes otherwise and nothing of the policy's own change. Its tokens are those of the
step's batch that the weights the trainer holds sampled (every token of an on-policy run), and,
with ``rollout.max_staleness >= 1``, a probe right after each weight sync: the engine scores
``rollout.sampler_probe`` of the step's sequences with the weights it just received and the
trainer scores them with the same weights (:meth:`~megatron_gspo.trainer.step.GSPOTrainer.
sampler_kl`). A sampler that computes the model as the trainer does keeps it near the numerical
noise of its dtype; one that computes another model (a kernel that misreads a layout, a sync
that did not arrive, a config the engine reads otherwise) samples from a distribution no
off-policy correction is meant to absorb.

``rollout_kl_k3`` (every token's behaviour log-prob against the recomputed old policy) is not
watched: with ``max_staleness`` K it also holds up to K updates of the policy's change, which
grows as a policy learns.

:class:`RolloutKLGuard` raises :class:`RolloutMismatchError` once the figure has stayed above
the limit for ``max_rollout_kl_steps`` consecutive steps, so one unlucky batch does not stop a
run. A step without the figure (no update, no probe) leaves the count as it was, and so does a
resume: the streak is in the checkpoint (:meth:`state`), so a run requeued more often than
``max_rollout_kl_steps`` is still stopped. Pure: fed the step's metrics, which every rank holds
alike (the figure is summed over the world), so every rank stops at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from megatron_gspo.runtime.errors import UserError

__all__ = ["METRIC", "RolloutKLGuard", "RolloutMismatchError"]

METRIC = "rollout_sampler_kl"
# Reported beside it in the error, for context: the sampled-vs-trained mismatch, drift included.
DRIFT = "rollout_kl_k3"


class RolloutMismatchError(UserError, RuntimeError):
    """The sampler's distribution stayed too far from the trainer's; the message says which
    figure, engine and model, and what usually causes it."""


@dataclass
class RolloutKLGuard:
    """``limit`` None: never stops. ``engine`` and ``family`` only name things in the error."""

    limit: float | None
    steps: int
    engine: str
    family: str
    staleness: int = 0
    _streak: list[tuple[int, float, float | None]] = field(default_factory=list)

    @classmethod
    def from_recipe(cls, recipe) -> RolloutKLGuard:
        from megatron_gspo.model.hf_config import model_family

        rollout = recipe.rollout
        engine = rollout.engine
        if engine == "local" and (rollout.local_worker or rollout.max_staleness):
            engine = "local (generation worker)"
        return cls(
            limit=rollout.max_rollout_kl,
            steps=rollout.max_rollout_kl_steps,
            engine=engine,
            family=model_family(recipe.model),
            staleness=rollout.max_staleness,
        )

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        """Count the step's figure; raise once it has been too high ``steps`` times running."""
        value = metrics.get(METRIC)
        if self.limit is None or value is None:
            return
        # NaN or inf (a token the sampler gave no probability) is a disagreement too.
        if not math.isfinite(value) or value > self.limit:
            self._streak.append((step, float(value), metrics.get(DRIFT)))
        else:
            self._streak.clear()
        if len(self._streak) >= self.steps:
            raise RolloutMismatchError(self._message())

    def state(self) -> list[list]:
        """The streak so far, for the checkpoint (``[step, figure, drift]`` each)."""
        return [[s, v, d] for s, v, d in self._streak]

    def restore(self, saved: list[list] | None) -> None:
        self._streak = [(int(s), float(v), d) for s, v, d in saved or []]

    def _message(self) -> str:
        recent = self._streak[-self.steps :]
        seen = ", ".join(f"step {s}: {v:.3g}" for s, v, _ in recent)
        drift = [d for _, _, d in recent if d is not None]
        context = ""
        if drift:
            context = f" ({DRIFT}, sampled against trained tokens, was {drift[-1]:.3g})"
        return (
            f"{METRIC} stayed above rollout.max_rollout_kl = {self.limit:g} for "
            f"{len(self._streak)} consecutive steps ({seen}): on the same weights and tokens, "
            f"the {self.engine} engine computes this {self.family} model otherwise than the "
            f"trainer{context}. Likely causes: a dtype (the sampler in lower precision than "
            "the trainer), a kernel of the engine that computes the model otherwise, a stale or "
            "partial weight sync, or a config the engine reads differently. Compare the "
            "engine's log-probs with the trainer's on the same tokens; rollout.max_rollout_kl: "
            "null turns this check off"
        )
