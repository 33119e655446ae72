"""Context parallelism end to end: sequences split over CP ranks train as on one rank.

Checked piece by piece against one rank: the split (``megatron_gspo.parallel.context``), the
attention that gathers keys and values over the CP group (``megatron_gspo.model.attention``),
and whole training steps, whose CP reductions (the policy losses' per-sequence sums, the KL
term, the off-policy weights, the metrics) all take part. Every sequence of the rollout batch
is longer than one rank's chunk (each is cut into 2 x CP chunks and every rank holds two), so a
CP reduction left out changes the sequence ratios, the loss and the update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron_gspo.config import ParallelConfig, Recipe
from megatron_gspo.parallel.context import cp_segment_positions, cp_token_index
from tests.support.ranks import run_distributed
from tests.support.rl_fixtures import rollout_batch, tiny_recipe
from tests.support.steps import CP2, LINEAR_ADAM, max_rel_weight_diff, train_steps
from tests.support.tiny import TINY_MOE

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------
# The split
# ------------------------------------------------------------------------------------------

# Padded segments (multiples of 2 x CP for CP 2), an empty one among them.
BOUNDS = [0, 8, 8, 20, 36]


@pytest.mark.parametrize("cp", [1, 2])
def test_split_gives_every_token_to_one_rank_and_balances_causal_work(cp):
    index = [cp_token_index(BOUNDS, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(index).sort().values, torch.arange(BOUNDS[-1]))
    assert len({len(i) for i in index}) == 1, "ranks hold different numbers of tokens"
    # Causal attention costs (position + 1) key reads per query: the same on every rank.
    work = [int((cp_segment_positions(BOUNDS, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, f"causal work per rank {work}"
    for r in range(cp):
        starts = torch.tensor(BOUNDS[:-1])[
            torch.searchsorted(torch.tensor(BOUNDS), index[r], right=True) - 1
        ]
        assert torch.equal(cp_segment_positions(BOUNDS, cp, r), index[r] - starts)


def test_a_segment_that_cp_cannot_split_is_refused():
    with pytest.raises(ValueError, match="need a multiple of 4"):
        cp_token_index([0, 6], 2, 0)


# ------------------------------------------------------------------------------------------
# The attention
# ------------------------------------------------------------------------------------------

HEADS, GROUPS, DIM, V_DIM = 4, 2, 8, 6
# Padded segment boundaries and each segment's real length (the rest is its padding; the last
# segment is a row's tail padding, a segment of its own).
ATT_BOUNDS = [0, 8, 20, 36, 40]
ATT_REAL = [5, 12, 13, 4]


def _reference_attention(q, k, v, bounds, real):
    """Per segment, causal attention over its real tokens (torch's SDPA): [t, heads * v]."""
    out = torch.zeros(q.shape[0], HEADS, v.shape[-1], dtype=q.dtype)
    rep = HEADS // GROUPS
    for a, n in zip(bounds[:-1], real, strict=True):
        qs = q[a : a + n].transpose(0, 1)
        ks = k[a : a + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[a : a + n].repeat_interleave(rep, dim=1).transpose(0, 1)
        out[a : a + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out.flatten(1)


def _attention_inputs():
    g = torch.Generator().manual_seed(3)
    t = ATT_BOUNDS[-1]
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, GROUPS, V_DIM, generator=g, dtype=torch.float64)
    grad = torch.randn(t, HEADS * V_DIM, generator=g, dtype=torch.float64)
    # Padding rows are nobody's output: no gradient flows from them.
    real_rows = torch.zeros(t, dtype=torch.bool)
    for a, n in zip(ATT_BOUNDS[:-1], ATT_REAL, strict=True):
        real_rows[a : a + n] = True
    return q, k, v, grad * real_rows[:, None], real_rows


def _attention_worker(rank, world, q, k, v, grad):
    """THD and padded (bshd) attention at CP 1 and CP 2 on this rank: outputs and gradients,
    put back into the full layout."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_gspo.model.attention import SegmentAttention
    from megatron_gspo.model.provider import transformer_config
    from megatron_gspo.parallel import init_parallel
    from megatron_gspo.parallel.context import gather_tokens

    groups = init_parallel(ParallelConfig(context_parallel_size=2))
    config = transformer_config(TINY_MOE, ParallelConfig(context_parallel_size=2))
    single = [torch.distributed.new_group([r]) for r in range(world)][rank]
    tp = parallel_state.get_tensor_model_parallel_group()

    def attention(cp_group):
        pgs = ProcessGroupCollection(tp=tp, cp=cp_group)
        return SegmentAttention(config, 1, None, "self", pg_collection=pgs)

    cu_real = torch.tensor([0, *torch.tensor(ATT_REAL).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=torch.tensor(ATT_BOUNDS, dtype=torch.int32),
        cu_seqlens_kv_padded=torch.tensor(ATT_BOUNDS, dtype=torch.int32),
        max_seqlen_q=16,
        max_seqlen_kv=16,
    )

    def run(module, index, thd: bool):
        """Forward and backward on the tokens ``index`` (dim 0); returns local results."""
        xs = [x[index].clone().requires_grad_() for x in (q, k, v)]
        if thd:
            out = module(*xs, None, packed_seq_params=params)
            out.backward(grad[index])
        else:  # one sequence of the whole row, batch of 1: [s, 1, heads, dim]
            out = module(*(x[:, None] for x in xs), None)[:, 0]
            out.backward(grad[index])
        return [out.detach()] + [x.grad for x in xs]

    def full(local, bounds):
        # gather_tokens works on the last dim: move tokens there and back.
        return [gather_tokens(t.movedim(0, -1).contiguous(), bounds, groups.cp).movedim(-1, 0)
                for t in local]  # fmt: skip

    everything = torch.arange(ATT_BOUNDS[-1])
    results = {
        "thd-cp1": run(attention(single), everything, thd=True),
        "thd-cp2": full(
            run(attention(groups.cp), cp_token_index(ATT_BOUNDS, 2, rank), True), ATT_BOUNDS
        ),  # fmt: skip
        "bshd-cp2": full(
            run(attention(groups.cp), cp_token_index([0, 16], 2, rank), thd=False), [0, 16]
        ),
    }
    return results


def test_segment_attention_equals_per_sequence_causal_attention_at_cp1_and_cp2():
    q, k, v, grad, real_rows = _attention_inputs()
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _reference_attention(*xs, ATT_BOUNDS, ATT_REAL)
    ref.backward(grad)
    # The padded (bshd) path: the first 16 tokens as one causal sequence.
    ys = [x[:16].clone().requires_grad_() for x in (q, k, v)]
    ref_bshd = _reference_attention(*ys, [0, 16], [16])
    ref_bshd.backward(grad[:16])

    results = run_distributed(_attention_worker, 2, q, k, v, grad)
    for rank, res in enumerate(results):
        for name in ("thd-cp1", "thd-cp2"):
            out, gq, gk, gv = res[name]
            torch.testing.assert_close(
                out[real_rows], ref[real_rows], msg=f"rank {rank} {name}: output"
            )
            for got, want, what in ((gq, xs[0].grad, "q"), (gk, xs[1].grad, "k"),
                                    (gv, xs[2].grad, "v")):  # fmt: skip
                torch.testing.assert_close(got, want, msg=f"rank {rank} {name}: grad {what}")
        out, gq, gk, gv = res["bshd-cp2"]
        torch.testing.assert_close(out, ref_bshd, msg=f"rank {rank} bshd-cp2: output")
        for got, want, what in ((gq, ys[0].grad, "q"), (gk, ys[1].grad, "k"),
                                (gv, ys[2].grad, "v")):  # fmt: skip
            torch.testing.assert_close(got, want, msg=f"rank {rank} bshd-cp2: grad {what}")


# ------------------------------------------------------------------------------------------
# Training steps
# ------------------------------------------------------------------------------------------

STEPS = 3
COMPARED = ("loss", "grad_norm", "approx_kl", "clip_fraction", "seq_log_ratio_mean", "entropy")


def _single_rank(packing: bool, **sections):
    recipe = tiny_recipe(
        optimizer=LINEAR_ADAM,
        loss={"eps_low": 0.02, "eps_high": 0.02, **sections.pop("loss", {})},
        train={"packing": packing, **sections.pop("train", {})},
        **sections,
    )
    samples = rollout_batch()
    metrics, start, weights = run_distributed(train_steps, 1, recipe, samples, STEPS)[0]
    return recipe, samples, metrics, weights, start


def _equal_to_single_rank(reference, parallel: dict, world: int, compared=COMPARED, tol=1e-4):
    recipe, samples, ref_metrics, ref_weights, start = reference
    data = recipe.model_dump()
    data["parallel"].update(parallel)
    results = run_distributed(
        train_steps, world, Recipe.model_validate(data), samples, STEPS, start
    )
    metrics, _, weights = results[0]
    for step, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        for key in compared:
            assert abs(m[key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (
                f"step {step + 1} {key}: {m[key]} != single-rank {r[key]}"
            )
    err = max_rel_weight_diff(weights, ref_weights, start)
    assert err <= tol, f"updated weights differ from single rank by {err:.2e} (relative)"
    return ref_metrics


@pytest.fixture(scope="module")
def packed_single_rank():
    return _single_rank(packing=True)


@pytest.fixture(scope="module")
def padded_single_rank():
    return _single_rank(packing=False)


CP2_TP2_SP = {
    "context_parallel_size": 2,
    "tensor_model_parallel_size": 2,
    "sequence_parallel": True,
}


@pytest.mark.parametrize(
    "layout,parallel,world",
    [
        pytest.param("packed", CP2, 2, id="cp2-packed"),
        pytest.param("padded", CP2, 2, id="cp2-padded"),
        pytest.param("packed", CP2_TP2_SP, 4, id="cp2-tp2-sp-packed"),
    ],
)
def test_context_parallel_steps_equal_single_rank(
    request, layout, parallel, world, packed_single_rank, padded_single_rank
):
    reference = packed_single_rank if layout == "packed" else padded_single_rank
    ref_metrics = _equal_to_single_rank(reference, parallel, world)
    assert any(m["clip_fraction"] > 0 for m in ref_metrics), "nothing clipped: a weak check"


@pytest.mark.parametrize(
    "sections",
    [
        # GRPO's token clip with routing replay, the KL term and sequence-level TIS.
        pytest.param(
            {
                "loss": {"name": "grpo", "eps_low": 0.05, "eps_high": 0.05, "kl_coef": 0.5},
                "train": {
                    "routing_replay": True,
                    "off_policy_correction": {"mode": "tis", "level": "sequence", "tis_cap": 1.5},
                },
            },
            id="grpo-replay-kl-tis-sequence",
        ),
        # GSPO-token with token-level MIS (its statistics are summed over CP ranks).
        pytest.param(
            {
                "loss": {"name": "gspo_token"},
                "train": {
                    "off_policy_correction": {
                        "mode": "mis",
                        "level": "token",
                        "mis_low": 0.2,
                        "mis_high": 5.0,
                    }
                },
            },  # fmt: skip
            id="gspo-token-mis-token",
        ),
    ],
)
def test_every_cp_reduction_of_the_step_equals_single_rank(sections):
    reference = _single_rank(packing=True, **sections)
    compared = COMPARED + ("is_weight_mean", "is_masked_fraction", "is_truncated_fraction")
    if sections["loss"].get("kl_coef"):
        compared += ("kl_ref",)
    ref_metrics = _equal_to_single_rank(reference, CP2, 2, compared)
    c = sections["train"]["off_policy_correction"]
    key = "is_truncated_fraction" if c["mode"] == "tis" else "is_masked_fraction"
    assert any(0 < m[key] < 1 for m in ref_metrics), f"{key} never between 0 and 1: weak check"


def test_cp2_with_the_router_aux_loss_equals_single_rank():
    """Megatron's aux loss spans the TP x CP group: each CP rank's share of one micro-batch's
    loss adds up to the single rank's (padded micro-batches hold the same samples in both
    layouts; packing pads sequences for CP, which may change what shares a micro-batch)."""
    reference = _single_rank(packing=False, model={"moe_aux_loss_coeff": 0.1})
    _equal_to_single_rank(reference, CP2, 2)


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_cp2_run_under_torchrun_samples_in_a_generation_worker(tmp_path):
    """The CLI under torchrun at CP 2: the in-process engine cannot decode over CP ranks, so
    the recipe samples in a generation worker (which must not wait on torchrun's store)."""
    data = yaml.safe_load((ROOT / "recipes" / "tiny-moe.yaml").read_text())
    data["parallel"]["context_parallel_size"] = 2
    data["rollout"].update(prompts_per_step=4, group_size=4)
    data["run"].update(output_dir=str(tmp_path / "run"), steps=2, checkpoint_every=2)
    recipe = tmp_path / "cp2.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command = [*torchrun, "-m", "megatron_gspo.cli", "train", str(recipe)]

    recipe.write_text(yaml.safe_dump(data))
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode == 1
    assert "rollout.local_worker: true" in refused.stdout + refused.stderr

    data["rollout"]["local_worker"] = True
    recipe.write_text(yaml.safe_dump(data))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["entropy"] > 0 and "routing_flip_rate" in m for m in metrics)
    assert (tmp_path / "run" / "checkpoints" / "iter_0000002" / "manifest.json").is_file()
