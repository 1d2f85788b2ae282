"""Token log-probs of completions under a causal LM, with one prompt forward shared by its completions."""

from __future__ import annotations

import torch
from torch import nn

from lit_grpo.batch import MicroBatch
from lit_grpo.math.logprobs import selective_log_softmax, token_entropy


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
    """
    out = model(
        input_ids=mb.prompt_ids,
        attention_mask=mb.prompt_mask,
        position_ids=positions_from_mask(mb.prompt_mask),
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.batch_select_indices(mb.prompt_index)
    logits = out.logits[:, -1:][mb.prompt_index]  # predicts the first completion token
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
        logits = torch.cat([logits, rest], dim=1)
    logp = selective_log_softmax(logits, mb.completion_ids, temperature)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = token_entropy(logits.detach(), temperature)
    return logp, entropy
