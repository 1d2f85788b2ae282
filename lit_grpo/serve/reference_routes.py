"""The rollout server's copy of pi_ref and its route ``POST /reference/logprobs`` (``data.reference_on_server``).

With asynchronous rollouts (``data.max_staleness`` >= 1) the server idles once the next batch is generated while
the trainer still updates; on a job whose update outweighs its generation that idle time is the whole gain left.
The reference pass (one no-grad forward of pi_ref over every completion, a quarter of the update's FLOPs) is the
part of the update that needs no gradient and no current policy, so the server can run it right after sampling.

The trainer pushes pi_ref like the policy (``/start_weight_update {"target": "reference"}``), labelled with its
``reference_version``; a scoring request names the version it expects and gets a 409 from a server holding
another. The request carries the batch's padded micro-batches (``lit_grpo.core.batch.micro_batch_views``; the
trainer sends one per request, so a body stays within ``--max-body-bytes`` however large the batch) and the server
runs the trainer's scoring function on them (``lit_grpo.core.scoring.completion_logprobs``, padded), so the numbers
are the ones the trainer would compute (bit for bit unless ``model.packing`` packs the trainer's own passes; then within
float tolerance): in the server's dtype, under the trainer's autocast when it trains in mixed precision
(``autocast`` in the request). The project's server only: vLLM 0.33 has no second model.

LoRA (``model.lora``): pi_ref is the served policy's base with its adapter switched off, so nothing is pushed for it;
its label is the number of the trainer's merges the base holds (``lit_grpo.serve.served_adapter``). Switching the
adapter off is a flag of the shared model, so such a scoring request runs while no generation does (``swapped``).

``ReferenceRoutes`` is one of ``RolloutServer``'s route handlers and holds the copy of pi_ref (made from the served
policy at pi_ref's first push, filled by the weight receiver); torch is imported when a request comes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from lit_grpo.serve.served_adapter import ServedAdapter
from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.wire.protocol import HTTPFailure, Limits, number_field

#: ``autocast`` of a ``/reference/logprobs`` request: the trainer's mixed precision (None: none)
AUTOCAST_DTYPES = (None, "bfloat16", "float16")
#: the fields of one micro-batch in a ``/reference/logprobs`` request
MICRO_BATCH_FIELDS = ("prompt_ids", "prompt_mask", "prompt_index", "completion_ids", "completion_mask")


class ReferenceRoutes:
    """``/reference/logprobs`` of ``RolloutServer``, and the copy of pi_ref a reference push fills: ``model`` (made
    at the first push), its ``params`` by name, its ``version``, and the ``lock`` a swap of its weights and a scoring
    request take."""

    def __init__(self, policy: ServedPolicy, vocab_size: int, limits: Limits,
                 adapter: ServedAdapter | None = None) -> None:
        self.policy = policy
        self.adapter = adapter
        self.device = policy.device
        self.vocab_size = vocab_size
        self.limits = limits
        self.model: Any = None  # pi_ref, made at its first push (data.reference_on_server)
        self.params: dict[str, Any] = {}
        self.version: str | None = None
        self.lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[[dict, dict], dict]]:
        """Its route's handler by the name ``lit_grpo.wire.protocol.ROUTES`` gives it."""
        return {"reference_logprobs": self.reference_logprobs}

    def ensure(self) -> None:
        """Make pi_ref's copy at its first push (the rollout policy's weights until the push lands). Called under
        the transfer lock, so no policy swap runs meanwhile."""
        if self.model is None:
            from lit_grpo.models.copies import frozen_copy
            from lit_grpo.models.lora import is_lora

            model = frozen_copy(self.policy.model)
            if is_lora(model):  # a LoRA fit's served model, before a full fit's first policy push: pi_ref is plain
                model = model.unload()
            self.model = model.eval()
            self.params = dict(self.model.named_parameters())

    def install(self, staged: dict[str, Any], version: str | None) -> None:
        """Switch pi_ref's parameters to the received tensors (no generation reads pi_ref: only a scoring request
        waits), and label them ``version``."""
        with self.lock:
            for name, tensor in staged.items():
                self.params[name].data = tensor
            if version is not None:
                self.version = str(version)

    def reference_logprobs(self, body: dict, query: dict) -> dict:
        """``{"reference_version": V, "temperature": T, "autocast": null | "bfloat16" | "float16",
        "micro_batches": [...]}`` -> ``{"reference_version": V,
        "logprobs": [[[...]]]}``: ``log softmax(logits / T)`` of every completion token under pi_ref, one
        ``[s, C']`` list per micro-batch (padded positions included; the trainer masks them)."""
        import torch

        from lit_grpo.core.scoring import completion_logprobs

        expected = body.get("reference_version")
        if isinstance(expected, bool) or not isinstance(expected, (str, int)):
            raise HTTPFailure(400, f"reference_version must be a string, got {expected!r}")
        temperature = number_field(body, "temperature", 1.0)
        if not temperature > 0:
            raise HTTPFailure(400, f"temperature must be > 0, got {temperature}")
        autocast = body.get("autocast")
        if autocast not in AUTOCAST_DTYPES:
            raise HTTPFailure(400, f"autocast must be one of {list(AUTOCAST_DTYPES)}, got {autocast!r}")
        items = body.get("micro_batches")
        if not isinstance(items, list) or not items:
            raise HTTPFailure(400, "micro_batches must be a non-empty list")
        batches = [self._micro_batch(item, i) for i, item in enumerate(items)]
        if self.adapter is not None and self.adapter.spec is not None:  # not a copy an earlier full fit pushed
            return self._base_logprobs(batches, str(expected), float(temperature), autocast)
        with self.lock:
            if self.model is None or self.version is None:
                raise HTTPFailure(409, "this server holds no pi_ref: the trainer pushes it first "
                                       "(data.reference_on_server, at WeightSync's first push)")
            if self.version != str(expected):
                raise HTTPFailure(409, f"this server holds pi_ref version {self.version!r}, not "
                                       f"{str(expected)!r}")
            out = []
            # the trainer's forward precision: under bf16-mixed its own pi_ref pass runs in autocast, and so does this
            precision = (torch.autocast(self.device.type, dtype=getattr(torch, autocast)) if autocast is not None
                         else contextlib.nullcontext())
            with torch.no_grad(), precision:
                for mb in batches:
                    logp, _ = completion_logprobs(self.model, mb, float(temperature))
                    out.append(logp.float().cpu().tolist())
            return {"reference_version": self.version, "logprobs": out}

    def _base_logprobs(self, batches: list, expected: str, temperature: float, autocast: str | None) -> dict:
        """pi_ref of a LoRA policy: the served base, adapter off, labelled with the merges it holds."""
        import torch

        from lit_grpo.core.scoring import completion_logprobs

        precision = (torch.autocast(self.device.type, dtype=getattr(torch, autocast)) if autocast is not None
                     else contextlib.nullcontext())
        with self.policy.swapped():  # the adapter switch is seen by every thread: no generation meanwhile
            version = str(self.adapter.merges_applied)
            if version != expected:
                raise HTTPFailure(409, f"this server's base holds {version} merges (pi_ref version {version!r}), "
                                       f"not {expected!r}")
            out = []
            with torch.no_grad(), precision, self.policy.model.disable_adapter():
                for mb in batches:
                    logp, _ = completion_logprobs(self.policy.model, mb, temperature)
                    out.append(logp.float().cpu().tolist())
        return {"reference_version": version, "logprobs": out}

    def _micro_batch(self, item: Any, i: int) -> Any:
        """One checked micro-batch as a ``MicroBatch`` on the server's device."""
        import torch

        from lit_grpo.core.batch import MicroBatch

        where = f"micro_batches[{i}]"
        if not isinstance(item, dict) or any(k not in item for k in MICRO_BATCH_FIELDS):
            raise HTTPFailure(400, f"{where} needs the fields {list(MICRO_BATCH_FIELDS)}")
        tensors = {}
        for name in MICRO_BATCH_FIELDS:
            try:
                tensors[name] = torch.tensor(item[name], dtype=torch.long)
            except (TypeError, ValueError, OverflowError, RuntimeError):
                raise HTTPFailure(400, f"{where}.{name} must be a rectangular list of integers") from None
        prompts, completions = tensors["prompt_ids"], tensors["completion_ids"]
        index = tensors["prompt_index"]
        if prompts.dim() != 2 or completions.dim() != 2 or index.dim() != 1 or 0 in prompts.shape:
            raise HTTPFailure(400, f"{where}: prompt_ids and completion_ids must be non-empty [rows, tokens] lists "
                                   "and prompt_index a flat list")
        if tensors["prompt_mask"].shape != prompts.shape or tensors["completion_mask"].shape != completions.shape:
            raise HTTPFailure(400, f"{where}: each mask must have the shape of its ids")
        if index.numel() != completions.shape[0] or completions.shape[0] == 0:
            raise HTTPFailure(400, f"{where}: prompt_index needs one entry per completion row "
                                   f"({completions.shape[0]}), got {index.numel()}")
        if int(index.min()) < 0 or int(index.max()) >= prompts.shape[0]:
            raise HTTPFailure(400, f"{where}: prompt_index must lie in [0, {prompts.shape[0]})")
        limits = self.limits
        if (completions.shape[0] > limits.max_prompts * limits.max_n or completions.shape[1] > limits.max_tokens
                or prompts.shape[1] > limits.max_prompt_tokens):
            raise HTTPFailure(400, f"{where} of {completions.shape[0]} completions x {completions.shape[1]} tokens "
                                   f"after {prompts.shape[1]} prompt tokens is larger than this server's limits")
        for name in ("prompt_ids", "completion_ids"):
            t = tensors[name]
            if int(t.min()) < 0 or int(t.max()) >= self.vocab_size:
                raise HTTPFailure(400, f"{where}.{name} holds a token id outside [0, {self.vocab_size})")
        for name in ("prompt_mask", "completion_mask"):
            if not bool(((tensors[name] == 0) | (tensors[name] == 1)).all()):
                raise HTTPFailure(400, f"{where}.{name} must hold 0 and 1 only")
        on = {name: t.to(self.device) for name, t in tensors.items()}
        return MicroBatch(rows=slice(0, completions.shape[0]), **on)
