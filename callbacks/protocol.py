"""The small protocol the callbacks rely on, so they work in any LightningModule.

- Policy: ``pl_module.policy`` (an ``nn.Module``); without that attribute the LightningModule itself is the policy.
- Reference (``RefModelSwap``): ``pl_module.reference``, an ``nn.Module`` with the policy's parameter layout,
  or ``None`` (nothing to swap; stages are still counted). An integer ``pl_module.reference_version``, when
  present, counts the swaps: ``WeightSync`` pushes pi_ref to an engine that scores it whenever it changed.
- Rollout engine (``WeightSync``): passed to the callback, or found as ``trainer.datamodule.rollout_engine`` or
  ``pl_module.rollout_engine``: a ``lit_grpo.engines.base.RolloutEngine`` (``load_weights(named_tensors, step)``,
  ``synced_step``, and ``state_dict()`` / ``load_state_dict(state, step)``, through which a lagging engine survives
  a restart exactly). An engine that is also ``ReferenceServing`` and ``serves_reference`` gets pi_ref pushed.
- Tokenizer (``GSM8KPassAtK``): ``pl_module.tokenizer``, a Hugging Face tokenizer; the policy a HF causal LM.
"""

from __future__ import annotations

import lightning as L
from torch import nn

from lit_grpo.distributed import FullParameters, full_named_parameters
from lit_grpo.engines.base import RolloutEngine


def policy_of(pl_module: L.LightningModule) -> nn.Module:
    return getattr(pl_module, "policy", pl_module)


def engine_of(trainer: L.Trainer, pl_module: L.LightningModule, explicit: RolloutEngine | None = None) -> RolloutEngine:
    if explicit is not None:
        return explicit
    datamodule = getattr(trainer, "datamodule", None)
    for owner in (datamodule, pl_module):
        engine = getattr(owner, "rollout_engine", None)
        if engine is not None:
            return engine
    raise RuntimeError(
        "no rollout engine: pass one to the callback or expose it as `datamodule.rollout_engine` "
        "or `pl_module.rollout_engine`"
    )


def full_named_tensors(module: nn.Module) -> FullParameters:
    """Full (unsharded) parameters by their model names. Sharded (FSDP2 DTensor) parameters are gathered one at a
    time and FSDP1 modules inside ``summon_full_params``, which every rank must do together; plain modules hand out
    their tensors without a copy. Wrapper prefixes (``_fsdp_wrapped_module.`` ...) are stripped.

    The iterator names its module (``FullParameters.module``): an engine that gathers more cheaply may use the
    module instead of iterating (the rollout server's push gathers FSDP2 shards to rank 0 only,
    ``lit_grpo.engines.remote.weight_gather.rank0_buckets``). Nothing is gathered until the first item is asked for."""
    return full_named_parameters(module)
