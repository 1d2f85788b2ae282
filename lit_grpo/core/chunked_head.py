"""The model's head applied a chunk of tokens at a time (:mod:`lit_grpo.math.chunked_logprobs`), for every layout that
scores completions (:mod:`lit_grpo.core.scoring`, :mod:`lit_grpo.core.packing`, :mod:`lit_grpo.core.prefix_tree`).

The final hidden states come from the model's own forward, so that the hooks of a sharded model (FSDP) run as they
would for logits: ``output_hidden_states=[-1]`` keeps the last hidden state only, which transformers (checked in
5.24: ``capture_outputs`` ties ``hidden_states[-1]`` to ``last_hidden_state``) returns after the final norm, the
head's input; ``logits_to_keep`` selecting no position (an empty index tensor) lets the model apply its head to
nothing. The head is then the model's output-embeddings module (``get_output_embeddings()``), called on each chunk:
tied embeddings are that module too, and a LoRA model's head is its base model's.

Some families change the logits after the head; :func:`logit_transform` applies the same in each chunk, read from
the config: Granite divides by ``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2 and its
successors soft-cap with ``final_logit_softcapping``. A config with another such setting (Falcon-H1's
``lm_head_multiplier``, ``logits_scaling`` outside Granite, ...) is one this module does not handle:
:func:`chunked_head_unsupported` says so in one line and the layouts fall back to the full logits.

FSDP2: the head belongs to the root's unit, whose parameters this project reshards after each forward
(:func:`lit_grpo.core.distributed.fully_shard_model`). :func:`head_gathered` keeps that unit gathered from the forward
to the last chunk (and, with autograd recording, to the backward, whose end reshards it), so the head's weights are
whole when a chunk, or its recompute in the backward, multiplies by them: one all-gather per forward, none in the
backward. The layouts enter it for every pass while chunks are on, also for a micro-batch that fits one chunk: a
sharded forward is a collective, and ranks whose micro-batches took different branches would otherwise gather the
root a different number of times.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from lit_grpo.math.chunked_logprobs import chunk_tokens_for, chunked_logprobs

#: the float32 logits one chunk may hold, in MiB (``model.head_chunk_mb``). 256 MiB is 441 tokens at Qwen2.5's
#: vocabulary (151,936) and 1,365 at SmolLM2's (49,152). A chunk's forward and backward hold two such tensors at once
#: (its recomputed float32 logits and their gradient): measured 536 MB of vocabulary-sized tensors at peak for 512 or
#: 4,096 completion tokens alike, where the full logits' path peaked at 5.0 GB for 4,096 (benchmarks/head_memory.py,
#: docs/speed.md). Smaller chunks would save little more beside the rest of a step, and would cost a GPU a read of
#: the head's weights per chunk (three per chunk with the recompute): hundreds of tokens keep its matmul efficient.
#: A micro-batch whose logits fit in one chunk runs as without chunks (the same kernels, the same numbers).
DEFAULT_HEAD_CHUNK_MB = 256.0

#: model types whose logits the model divides by ``config.logits_scaling`` after the head
_DIVIDED_BY_LOGITS_SCALING = ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                              "granitemoe_swa")
#: model types whose logits the model multiplies by ``config.logit_scale`` after the head
_TIMES_LOGIT_SCALE = ("cohere", "cohere2", "cohere2_moe")
#: config settings that change logits after the head in families not handled here
_UNHANDLED_SETTINGS = ("logits_scaling", "logit_scale", "lm_head_multiplier", "output_multiplier", "logits_soft_cap")


def unwrapped_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP, FSDP1, ``torch.compile`` or PEFT wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def _text_config(model: nn.Module) -> object | None:
    config = getattr(unwrapped_model(model), "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _softcap(cap: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda logits: torch.tanh(logits / cap) * cap


def logit_transform(config: object) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a model of this (text) config does to its logits after the head, as a function of float32 logits, or
    None (nothing). Raises ``ValueError`` for a setting :func:`chunked_head_unsupported` refuses."""
    model_type = getattr(config, "model_type", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if model_type in _DIVIDED_BY_LOGITS_SCALING:
        scaling = float(config.logits_scaling)
        scale: Callable[[torch.Tensor], torch.Tensor] | None = lambda logits: logits / scaling  # noqa: E731
    elif model_type in _TIMES_LOGIT_SCALE:
        factor = float(config.logit_scale)
        scale = lambda logits: logits * factor  # noqa: E731
    else:
        settings = [f"{name}={getattr(config, name)!r}" for name in _UNHANDLED_SETTINGS
                    if getattr(config, name, None) is not None]
        if settings:
            raise ValueError(f"the chunked head does not know what {model_type!r} does with {', '.join(settings)} "
                             "after its head")
        scale = None
    if cap is None:
        return scale
    capped = _softcap(float(cap))
    return capped if scale is None else (lambda logits: capped(scale(logits)))


def chunked_head_unsupported(model: nn.Module) -> str | None:
    """``None`` when the chunked head can score ``model``, else one line saying why not: no output embeddings, a
    config whose ``hidden_states[-1]`` is not the final norm's output, or logits post-processed in a way
    :func:`logit_transform` does not know."""
    base = unwrapped_model(model)
    config = _text_config(model)
    if config is None or not hasattr(base, "get_output_embeddings"):
        return f"the chunked head needs a transformers model with a config; got {type(base).__name__}"
    if not isinstance(base.get_output_embeddings(), nn.Module):
        return f"the chunked head needs the model's output embeddings; {type(base).__name__} has none"
    if getattr(config, "tie_last_hidden_states", True) is False:
        return f"{type(base).__name__} returns its last hidden state before the final norm (tie_last_hidden_states)"
    try:
        logit_transform(config)
    except ValueError as refused:
        return str(refused)
    return None


def head_chunk_tokens(model: nn.Module, head_chunk_mb: float | None) -> int | None:
    """Tokens per chunk for ``model`` at a budget of ``head_chunk_mb`` MiB of float32 logits, or None: chunks off
    (``head_chunk_mb`` None) or a model the chunked head does not handle (the full logits then)."""
    if head_chunk_mb is None or chunked_head_unsupported(model) is not None:
        return None
    head = unwrapped_model(model).get_output_embeddings()
    vocab = getattr(head, "out_features", None) or _text_config(model).vocab_size
    return chunk_tokens_for(int(vocab), head_chunk_mb)


def hidden_only(device: torch.device) -> dict[str, object]:
    """The forward's keyword arguments that return the last hidden state and apply the head to no position."""
    return {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=device),
            "output_hidden_states": [-1] if _selects_hidden_states() else True}


@functools.lru_cache(maxsize=1)
def _selects_hidden_states() -> bool:
    """Whether this transformers returns only the listed layers for ``output_hidden_states=[-1]`` (5.24 does;
    5.19, the newest vLLM 0.32 allows, returns none for a list). Where it does not, every layer's hidden states are
    asked for: references to activations that the backward keeps anyway, the last of them the head's input."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.24")


def final_hidden(output: object) -> torch.Tensor:
    """The final (normed) hidden states ``[B, T, H]`` of a forward run with :func:`hidden_only`."""
    return output.hidden_states[-1]  # type: ignore[attr-defined]


def head_logprobs(model: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                  chunk_tokens: int, with_entropy: bool = False, entropy_grad: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``tokens`` from the final hidden states predicting them, through ``model``'s
    head and logit transform, ``chunk_tokens`` at a time (:func:`lit_grpo.math.chunked_logprobs.chunked_logprobs`).
    Call it inside :func:`head_gathered`, with the forward that made ``hidden``."""
    head = unwrapped_model(model).get_output_embeddings()
    return chunked_logprobs(hidden, tokens, head, temperature, chunk_tokens, with_entropy, entropy_grad,
                            transform=logit_transform(_text_config(model)))


def _fsdp2_owner(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The FSDP2 unit whose parameter group holds ``head``'s weights (its innermost ``fully_shard`` ancestor), or
    None: no FSDP2, or the head is a unit of its own (whose hooks gather it at each call)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if isinstance(head, FSDPModule):
        return None
    modules = dict(model.named_modules())
    head_name = next((name for name, module in modules.items() if module is head), None)
    if head_name is None:
        return None
    owners = [name for name, module in modules.items() if isinstance(module, FSDPModule)
              and (name == "" or head_name.startswith(name + "."))]
    return modules[max(owners, key=len)] if owners else None


@contextlib.contextmanager
def head_gathered(model: nn.Module) -> Iterator[None]:
    """Inside the block, the FSDP2 unit holding ``model``'s head stays gathered after its forward (see the module
    docstring); at the end, without autograd recording, it is resharded as its forward would have. A no-op for a
    model without FSDP2 (one process, DDP; FSDP1 keeps its root gathered after a forward by itself)."""
    owner = _fsdp2_owner(model, unwrapped_model(model).get_output_embeddings())
    if owner is None:
        yield
        return
    group = owner._get_fsdp_state()._fsdp_param_group
    # FSDP2 has no public getter: a unit that reshards after forward has a post-forward mesh
    reshards = group is not None and getattr(group, "post_forward_mesh_info", True) is not None
    owner.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        owner.set_reshard_after_forward(reshards, recurse=False)
        if reshards and not torch.is_grad_enabled():
            owner.reshard()  # no backward follows to reshard it
