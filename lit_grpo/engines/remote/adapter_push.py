"""``ServerEngine``'s LoRA pushes (``model.lora``, ``AdapterPushing``): the adapter, and the merges the servers'
bases lack, to the project's servers over the weight transfer, or to ``vllm serve`` as a new adapter version loaded
by path; and the count of merges the servers' bases hold. A mixin of ``lit_grpo.engines.remote.client.ServerEngine``,
whose servers, pusher and push bookkeeping (``_before_push``, ``_pushing``, ``load_weights``) it uses."""

from __future__ import annotations

import torch

from lit_grpo.core.distributed import rank_and_world
from lit_grpo.engines.base import AdapterUpdate
from lit_grpo.wire.protocol import ServerError


class AdapterPushing:
    """The LoRA side of ``ServerEngine`` (see the module's docstring)."""

    @property
    def merges_applied(self) -> int:
        """How many of the policy's merges the servers' bases hold (``model.lora``): asked of them (``/weight_info``'s
        ``lora``; 0 for a server that has had no adapter yet) until this engine has pushed, then counted here; every
        server must hold the same number. The base hash sent with the merges checks it."""
        if self.kind == "vllm":  # counted by the adapters' sequence, from 0: vLLM starts from its own checkpoint
            return 0 if self.vllm_adapters is None else self.vllm_adapters.merges_applied
        if self._merges_applied is None:
            counts = {s.url: int((s.client.get("/weight_info").get("lora") or {}).get("merges_applied", 0))
                      for s in self.servers}
            if len(set(counts.values())) > 1:
                raise ServerError(f"the rollout servers hold different numbers of merges {counts}: restart them "
                                  "from the same base")
            self._merges_applied = next(iter(counts.values()))
        return self._merges_applied

    @torch.no_grad()
    def load_adapter(self, update: AdapterUpdate, step: int) -> None:
        """A LoRA push (``model.lora``): the adapter, and the merges the servers' bases lack, to every server
        (``lit_grpo.serve.served_adapter``: they sample with base plus adapter, unmerged, and check their base
        against ``update.base_hash``). Only rank 0's update is sent; every rank holds the same one. With
        ``data.reference_on_server`` the servers' pi_ref is their base with the adapter off, labelled with the merges
        it holds, so no pi_ref is pushed. With ``keep_pushed_weights`` the trainer keeps the adapter pushed
        (``KeptWeights.keep_adapter``)."""
        if not isinstance(update, AdapterUpdate):
            raise TypeError(f"load_adapter takes an AdapterUpdate, got {type(update).__name__}")
        if self.kept_weights is not None:
            self.kept_weights.invalidate()  # until this push is through
        if self.kind == "vllm":
            self._load_vllm_adapter(update, step)
        else:
            self._load_served_adapter(update, step)
        if self.kept_weights is not None:  # the adapter only: the base is the policy's, at this many merges
            self.kept_weights.keep_adapter(update.adapter, update.spec, self.merges_applied, self.synced_step)

    def _load_served_adapter(self, update: AdapterUpdate, step: int) -> None:
        """The project's server: the adapter and the merges its base lacks, over the weight transfer."""
        if self.pusher.dtype != next(iter(update.adapter.values())).dtype:
            raise ValueError(f"model.lora with the project's server needs it to hold the policy's dtype "
                             f"({next(iter(update.adapter.values())).dtype}), not {self.pusher.dtype}: its base must "
                             "follow the trainer's merges bitwise; restart it with that --dtype")
        held = self.merges_applied
        self._before_push()
        self._pushing(step)
        start = {"lora": {"spec": update.spec, "merges": len(update.merges), "base_hash": update.base_hash}}
        tensors = [(f"merges.{i}.{name}", t) for i, merge in enumerate(update.merges) for name, t in merge.items()]
        tensors += list(update.adapter.items())
        try:
            versions = self.pusher.push(iter(tensors), str(int(step)), "adapter", start)
        except ServerError:
            for server in self.servers:
                server.expected_version = None
            self._merges_applied = None  # ask the servers again at the next push
            raise
        self.record_push(versions)
        self._merges_applied = held + len(update.merges)
        if self.serves_reference:
            self.reference_version = str(self._merges_applied)

    def _load_vllm_adapter(self, update: AdapterUpdate, step: int) -> None:
        """``kind: vllm``: the adapter as a new version loaded by path (``vllm_client.ServeAdapters``, the sequence
        both vLLM kinds share, which counts the merges). vLLM's base cannot be hashed under the model's names, so it
        gets the trainer's base instead (the full-weight push, ``base_named_tensors``) at the first push of a fit and
        with every merge. A collective: every rank calls it."""
        from lit_grpo.engines.remote.vllm_client import ServeAdapters
        from lit_grpo.engines.vllm_lora import base_named_tensors

        rank, _ = rank_and_world()
        if self.vllm_adapters is None:
            # None when built outside the data module, which sets K + 1: keep two, enough for K <= 1
            keep = 2 if self.options.lora_keep is None else self.options.lora_keep
            self.vllm_adapters = ServeAdapters(  # load_weights drains the producer first
                self.options.lora_dir, keep, rank,
                lambda at: self.load_weights(base_named_tensors(self.pusher.policy()), at))
        if not self.vllm_adapters.sequence.needs_base(len(update.merges)):
            self._before_push()  # a base reload drains the producer itself
        self._pushing(step)
        self.vllm_adapters.push(self.servers, update, step)  # raises on every rank together
        for server in self.servers:
            server.expected_version = str(int(step))
        self.synced_step = int(step)


__all__ = ["AdapterPushing"]
