"""The rollout-engine contract: what the data module and the callbacks rely on, and all an engine implements.

- ``RolloutEngine``: every engine (the in-process transformers engine, colocated vLLM, rollout servers). It holds
  *its own* weights (the rollout policy alpha); they change only through ``load_weights``, which the
  ``WeightSync`` callback calls every v steps, so between syncs alpha lags the policy.
- ``RemoteEngine``: what an engine in other processes adds (rollout servers over HTTP, ``lit_grpo.engines.remote``):
  generation in two steps, so that a background thread can run the first (``request_rollouts``: no collective;
  ``check_lockstep``: the ranks' agreement, on the training thread), and hooks every rank runs before a weight push
  (``before_push``).
- ``ReferenceServing``: what an engine that also holds pi_ref adds (``data.reference_on_server``): ``WeightSync``
  pushes pi_ref into it, the data module asks it for pi_ref's log-probs of each batch.
- ``AdapterEngine``: what an engine that takes LoRA adapters adds (``model.lora``): instead of the full weights,
  ``WeightSync`` sends an ``AdapterUpdate`` (the merges into the base the engine has not applied yet, the adapter,
  and the hash of the trainer's base after those merges), and the engine counts the merges it applied
  (``merges_applied``) so that the next update carries only the newer ones.

A new engine implements ``RolloutEngine`` (and ``RemoteEngine`` / ``ReferenceServing`` / ``AdapterEngine`` when it
lives elsewhere, scores pi_ref or takes adapters); nothing else of it is read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.chunked_head import DEFAULT_HEAD_CHUNK_MB
from lit_grpo.models.lora import AdapterUpdate  # noqa: F401 (one LoRA push: defined beside the functions that build it)


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
    #: a multi-turn trajectory: 1 per token the model sampled, 0 per token of the environment's messages between its
    #: turns (whose ``logprobs`` are 0); ``None``: every token is the model's (a single turn)
    mask: tuple[int, ...] | None = None
    #: a multi-turn trajectory's record as plain data (messages, rewards, turns, counts:
    #: ``lit_grpo.data.multi_turn.Trajectory``); ``None`` for a single turn
    trajectory: dict | None = None
    #: how many tokens each entry of ``versions`` sampled, in order (partial rollouts, ``data.partial_rollouts``: a
    #: weight push landed mid-generation); empty: one span covering every token
    span_lengths: tuple[int, ...] = ()
    #: the URL of the rollout server that sampled it (``None``: an in-process engine, or a router's answer); not
    #: part of its value: the same tokens sampled elsewhere are the same completion
    server: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Rollouts:
    """What one rank's request for a batch brought back: ``groups`` (``n`` completions per prompt, in prompt order)
    when it succeeded; else ``groups`` is ``None`` and ``error`` says why (naming the server)."""

    groups: list[list[Completion]] | None
    error: str | None = None
    #: pi_ref's log-probs of the completions ``[S, C]`` in ``pad_rollouts``' layout and pi_ref's version, when the
    #: server scored them too (``data.reference_on_server``)
    reference: tuple[torch.Tensor, str] | None = None
    reference_seconds: float = 0.0  # how long the server took to score them


class ScoringLayout(Protocol):
    """Padded completions as the trainer lays them out (a ``RolloutBatch``, or the padded rollouts it is built
    from): ``score`` runs over exactly these micro-batches."""

    @property
    def completion_ids(self) -> torch.Tensor: ...

    def micro_batches(self) -> Iterator[MicroBatch]: ...


class RolloutEngine(ABC):
    """Generates completions with its own copy of the weights."""

    #: optimizer step of the policy whose weights the engine holds (set by ``load_weights``)
    synced_step: int = 0
    #: the engine's log-probs are the trainer's function of the same weights, so when it holds the policy's
    #: current weights alpha = pi_k and the trainer's first forward gives alpha's log-probs
    #: (``data.reuse_policy_logprobs``); ``False``: the sampler's own log-probs are alpha's
    rescore: bool = False
    #: MiB of float32 logits past which the recompute of alpha (``score``) runs the lm head in chunks: the
    #: trainer's ``model.head_chunk_mb`` (set when the data module builds the engine), so that both passes see the
    #: same chunks and alpha = pi_k holds to the bit when the engine holds the policy's weights
    head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB

    @abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[list[Completion]]:
        """``n`` completions for each tokenized prompt, reproducible for a given ``seed``."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Replace the engine's weights by the given full tensors (HF parameter names); record ``step``."""

    def score(self, layout: ScoringLayout, temperature: float) -> torch.Tensor | None:
        """Log-probs ``[S, C]`` of the layout's completions under the engine's weights, recomputed over the
        layout's padded micro-batches (the trainer's, unless ``model.packing`` packs its own); ``None`` when the
        engine cannot (then the sampler's are used)."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The engine's weights, for an exact resume while they lag the policy; ``None`` if not readable."""
        return None

    def load_state_dict(self, state: dict[str, torch.Tensor], step: int) -> None:
        self.load_weights(state.items(), step)

    def to(self, device: torch.device | str) -> RolloutEngine:
        """Move the engine next to the trainer's device (no-op for engines that place themselves)."""
        return self


class RemoteEngine(RolloutEngine):
    """An engine in other processes: generation is a request (no collective, so a background thread may send it)
    followed by the ranks' agreement on the training thread, and a weight push waits for the ``before_push``
    hooks first (the asynchronous producer's drain)."""

    #: called on every rank before each weight push, in order
    before_push: list[Callable[[], None]]

    @abstractmethod
    def request_rollouts(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
                         sessions: Sequence[Hashable] | None = None) -> Rollouts:
        """This rank's request, no torch.distributed call; a failed request comes back as ``Rollouts.error``.
        ``sessions``: the multi-turn session of each prompt, for engines that keep a session on one server
        (``ServerEngine``); the caller releases them (``release_sessions``) when they end."""

    def release_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Forget ``sessions`` (their trajectories ended). Engines without sessions have nothing to forget."""

    @abstractmethod
    def check_lockstep(self, rollouts: Rollouts) -> list[list[Completion]]:
        """On the training thread: raise on every rank when any rank's request failed, else the completions."""

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[list[Completion]]:
        """``request_rollouts``, then ``check_lockstep``."""
        return self.check_lockstep(self.request_rollouts(prompts, n, sampling, seed))


@runtime_checkable
class ReferenceServing(Protocol):
    """An engine that holds a copy of pi_ref and scores it (``data.reference_on_server``)."""

    #: the data module asks for pi_ref's log-probs from this engine: ``WeightSync`` keeps its copy current
    serves_reference: bool
    #: the label of the pi_ref pushed to it (``None``: none yet, or the last push failed)
    reference_version: str | None

    def load_reference(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Replace the engine's pi_ref by the given full tensors, labelled ``version``."""
        ...

    def score_reference(self, micro_batches: list[MicroBatch], num_sequences: int, width: int, temperature: float,
                        autocast: str | None = None) -> tuple[torch.Tensor, str]:
        """pi_ref's log-probs ``[num_sequences, width]`` of the completions in ``micro_batches`` (under ``autocast``,
        the trainer's mixed-precision dtype, when given), and the version of pi_ref that computed them."""
        ...


@runtime_checkable
class EngineSyncer(Protocol):
    """Something that loads the policy's weights into the rollout engine during a fit: ``WeightSync``, or a callback
    (or LightningModule) of one's own that says so with ``syncs_rollout_engine = True``. The data module looks for one
    among the trainer's callbacks and on the module when a fit starts and warns when there is none: the engine would
    keep the weights it started with, so every batch would come from the initial policy."""

    syncs_rollout_engine: bool


@runtime_checkable
class AdapterEngine(Protocol):
    """An engine that takes LoRA adapters (``model.lora``): it holds a base and an adapter of the policy's spec and
    samples with both, unmerged."""

    #: how many of the trainer's merges (``lit_grpo.models.lora.merge_log(policy).entries``) its base holds: the next
    # update
    #: carries ``entries[merges_applied:]``
    merges_applied: int

    def load_adapter(self, update: AdapterUpdate, step: int) -> None:
        """Apply ``update.merges`` to the base, check ``update.base_hash`` (a ``ValueError`` naming both hashes when
        they differ; the engine is then left unchanged where it can be), load ``update.adapter``, record ``step``."""
        ...
