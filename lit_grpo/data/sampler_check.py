"""The first-push check: does the rollout engine sample from the distribution the trainer scores?

An engine other than the trainer's own (vLLM colocated, ``vllm serve``, the project's server) reports the log-prob
of each token it sampled; alpha's log-probs in eq. 6 are those. Right after the first push its weights are the
policy's, so they must equal the trainer's teacher-forced ``log softmax(logits / T)`` of the same tokens up to the
engines' numerics. What breaks that silently, and what this check catches on the first batch sampled by pushed
weights:

- a ``vllm serve`` started without ``--logprobs-mode processed_logprobs``: it samples at T but reports log-probs at
  temperature 1 (visible when T != 1);
- a server holding another model, or weights that did not arrive;
- a generation config that changes sampling (top-k, penalties, ...) reaching the sampler;
- a served dtype far coarser than the trainer's.

A rollout server that rejoins a fleet (``lit_grpo.engines.remote.fleet``: restarted, and pushed the weights anew)
arms the check again: the first batch sampled after that push is checked the same way, its completions from the
rejoined servers first (``Completion.server``).

The check teacher-forces ``sequences`` completions of that batch on the trainer, in the trainer's precision and
without dropout, and refuses the run in one line when the mean absolute gap per token exceeds ``max_gap``.
Measured with SmolLM2-135M on GSM8K prompts (``benchmarks/sampler_gap.py``, docs/vllm.md's table), mean |gap| per
token: float32 engines 2.3e-6 (in-process, project's server) and 1.5e-5 (vLLM); a bfloat16 sampler against a
float32 trainer 0.023 to 0.031; log-probs at T = 1 while sampling at 0.7: 0.19; a repetition penalty of 1.1: 0.54.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from lit_grpo.core.distributed import all_reduce
from lit_grpo.engines.base import Completion

#: the default bound on the mean |sampler - trainer| log-prob gap per token: twice the largest bfloat16 gap measured
#: (0.031, vLLM in bfloat16 against a float32 trainer), below every misconfiguration measured (0.12 and more)
DEFAULT_MAX_GAP = 0.06
DEFAULT_SEQUENCES = 4


class SamplerMismatchError(RuntimeError):
    """The rollout engine's log-probs are not the trainer's: one line saying what to check."""


@dataclass
class GapReport:
    """The check's result: mean absolute gap per token, the tokens compared, and the seconds it took."""

    mean_gap: float
    tokens: int
    seconds: float


@torch.no_grad()
def teacher_forced_logprobs(model: nn.Module, prompt: list[int], completion: list[int], temperature: float,
                            device: torch.device) -> torch.Tensor:
    """``log softmax(logits / T)`` of each completion token after the prompt and the tokens before it, float64:
    one plain forward over ``prompt + completion`` (independent of ``lit_grpo.core.scoring``'s shared-prompt
    path)."""
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1: -1].double() / temperature
    tokens = torch.tensor(completion, device=device)[:, None]
    return logits.log_softmax(-1).gather(-1, tokens)[:, 0]


def sampler_gap(model: nn.Module, prompts: list[list[int]], groups: list[list[Completion]], temperature: float,
                sequences: int, device: torch.device, prefer: frozenset[str] = frozenset()) -> tuple[float, int]:
    """Sum of |sampler log-prob - teacher-forced log-prob| over the model's tokens of the first ``sequences``
    completions (in prompt order, those sampled by a server in ``prefer`` first), and their number. Every rank runs
    the same number of forwards, so that a sharded policy's collectives stay in step."""
    rows = [(prompts[i], c) for i, group in enumerate(groups) for c in group]
    rows = sorted(rows, key=lambda row: row[1].server not in prefer)[:sequences]  # stable: prompt order otherwise
    total, count = 0.0, 0
    for prompt, completion in rows:
        if not completion.token_ids:
            model(input_ids=torch.tensor([list(prompt)], device=device), use_cache=False)  # keep the ranks in step
            continue
        expected = teacher_forced_logprobs(model, prompt, completion.token_ids, temperature, device)
        reported = torch.tensor(completion.logprobs, dtype=torch.float64, device=device)
        # a multi-turn trajectory: only the model's tokens have a sampler log-prob (the environment's are context)
        own = torch.ones_like(reported) if completion.mask is None else torch.tensor(
            completion.mask, dtype=torch.float64, device=device)
        total += float(((reported - expected).abs() * own).sum())
        count += int(own.sum())
    return total, count


def rejoined_servers(engine: object) -> list[str]:
    """The rollout servers that rejoined ``engine``'s fleet since the last call (``ServerEngine.take_rejoined``);
    none for an engine without a fleet."""
    take = getattr(engine, "take_rejoined", None)
    return list(take()) if callable(take) else []


def mismatch_message(gap: float, max_gap: float, engine: str, rejoined: list[str] | None = None) -> str:
    """The refusal: the gap, the bound, and the four things to check; ``rejoined``: the servers whose return armed
    the check again, named."""
    push = (f"the push that brought back {', '.join(rejoined)}" if rejoined else "the first weight push")
    return (f"the rollout engine ({engine}) does not sample what the trainer scores: right after {push} "
            f"its log-probs differ from the trainer's by {gap:.3g} per token on average, more than "
            f"data.sampler_check_max_gap={max_gap} (a bfloat16 sampler shows about 0.03); check that vllm serve "
            "runs with --logprobs-mode processed_logprobs, that it serves the policy's dtype (--dtype, "
            "engine_options.dtype) and the same model, and that the served "
            "generation config changes no sampling field (top_k, min_p, penalties)")


class SamplerCheck:
    """Runs once, on the first batch sampled by weights the trainer pushed and has not updated since, on every rank.

    Args:
        max_gap: the largest mean |sampler - trainer| log-prob gap per token accepted.
        sequences: how many completions (of each rank's batch) are teacher-forced.
    """

    def __init__(self, max_gap: float = DEFAULT_MAX_GAP, sequences: int = DEFAULT_SEQUENCES) -> None:
        self.max_gap = max_gap
        self.sequences = sequences
        self.done = False
        self.checks = 0  # how many batches were checked so far
        #: the servers whose rejoining armed the check again (``rearm``): their completions are checked first
        self.rejoined: frozenset[str] = frozenset()

    def rearm(self, servers: list[str]) -> None:
        """Check the next batch sampled by pushed weights again, ``servers``' completions first (rollout servers
        that rejoined the fleet in the last push); nothing when ``servers`` is empty. Every rank calls it with the
        same list (the push's outcome), so the ranks check the same batch."""
        if servers:
            self.done = False
            self.rejoined = self.rejoined | frozenset(servers)

    def __call__(self, model: nn.Module, prompts: list[list[int]], groups: list[list[Completion]],
                 temperature: float, device: torch.device, engine: str,
                 precision: Callable[[], AbstractContextManager]) -> GapReport:
        """Teacher-force, compare, and raise ``SamplerMismatchError`` when the gap is too large (on every rank: the
        sums are all-reduced first)."""
        start = time.perf_counter()
        was_training = model.training
        model.eval()  # no dropout: the sampler had none
        try:
            with precision():
                total, count = sampler_gap(model, prompts, groups, temperature, self.sequences, device,
                                           self.rejoined)
        finally:
            model.train(was_training)
        summed = all_reduce(torch.tensor([total, float(count)], dtype=torch.float64))
        gap = float(summed[0]) / max(float(summed[1]), 1.0)
        rejoined, self.done, self.rejoined = self.rejoined, True, frozenset()
        self.checks += 1
        report = GapReport(gap, int(summed[1]), time.perf_counter() - start)
        if gap > self.max_gap:
            raise SamplerMismatchError(mismatch_message(gap, self.max_gap, engine, sorted(rejoined)))
        return report
