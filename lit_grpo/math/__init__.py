"""Pure math of GRPO (no Lightning): each function cites the equation it implements.

Equation numbers refer to Mroueh et al., "Revisiting Group Relative Policy Optimization: Insights into
On-Policy and Off-Policy Training" unless stated otherwise.
"""

from lit_grpo.math.advantages import group_advantages, zero_variance_mask
from lit_grpo.math.aggregation import AGGREGATION_MODES, token_weights
from lit_grpo.math.kl import k3_kl
from lit_grpo.math.logprobs import selective_log_softmax, token_entropy
from lit_grpo.math.objective import GRPOLossConfig, grpo_loss
from lit_grpo.math.pass_at_k import pass_at_k
from lit_grpo.math.surrogate import clip_bounds, clipped_surrogate, truncate_ratio

__all__ = [
    "AGGREGATION_MODES",
    "GRPOLossConfig",
    "clip_bounds",
    "clipped_surrogate",
    "group_advantages",
    "grpo_loss",
    "k3_kl",
    "pass_at_k",
    "selective_log_softmax",
    "token_entropy",
    "token_weights",
    "truncate_ratio",
    "zero_variance_mask",
]
