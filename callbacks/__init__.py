"""Reusable Lightning callbacks for RL post-training (imported as ``lit_grpo.callbacks``).

They rely on the protocol in ``lit_grpo.callbacks.protocol`` (``policy``, ``reference``, ``tokenizer``,
``rollout_engine``), not on ``GRPOModule``, and check it when a fit starts: a module that does not follow it stops with
one line (a ``ProtocolError``) naming the attribute and what it must be. They import ``core``, ``data``,
``engines``, ``evaluation`` and ``models``; never the training step (what they share with it, such as
``log_measured``, is in ``core``) nor the command line.
"""

from lit_grpo.callbacks.hf_export import HFExport
from lit_grpo.callbacks.host_memory import HostMemory
from lit_grpo.callbacks.pass_at_k import GSM8KPassAtK, PassAtKEvaluation
from lit_grpo.callbacks.protocol import ProtocolError
from lit_grpo.callbacks.ref_swap import RefModelSwap
from lit_grpo.callbacks.weight_sync import WeightSync

__all__ = ["GSM8KPassAtK", "HFExport", "HostMemory", "PassAtKEvaluation", "ProtocolError", "RefModelSwap", "WeightSync"]
