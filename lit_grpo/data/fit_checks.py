"""What the data module checks of the LightningModule and the trainer when a fit starts, before any rollout: that the
loss scores tokens at the temperature they were sampled with, that Dr.GRPO's constant normaliser is the generation
budget, and that something keeps the rollout engine's weights in step with the policy.

The LightningModule is read duck-typed, so that these checks apply to ``GRPOModule`` and stay out of the way of a
module of one's own: a setting is compared only when the module exposes it (in ``hparams``, else as an attribute).
The CLI links ``data.temperature`` and ``data.max_new_tokens`` to the module's settings; a module and data module
built in Python are checked here instead.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

from lit_grpo.engines.base import EngineSyncer, SamplingConfig


def module_setting(module: Any, name: str) -> Any:
    """``module``'s setting ``name``: from its ``hparams`` (``save_hyperparameters``), else its attribute; ``None``
    when it has neither."""
    hparams = getattr(module, "hparams", None)
    if hparams is not None and name in hparams:
        return hparams[name]
    return getattr(module, name, None)


def check_temperature_agrees(module: Any, sampling: SamplingConfig) -> None:
    """Refuse a module whose loss divides the logits by another temperature than the rollouts were sampled at: the
    ratio pi / alpha of eq. 6 would compare two different distributions, and be != 1 even for equal weights."""
    temperature = module_setting(module, "temperature")
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        return  # a module with no temperature of its own
    if float(temperature) != float(sampling.temperature):
        raise ValueError(
            f"{type(module).__name__} temperature={temperature} but RolloutDataModule temperature="
            f"{sampling.temperature}: the loss must use the temperature the rollouts were sampled with; set them equal")


def decoupled_without_recompute(module: Any, rescores: bool, where: str) -> str | None:
    """Why ``model.correction.old_policy: decoupled`` cannot work with this engine, or ``None``: it divides by alpha
    recomputed in the trainer's numerics, and an engine that never rescores (colocated vLLM, ``vllm serve``
    without ``keep_pushed_weights``) leaves every batch with the sampler's report, so rho would be 1 throughout."""
    correction = module_setting(module, "correction")
    if not isinstance(correction, dict) or correction.get("mode", "none") == "none":
        return None
    if correction.get("old_policy") != "decoupled" or rescores:
        return None
    return (f"model.correction.old_policy 'decoupled' needs alpha recomputed from the rollout weights, which the "
            f"{where} does not do (it reports only the sampler's log-probs); use the in-process engine, "
            "data.engine_options.keep_pushed_weights: true for a server, or old_policy: proximal")


def constant_normaliser_mismatch(module: Any, sampling: SamplingConfig) -> str | None:
    """Why Dr.GRPO's constant normaliser (``loss_aggregation: constant``, ``1 / (num_sequences *
    max_completion_length)``) is not the generation budget ``max_new_tokens``, or ``None`` when it is (or the module
    aggregates otherwise). Only a warning: any constant keeps the objective unbiased, a different one rescales the
    loss and its gradient (so what gradient clipping and the learning rate mean), which may be intended."""
    if module_setting(module, "loss_aggregation") != "constant":
        return None
    length = module_setting(module, "max_completion_length")
    if not isinstance(length, numbers.Integral) or int(length) == sampling.max_new_tokens:
        return None
    return (f"{type(module).__name__} max_completion_length={length} but RolloutDataModule max_new_tokens="
            f"{sampling.max_new_tokens} with loss_aggregation='constant': Dr.GRPO's normaliser is the generation "
            f"budget, so the loss is scaled by {sampling.max_new_tokens}/{length} relative to it; set them equal "
            "unless the other constant is intended")


def syncs_rollout_engine(candidate: object) -> bool:
    """Whether ``candidate`` (a callback, or the LightningModule) says it loads the policy's weights into the rollout
    engine (:class:`lit_grpo.engines.base.EngineSyncer`)."""
    return isinstance(candidate, EngineSyncer) and candidate.syncs_rollout_engine is True


def unsynced_engine_warning(callbacks: Iterable[object], module: object) -> str | None:
    """The warning for a fit in which nothing syncs the rollout engine, or ``None`` when something does."""
    if syncs_rollout_engine(module) or any(syncs_rollout_engine(c) for c in callbacks):
        return None
    return ("no callback syncs the rollout engine: without WeightSync (lit_grpo.callbacks.WeightSync) in the "
            "trainer's callbacks the engine keeps the policy's initial weights for the whole fit, so every batch is "
            "sampled by the initial policy and train/staleness grows with every optimizer step")
