"""Pure math of GRPO (no Lightning): each function cites the equation it implements.

Equation numbers refer to Mroueh et al., "Revisiting Group Relative Policy Optimization: Insights into
On-Policy and Off-Policy Training" unless stated otherwise. It imports torch only: every other role may import it,
and it imports none of them.
"""

from lit_grpo.math.advantages import group_advantages, zero_variance_mask
from lit_grpo.math.aggregation import (
    AGGREGATION_MODES,
    token_weights,
    zero_variance_dropped_weights,
    zero_variance_masked_weights,
)
from lit_grpo.math.cispo import CISPOOptions, cispo_loss, cispo_weight
from lit_grpo.math.corrections import (
    CORRECTION_MODES,
    CorrectionOptions,
    CorrectionWeight,
    correction_weight,
    mismatch_stats,
)
from lit_grpo.math.dppo import DPPOKLOptions, DPPOOptions, dppo_kl_loss, dppo_tv_loss
from lit_grpo.math.entropy_terms import (
    EntropyOptions,
    adaptive_entropy_coefficient,
    applied_entropy_coefficient,
    entropy_bonus,
    entropy_threshold,
    high_entropy_mask,
)
from lit_grpo.math.gmpo import GMPOOptions, gmpo_clipped_log_ratio, gmpo_loss
from lit_grpo.math.gspo import GSPOOptions, gspo_loss, sequence_log_ratio
from lit_grpo.math.kl import k3_kl
from lit_grpo.math.logprobs import selective_log_softmax, token_entropy
from lit_grpo.math.luspo import LUSPOOptions, luspo_loss
from lit_grpo.math.objective import ClipBand, GRPOOptions, LossConfig, LossFn, grpo_loss, with_kl_penalty
from lit_grpo.math.overlong import soft_overlong_penalty
from lit_grpo.math.pass_at_k import pass_at_k
from lit_grpo.math.rec import (
    ClipOptions,
    REDWeightOptions,
    RingOptions,
    TauOptions,
    advantage_coefficient,
    asymre_coefficient,
    asymre_loss,
    one_side_mask,
    opmd_loss,
    opmd_regulariser,
    rec_oneside_is_loss,
    rec_oneside_nois_loss,
    rec_ring_loss,
    rec_twoside_is_loss,
    red_drop_advantages,
    red_drop_loss,
    red_weight_coefficient,
    red_weight_loss,
    red_weights,
    reinforce_loss,
    ring_mask,
    two_side_mask,
)
from lit_grpo.math.sapo import SAPOOptions, sapo_gate, sapo_loss
from lit_grpo.math.surrogate import clip_bounds, clipped_surrogate, truncate_ratio
from lit_grpo.math.tv import TVEstimate, group_reward_std, tv_estimate, tv_from_sum_count
from lit_grpo.math.vespo import VESPOOptions, gamma_weight, sequence_log_weight, vespo_loss

__all__ = [
    "AGGREGATION_MODES",
    "CORRECTION_MODES",
    "CISPOOptions",
    "ClipBand",
    "ClipOptions",
    "CorrectionOptions",
    "CorrectionWeight",
    "DPPOKLOptions",
    "DPPOOptions",
    "EntropyOptions",
    "GMPOOptions",
    "GRPOOptions",
    "GSPOOptions",
    "LUSPOOptions",
    "LossConfig",
    "LossFn",
    "REDWeightOptions",
    "SAPOOptions",
    "RingOptions",
    "TVEstimate",
    "TauOptions",
    "VESPOOptions",
    "adaptive_entropy_coefficient",
    "applied_entropy_coefficient",
    "advantage_coefficient",
    "asymre_coefficient",
    "asymre_loss",
    "cispo_loss",
    "cispo_weight",
    "clip_bounds",
    "clipped_surrogate",
    "correction_weight",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "entropy_bonus",
    "entropy_threshold",
    "gamma_weight",
    "gmpo_clipped_log_ratio",
    "gmpo_loss",
    "group_advantages",
    "group_reward_std",
    "grpo_loss",
    "gspo_loss",
    "high_entropy_mask",
    "k3_kl",
    "luspo_loss",
    "mismatch_stats",
    "one_side_mask",
    "opmd_loss",
    "opmd_regulariser",
    "pass_at_k",
    "rec_oneside_is_loss",
    "rec_oneside_nois_loss",
    "rec_ring_loss",
    "rec_twoside_is_loss",
    "red_drop_advantages",
    "red_drop_loss",
    "red_weight_coefficient",
    "red_weight_loss",
    "red_weights",
    "reinforce_loss",
    "ring_mask",
    "sapo_gate",
    "sapo_loss",
    "selective_log_softmax",
    "sequence_log_ratio",
    "sequence_log_weight",
    "soft_overlong_penalty",
    "token_entropy",
    "token_weights",
    "truncate_ratio",
    "tv_estimate",
    "tv_from_sum_count",
    "two_side_mask",
    "vespo_loss",
    "with_kl_penalty",
    "zero_variance_dropped_weights",
    "zero_variance_mask",
    "zero_variance_masked_weights",
]
