"""The k3 estimator of KL(pi || pi_ref), the regulariser of eq. 7."""

from __future__ import annotations

import torch


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi || pi_ref)`` (Schulman's "approximating KL", used by GRPO).

    With ``d = log pi_ref(y) - log pi(y)`` on tokens sampled from the rollout policy: ``exp(d) - d - 1``.
    It is non-negative, zero exactly when the two log-probs agree, and its gradient w.r.t. ``logp`` is
    ``1 - pi_ref/pi``.
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0
