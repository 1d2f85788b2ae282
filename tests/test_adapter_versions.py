"""The one sequence of a LoRA push to a vLLM engine (``VersionedAdapters``), both kinds' steps through a fake
transport: the order of the calls, the version and merge counters, the stale versions unloaded, and a state that
stays consistent when a step fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lit_grpo.engines.adapter_versions import AdapterVersions, VersionedAdapters

SPEC = {"r": 1, "alpha": 2.0, "target_modules": ["q_proj"]}


def update(merges: int = 0) -> SimpleNamespace:
    """What the sequence reads of an ``AdapterUpdate``: spec, merges, adapter."""
    adapter = {"base_model.model.q_proj.lora_A.weight": torch.ones(1, 2),
               "base_model.model.q_proj.lora_B.weight": torch.zeros(2, 1)}
    return SimpleNamespace(spec=SPEC, merges=tuple({} for _ in range(merges)), adapter=adapter)


class FakeTransport:
    """Records each call; ``fail`` names the calls that raise (``load``, ``unload``, ``reload_base``)."""

    def __init__(self, written: bool = True) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()
        self.written = written  # whether this process writes the versions it loads

    def reload_base(self, step: int) -> None:
        self.calls.append(f"reload {step}")
        if "reload_base" in self.fail:
            raise RuntimeError("base reload refused")

    def load(self, version) -> None:  # noqa: ANN001
        assert (version.path / "adapter_model.safetensors").is_file() == self.written  # written before it is loaded
        self.calls.append(f"load {version.name}")
        if "load" in self.fail:
            raise RuntimeError(f"refused {version.name}")

    def unload(self, version) -> None:  # noqa: ANN001
        self.calls.append(f"unload {version.name}")
        if "unload" in self.fail:
            raise RuntimeError(f"cannot unload {version.name}")


def sequence(tmp_path, keep: int = 1, **kwargs) -> tuple[VersionedAdapters, FakeTransport]:
    transport = FakeTransport(written=kwargs.get("write", True))
    return VersionedAdapters(AdapterVersions(tmp_path, keep), transport, **kwargs), transport


def on_disk(tmp_path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


def test_pushes_load_each_version_unload_the_stale_and_reload_the_base_at_a_merge(tmp_path):
    adapters, transport = sequence(tmp_path, keep=2)
    assert adapters.current is None and adapters.merges_applied == 0
    for step, merges in [(1, 0), (2, 0), (3, 1), (4, 2)]:
        version = adapters.push(update(merges), step)
        assert adapters.current == version and adapters.steps[version.id] == step
    assert transport.calls == [
        "load v1",
        "load v2",
        "reload 3", "load v3", "unload v1",  # merge first, then the new version, then the stale one
        "reload 4", "load v4", "unload v2",
    ]
    assert adapters.merges_applied == 3
    assert [v.name for v in adapters.versions.loaded] == ["v3", "v4"] and on_disk(tmp_path) == ["v3", "v4"]
    assert sorted(adapters.steps) == [3, 4]  # the stale versions' labels went with them
    adapters.close()
    assert not tmp_path.exists()


def test_a_served_engine_gets_the_trainers_base_before_its_first_version(tmp_path):
    adapters, transport = sequence(tmp_path, base_at_first=True)
    assert adapters.needs_base(0)
    adapters.push(update(), 5)
    adapters.push(update(), 6)
    assert transport.calls == ["reload 5", "load v1", "load v2", "unload v1"]
    assert adapters.merges_applied == 0 and not adapters.needs_base(0) and adapters.needs_base(1)


def test_a_refused_load_keeps_the_previous_version_and_never_reuses_the_id(tmp_path):
    adapters, transport = sequence(tmp_path)
    first = adapters.push(update(), 1)
    transport.fail = {"load"}
    with pytest.raises(RuntimeError, match="refused v2"):
        adapters.push(update(merges=1), 2)
    # the base reload went through (its merge is counted); the refused version is gone, the previous one is named
    assert adapters.current == first and adapters.merges_applied == 1
    assert on_disk(tmp_path) == ["v1"] and 2 not in adapters.steps
    transport.fail = set()
    assert adapters.push(update(), 3).name == "v3"  # vLLM caches by id: a refused id is not used again
    assert transport.calls[-2:] == ["load v3", "unload v1"]


def test_a_failed_base_reload_changes_nothing(tmp_path):
    adapters, transport = sequence(tmp_path)
    first = adapters.push(update(), 1)
    transport.fail = {"reload_base"}
    with pytest.raises(RuntimeError, match="base reload refused"):
        adapters.push(update(merges=2), 2)
    assert transport.calls == ["load v1", "reload 2"]  # no version loaded on a base that did not follow
    assert adapters.current == first and adapters.merges_applied == 0 and on_disk(tmp_path) == ["v1"]


def test_a_failed_unload_keeps_the_stale_version_listed_for_the_next_push(tmp_path):
    adapters, transport = sequence(tmp_path)
    adapters.push(update(), 1)
    transport.fail = {"unload"}
    with pytest.raises(RuntimeError, match="cannot unload v1"):
        adapters.push(update(), 2)
    assert adapters.current.name == "v2"  # loaded: requests name it
    assert [v.name for v in adapters.versions.loaded] == ["v1", "v2"] and on_disk(tmp_path) == ["v1", "v2"]
    transport.fail = set()
    adapters.push(update(), 3)
    assert transport.calls[-3:] == ["load v3", "unload v1", "unload v2"]  # tried again
    assert on_disk(tmp_path) == ["v3"]


def test_a_failure_on_another_rank_drops_the_version_here_too(tmp_path):
    """Ranks that only count the versions (``write=False``) learn of rank 0's refusal through ``agree`` and keep
    naming the previous version, as rank 0 does."""
    peer_failed = [False]

    def agree(failure: Exception | None) -> Exception | None:
        return failure or (RuntimeError("the push failed on rank 0") if peer_failed[0] else None)

    adapters, transport = sequence(tmp_path / "root", write=False, agree=agree)
    first = adapters.push(update(), 1)
    assert not first.path.exists()  # counted, not written
    peer_failed[0] = True
    with pytest.raises(RuntimeError, match="failed on rank 0"):
        adapters.push(update(), 2)
    assert adapters.current == first and [v.name for v in adapters.versions.loaded] == ["v1"]


def test_a_failed_write_leaves_no_half_written_version(tmp_path, monkeypatch):
    import lit_grpo.models.lora as lora

    adapters, transport = sequence(tmp_path)

    def broken(spec, tensors, dirpath, base_model=None):  # noqa: ANN001, ANN202
        dirpath.mkdir(parents=True)
        (dirpath / "adapter_config.json").write_text("{")
        raise OSError("disk full")

    monkeypatch.setattr(lora, "write_adapter", broken)
    with pytest.raises(OSError, match="disk full"):
        adapters.push(update(), 1)
    assert adapters.current is None and transport.calls == [] and on_disk(tmp_path) == []
    monkeypatch.undo()
    assert adapters.push(update(), 2).name == "v2"
