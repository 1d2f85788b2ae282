"""Reusable Lightning callbacks for RL post-training (imported as ``lit_grpo.callbacks``).

They rely on the small protocol in ``lit_grpo.callbacks.protocol``, not on ``GRPOModule``.
"""

from lit_grpo.callbacks.hf_export import HFExport
from lit_grpo.callbacks.pass_at_k import GSM8KPassAtK
from lit_grpo.callbacks.ref_swap import RefModelSwap
from lit_grpo.callbacks.weight_sync import WeightSync

__all__ = ["GSM8KPassAtK", "HFExport", "RefModelSwap", "WeightSync"]
