"""Group-relative advantages: each response is scored against the other responses to its prompt.

``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over the ``G`` responses of a prompt. The
standard deviation is the *sample* one (Bessel's correction, ``torch.std``'s default): it is
what the GRPO/GSPO reference implementations use, so advantages -- and the step size they
imply -- match the published recipes. For small groups the choice matters: with G = 8 the
population std is ``sqrt(7/8)`` of the sample std, i.e. advantages ~7% larger.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["group_advantages", "returns_to_go", "turn_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    eps: float = 1e-6,
    scale: Literal["std", "none"] = "std",
) -> torch.Tensor:
    """Advantages of ``rewards`` laid out group-contiguous: ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

    Args:
        rewards: ``[num_prompts * group_size]``.
        group_size: responses per prompt (``G``).
        eps: added to the std so a near-constant group does not explode.
        scale: ``"std"`` divides the centred rewards by ``std + eps`` (sample std);
            ``"none"`` only centres them (Dr. GRPO style).

    Returns:
        fp32 (fp64 for fp64 rewards) advantages with the shape of ``rewards``. A group whose
        rewards are all equal gets exact zeros (it carries no learning signal), and so does
        every group when ``group_size == 1``.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [num_prompts * group_size], got {tuple(rewards.shape)}"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of {group_size}; expected "
            "num_prompts * group_size rewards laid out group by group"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    # In fp64 whatever comes in: squares of large (float32-finite) rewards overflow fp32.
    grouped = rewards.detach().to(torch.float64).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std":
        # group_size == 1 has no sample std; its centred rewards are zero anyway.
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + eps)
    # mean() of equal values can differ from them by an ulp; make constant groups exactly 0.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    out = torch.where(constant, torch.zeros_like(centred), centred).view(rewards.shape)
    return out.to(dtype)


def returns_to_go(turn_rewards: list[float], final: float) -> list[float]:
    """Per turn ``k``: the rewards from turn ``k`` on, and the episode's final reward
    (undiscounted): what the turn's actions could still change."""
    out, total = [], final
    for r in reversed(turn_rewards):
        total += r
        out.append(total)
    return out[::-1]


def turn_advantages(
    returns: list[list[float]],
    group_size: int,
    *,
    eps: float = 1e-6,
    scale: Literal["std", "none"] = "std",
) -> list[list[float]]:
    """Turn-level advantages: turn ``k`` of episode ``i`` gets its return-to-go against that
    of turn ``k`` of the other episodes of its group,
    ``A_{i,k} = (R_{i,k} - mean_g R_{.,k}) / (std_g R_{.,k} + eps)``.

    ``returns[i]`` holds episode ``i``'s returns-to-go, one per model turn (episodes laid out
    group by group, like :func:`group_advantages`). The mean and the sample std run over the
    episodes of the group that reached turn ``k``; a turn only one episode of its group reached,
    or whose returns are all equal, gets 0. Comparing turn ``k`` with turn ``k`` keeps a
    baseline of what that point of an episode is worth; a return-to-go leaves out the rewards
    of earlier turns, which a later turn cannot change. With one turn per episode this is
    :func:`group_advantages` of the episodes' returns.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    if group_size < 1 or len(returns) % group_size:
        raise ValueError(
            f"{len(returns)} episodes do not split into groups of {group_size}; expected "
            "num_prompts * group_size episodes laid out group by group"
        )
    turns = max((len(r) for r in returns), default=0)
    if turns == 0:
        return [[] for _ in returns]
    padded = torch.zeros(len(returns), turns, dtype=torch.float64)
    present = torch.zeros(len(returns), turns, dtype=torch.bool)
    for i, r in enumerate(returns):
        padded[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        present[i, : len(r)] = True
    values = padded.view(-1, group_size, turns)
    here = present.view(-1, group_size, turns)
    count = here.sum(dim=1, keepdim=True)
    mean = (values * here).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = (values - mean) * here
    if scale == "std":
        var = (centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)
        centred = centred / (var.sqrt() + eps)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    high = torch.where(here, values, -inf).amax(dim=1, keepdim=True)
    low = torch.where(here, values, inf).amin(dim=1, keepdim=True)
    # No baseline (one episode got there) or no signal (all equal): no advantage.
    no_signal = (count < 2) | (high == low)
    adv = torch.where(no_signal | ~here, torch.zeros_like(centred), centred).view(-1, turns)
    return [adv[i, : len(r)].float().tolist() for i, r in enumerate(returns)]
