"""Group-relative advantage (eq. 2) and the zero-variance mask (eq. 8)."""

from __future__ import annotations

import torch

#: the two ways to whiten a group's rewards: eq. 2 as the paper writes it, and TRL's (``GRPOTrainer``, 1.16)
ADVANTAGE_STDS = ("population", "bessel")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4, scale: bool = True,
                     std: str = "population") -> torch.Tensor:
    """Whitened reward of eq. 2: ``A = (r - mean) / sqrt(std^2 + eps)`` per group.

    ``rewards`` has shape ``[num_groups, G]``: the G completions of one prompt, all drawn from the rollout
    policy alpha, so the statistics are alpha's (the off-policy advantage ``A_alpha``). ``std`` is the
    population standard deviation (divide by G), the plug-in estimate of ``sigma_alpha`` in eq. 2; ``eps`` sits
    inside the square root as in the paper. ``scale=False`` drops the division (Dr.GRPO: centring only).

    ``std="bessel"`` is TRL's definition instead: ``A = (r - mean) / (s + eps)`` with the Bessel-corrected
    ``s`` (divide by G - 1) and ``eps`` outside the square root (``GRPOTrainer._generate_and_score_completions``
    with ``scale_rewards="group"``). For a group with spread the two differ by a factor of about
    ``sqrt(G / (G - 1))`` (1.069 at G = 8: eq. 2's advantages are the larger); a zero-variance group is 0 in both.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, G], got {tuple(rewards.shape)}")
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"std must be one of {', '.join(ADVANTAGE_STDS)}, got {std!r}")
    rewards = rewards.to(torch.float32)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    if std == "bessel":
        if rewards.shape[1] < 2:
            raise ValueError(f"std='bessel' needs groups of G >= 2, got G = {rewards.shape[1]}")
        return centred / (torch.sqrt(centred.pow(2).sum(dim=1, keepdim=True) / (rewards.shape[1] - 1)) + eps)
    variance = centred.pow(2).mean(dim=1, keepdim=True)
    return centred / torch.sqrt(variance + eps)


def zero_variance_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Indicator ``1[sigma_alpha(x) != 0]`` of eq. 8, one value per group, shape ``[num_groups]``.

    A group whose G rewards are all equal carries no signal (its advantage is 0) and, per the lower bound of
    Theorem 1, only adds total-variation penalty; eq. 8 drops it from the objective, KL term included.
    Equality is exact: rewards are compared, not their float variance.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, G], got {tuple(rewards.shape)}")
    return (rewards.max(dim=1).values != rewards.min(dim=1).values).to(torch.float32)
