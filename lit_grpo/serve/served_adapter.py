"""The rollout server's LoRA side (``model.lora``): an adapter push carries only the adapter tensors, and the merges
of the trainer's ``RefModelSwap``s the server's base lacks.

A push with ``{"target": "adapter", "lora": {"spec": ..., "merges": k, "base_hash": h | null}}`` in
``/start_weight_update`` announces, in its buckets, the ``k`` merged adapters (names ``merges.<i>.<peft name>``,
oldest first) and the adapter (peft's saved names). At the first adapter push the served model becomes a peft model
of ``spec``'s structure (``lit_grpo.engines.adapters.wrap_with_spec``); its base stays the one the server was started
with, plus the merges it applied. At ``/finish_weight_update`` the server applies the merges with the trainer's own
function, checks its base's hash against ``h`` (sent at the first push of a fit and with every merge), and loads the
adapter, all or nothing (``lit_grpo.engines.adapters.apply_adapter_update``). A server started from another base is
refused at its first push, before any bytes travel.

It samples with base plus adapter unmerged (peft's forward, as the trainer computes): a push then rewrites no base
weight, and merges happen only at swaps, with bitwise the trainer's result, which the hash checks.

pi_ref (``data.reference_on_server``): with LoRA it is the server's own base with the adapter switched off, so no
copy is pushed; its label is the number of merges the base holds (``reference_version``), which is the trainer's
``reference_version`` when the base is current (one merge per stage swap).
"""

from __future__ import annotations

from typing import Any

from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.wire.protocol import HTTPFailure

#: the name prefix of a merged adapter's tensors in an adapter push
MERGE_PREFIX = "merges."


class ServedAdapter:
    """The served policy's adapter state: its ``spec`` (``None`` until the first adapter push), the number of the
    trainer's merges its base holds (``merges_applied``) and its base hash (cached: the base changes only at a
    merge)."""

    def __init__(self, policy: ServedPolicy) -> None:
        self.policy = policy
        self.spec: dict[str, Any] | None = None
        self.merges_applied = 0
        self._hash: str | None = None
        self.pending: dict[str, Any] | None = None  # the adapter push in progress: merges, base_hash

    def info(self) -> dict[str, Any] | None:
        """What ``/weight_info`` reports (``lora``): ``None`` before the first adapter push."""
        if self.spec is None:
            return None
        return {"spec": self.spec, "merges_applied": self.merges_applied}

    def base_hash(self) -> str:
        from lit_grpo.models.lora import base_hash

        if self._hash is None:
            self._hash = base_hash(self.policy.model)
        return self._hash

    def start(self, lora: Any) -> None:
        """``/start_weight_update`` of an adapter push: check its header, make the served model a peft model at the
        first push (an adapter with B = 0 changes no output, and generation is held back meanwhile) and, with no
        merges to apply, check the base hash now (a server started from another base is refused before any byte)."""
        from lit_grpo.engines.adapters import check_spec, ensure_lora

        if not isinstance(lora, dict):
            raise HTTPFailure(400, 'an adapter push needs {"lora": {"spec": ..., "merges": k, "base_hash": ...}}')
        merges, digest = lora.get("merges", 0), lora.get("base_hash")
        if isinstance(merges, bool) or not isinstance(merges, int) or merges < 0:
            raise HTTPFailure(400, f"lora.merges must be an integer >= 0, got {merges!r}")
        if digest is not None and not isinstance(digest, str):
            raise HTTPFailure(400, f"lora.base_hash must be a string or null, got {digest!r}")
        try:
            spec = check_spec(lora.get("spec"))
            with self.policy.swapped():
                model = ensure_lora(self.policy.model, spec)
                if model is not self.policy.model:
                    self.policy.set_model(model)
                    self._hash = None
        except ValueError as err:
            raise HTTPFailure(400, str(err)) from None
        self.spec = spec
        if merges == 0 and digest is not None and self.base_hash() != digest:
            raise HTTPFailure(409, f"this server's base has hash {self.base_hash()[:16]}..., the trainer's "
                                   f"{digest[:16]}...: it was started from another model or dtype than the policy's "
                                   "base; restart it with the policy's model and --dtype")
        self.pending = {"merges": merges, "base_hash": digest}

    def full_push_params(self) -> dict[str, Any]:
        """The parameters a full (``policy``) push writes, by the plain model's names: the served model's own, or,
        while it carries an adapter, its base's (peft's names without ``base_model.model.`` and ``.base_layer``), so
        that a full fit that follows a LoRA fit pushes to this server as to a fresh one."""
        from lit_grpo.models.lora import is_lora, plain_name

        if not is_lora(self.policy.model):
            return self.policy.params
        return {plain_name(name): p for name, p in self.policy.params.items() if ".lora_" not in name}

    def drop(self) -> None:
        """Back to the plain model, after a full push wrote every base weight (call it inside ``swapped``).

        Why: the adapter and the merges the base held belong to the LoRA fit that pushed them, and the full push
        has replaced everything they applied to; keeping the peft model would sample with a stale adapter on top of
        the new weights and report the old fit's merges. peft's ``unload`` takes the adapter layers out without
        merging them (the push overwrote the base), and leaves the very parameters the push wrote. The next LoRA
        fit's first push wraps the model again (``start``), with a fresh adapter and no merges."""
        from lit_grpo.models.lora import is_lora

        if is_lora(self.policy.model):
            self.policy.set_model(self.policy.model.unload())
        self.spec, self.merges_applied, self._hash, self.pending = None, 0, None, None

    def params(self) -> dict[str, Any]:
        """The tensors an adapter push must announce, by name (their dtype and shape are the server's): the merges
        the push declared, then the adapter."""
        from lit_grpo.models.lora import adapter_names, adapter_parameters

        if self.pending is None:
            return {}
        own = dict(zip(adapter_names(self.policy.model), adapter_parameters(self.policy.model)))
        out = {f"{MERGE_PREFIX}{i}.{name}": p for i in range(self.pending["merges"]) for name, p in own.items()}
        out.update(own)
        return out

    def install(self, staged: dict[str, Any], version: str | None) -> None:
        """``/finish_weight_update`` of an adapter push (every announced tensor arrived): merges, hash check,
        adapter, version; all or nothing (a 409 leaves the base, the adapter and the version as they were)."""
        from lit_grpo.engines.adapters import apply_adapter_update

        pending, self.pending = self.pending, None
        merges = [{name[len(f"{MERGE_PREFIX}{i}."):]: t for name, t in staged.items()
                   if name.startswith(f"{MERGE_PREFIX}{i}.")} for i in range(pending["merges"])]
        adapter = {name: t for name, t in staged.items() if not name.startswith(MERGE_PREFIX)}
        with self.policy.swapped():
            try:
                applied, digest = apply_adapter_update(self.policy.model, merges, adapter, pending["base_hash"],
                                                       "this rollout server")
            except ValueError as err:
                raise HTTPFailure(409, str(err)) from None
            if applied:
                self._hash = digest
            self.merges_applied += applied
            if version is not None:
                self.policy.weight_version = str(version)
