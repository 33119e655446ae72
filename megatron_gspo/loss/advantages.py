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

__all__ = ["group_advantages"]


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
    grouped = rewards.detach().to(dtype).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "std":
        # group_size == 1 has no sample std; its centred rewards are zero anyway.
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred)
        centred = centred / (std + eps)
    # mean() of equal values can differ from them by an ulp; make constant groups exactly 0.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred).view(rewards.shape)
