"""The adapter versions of a LoRA policy (``model.lora``) in a vLLM engine, and the one sequence of an adapter push,
for both kinds: the colocated ``VLLMEngine`` and ``vllm serve`` (``ServerEngine`` with ``kind: vllm``).

vLLM takes adapters by path and caches them by an integer id, and its base weights are fused (they cannot be read back
or hashed under the model's names). So a push is, whatever carries it:

1. merge: when the update carries merges (or the engine's base is not known to be the trainer's), reload the trainer's
   merged base into the engine; vLLM then drops the adapters it held. The count of merges the engine's base holds
   (``merges_applied``) moves only once that reload went through.
2. load the new version: write the adapter in peft's format into ``<root>/<prefix><k>`` and load it; requests name
   the newest loaded version.
3. unload the stale ones: the versions beyond the newest ``keep`` (a request sampled before a push may still name the
   previous one), and remove their directories.

:class:`VersionedAdapters` owns that sequence, the version counter and the merge counter; the engine kind only supplies
an :class:`AdapterTransport` (colocated: calls on the in-process ``vllm.LLM``; served: HTTP to ``vllm serve``'s
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``). vLLM is not imported here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class AdapterVersion:
    """One adapter version written for vLLM: its name (``v<k>``, what requests name), vLLM's integer id ``k``
    (``LoRARequest.lora_int_id``, >= 1, never reused) and its directory."""

    name: str
    id: int
    path: Path


class AdapterVersions:
    """The adapter versions written under ``root`` for one vLLM, newest last, of which the newest ``keep`` stay.

    ``add`` writes the next version; ``stale`` names those beyond the newest ``keep`` (to unload), ``drop`` removes
    one's directory once unloaded. Numbering starts at 1 (vLLM refuses id 0) and never repeats: vLLM caches an
    adapter by its id, so a reused id would serve the old tensors."""

    def __init__(self, root: str | Path, keep: int, prefix: str = "v") -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"the number of adapter versions kept must be an integer >= 1, got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.prefix = prefix
        self.loaded: list[AdapterVersion] = []
        self._next_id = 1

    @property
    def current(self) -> AdapterVersion | None:
        """The newest version (the one new requests name), or None before the first push."""
        return self.loaded[-1] if self.loaded else None

    def add(self, spec: dict[str, Any], tensors: dict[str, torch.Tensor], write: bool = True) -> AdapterVersion:
        """Write the next version (peft's format, ``lit_grpo.models.lora.write_adapter``) and make it the current one.
        ``write=False`` only counts it (a rank that names the versions rank 0 writes). The id is taken before the
        write, so a failed write uses it up on every rank alike (ranks that write nothing count it too)."""
        from lit_grpo.models.lora import write_adapter

        name = f"{self.prefix}{self._next_id}"
        version = AdapterVersion(name, self._next_id, self.root / name)
        self._next_id += 1
        if write:
            try:
                write_adapter(spec, tensors, version.path)
            except BaseException:
                shutil.rmtree(version.path, ignore_errors=True)  # no half-written version left to be read
                raise
        self.loaded.append(version)
        return version

    def stale(self) -> list[AdapterVersion]:
        """The versions beyond the newest ``keep``, oldest first."""
        return self.loaded[:-self.keep] if len(self.loaded) > self.keep else []

    def drop(self, version: AdapterVersion) -> None:
        """Forget ``version`` and remove its directory (after vLLM unloaded it)."""
        self.loaded = [v for v in self.loaded if v.id != version.id]
        shutil.rmtree(version.path, ignore_errors=True)

    def clear(self) -> None:
        """Remove every version's directory (at close)."""
        for version in list(self.loaded):
            self.drop(version)

    def remove(self) -> None:
        """Remove ``root`` itself with every version in it (at close; a second call does nothing): only for a
        ``root`` made for these versions alone."""
        self.clear()
        shutil.rmtree(self.root, ignore_errors=True)


class AdapterTransport(Protocol):
    """What one engine kind does for each step of :class:`VersionedAdapters`' sequence."""

    def reload_base(self, step: int) -> None:
        """Load the trainer's base as it is now (after the update's merges) into the engine, labelled ``step``."""

    def load(self, version: AdapterVersion) -> None:
        """Load ``version`` from its path; raise when the engine refuses it."""

    def unload(self, version: AdapterVersion) -> None:
        """Unload ``version``; one the engine no longer holds (a base reload dropped it) is not an error."""


#: ``agree(this rank's failure or None)``: the failure every rank raises, or None when the step went through on
#: every rank (one collective for a sequence run on several ranks at once)
Agreement = Callable[[Exception | None], Exception | None]


def alone(failure: Exception | None) -> Exception | None:
    """The agreement of a sequence run by one process: its own failure."""
    return failure


class VersionedAdapters:
    """The adapter versions of one vLLM engine and the sequence of a push (see the module's docstring): merge
    (reload the base), load the new version, unload the stale ones.

    Args:
        versions: where the versions are written and how many stay loaded.
        transport: the engine kind's calls (:class:`AdapterTransport`).
        write: whether this process writes the versions (``False`` on the ranks of a ``vllm serve`` push other than
            rank 0, which count and name the versions rank 0 writes).
        base_at_first: reload the trainer's base before the first version even without merges (``vllm serve``: it
            was started from its own checkpoint, which cannot be hashed against the trainer's base).
        agree: how the ranks that run the sequence together learn of a failed load or unload (:data:`Agreement`);
            one process alone by default.

    State after a failure: a failed base reload changes nothing here; a failed load (or write) drops the new
    version, so the previous one stays the one requests name; a failed unload keeps the stale version listed, so the
    next push unloads it again. The error is raised after that, on every rank that agreed.
    """

    def __init__(self, versions: AdapterVersions, transport: AdapterTransport, write: bool = True,
                 base_at_first: bool = False, agree: Agreement = alone) -> None:
        self.versions = versions
        self.transport = transport
        self.write = bool(write)
        self.base_at_first = bool(base_at_first)
        self.agree = agree
        #: how many of the policy's merges the engine's base holds: 0, since it loads its checkpoint from disk (a
        #: resumed run's first push therefore carries all the merges so far, and the base follows them)
        self.merges_applied = 0
        #: version id -> the optimizer step of its adapter (the label of the completions sampled with it)
        self.steps: dict[int, int] = {}

    @property
    def current(self) -> AdapterVersion | None:
        """The version new requests name, or None before the first push (the engine's base alone)."""
        return self.versions.current

    def needs_base(self, merges: int) -> bool:
        """Whether a push carrying ``merges`` merges reloads the engine's base first."""
        return merges > 0 or (self.base_at_first and self.versions.current is None)

    def push(self, update: Any, step: int) -> AdapterVersion:
        """One adapter push of ``update`` (a ``lit_grpo.models.lora.AdapterUpdate``) made at optimizer ``step``:
        merge, load the new version, unload the stale ones. Returns the new version."""
        if self.needs_base(len(update.merges)):
            self.transport.reload_base(int(step))
            self.merges_applied += len(update.merges)
        failure: Exception | None = None
        version: AdapterVersion | None = None
        try:
            version = self.versions.add(update.spec, update.adapter, write=self.write)
            self.transport.load(version)
        except Exception as err:  # noqa: BLE001 (agreed on with the other ranks, then raised)
            failure = err
        failure = self.agree(failure)
        if failure is not None:
            if version is not None:
                self.versions.drop(version)  # the previous version stays the one requests name
            raise failure
        assert version is not None  # no failure: added
        self.steps[version.id] = int(step)
        failure = None
        for old in self.versions.stale():
            try:
                self.transport.unload(old)
            except Exception as err:  # noqa: BLE001 (the first is raised once every stale version was tried)
                failure = failure or err
                continue
            self.versions.drop(old)
            self.steps.pop(old.id, None)
        failure = self.agree(failure)
        if failure is not None:
            raise failure
        return version

    def close(self) -> None:
        """Remove the versions' root with every version in it (at the end of the fit; a second call does nothing)."""
        if self.write:
            self.versions.remove()
