"""Log-probabilities and entropy of the sampling distribution ``softmax(logits / temperature)``."""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[token]`` for each position, without materialising the full log-softmax.

    Importance ratios compare pi, pi_k and alpha under the distribution tokens are actually sampled from,
    so the same temperature divides the logits of all three.
    """
    logits = logits.float() / temperature
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / temperature)`` at each position (nats)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
