"""The rollout-engine interface shared by the in-process transformers engine and the vLLM engine.

An engine holds *its own* weights (the rollout policy alpha). They change only through ``load_weights``,
which the ``WeightSync`` callback calls every v steps; between syncs alpha lags the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled. Log-probs everywhere are those of ``softmax(logits / temperature)``."""

    max_new_tokens: int = 200
    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """One sampled completion: its tokens, their log-probs under the engine's weights, and whether it was cut
    at ``max_new_tokens`` before an end-of-sequence token."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool
    #: the weight versions that sampled its tokens, one per span in order, as a rollout server reports them
    #: (one when no weight update interrupted it; empty for the in-process engines)
    versions: tuple[str, ...] = ()


class RolloutEngine(ABC):
    """Generates completions with its own copy of the weights."""

    #: optimizer step of the policy whose weights the engine holds (set by ``load_weights``)
    synced_step: int = 0

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[list[Completion]]:
        """``n`` completions for each tokenized prompt, reproducible for a given ``seed``."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Replace the engine's weights by the given full tensors (HF parameter names); record ``step``."""

    def score(self, batch, temperature: float) -> torch.Tensor | None:  # noqa: ANN001 (RolloutBatch; avoids a cycle)
        """Log-probs ``[S, C]`` of the batch's completions under the engine's weights, recomputed with the same
        micro-batch layout the trainer uses; ``None`` when the engine cannot (then the sampler's are used)."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The engine's weights, for an exact resume while they lag the policy; ``None`` if not readable."""
        return None

    def load_state_dict(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.load_weights(state.items(), step)

    def to(self, device: torch.device | str) -> RolloutEngine:
        """Move the engine next to the trainer's device (no-op for engines that place themselves)."""
        return self
