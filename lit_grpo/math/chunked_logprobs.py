"""Log-probs and entropy of ``softmax(head(h) / T)`` from hidden states, a chunk of tokens at a time, so that no
vocabulary-sized tensor covers more than one chunk.

The logits of a language model are ``tokens x V`` (at Qwen2.5's V = 151,936, 0.61 MB per token in float32), and
the plain path (:mod:`lit_grpo.math.logprobs`) keeps them, upcast to float32, for the backward pass, which writes a
gradient of the same size: a 4,096-token row holds about 5 GB for its head alone. Here the head runs on one chunk of
hidden states at a time (``[n, H]``, with ``H`` in the hundreds or thousands), the chunk's log-probs and entropy come
out, and its logits are dropped. With autograd recording, each chunk runs under non-reentrant activation
checkpointing (:func:`torch.utils.checkpoint.checkpoint`): the forward keeps only the chunk's hidden states, and
the backward recomputes that chunk's logits, takes their gradient and writes it to the hidden states and the head's
weights, chunk by chunk (the scheme of chunked losses such as Liger's fused linear ones). The working set
is a few chunks of logits, whatever the number of tokens. The recompute costs one more head matmul per token
(``2 H V`` FLOPs), a third of the head's forward and backward.

The math of a chunk is that of :mod:`lit_grpo.math.logprobs` (the same functions), in float32 with autocast off:
the head's matmul runs in the autocast dtype, its logits are upcast, and every normaliser and sum is a float32 one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from lit_grpo.math.logprobs import logprobs_and_entropy, upcast

#: bytes of one float32 logit: the unit of a chunk's budget
LOGIT_BYTES = 4


def chunk_tokens_for(vocab_size: int, budget_mb: float) -> int:
    """Tokens per chunk whose float32 logits (``tokens x vocab_size x 4`` bytes) fit ``budget_mb`` MiB, at least 1."""
    if not budget_mb > 0:
        raise ValueError(f"a head chunk's budget must be > 0 MiB, got {budget_mb}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return max(1, int(budget_mb * (1 << 20)) // (LOGIT_BYTES * vocab_size))


def _chunk(hidden: torch.Tensor, tokens: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
           transform: Callable[[torch.Tensor], torch.Tensor] | None, temperature: float, with_entropy: bool,
           entropy_grad: bool) -> tuple[torch.Tensor, ...]:
    """One chunk: ``(log-probs,)`` or ``(log-probs, entropy)`` of ``hidden [n, H]`` predicting ``tokens [n]``."""
    logits = head(hidden)  # in the autocast dtype, as the model's own head would run
    with torch.autocast(device_type=logits.device.type, enabled=False):
        # float32 from here, normalisers and sums alike
        logits = upcast(logits)
        if transform is not None:
            logits = transform(logits)
        logp, entropy = logprobs_and_entropy(logits, tokens, temperature, with_entropy, entropy_grad)
    return (logp,) if entropy is None else (logp, entropy)


def chunked_logprobs(hidden: torch.Tensor, tokens: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                     temperature: float, chunk_tokens: int, with_entropy: bool = False, entropy_grad: bool = False,
                     transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(transform(head(hidden)) / T)[token]`` at each position, float32 of ``tokens``' shape, and
    optionally the entropy of that distribution (with its gradient when ``entropy_grad``: an entropy bonus; else a
    detached statistic), ``chunk_tokens`` positions at a time (see the module docstring).

    ``hidden`` is ``[..., H]`` with ``tokens``' leading shape; ``head`` maps ``[n, H]`` to ``[n, V]`` logits (the
    model's output embeddings), ``transform`` what the model does to its logits after the head (Granite's scaling,
    Gemma 2's soft cap), applied to float32 logits. With autograd recording a chunk keeps only its hidden states
    for the backward pass and recomputes its logits there."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if hidden.shape[:-1] != tokens.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match tokens {tuple(tokens.shape)}: expected "
                         "one hidden state per token, [..., H]")
    flat_hidden, flat_tokens = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1)
    args = (head, transform, float(temperature), with_entropy, entropy_grad)
    logps, entropies = [], []
    for part, part_tokens in zip(flat_hidden.split(chunk_tokens), flat_tokens.split(chunk_tokens)):
        if torch.is_grad_enabled():
            # the head's weights may want a gradient even where the hidden states do not (a frozen body)
            out = checkpoint(_chunk, part, part_tokens, *args, use_reentrant=False)
        else:
            out = _chunk(part, part_tokens, *args)
        logps.append(out[0])
        if with_entropy:
            entropies.append(out[1])
    if not logps:  # no token: empty float32 outputs of tokens' shape
        empty = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)
        return empty, empty.clone() if with_entropy else None
    logp = torch.cat(logps).reshape(tokens.shape)
    return logp, torch.cat(entropies).reshape(tokens.shape) if with_entropy else None
