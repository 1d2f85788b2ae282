"""Unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")."""

from __future__ import annotations

import torch


def pass_at_k(num_samples: torch.Tensor | int, num_correct: torch.Tensor, k: int) -> torch.Tensor:
    """``1 - C(n - c, k) / C(n, k)`` per question, in the stable product form ``1 - prod_{j=n-c+1}^{n} (1 - k/j)``.

    ``num_samples`` (n) and ``num_correct`` (c) are per question; ``k <= n``. With ``k = 1`` this is ``c / n``,
    the paper's Pass@1 ("frequency of success given 50 generations").
    """
    c = torch.as_tensor(num_correct, dtype=torch.float64)
    n = torch.as_tensor(num_samples, dtype=torch.float64).expand_as(c)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if bool((n < k).any()):
        raise ValueError(f"pass@{k} needs at least {k} samples per question, got n={n.min().item():.0f}")
    if bool((c > n).any()) or bool((c < 0).any()):
        raise ValueError("num_correct must lie in [0, num_samples]")
    out = torch.empty_like(c)
    for idx in range(c.numel()):
        ni, ci = int(n.view(-1)[idx]), int(c.view(-1)[idx])
        if ni - ci < k:
            out.view(-1)[idx] = 1.0
        else:
            js = torch.arange(ni - ci + 1, ni + 1, dtype=torch.float64)
            out.view(-1)[idx] = 1.0 - torch.prod(1.0 - k / js)
    return out
