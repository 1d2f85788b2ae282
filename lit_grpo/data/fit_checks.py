"""What the data module checks of the LightningModule and the trainer when a fit starts, before any rollout: that the
loss scores tokens at the temperature they were sampled with, that Dr.GRPO's constant normaliser is the generation
budget, that something keeps the rollout engine's weights in step with the policy, and that a sampler correction
with ``old_policy: decoupled`` gets alpha from the weights that sampled (not the sampler's own report, which makes
rho = 1).

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
from lit_grpo.math.corrections import RATIO_MODES


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


def _field(group: Any, name: str, default: Any = None) -> Any:
    """``name`` of an option group given as a mapping, a parsed namespace (its ``init_args`` when it names a
    ``class_path``) or a dataclass; ``default`` when it is not set."""
    init_args = group.get("init_args") if hasattr(group, "get") else None
    group = init_args if init_args is not None else group
    value = group.get(name) if hasattr(group, "get") else getattr(group, name, None)
    return default if value is None else value


def sync_schedule(callbacks: Iterable[object]) -> tuple[int, int]:
    """``(v, d)`` of the fit's weight pushes: the largest ``every_n_batches`` and ``delay_batches`` of the callbacks
    that sync the rollout engine (``WeightSync``); ``(1, 0)`` when none says otherwise."""
    syncers = [c for c in callbacks if syncs_rollout_engine(c)]
    interval = max((getattr(c, "every_n_batches", 1) for c in syncers), default=1)
    delay = max((getattr(c, "delay_batches", 0) for c in syncers), default=0)
    return interval, delay


def stale_sampling(max_staleness: Any, sync_interval: Any = 1, delay_batches: Any = 0,
                   reuse_policy_logprobs: Any = True) -> str | None:
    """The setting, as ``key=value``, under which a remote engine's batch can be trained on without the trainer's
    own log-probs of the weights that sampled it: one generated ahead (``data.max_staleness`` K >= 1), between
    pushes (``sync.every_n_batches`` v > 1), or delivered late (``sync.delay_batches`` >= 1), or every batch when
    the first forward is not reused as alpha (``data.reuse_policy_logprobs: false``). ``None`` at K = 0, v = 1,
    d = 0: every batch is sampled by the current weights and alpha is pi_k."""
    for key, value, fresh in (("data.max_staleness", max_staleness, 0), ("sync.every_n_batches", sync_interval, 1),
                              ("sync.delay_batches", delay_batches, 0)):
        if isinstance(value, int) and not isinstance(value, bool) and value > fresh:
            return f"{key}={value}"
    return "data.reuse_policy_logprobs=false" if reuse_policy_logprobs is False else None


def decoupled_on_stale_server(correction: Any, engine_options: Any, stale: str | None) -> str | None:
    """Why a ratio mode of ``model.correction`` (rho = pi_old / mu) with ``old_policy: decoupled`` would correct
    nothing on the project's rollout server, or ``None``. The server reports only the sampler's log-probs; the
    trainer's alpha is its own forward for a batch of its current weights, or with ``keep_pushed_weights`` the kept
    copy's. Under ``stale`` (:func:`stale_sampling`) the other batches take the server's report as alpha, so
    rho = 1 on them. The masks on pi_theta against mu still act (the loss then divides by mu); ``vllm serve`` and
    ``rescore: false`` are :func:`decoupled_without_recompute`'s."""
    mode, old_policy = _field(correction, "mode", "none"), _field(correction, "old_policy", "decoupled")
    if stale is None or mode not in RATIO_MODES or old_policy != "decoupled":
        return None
    if _field(engine_options, "kind", "lit_grpo") != "lit_grpo" or _field(engine_options, "rescore") is False \
            or _field(engine_options, "keep_pushed_weights") is True:
        return None
    return (f"model.correction.mode={mode!r} with old_policy 'decoupled' weighs by rho = alpha / mu, but with "
            f"{stale} the project's rollout server cannot give alpha of the weights that sampled a batch (it reports "
            "only the sampler's log-probs), so alpha = mu and rho = 1: nothing would be corrected; set "
            "data.engine_options.keep_pushed_weights: true (the trainer keeps the pushed weights and recomputes "
            "alpha), or model.correction.old_policy: proximal")


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


def packing_without_budget(module: Any, micro_batch_tokens: int | None, micro_batch_size: int) -> str | None:
    """The warning for ``model.packing`` without ``data.micro_batch_tokens``, or ``None``. Without a budget a packed
    row is ``micro_batch_size`` whole sequences, and where its attention is masked densely it costs the square of
    the row's length (the demo's update on a CPU, in the copies layout: 20x slower than unpacked): eager attention,
    and sdpa in the copies layout (models with chunked-attention layers). sdpa's prefix tree attends in blocks
    (:mod:`lit_grpo.core.tree_attention`), and flash and flex attention skip what the sequences do not attend to,
    so they are not warned about."""
    if module_setting(module, "packing") is not True or micro_batch_tokens is not None:
        return None
    policy = getattr(module, "policy", None)
    attention = getattr(getattr(policy, "config", None), "_attn_implementation", None)
    if not isinstance(attention, str) or attention.startswith(("flash_attention", "flex_attention")):
        return None
    from lit_grpo.core.packing import packed_layout_kind

    if attention == "sdpa" and packed_layout_kind(policy) == "packed_tree":
        return None
    layout = "prefix tree" if packed_layout_kind(policy) == "packed_tree" else "copies layout"
    return (f"model.packing: true without data.micro_batch_tokens packs each micro-batch of micro_batch_size="
            f"{micro_batch_size} whole sequences into one row, and {attention} attention in the {layout} masks it "
            "densely, at the square of its length (on a CPU the update can be many times slower than unpacked); set "
            "data.micro_batch_tokens (e.g. 4096) to bound each packed row")


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
