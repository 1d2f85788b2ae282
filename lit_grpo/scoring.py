"""Token log-probs of completions under a causal LM, with one prompt forward shared by its completions."""

from __future__ import annotations

import torch
from torch import nn

from lit_grpo.batch import MicroBatch
from lit_grpo.math.logprobs import selective_log_softmax_with_normaliser, token_entropy


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for left-padded rows: 0 at the first real token."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)`` of each completion token, shape ``[s, C']``, and optionally the entropy.

    The prompt is run once per distinct prompt; its KV cache is then indexed out to the completions that
    share it (a differentiable gather), and the completions run on top. This is the same computation as a
    forward over ``prompt + completion`` per row, with G times less work on the prompt.

    Under activation checkpointing (a training-mode model with ``gradient_checkpointing_enable()``) there is no
    KV cache to share, so each row runs as one cacheless forward over ``prompt + completion`` instead: the same
    function, with the prompt computed G times (see :func:`checkpointing_drops_cache`).
    """
    if checkpointing_drops_cache(model):
        pieces = [(_logits_without_cache(model, mb), mb.completion_ids)]
    else:
        pieces = _logits_with_shared_prompt(model, mb)
    # one piece at a time: concatenating the logits would copy the largest tensor of the update
    logps, entropies = [], []
    for logits, tokens in pieces:
        logp, normaliser = selective_log_softmax_with_normaliser(logits, tokens, temperature)
        logps.append(logp)
        if with_entropy:
            entropies.append(token_entropy(logits.detach(), temperature, normaliser))
    return torch.cat(logps, dim=1), torch.cat(entropies, dim=1) if with_entropy else None


def checkpointing_drops_cache(model: nn.Module) -> bool:
    """Whether transformers will refuse a KV cache in this model's forward.

    With activation checkpointing on and the model in train mode, transformers (checked against 5.23) turns
    ``use_cache`` off in the model's forward and, in every checkpointed decoder layer, replaces
    ``past_key_values`` with ``None`` (a layer recomputed in the backward pass would append its keys and values
    to the cache a second time). An explicit ``DynamicCache`` is dropped the same way, whatever the
    checkpoint's reentrancy, so prefix sharing cannot work there: the prompt pass returns no cache at all.
    """
    return model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _logits_without_cache(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """Logits predicting each completion token from one forward over ``prompt + completion[:-1]`` per row."""
    completion_len = mb.completion_ids.shape[1]
    input_ids = torch.cat([mb.prompt_ids[mb.prompt_index], mb.completion_ids[:, :-1]], dim=1)
    full_mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask[:, :-1]], dim=1)
    # the last C' positions: the last prompt token, then every completion token but the last
    return model(
        input_ids=input_ids,
        attention_mask=full_mask,
        position_ids=positions_from_mask(full_mask),
        use_cache=False,
        logits_to_keep=completion_len,
    ).logits


def _logits_with_shared_prompt(model: nn.Module, mb: MicroBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same logits, with one prompt forward per distinct prompt and its KV cache shared by the rows, as
    ``(logits, tokens they predict)`` pieces: the first completion token (from the prompt pass), then the rest."""
    out = model(
        input_ids=mb.prompt_ids,
        attention_mask=mb.prompt_mask,
        position_ids=positions_from_mask(mb.prompt_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.batch_select_indices(mb.prompt_index)
    pieces = [(out.logits[:, -1:][mb.prompt_index], mb.completion_ids[:, :1])]  # predicts the first token
    if mb.completion_ids.shape[1] > 1:
        full_mask = torch.cat([mb.prompt_mask[mb.prompt_index], mb.completion_mask[:, :-1]], dim=1)
        positions = positions_from_mask(full_mask)[:, mb.prompt_mask.shape[1] :]
        rest = model(
            input_ids=mb.completion_ids[:, :-1],
            attention_mask=full_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).logits
        pieces.append((rest, mb.completion_ids[:, 1:]))
    return pieces
