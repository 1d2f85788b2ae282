"""``KeptWeights``: a frozen copy, on the trainer, of the weights last pushed to the rollout servers
(``ServerOptions.keep_pushed_weights``), scored in the trainer's numerics to give alpha for the batches sampled with
that version: verl's decoupled mode, for a server that cannot rescore (``vllm serve``).

What is kept:

- a full push: every tensor the push sends, as the trainer holds it (its dtype, not the wire's), copied while the
  push iterates them (no second gather), into a frozen model of the policy's structure;
- a LoRA push (``AdapterUpdate``): the adapter tensors only. The base is the policy's own, frozen: the kept adapter is
  scored on it by writing the kept values into the policy's adapter for the pass and the policy's values back after
  (bitwise). A ``RefModelSwap`` merges the adapter into the policy's base, so once the policy's merge log is longer
  than it was at the push, base plus kept adapter is no longer what was pushed: ``score`` then answers ``None`` and
  alpha falls back to the sampler's report (``alpha_source`` ``sampler``) until the next push.

The copy lives on the policy's device (``trainer``) or in host memory (``cpu``, moved to the trainer's device for
each recompute and back). An unsharded policy only: under FSDP every rank would hold the whole model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.core.chunked_head import DEFAULT_HEAD_CHUNK_MB
from lit_grpo.core.distributed import is_sharded
from lit_grpo.core.scoring import layout_logprobs
from lit_grpo.engines.base import ScoringLayout
from lit_grpo.models.copies import materialize, skeleton_copy

#: the keys of ``KeptWeights.state_dict`` beside a kept adapter's tensors
LORA_SPEC_KEY = "lit_grpo.kept_lora_spec"
MERGES_KEY = "lit_grpo.kept_merges"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the given tensors' storage (tied tensors counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class KeptWeights:
    """The trainer's copy of the last pushed weights, and its recompute of their log-probs.

    Args:
        policy: returns the policy module (the structure a full copy takes, the base a kept adapter runs on).
        device: ``trainer`` (the policy's device) or ``cpu`` (host memory between recomputes).
    """

    def __init__(self, policy: Callable[[], nn.Module], device: str = "trainer") -> None:
        if device not in ("trainer", "cpu"):
            raise ValueError(f"kept_weights_device must be 'trainer' or 'cpu', got {device!r}")
        self._policy = policy
        self.where = device
        #: the weight version (optimizer step) the copy holds; ``None``: nothing valid is kept
        self.version: int | None = None
        self.model: nn.Module | None = None  # a full copy
        self.adapter: dict[str, torch.Tensor] | None = None  # a kept adapter (peft's saved names)
        self.adapter_spec: dict[str, Any] | None = None
        self.adapter_merges = 0  # the policy's merges its base held at the adapter's push
        self.copy_seconds = 0.0  # the copies of the pushes since ``stats`` was last read
        self.score_seconds = 0.0  # the recomputes since ``stats`` was last read
        self._seen: set[str] = set()
        self._copying_push = False  # the push in progress is copied into ``model``

    # ---- what is held -------------------------------------------------------------------------------
    def policy(self) -> nn.Module:
        policy = self._policy()
        if is_sharded(policy):
            raise ValueError("keep_pushed_weights needs an unsharded policy (one device or DDP): under FSDP every "
                             "rank would hold a full copy of the model")
        return policy

    def held(self) -> list[torch.Tensor]:
        if self.adapter is not None:
            return list(self.adapter.values())
        return [] if self.model is None else list(self.model.parameters())

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds (the adapter only with LoRA)."""
        return tensor_bytes(self.held())

    def stats(self) -> dict[str, float]:
        """The batch's statistics: ``kept_weights_bytes`` (held now), ``kept_weights_copy_seconds`` (the copies of the
        pushes since the last call) and ``alpha_recompute_seconds`` (the recomputes since the last call: this
        batch's). Each push and recompute is counted once, so their sums over a run are its totals."""
        out = {"kept_weights_bytes": float(self.nbytes), "kept_weights_copy_seconds": self.copy_seconds,
               "alpha_recompute_seconds": self.score_seconds}
        self.copy_seconds = self.score_seconds = 0.0
        return out

    def invalidate(self) -> None:
        """A push failed or sent something not kept: no version is held (``score`` answers ``None``)."""
        self.version = None

    # ---- a full push --------------------------------------------------------------------------------
    def keeping(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The push's tensors, each copied into the kept model as the push takes it (call ``commit`` after a push
        that went through). A LoRA policy's full push (``vllm serve``'s base reload) is not kept: its adapter push
        follows."""
        from lit_grpo.models.lora import is_lora

        self.invalidate()
        self._copying_push = False
        policy = self.policy()
        if is_lora(policy):
            return named_tensors
        if self.model is None:
            # storage of the policy's structure, straight where it lives: no intermediate host copy
            target = next(policy.parameters()).device if self.where == "trainer" else torch.device("cpu")
            self.model = materialize(skeleton_copy(policy), target).eval()
        self.adapter = self.adapter_spec = None
        self._seen = set()
        self._copying_push = True
        return self._copying(named_tensors)

    def _copying(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            start = time.perf_counter()
            mine = params.get(name)
            if mine is not None:  # an unknown name is reported by ``commit``, on every rank alike
                with torch.no_grad():
                    mine.copy_(tensor.detach().to(mine.device, mine.dtype))
                self._seen.add(name)
            else:
                self._seen.add(f"?{name}")
            self.copy_seconds += time.perf_counter() - start
            yield name, tensor

    def commit(self, step: int) -> None:
        """The push went through: the copy holds version ``step``. A ``KeyError`` when the push's names did not
        cover the policy's parameters exactly (every rank sees the same names, so every rank raises)."""
        if not self._copying_push:
            return  # a LoRA policy's full push: not kept
        self._copying_push = False
        start = time.perf_counter()
        if next(self.model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()  # the copies are asynchronous there: their time is the push's
        self.copy_seconds += time.perf_counter() - start
        unknown = sorted(n[1:] for n in self._seen if n.startswith("?"))
        missing = sorted(set(dict(self.model.named_parameters())) - self._seen)
        if unknown or missing:
            self.invalidate()
            raise KeyError(f"keep_pushed_weights: the push's tensors do not match the policy's parameters "
                           f"({'unknown ' + repr(unknown[0]) if unknown else 'missing ' + repr(missing[0])})")
        self.version = int(step)

    # ---- a LoRA push --------------------------------------------------------------------------------
    def keep_adapter(self, adapter: dict[str, torch.Tensor], spec: dict[str, Any], merges: int, step: int) -> None:
        """After an adapter push that went through: keep its tensors (the base is the policy's, holding ``merges``
        of its merge log)."""
        start = time.perf_counter()
        policy = self.policy()
        target = next(policy.parameters()).device if self.where == "trainer" else torch.device("cpu")
        # detached copies: the update's tensors may be the policy's own storage
        self.adapter = {name: t.detach().to(target, copy=True) for name, t in adapter.items()}
        self.adapter_spec = dict(spec)
        self.adapter_merges = int(merges)
        self.model = None  # a full copy left from before the policy got its adapter is freed
        self.copy_seconds += time.perf_counter() - start
        self.version = int(step)

    # ---- alpha --------------------------------------------------------------------------------------
    def score(self, layout: ScoringLayout, temperature: float, version: int,
              head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB) -> torch.Tensor | None:
        """Log-probs ``[S, C]`` of the layout's completions under the kept weights, over its padded micro-batches
        (``layout_logprobs``, the in-process engine's path), in the caller's precision context; ``None`` when
        the copy does not hold ``version`` or a merge changed the policy's base since the adapter's push.
        ``head_chunk_mb``: the trainer's lm head chunk budget."""
        if self.version is None or self.version != int(version):
            return None
        start = time.perf_counter()
        device = layout.completion_ids.device
        if self.adapter is not None:
            out = self._score_adapter(layout, temperature, device, head_chunk_mb)
        else:
            out = self._score_full(layout, temperature, device, head_chunk_mb)
        if out is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.score_seconds += time.perf_counter() - start
        return out


    def _score_full(self, layout: ScoringLayout, temperature: float, device: torch.device,
                    head_chunk_mb: float | None) -> torch.Tensor:
        model = self.model
        moved = self.where == "cpu" and device.type != "cpu"
        if moved:
            model.to(device)
        try:
            with torch.inference_mode():
                return layout_logprobs(model, layout, temperature, head_chunk_mb)
        finally:
            if moved:
                model.to("cpu")

    def _score_adapter(self, layout: ScoringLayout, temperature: float, device: torch.device,
                       head_chunk_mb: float | None) -> torch.Tensor | None:
        from lit_grpo.models.lora_layers import adapter_params, lora_layers
        from lit_grpo.models.lora_merge import merge_log

        policy = self.policy()
        if len(merge_log(policy)) != self.adapter_merges:
            return None  # its base is no longer the one the adapter was pushed against
        params = {f"{name}.{part}.weight": p for name, layer in lora_layers(policy)
                  for part, p in zip(("lora_A", "lora_B"), adapter_params(layer))}
        if set(params) != set(self.adapter):
            raise ValueError("keep_pushed_weights: the kept adapter does not fit the policy's adapter")
        was_training = policy.training
        with torch.no_grad():  # no inference tensors: the policy trains with its buffers afterwards
            saved = {name: p.detach().clone() for name, p in params.items()}
            try:
                for name, p in params.items():
                    p.copy_(self.adapter[name])
                policy.eval()  # the in-process engine's copy samples and scores in eval mode
                return layout_logprobs(policy, layout, temperature, head_chunk_mb)
            finally:
                policy.train(was_training)
                for name, p in params.items():
                    p.copy_(saved[name])

    # ---- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The kept weights on the CPU, for an exact resume while the server lags the policy: a full copy's tensors
        by name, or the adapter with its spec and merge count; ``None`` when nothing valid is kept."""
        if self.version is None:
            return None
        if self.adapter is not None:
            return {**{k: v.detach().cpu().clone() for k, v in self.adapter.items()},
                    LORA_SPEC_KEY: json.dumps(self.adapter_spec), MERGES_KEY: int(self.adapter_merges)}
        return {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}
