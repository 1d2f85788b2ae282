"""`PassAtK`: a torchmetrics Metric for pass@k over questions, reduced across ranks by summation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchmetrics import Metric

from lit_grpo.math.pass_at_k import pass_at_k


class PassAtK(Metric):
    """Mean over questions of the unbiased pass@k estimator, for several k at once.

    ``update(num_correct, num_samples)`` takes per-question counts; ``compute()`` returns ``{k: value}``.
    Pass@1 is the mean fraction of correct samples (the paper's "Pass@1 using 50 samples").
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, ks: Sequence[int] = (1,), **kwargs) -> None:  # noqa: ANN003
        super().__init__(**kwargs)
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ks must be a non-empty list of integers >= 1, got {list(ks)}")
        self.ks = tuple(int(k) for k in ks)
        for k in self.ks:
            self.add_state(f"sum_{k}", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("questions", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num_correct: torch.Tensor, num_samples: torch.Tensor | int) -> None:
        num_correct = torch.as_tensor(num_correct).reshape(-1)
        for k in self.ks:
            value = pass_at_k(num_samples, num_correct, k).sum().to(self.device)
            setattr(self, f"sum_{k}", getattr(self, f"sum_{k}") + value)
        self.questions += num_correct.numel()

    def compute(self) -> dict[int, torch.Tensor]:
        denom = self.questions.clamp(min=1)
        return {k: getattr(self, f"sum_{k}") / denom for k in self.ks}
