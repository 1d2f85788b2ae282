"""What a checkpoint keeps of ``RolloutDataModule`` (Lightning's ``state_dict`` / ``load_state_dict`` of a data
module), so that a resumed run continues exactly: the rollout batches consumed (the next prompts), the data seed
they were drawn with, the running failure counts it logs, and with ``max_staleness`` >= 1 the batches generated
ahead but not yet trained on, and the producer's count of waits.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_grpo.data.datamodule import RolloutDataModule

#: the running counts logged as ``rollout/<name>``, kept across a resume
COUNTS = ("reward_errors", "reward_timeouts", "env_errors")


def data_state(data: RolloutDataModule) -> dict[str, Any]:
    """The checkpoint's entry of ``data``: consumed batches, seed and counts; with K >= 1 the batches in flight."""
    state = {"consumed": data.consumed, "seed": data.seed, **{name: getattr(data, name) for name in COUNTS}}
    if data.max_staleness:
        state["in_flight"] = data.async_rollouts.state(data.rank_and_world()[1])
        state["producer_waits"] = data.async_rollouts.producer_waits
    return state


def restore_data_state(data: RolloutDataModule, state: dict[str, Any]) -> None:
    """Put the checkpoint's ``state`` back into ``data``; refused when it was written with another data seed (its
    batches were other prompts). A checkpoint from before a count was kept restores it as 0."""
    data.consumed = int(state["consumed"])
    for name in COUNTS:
        setattr(data, name, int(state.get(name, 0)))
    if int(state["seed"]) != data.seed:
        raise ValueError(f"checkpoint was written with data seed {state['seed']}, this run uses {data.seed}")
    data.async_rollouts.producer_waits = int(state.get("producer_waits", 0))
    # the batches generated ahead are the checkpoint's or none: ones kept from an earlier fit or state were
    # sampled by weights this state's run never trained with (a K = 0 checkpoint stores none, and one from
    # another world size is regenerated)
    in_flight = state.get("in_flight")
    if in_flight and not data.max_staleness:
        warnings.warn("the checkpoint holds rollout batches generated ahead (max_staleness >= 1); this run is "
                      "synchronous (max_staleness: 0) and regenerates them, so it is not an exact continuation",
                      stacklevel=3)  # the caller of the data module's load_state_dict
    data.async_rollouts.restore(in_flight if data.max_staleness else None, *data.rank_and_world())
