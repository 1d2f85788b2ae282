"""``ServerEngine``'s LoRA pushes (``model.lora``): the adapter, and the merges the servers' bases lack, to the
project's servers over the weight transfer (``push_served_adapter``), or to ``vllm serve`` as a new adapter version
loaded by path (``push_vllm_adapter``); and the count of merges the servers' bases hold (``merges_held``). Functions of
the engine (its servers, pusher and push bookkeeping: ``_before_push``, ``_pushing``, ``load_weights``), which
``ServerEngine.load_adapter`` and ``merges_applied`` call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_grpo.core.distributed import all_gather_objects, rank_and_world
from lit_grpo.engines.base import AdapterUpdate
from lit_grpo.wire.protocol import ServerError

if TYPE_CHECKING:
    from lit_grpo.engines.remote.client import ServerEngine


def merges_held(engine: ServerEngine) -> int:
    """How many of the policy's merges the servers' bases hold (``model.lora``): asked of them (``/weight_info``'s
    ``lora``; 0 for a server that has had no adapter yet) until this engine has pushed, then counted here; every
    server must hold the same number. The base hash sent with the merges checks it."""
    if engine.kind == "vllm":  # counted by the adapters' sequence, from 0: vLLM starts from its own checkpoint
        return 0 if engine.vllm_adapters is None else engine.vllm_adapters.merges_applied
    if engine._merges_applied is None:
        counts = {s.url: int((s.client.get("/weight_info").get("lora") or {}).get("merges_applied", 0))
                  for s in engine.servers}
        if len(set(counts.values())) > 1:
            raise ServerError(f"the rollout servers hold different numbers of merges {counts}: restart them "
                              "from the same base")
        engine._merges_applied = next(iter(counts.values()))
    return engine._merges_applied


def push_served_adapter(engine: ServerEngine, update: AdapterUpdate, step: int) -> None:
    """The project's server: the adapter and the merges its base lacks, over the weight transfer."""
    if engine.pusher.dtype != next(iter(update.adapter.values())).dtype:
        raise ValueError(f"model.lora with the project's server needs it to hold the policy's dtype "
                         f"({next(iter(update.adapter.values())).dtype}), not {engine.pusher.dtype}: its base must "
                         "follow the trainer's merges bitwise; restart it with that --dtype")
    held = engine.merges_applied
    engine._before_push()
    engine._pushing(step)
    start = {"lora": {"spec": update.spec, "merges": len(update.merges), "base_hash": update.base_hash}}
    tensors = [(f"merges.{i}.{name}", t) for i, merge in enumerate(update.merges) for name, t in merge.items()]
    tensors += list(update.adapter.items())
    try:
        versions = engine.pusher.push(iter(tensors), str(int(step)), "adapter", start)
    except ServerError:
        for server in engine.servers:
            server.expected_version = None
        engine._merges_applied = None  # ask the servers again at the next push
        raise
    engine.record_push(versions)
    engine._merges_applied = held + len(update.merges)
    if engine.serves_reference:
        engine.reference_version = str(engine._merges_applied)


def push_vllm_adapter(engine: ServerEngine, update: AdapterUpdate, step: int) -> None:
    """``kind: vllm``: the adapter as a new version loaded by path (``vllm_client.ServeAdapters``, the sequence
    both vLLM kinds share, which counts the merges). vLLM's base cannot be hashed under the model's names, so it
    gets the trainer's base instead (the full-weight push, ``base_named_tensors``) at the first push of a fit and
    with every merge. A collective: every rank calls it.

    Over a fleet: the push goes to the servers up and the down ones that answer again (``adapter_targets``); a
    server that restarted (it no longer reports the base pushed last) first gets the base with the others, which
    brings it back like a full-weight push does; one lost during the load is left out and down. The base push and
    the ``Fleet``'s bookkeeping follow rank 0's findings on every rank."""
    from lit_grpo.engines.remote.vllm_client import ServeAdapters
    from lit_grpo.engines.vllm_lora import base_named_tensors

    rank, _ = rank_and_world()
    if engine.vllm_adapters is None:
        # None when built outside the data module, which sets K + 1: keep two, enough for K <= 1
        keep = 2 if engine.options.lora_keep is None else engine.options.lora_keep
        engine.vllm_adapters = ServeAdapters(  # load_weights drains the producer first
            engine.options.lora_dir, keep, rank,
            lambda at: engine.load_weights(base_named_tensors(engine.pusher.policy()), at))
    adapters, fleet = engine.vllm_adapters, engine.fleet
    needs_base = adapters.sequence.needs_base(len(update.merges))
    if not needs_base:
        engine._before_push()  # a base reload drains the producer itself
    targets, restarted = adapter_targets(engine, rank)
    if restarted and not needs_base:
        # the base at this fit's merges to every server (a merge does the same); the pusher finds the restarted
        # ones (another version than it pushed there), gives them vLLM's trainer side anew and puts them back up
        adapters.calls.reload_base(int(step))
        targets = [s.url for s in fleet.up]
    engine._pushing(step)
    adapters.calls.answers = fleet.probe if rank == 0 else None
    adapters.calls.lost = []
    try:
        adapters.push([s for s in engine.servers if s.url in targets], update, step)  # raises on every rank together
    finally:
        lost = all_gather_objects(adapters.calls.lost)[0] if rank_and_world()[1] > 1 else adapters.calls.lost
    reached = [url for url in targets if url not in lost]
    fleet.apply([s.url for s in engine.servers if s.url not in reached])
    for server in engine.servers:
        server.expected_version = str(int(step)) if server.url in reached else None
    engine.synced_step = int(step)


def adapter_targets(engine: ServerEngine, rank: int) -> tuple[list[str], list[str]]:
    """Rank 0's ``(URLs an adapter push goes to, those of them that restarted)``, shared with every rank: the servers
    up and the down ones that answer again (``Fleet.push_targets``); restarted, the ones that report another weight
    version than the base pushed last (before the first base push: none; one that does not answer is not restarted
    but dead, and the load leaves it out)."""
    fleet, calls = engine.fleet, engine.vllm_adapters.calls
    found: dict = {"targets": [], "restarted": [], "error": None}
    if rank == 0:
        try:
            targets = fleet.push_targets()
            found["targets"] = [s.url for s in targets]
            if calls.base_step is not None:
                held = {s.url: fleet.probe(s) for s in targets}  # None: it died since (the load leaves it out)
                found["restarted"] = [url for url, version in held.items()
                                      if version is not None and version != str(calls.base_step)]
        except ServerError as err:
            found["error"] = str(err)
    if rank_and_world()[1] > 1:
        found = all_gather_objects(found)[0]
    if found["error"]:
        raise ServerError(f"adapter push failed: {found['error']}")
    return found["targets"], found["restarted"]

__all__ = ["merges_held", "push_served_adapter", "push_vllm_adapter"]
