"""What vLLM's CPU build needs to sample a GRPO batch, set by the colocated engine and named by the docs for
``vllm serve`` (docs/vllm.md, "On a CPU").

- **No chunked prefill.** The rollouts are seeded requests. When a prefill does not fit the step's token budget,
  vLLM schedules part of it and rewinds that request's generator afterwards (``gen.set_offset``), which a CPU
  generator cannot do: the step dies with ``CPU Generator does not use offset``. At the demo's 16 prompts x 8 the
  prompts exceed the CPU default budget (4,096 tokens in the trainer's process, 2,048 for ``vllm serve``), so it
  happened on the first batch. With chunked prefill off, a prompt that does not fit waits for the next step whole.
- **A token budget of at least the longest sequence** (vLLM's rule when chunked prefill is off).
- **A KV cache of a set size.** vLLM's CPU build otherwise sizes its cache from the host's free memory
  (``gpu_memory_utilization`` of it: 0.3 colocated, 0.9 for ``vllm serve``, 17.65 GiB of a 24 GiB machine),
  which leaves the trainer beside it too little.
"""

from __future__ import annotations

from typing import Any

#: the KV cache a CPU vLLM gets unless told otherwise: 2 GiB hold about 45,000 tokens of SmolLM2-135M in float32,
#: the demo's 128 sequences of up to ~350 tokens
CPU_KV_CACHE_BYTES = 2 << 30
#: the scheduler's token budget per step on a CPU, unless told otherwise
CPU_MAX_NUM_BATCHED_TOKENS = 8192


def cpu_llm_defaults(options: dict[str, Any], max_model_len: int | None, kv_cache_env: str | None) -> dict[str, Any]:
    """``vllm.LLM`` arguments for the CPU build that ``options`` (the user's ``llm_kwargs``) does not set:
    chunked prefill off, a token budget of at least ``max_model_len``, and :data:`CPU_KV_CACHE_BYTES` of KV cache
    unless ``$VLLM_CPU_KVCACHE_SPACE`` (``kv_cache_env``, GiB) already sizes it."""
    defaults: dict[str, Any] = {"enable_chunked_prefill": False,
                                "max_num_batched_tokens": max(CPU_MAX_NUM_BATCHED_TOKENS, int(max_model_len or 0))}
    if not kv_cache_env:
        defaults["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return {key: value for key, value in defaults.items() if key not in options}


#: the same settings as ``vllm serve`` flags (docs/vllm.md and docs/rollout-server.md print them)
SERVE_CPU_FLAGS = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", str(CPU_MAX_NUM_BATCHED_TOKENS),
                   "--kv-cache-memory-bytes", "2G")
