"""Before the first step: does the update of the largest micro-batch the data can form fit this machine's memory?

A fit whose micro-batch cannot fit is otherwise killed by the kernel (or by CUDA's allocator) minutes in, after its
first rollout, with no word from the library. The check measures instead of modelling each family: it runs the
module's own scoring (its layout, precision, checkpointing, LoRA) forward and backward on two small synthetic
micro-batches and counts the bytes the operators allocate (:class:`lit_grpo.core.peak_memory.PeakLiveBytes`). The
bytes per token are the growth, between the probes, of what the forward leaves alive for the backward (the saved
activations). The need it checks is a lower bound: those activations at the micro-batch's tokens, one float32
vocabulary-sized row per token of the lm head's chunk (the logits; the full logits without chunks), and the
optimizer's state, which from the second step on is alive through every forward. The weights' gradients and the
backward's transients come on top (measured on SmolLM2-135M's shape at 2,048 tokens: the bound is 84 % of the
peak without activation checkpointing, 34 % under it, where the forward keeps only the layers' inputs),
so the check never refuses a micro-batch that would fit.

The probes cost two forwards and backwards under a Python dispatch mode (seconds on a CPU for a 135M model), so
they run only when a generous bound computed from the config (:func:`rough_upper_bound`) does not already fit.

The micro-batch checked is the largest the configuration allows (the prompts not counted): ``data.micro_batch_tokens``
when set, else ``micro_batch_size`` completions of ``max_new_tokens``, within a step's completions. A fit whose
completions happen to stay short could run where that one cannot; it is refused all the same, as the first long
batch would kill it. Not checked: sharded or multi-process fits (a probe there would run collectives).

Generation's own memory is checked too, for the in-process engine (``data.engine: transformers``): its KV cache
holds, for every sequence decoding at once, keys and values of every attention layer at every position
(:func:`kv_cache_bytes`, eq.: rows x positions x layers x 2 x kv heads x head dim x bytes; a sliding layer holds
its window at most). The positions counted are the completion budget's, the prompts not counted: a lower bound
again, from the config alone, so it costs nothing. With ``data.max_staleness`` >= 1 generation overlaps the update
and the two needs add up; each is checked alone, so that bound is lower still.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lit_grpo.core.batch import MicroBatch, left_pad, micro_batch_views
from lit_grpo.core.peak_memory import PeakLiveBytes

#: the probes' tokens: one 16-token prompt and rows of completions summing to about these
PROBE_TOKENS = (64, 192)
#: the probes' lm head chunk, in tokens: one chunk for the first probe, three for the second
PROBE_HEAD_TOKENS = 64
#: float32 values a decoder layer keeps per token for the backward, per unit of ``hidden + intermediate`` size: about
#: 5.7 measured on SmolLM2-135M (30 layers, 1.4 MB per token); :func:`rough_upper_bound` takes 8
ROUGH_VALUES_PER_UNIT = 8
GIB = 1024**3


class UpdateMemoryError(MemoryError):
    """A fit's largest micro-batch cannot fit this machine's memory (one line, naming the options)."""


@dataclass(frozen=True)
class UpdateMemory:
    """The probes' result: a lower bound of the bytes a micro-batch of ``tokens`` needs, ``slope x tokens`` of saved
    activations beside the head's logits and the optimizer's state."""

    slope: float
    head_bytes_per_token: float  # one float32 vocabulary-sized row
    head_chunk_tokens: int | None  # None: the full logits, no chunks
    optimizer_bytes: int

    def need(self, tokens: int) -> float:
        head_tokens = tokens if self.head_chunk_tokens is None else min(tokens, self.head_chunk_tokens)
        return self.slope * tokens + self.head_bytes_per_token * head_tokens + self.optimizer_bytes

    def tokens_within(self, available: float) -> int:
        """The most tokens whose :meth:`need` stays within ``available`` (0 when none do)."""
        low, high = 0, 1 << 24
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.need(middle) <= available else (low, middle - 1)
        return low


def probe_micro_batch(vocab: int, tokens: int, device: torch.device, rows: int = 4) -> MicroBatch:
    """One 16-token prompt and ``rows`` completions of equal length, about ``tokens`` in all."""
    gen = torch.Generator().manual_seed(0)
    high = max(3, min(vocab, 1000))
    prompt_ids, prompt_mask = left_pad([torch.randint(0, high, (16,), generator=gen).tolist()], 0, device)
    length = max(1, (tokens - 16) // rows)
    completion_ids = torch.randint(0, high, (rows, length), generator=gen).to(device)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, torch.zeros(rows, dtype=torch.long, device=device),
                              completion_ids, torch.ones_like(completion_ids), rows)
    return mb


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the state an Adam-like optimizer makes at its first step (two tensors per parameter), for the
    parameters that hold none yet (a resumed fit's are already counted in the process)."""
    total = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and not optimizer.state.get(param):
                    total += 2 * param.numel() * param.element_size()
    return total


def probe_update_memory(model: nn.Module, score: Callable[[nn.Module, MicroBatch, float | None], torch.Tensor],
                        head_chunk_mb: float | None, optimizers: list[torch.optim.Optimizer]) -> UpdateMemory:
    """Run ``score(model, mb, head_chunk_mb)`` (the log-probs ``[s, C']``) forward and backward on the probes."""
    from lit_grpo.core.chunked_head import head_chunk_tokens, unwrapped_model

    config = unwrapped_model(model).config
    vocab = int(config.vocab_size)
    device = next(model.parameters()).device
    probe_mb = PROBE_HEAD_TOKENS * vocab * 4 / 2**20  # a budget of PROBE_HEAD_TOKENS float32 rows
    probes = []
    for tokens in PROBE_TOKENS:
        mb = probe_micro_batch(vocab, tokens, device)
        with PeakLiveBytes() as meter:
            logp = score(model, mb, probe_mb)
            saved = meter.live  # what the forward keeps for the backward
            (logp * mb.completion_mask).sum().backward()
            del logp
        model.zero_grad(set_to_none=True)
        probes.append((int(mb.completion_mask.numel()) + 16, saved))
    (n0, saved0), (n1, saved1) = probes
    return UpdateMemory(slope=max(0.0, (saved1 - saved0) / (n1 - n0)), head_bytes_per_token=4 * vocab,
                        head_chunk_tokens=head_chunk_tokens(model, head_chunk_mb) if head_chunk_mb else None,
                        optimizer_bytes=optimizer_state_bytes(optimizers))


def rough_upper_bound(config: object, tokens: int, trainable_bytes: int, head_chunk: int | None) -> float | None:
    """A generous bound of the update's need from the config alone (:data:`ROUGH_VALUES_PER_UNIT` float32 values
    per token, layer and unit of ``hidden + intermediate``, the weights' gradients, an Adam state, the head's chunk),
    or None for a config without those sizes."""
    sizes = [getattr(config, name, None) for name in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                       "vocab_size")]
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        return None
    layers, hidden, intermediate, vocab = sizes
    head_tokens = tokens if head_chunk is None else min(tokens, head_chunk)
    return (4.0 * tokens * layers * ROUGH_VALUES_PER_UNIT * (hidden + intermediate) + 3 * trainable_bytes
            + 2 * 4 * vocab * head_tokens)


def available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on ``device``: CUDA's free memory plus what its allocator caches unused;
    on a CPU the kernel's ``MemAvailable``. None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def update_too_large(memory: UpdateMemory, tokens: int, available: int, where: str) -> str | None:
    """One line when a micro-batch of ``tokens`` cannot fit in ``available`` bytes (``where`` names the bound's
    source, e.g. ``data.micro_batch_tokens=16384``), naming what brings it down; None when it fits."""
    need = memory.need(tokens)
    if need <= available:
        return None
    fits = memory.tokens_within(0.6 * available)  # the bound is below the need: leave room for what it leaves out
    fix = (f"set data.micro_batch_tokens to at most about {fits}" if fits > 0 else
           "no micro-batch fits as configured: free memory or use a smaller model")
    return (f"the update of a micro-batch of {tokens} tokens ({where}) needs at least {_size(need)} beyond what this "
            f"process holds (measured: {memory.slope / 2**20:.3f} MiB of activations per token, plus the optimizer's "
            f"state and the lm head's logits), and {_size(available)} are available; {fix}, or bring the per-token "
            "cost down with model.gradient_checkpointing: true (or selective, or a smaller model.head_chunk_mb)")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.0f} MiB"


def micro_batch_bound(micro_batch_tokens: int | None, micro_batch_size: int, max_new_tokens: int,
                      rows_per_step: int | None = None) -> tuple[int, str]:
    """A lower bound of the largest micro-batch's tokens a fit can form, and where it comes from: the budget
    ``data.micro_batch_tokens``, or ``micro_batch_size`` completions of ``max_new_tokens``, but never more than a
    step's ``rows_per_step`` completions of ``max_new_tokens`` hold (the prompts not counted)."""
    step = None if rows_per_step is None else rows_per_step * max_new_tokens
    if micro_batch_tokens is not None and (step is None or micro_batch_tokens <= step):
        return micro_batch_tokens, f"data.micro_batch_tokens={micro_batch_tokens}"
    rows = micro_batch_size if rows_per_step is None else min(micro_batch_size, rows_per_step)
    what = "data.micro_batch_size" if rows == micro_batch_size else "a step's completions"
    return rows * max_new_tokens, (f"{what}={rows} x data.max_new_tokens={max_new_tokens}, prompts not counted")


#: the attention layer kinds whose cache :func:`kv_cache_bytes` knows (other kinds, e.g. linear attention's state,
#: are left out: a lower bound)
KV_LAYER_KINDS = ("full_attention", "sliding_attention")


def kv_cache_bytes(config: object, rows: int, positions: int, element_size: int) -> int | None:
    """Bytes of a decoder's KV cache for ``rows`` sequences of ``positions`` tokens: per layer 2 (keys and values)
    x ``num_key_value_heads`` x ``head_dim`` x ``element_size`` per position. A sliding layer keeps its
    ``sliding_window - 1`` latest positions (transformers' ``DynamicSlidingWindowLayer``); a config with a window
    and no ``layer_types`` (Mistral's) slides on every layer. None for a config without those sizes (the check then
    skips generation)."""
    config = getattr(config, "text_config", None) or config
    layers, heads, hidden = (getattr(config, name, None) for name in ("num_hidden_layers", "num_attention_heads",
                                                                       "hidden_size"))
    if not all(isinstance(size, int) and size > 0 for size in (layers, heads, hidden)):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or [KV_LAYER_KINDS[1 if window else 0]] * layers
    total = 0
    for kind in kinds[:layers]:
        if kind == "full_attention" or (kind == "sliding_attention" and not window):
            total += positions
        elif kind == "sliding_attention":
            total += min(positions, int(window) - 1)
    return rows * total * 2 * kv_heads * head_dim * element_size


def generation_too_large(config: object, rows: int, max_new_tokens: int, element_size: int, available: int,
                         where: str) -> str | None:
    """One line when the KV cache of ``rows`` sequences decoding ``max_new_tokens`` each at once cannot fit in
    ``available`` bytes (``where`` names where the rows come from), naming what brings it down; None when it fits
    or the config does not say."""
    need = kv_cache_bytes(config, rows, max_new_tokens, element_size)
    per_row = kv_cache_bytes(config, 1, max_new_tokens, element_size)
    if need is None or not per_row or need <= available:
        return None
    fits = int(0.6 * available // per_row)  # prompts and the decode step's transients come on top
    fix = (f"set data.engine_options.max_num_seqs to at most about {fits} (sequences decoding at once)" if fits else
           "lower data.max_new_tokens")
    return (f"generating {rows} sequences of {max_new_tokens} new tokens at once ({where}) needs at least "
            f"{_size(need)} of KV cache ({_size(per_row)} a sequence, prompts not counted), and {_size(available)} "
            f"are available; {fix}")


def check_generation_memory(module: object, trainer: object) -> None:
    """Raise :class:`UpdateMemoryError` with :func:`generation_too_large`'s line when the in-process engine's KV
    cache for a step's sequences cannot fit (one process; read duck-typed off the data module)."""
    from lit_grpo.core.chunked_head import unwrapped_model

    data = getattr(trainer, "datamodule", None)
    sampling = getattr(data, "sampling", None)
    if getattr(trainer, "world_size", 1) != 1 or sampling is None or getattr(data, "engine_kind", None) != \
            "transformers":
        return
    sequences = int(data.prompts_per_step) * int(data.num_generations)
    cap = getattr(getattr(data, "engine_options", None), "max_num_seqs", None)
    rows, where = ((cap, f"data.engine_options.max_num_seqs={cap}") if cap is not None and cap < sequences else
                   (sequences, f"data.prompts_per_step={data.prompts_per_step} x "
                               f"data.num_generations={data.num_generations}"))
    param = next(module.policy.parameters())
    element = param.element_size()
    if "16" in str(getattr(trainer, "precision", "")) or getattr(data.engine_options, "sampler_autocast", None):
        element = min(element, 2)  # sampled under autocast: the projections write half-precision keys and values
    available = available_bytes(param.device)
    if available is None:
        return
    line = generation_too_large(unwrapped_model(module.policy).config, rows, sampling.max_new_tokens, element,
                                available, where)
    if line is not None:
        raise UpdateMemoryError(line)


def check_update_memory(module: object, trainer: object) -> None:
    """Raise :class:`UpdateMemoryError` with :func:`update_too_large`'s line when the fit's largest micro-batch
    cannot fit; a fit of one process only (see the module docstring), read duck-typed off the data module."""
    from lit_grpo.core.distributed import is_sharded
    from lit_grpo.core.scoring import policy_logprobs

    data = getattr(trainer, "datamodule", None)
    sampling = getattr(data, "sampling", None)
    if getattr(trainer, "world_size", 1) != 1 or sampling is None or is_sharded(module.policy):
        return
    rows = getattr(data, "prompts_per_step", None), getattr(data, "num_generations", None)
    tokens, where = micro_batch_bound(getattr(data, "micro_batch_tokens", None), data.micro_batch_size,
                                      sampling.max_new_tokens, rows[0] * rows[1] if None not in rows else None)
    device = next(module.policy.parameters()).device
    available = available_bytes(device)
    if available is None:
        return
    hp = module.hparams
    from lit_grpo.core.chunked_head import head_chunk_tokens, unwrapped_model

    head_mb = module.scoring["head_chunk_mb"]
    trainable = sum(p.numel() * p.element_size() for p in module.policy.parameters() if p.requires_grad)
    bound = rough_upper_bound(unwrapped_model(module.policy).config, tokens, trainable,
                              head_chunk_tokens(module.policy, head_mb) if head_mb else None)
    if bound is not None and bound <= available:
        return  # fits even by the generous bound: no probe

    def score(model: nn.Module, mb: MicroBatch, head_chunk_mb: float | None) -> torch.Tensor:
        scoring = {**module.scoring, "head_chunk_mb": head_chunk_mb}
        return policy_logprobs(model, mb, hp.temperature, with_entropy=True,
                               entropy_grad=getattr(module, "entropy_coef", 0.0) != 0.0, **scoring)[0]

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), trainer.precision_plugin.train_step_context():
        memory = probe_update_memory(module.policy, score, head_mb, trainer.optimizers)
    if (message := update_too_large(memory, tokens, available, where)) is not None:
        raise UpdateMemoryError(message)
