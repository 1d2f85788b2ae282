"""The rollout engine of ``RolloutDataModule``: its options checked when the data module is built, the engine built
and wired to the asynchronous rollouts when the fit sets up, described in messages, and where alpha's log-probs
(eq. 6's sampling policy, ``RolloutBatch.alpha_logp``) come from once a batch is sampled.

These are plain functions of the data module's settings, so that each refusal is one line raised before any model
loads, and the data module itself only wires them into Lightning's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lit_grpo.core.option_groups import plain
from lit_grpo.data.fit_checks import (
    decoupled_on_stale_server,
    decoupled_without_recompute,
    module_setting,
    stale_sampling,
    sync_schedule,
    syncs_rollout_engine,
)
from lit_grpo.data.rollout import PaddedRollouts
from lit_grpo.data.server_reference import ServerReference
from lit_grpo.data.staleness import check_partial_rollouts, check_reference_on_server, check_staleness_setup
from lit_grpo.engines.base import ReferenceServing, RemoteEngine, RolloutEngine, SamplingConfig
from lit_grpo.engines.options import ENGINE_OPTIONS, ServerOptions, TransformersOptions, VLLMOptions
from lit_grpo.engines.options import engine_options as engine_options_of
from lit_grpo.models.loading import eos_token_ids, pad_token_id

#: the autocast dtype of Lightning's mixed precisions (the forward context of ``training_step``)
MIXED_AUTOCAST = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}

EngineOptions = TransformersOptions | VLLMOptions | ServerOptions


def checked_engine_options(engine: str, engine_options: dict[str, Any] | EngineOptions | None, max_staleness: int,
                           reference_on_server: bool, partial_rollouts: bool) -> EngineOptions:
    """``engine_options`` as the typed group of ``engine``, after the refusals that need only the constructor's
    arguments: an unknown engine, asynchronous rollouts or pi_ref on the server with an engine that has none, and
    ``vllm serve`` keeping fewer adapter versions than a batch requested K ahead may name."""
    check_staleness_setup(max_staleness, engine)
    if engine not in ENGINE_OPTIONS:
        raise ValueError(f"unknown engine {engine!r}; expected one of {tuple(ENGINE_OPTIONS)}")
    options = engine_options_of(engine, engine_options)
    server_kind = server_kind_of(options)
    check_reference_on_server(reference_on_server, engine, server_kind)
    check_partial_rollouts(partial_rollouts, max_staleness, engine, reference_on_server)
    if server_kind == "vllm" and options.lora_keep is not None and options.lora_keep < max_staleness + 1:
        raise ValueError(f"engine_options.lora_keep={options.lora_keep} is below max_staleness + 1 = "
                         f"{max_staleness + 1}: a batch requested ahead would name an unloaded adapter version")
    return options


def server_kind_of(options: EngineOptions) -> str | None:
    """The kind of rollout server (``lit_grpo`` or ``vllm``) the options name, ``None`` for a colocated engine."""
    return options.kind if isinstance(options, ServerOptions) else None


def check_engine_sampling(engine: str, options: EngineOptions, temperature: float, top_p: float) -> None:
    """Refuse sampling settings vLLM (colocated or ``vllm serve``) would not sample with as the trainer scores."""
    if engine == "vllm" or server_kind_of(options) == "vllm":
        from lit_grpo.engines.vllm_engine import check_vllm_temperature, check_vllm_top_p  # imports no vllm

        check_vllm_temperature(temperature)
        check_vllm_top_p(top_p)


def check_servers_answer(options: EngineOptions) -> None:
    """A server that is down, or a wrong token: one line now, before any model loads."""
    if isinstance(options, ServerOptions):
        from lit_grpo.engines.remote.client import check_servers

        check_servers(options)


def check_before_build(module: Any, engine_kind: str, options: EngineOptions, max_staleness: int,
                       callbacks: Sequence[Any], reuse_policy_logprobs: bool) -> None:
    """Refuse a sampler correction with ``old_policy: decoupled`` that the engine could not give alpha for, before
    the engine loads: colocated vLLM never rescores, and the project's server rescores fresh batches only."""
    if engine_kind == "vllm" and (refused := decoupled_without_recompute(module, False, "colocated vLLM")):
        raise ValueError(refused)
    if isinstance(options, ServerOptions):
        stale = stale_sampling(max_staleness, *sync_schedule(callbacks), reuse_policy_logprobs)
        if (refused := decoupled_on_stale_server(module_setting(module, "correction"), options, stale)) is not None:
            raise ValueError(refused)


def check_after_build(module: Any, engine: RolloutEngine, description: str) -> None:
    """The same refusal for the engines that say only once built (cheaply) whether they rescore."""
    if (refused := decoupled_without_recompute(module, engine.rescore, description)) is not None:
        raise ValueError(refused)


def why_not_shared(callbacks: Sequence[Any], module: Any, max_staleness: int, strategy: Any) -> str | None:
    """Why the in-process engine could sample with other weights than the policy's current ones at some batch, so
    that it needs a private copy (``TransformersOptions.weights``), or ``None``: one ``WeightSync`` loads the policy
    after every batch, nothing is generated ahead and the policy is not sharded, so a copy would equal the policy
    whenever it samples."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    if max_staleness:
        return f"data.max_staleness={max_staleness} samples while the policy trains"
    if syncs_rollout_engine(module):
        return f"{type(module).__name__} loads the engine's weights itself"
    syncs = [c for c in callbacks if syncs_rollout_engine(c)]
    if not syncs:
        return "no WeightSync callback: the engine keeps the initial weights"
    # a syncer that knows the engine may share the policy (WeightSync) skips its pushes; another would copy into it
    if (other := next((c for c in syncs if getattr(c, "skips_shared_pushes", False) is not True), None)):
        return f"{type(other).__name__} loads weights into the engine"
    interval, delay = sync_schedule(syncs)
    if interval != 1 or delay:
        return f"WeightSync(every_n_batches={interval}, delay_batches={delay}) lets the engine lag the policy"
    if strategy is not None and not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return f"the {type(strategy).__name__} shards the policy (a sharded model decodes in lockstep)"
    return None


def shares_weights(options: EngineOptions, callbacks: Sequence[Any], module: Any, max_staleness: int,
                   strategy: Any) -> bool:
    """Whether the in-process engine samples from the policy itself (``TransformersOptions.weights``): ``auto``
    where :func:`why_not_shared` finds nothing against it; ``shared`` refused in one line where it does."""
    if not isinstance(options, TransformersOptions) or options.weights == "copy":
        return False
    why = why_not_shared(callbacks, module, max_staleness, strategy)
    if why is not None and options.weights == "shared":
        raise ValueError(f"data.engine_options.weights=shared samples from the policy itself, but {why}; expected "
                         "weights: copy (or auto)")
    return why is None


def build_rollout_engine(options: EngineOptions, module: Any, tokenizer: Any, max_staleness: int,
                         scores_reference: bool, share: bool = False) -> RolloutEngine:
    """The engine ``options`` name, for the LightningModule ``module``'s policy (``share``: the in-process engine
    samples from the policy itself, :func:`shares_weights`), its recompute of alpha at the module's
    ``head_chunk_mb`` (when the module has one)."""
    engine = _build_engine(options, module, tokenizer, max_staleness, scores_reference, share)
    hparams = getattr(module, "hparams", None)
    if hparams is not None and "head_chunk_mb" in hparams:
        engine.head_chunk_mb = hparams["head_chunk_mb"]
    return engine


def _build_engine(options: EngineOptions, module: Any, tokenizer: Any, max_staleness: int,
                  scores_reference: bool, share: bool) -> RolloutEngine:
    """In-process, rollout servers over HTTP (the trainer's EOS ids stop them too) or colocated vLLM."""
    eos = eos_token_ids(tokenizer, module.policy)
    if isinstance(options, TransformersOptions):
        from lit_grpo.engines.transformers_engine import TransformersEngine

        kwargs = plain(options)
        kwargs.pop("weights")  # decided by the fit (``share``), see shares_weights
        return TransformersEngine(module.policy, eos, pad_token_id(tokenizer), copy_weights=not share,
                                  shares_policy=share, **kwargs)
    if isinstance(options, ServerOptions):
        from lit_grpo.engines.remote.client import ServerEngine

        stops = eos if options.stop_token_ids is None else options.stop_token_ids
        # a request in flight names an adapter version up to K pushes old: K + 1 stay loaded on `vllm serve`
        keep = max_staleness + 1 if options.lora_keep is None else options.lora_keep
        return ServerEngine(policy=lambda: module.policy, serves_reference=scores_reference,
                            **{**plain(options), "stop_token_ids": stops, "lora_keep": keep})
    from lit_grpo.engines.vllm_engine import VLLMEngine

    vllm_options = plain(options)
    return VLLMEngine(module.hparams.model_name, tokenizer=tokenizer, policy=lambda: module.policy,
                      **vllm_options.pop("llm_kwargs"), **vllm_options)


def server_reference_for(engine: RolloutEngine, module: Any, tokenizer: Any, precision: Any, micro_batch_size: int,
                         micro_batch_tokens: int | None, sampling: SamplingConfig) -> ServerReference | None:
    """How pi_ref's log-probs are asked of a server that scores them (``None``: the engine cannot). They are taken
    at the loss's temperature (the CLI links it to ``data.temperature``) and in the precision of the module's own
    pass (autocast under a mixed precision), so that KL(pi || pi_ref) is still exactly 0 right after a
    ``RefModelSwap``."""
    if not isinstance(engine, ReferenceServing):
        return None
    return ServerReference(engine, pad_token_id(tokenizer), micro_batch_size,
                           float(module.hparams.get("temperature", sampling.temperature)),
                           MIXED_AUTOCAST.get(str(precision)), micro_batch_tokens)


def hold_batches_through_pushes(engine: RolloutEngine, max_staleness: int, partial_rollouts: bool,
                                drain: Callable[[], None]) -> None:
    """What a weight push does to the batches requested ahead of it (``max_staleness`` >= 1, a remote engine): with
    partial rollouts they keep generating through it; else every push first waits for them (``drain``, on every
    rank, then a barrier in the push), so no batch handed over under the old weights is sampled with the new ones."""
    if not (max_staleness and isinstance(engine, RemoteEngine)):
        return
    if partial_rollouts:
        engine.keep_generating_through_pushes()
    else:
        engine.before_push.append(drain)


def engine_description(options: EngineOptions, engine_kind: str) -> str:
    """The rollout engine in words, for messages: colocated vLLM, or the kind and URL of the servers."""
    if isinstance(options, ServerOptions):
        where = options.url or ", ".join(options.urls or [])
        return f"{'vllm serve' if options.kind == 'vllm' else 'rollout server'} at {where}"
    return "colocated vLLM" if engine_kind == "vllm" else "in-process engine"


def precision_context(trainer: Any, engine_kind: str) -> AbstractContextManager:
    """The trainer's forward precision (autocast under ``bf16-mixed`` / ``16-mixed``), the one its
    ``training_step`` runs in. An in-process engine samples and scores in it, so that alpha and pi are the same
    function of the same weights: equal weights give equal log-probs, and a lagging step's ratio measures the
    lag, not a precision gap. Engines in other processes (server, vLLM) compute alpha in their own precision."""
    if trainer is None or engine_kind != "transformers":
        return nullcontext()
    return trainer.precision_plugin.forward_context()


def alpha_precision(engine: RolloutEngine, trainer: Any, engine_kind: str) -> AbstractContextManager:
    """The precision alpha's log-probs are recomputed in: a server engine's kept copy of the pushed weights
    (``keep_pushed_weights``) recomputes them on the trainer, in its forward precision as the in-process engine does
    (:func:`precision_context`); the other engines in their own."""
    if getattr(engine, "kept_weights", None) is not None and trainer is not None:
        return trainer.precision_plugin.forward_context()
    return precision_context(trainer, engine_kind)


def alpha_logprobs(engine: RolloutEngine, padded: PaddedRollouts, sampled_step: int, current_step: int | None,
                   reuse_policy_logprobs: bool, temperature: float,
                   mixed: bool = False) -> tuple[torch.Tensor | None, str]:
    """Log-probs of the completions under the weights that sampled them (version ``sampled_step``), and where
    they come from (``RolloutBatch.alpha_source``); ``None`` means "alpha is pi_k": those are the policy's
    current weights (the optimizer step is ``current_step``), so the trainer's first forward gives them exactly.
    ``mixed``: the batch's tokens come from several versions (partial rollouts): no one set of weights recomputes
    them, so alpha is the sampler's."""
    if mixed:
        return padded.sampler_logp, "sampler"
    if reuse_policy_logprobs and engine.rescore and sampled_step == current_step:
        return None, "policy"
    if sampled_step != engine.synced_step:
        return padded.sampler_logp, "sampler"  # sampled before the last push: only the sampler knew them
    alpha = engine.score(padded, temperature)
    return (alpha, "recompute") if alpha is not None else (padded.sampler_logp, "sampler")
