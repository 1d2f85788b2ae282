"""Token log-probs of completions under a causal LM, with one prompt forward shared by its completions, and the
policy's log-probs for a gradient pass when the policy has dropout (LoRA's ``lora.dropout``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.cache_argument import cache_kwarg, output_cache
from lit_grpo.core.chunked_head import (
    DEFAULT_HEAD_CHUNK_MB,
    final_hidden,
    head_chunk_tokens,
    head_gathered,
    head_logprobs,
    hidden_only,
)
from lit_grpo.core.packing import packed_completion_logprobs
from lit_grpo.math.logprobs import logprobs_and_entropy


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
    packed: bool = False, head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` of each completion token, shape ``[s, C']``, and optionally the entropy (with
    its gradient when ``entropy_grad``: an entropy bonus; else a detached statistic).

    The prompt is run once per distinct prompt; its KV cache is then indexed out to the completions that
    share it (a differentiable gather), and the completions run on top. This is the same computation as a
    forward over ``prompt + completion`` per row, with G times less work on the prompt.

    Under activation checkpointing (a training-mode model with ``gradient_checkpointing_enable()``) there is no
    KV cache to share, so each row runs as one cacheless forward over ``prompt + completion`` instead: the same
    function, with the prompt computed G times (see :func:`checkpointing_drops_cache`).

    ``packed``: the same numbers (within 1e-5 in float32) from one packed row without padding
    (:func:`lit_grpo.core.packing.packed_completion_logprobs`).

    ``head_chunk_mb``: when the micro-batch's logits (``s x C' x V`` in float32) exceed this many MiB, the head runs
    on chunks of tokens that fit it, from the final hidden states, and no full logits exist
    (:mod:`lit_grpo.core.chunked_head`); the same numbers within 1e-5 in float32. None: the full logits always
    (also for a model the chunked head does not handle).
    """
    if packed:
        return packed_completion_logprobs(model, mb, temperature, with_entropy, entropy_grad,
                                          head_chunk_mb=head_chunk_mb)
    chunk = head_chunk_tokens(model, head_chunk_mb)
    # with chunks on, FSDP2 ranks keep the head's unit gathered on both branches alike, so that ranks whose
    # micro-batches take different branches (one fits a chunk, the other does not) make the same collectives
    with head_gathered(model) if chunk is not None else contextlib.nullcontext():
        if chunk is None or mb.completion_ids.numel() <= chunk:
            return _full_logits_logprobs(model, mb, temperature, with_entropy, entropy_grad)
        if checkpointing_drops_cache(model):
            hidden = _forward_without_cache(model, mb, hidden=True)
        else:
            hidden = torch.cat([h for h, _ in _forward_with_shared_prompt(model, mb, hidden=True)], dim=1)
        return head_logprobs(model, hidden, mb.completion_ids, temperature, chunk, with_entropy, entropy_grad)


def _full_logits_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool,
                          entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`completion_logprobs` from the full logits of each piece (``head_chunk_mb`` None, the reference)."""
    if checkpointing_drops_cache(model):
        pieces = [(_forward_without_cache(model, mb), mb.completion_ids)]
    else:
        pieces = _forward_with_shared_prompt(model, mb)
    # one piece at a time: concatenating the logits would copy the largest tensor of the update
    logps, entropies = [], []
    for logits, tokens in pieces:
        logp, entropy = logprobs_and_entropy(logits, tokens, temperature, with_entropy, entropy_grad)
        logps.append(logp)
        entropies.append(entropy)
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1) if with_entropy else None


def layout_logprobs(model: nn.Module, layout: object, temperature: float,
                    head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB) -> torch.Tensor:
    """``[S, C]`` float32 log-probs of a padded layout's completions (a ``RolloutBatch`` or the padded rollouts it
    is built from: ``completion_ids`` and ``micro_batches()``), micro-batch by micro-batch as the trainer lays them
    out, so that an engine's recompute of alpha and the trainer's own pass see the same shapes (and, at the default
    ``head_chunk_mb``, the same chunks); 0 on padding."""
    ids = layout.completion_ids  # type: ignore[attr-defined]
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    for mb in layout.micro_batches():  # type: ignore[attr-defined]
        logp, _ = completion_logprobs(model, mb, temperature, head_chunk_mb=head_chunk_mb)
        out[mb.rows, : logp.shape[1]] = logp
    return out


def checkpointing_drops_cache(model: nn.Module) -> bool:
    """Whether transformers will refuse a KV cache in this model's forward.

    With activation checkpointing on and the model in train mode, transformers (checked against 5.23) turns
    ``use_cache`` off in the model's forward and, in every checkpointed decoder layer, replaces
    ``past_key_values`` with ``None`` (a layer recomputed in the backward pass would append its keys and values
    to the cache a second time). An explicit ``DynamicCache`` is dropped the same way, whatever the
    checkpoint's reentrancy, so prefix sharing cannot work there: the prompt pass returns no cache at all.
    """
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _forward_without_cache(model: nn.Module, mb: MicroBatch, hidden: bool = False) -> torch.Tensor:
    """Logits predicting each completion token (with ``hidden``: the final hidden states that predict it) from one
    forward over ``prompt + completion[:-1]`` per row."""
    completion_len = mb.completion_ids.shape[1]
    input_ids = torch.cat([mb.prompt_ids[mb.prompt_index], mb.completion_ids[:, :-1]], dim=1)
    full_mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask[:, :-1]], dim=1)
    # the last C' positions: the last prompt token, then every completion token but the last
    out = model(
        input_ids=input_ids,
        attention_mask=full_mask,
        position_ids=positions_from_mask(full_mask),
        use_cache=False,
        **(hidden_only(input_ids.device) if hidden else {"logits_to_keep": completion_len}),
    )
    return final_hidden(out)[:, -completion_len:] if hidden else out.logits


def _forward_with_shared_prompt(model: nn.Module, mb: MicroBatch,
                                hidden: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same logits (or final hidden states), with one prompt forward per distinct prompt and its KV cache shared
    by the rows, as ``(logits, tokens they predict)`` pieces: the first completion token (from the prompt pass),
    then the rest."""
    head = hidden_only(mb.prompt_ids.device) if hidden else {}
    out = model(
        input_ids=mb.prompt_ids,
        attention_mask=mb.prompt_mask,
        position_ids=positions_from_mask(mb.prompt_mask),
        use_cache=True,
        **(head or {"logits_to_keep": 1}),
    )
    cache = output_cache(out)
    cache.batch_select_indices(mb.prompt_index)
    first = final_hidden(out) if hidden else out.logits
    pieces = [(first[:, -1:][mb.prompt_index], mb.completion_ids[:, :1])]  # predicts the first token
    if mb.completion_ids.shape[1] > 1:
        full_mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask[:, :-1]], dim=1)
        positions = positions_from_mask(full_mask)[:, mb.prompt_mask.shape[1] :]
        rest = model(
            input_ids=mb.completion_ids[:, :-1],
            attention_mask=full_mask,
            position_ids=positions,
            use_cache=True,
            **{cache_kwarg(model): cache},
            **head,
        )
        pieces.append((final_hidden(rest) if hidden else rest.logits, mb.completion_ids[:, 1:]))
    return pieces


def active_dropout(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now drops activations: a dropout layer with ``p > 0`` in train mode (the
    policy's own dropout is zeroed at load, ``lit_grpo.models.loading.disable_dropout``; LoRA's ``lora.dropout`` is
    not)."""
    return any(isinstance(m, _DropoutNd) and m.training and m.p > 0 for m in model.modules())


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Every dropout layer of ``model`` in eval mode inside the block, restored after. Only the dropout layers:
    the model keeps its train mode, so activation checkpointing (which keys off it) takes the same code path as
    the gradient pass and a dropout-free forward gives the same numbers as one with ``p = 0``."""
    switched = [m for m in model.modules() if isinstance(m, _DropoutNd) and m.training]
    for module in switched:
        module.training = False
    try:
        yield
    finally:
        for module in switched:
            module.training = True


class _ValueOfFirst(torch.autograd.Function):
    """``value`` forward, the gradient to ``carrier`` backward (a straight-through substitution). Written as a
    function rather than ``value + (carrier - carrier.detach())`` so that the value is exact also where the
    carrier is infinite."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, carrier: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return value.to(carrier.dtype).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:  # noqa: ANN001
        return None, grad


def policy_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
    packed: bool = False, head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs a gradient pass feeds the loss: :func:`completion_logprobs`, or, when ``model`` has active
    dropout and grad is on, log-probs whose *values* are the policy's without dropout (a no-grad pass inside
    :func:`dropout_off`) and whose *gradient* is that of a forward with dropout.

    Why: the ratio pi / alpha of eq. 6 and the TV terms of Theorem 1 compare the policy with the sampler, which
    samples and scores without dropout. With dropout in the numerator, the ratio at v = 1, i = 1 would be a random
    mask's, not 1; with the substitution it is exactly 1 there (and pi_k, the first iteration's values, is the
    policy itself), while the update still gets dropout's noisy gradient, ``ratio * A * grad log pi_dropout``.
    Costs one extra no-grad forward per micro-batch; without dropout nothing changes. The entropy comes from the
    dropout-free pass; one with a gradient (``entropy_grad``, an entropy bonus) from the pass with dropout, the
    pass that carries gradients."""
    chunks = {"packed": packed, "head_chunk_mb": head_chunk_mb}
    if not (torch.is_grad_enabled() and active_dropout(model)):
        return completion_logprobs(model, mb, temperature, with_entropy, entropy_grad, **chunks)
    with torch.no_grad(), dropout_off(model):
        value, entropy = completion_logprobs(model, mb, temperature, with_entropy and not entropy_grad, **chunks)
    carrier, carried_entropy = completion_logprobs(model, mb, temperature, with_entropy and entropy_grad,
                                                   entropy_grad, **chunks)
    return _ValueOfFirst.apply(value, carrier), carried_entropy if entropy_grad else entropy
