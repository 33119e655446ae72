"""A checkpoint's model tensors against the recipe's (weights/model_check.py): the optimizer's
state, under either of Megatron's key layouts, and the reference policy are not the model's.
The saved listing is given here; benchmarks/checkpoint_format.py loads real ones of both
optimizer formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.weights import dist_ckpt
from megatron_gspo.weights.model_check import model_mismatch
from tests.support.rl_fixtures import tiny_recipe

pytestmark = pytest.mark.timeout(60)

MODEL = {"embedding.word_embeddings.weight": (64, 16), "decoder.final_layernorm.weight": (16,)}
NOT_MODEL = {
    # fully_reshardable, and dp_reshardable under the distributed optimizer's chain
    "optimizer.state.exp_avg.decoder.final_layernorm.weight": (16,),
    "chained_0.optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg": (1040,),
    "reference.decoder.final_layernorm.weight": (16,),
}


def _why(monkeypatch, saved: dict) -> str | None:
    monkeypatch.setattr(dist_ckpt, "_saved_shapes", lambda directory: saved)
    return model_mismatch(
        Path("ckpt"), MODEL, tiny_recipe().model, recorded=None, any_vocab_rows=False
    )


def test_the_optimizer_and_reference_tensors_are_not_compared(monkeypatch):
    assert _why(monkeypatch, {**MODEL, **NOT_MODEL}) is None


@pytest.mark.parametrize(
    "saved, named",
    [
        ({**MODEL, "decoder.layers.0.mlp.weight": (16, 16)}, "decoder.layers.0.mlp.weight"),
        ({**MODEL, "decoder.final_layernorm.weight": (32,)}, "[32] saved, [16] here"),
        ({"embedding.word_embeddings.weight": (64, 16)}, "absent saved"),
        ({**MODEL, "chained_0.decoder.x": (1,)}, "chained_0.decoder.x"),
    ],
    ids=["extra", "shape", "missing", "not-optimizer"],
)
def test_a_model_tensor_that_differs_is_named(monkeypatch, saved, named):
    why = _why(monkeypatch, saved)
    assert why is not None and named in why, why
