"""The sampling contract every engine keeps: tokens are drawn from ``softmax(logits / T)``, restricted to the
nucleus ``top_p`` when it is below 1, and from nothing else, because the log-probs the loss uses (alpha's, eq. 6's
denominator) are those of that distribution.

The in-process engine and the project's server never read a model's generation config
(``lit_grpo.engines.static_decoding.sole_generation_config``). vLLM does: ``vllm serve`` defaults to
``--generation-config auto`` and fills every sampling field a request leaves unset from the model's
``generation_config.json`` (vLLM 0.32/0.33 ``ModelConfig.get_diff_sampling_param``: ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``max_new_tokens``).
Qwen2.5-Instruct's ships ``top_k: 20`` and ``repetition_penalty: 1.1``, for example. So both vLLM engines send every
one of those fields, the neutral value where the contract has none.
"""

from __future__ import annotations

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.wire.protocol import NEUTRAL_SAMPLING_FIELDS


def vllm_sampling_fields(sampling: SamplingConfig) -> dict[str, float | int]:
    """Every field vLLM could otherwise take from the model's generation config: the contract's temperature,
    ``top_p`` and ``max_tokens``, and the neutral value of the rest (the protocol's ``NEUTRAL_SAMPLING_FIELDS``)."""
    return {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
            "max_tokens": int(sampling.max_new_tokens), **NEUTRAL_SAMPLING_FIELDS}
