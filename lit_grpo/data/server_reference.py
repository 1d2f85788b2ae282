"""`ServerReference`: pi_ref's log-probs of a batch's completions from the rollout server
(``data.reference_on_server``), asked for right after the completions come back, as part of the batch's request (on
the producer's thread when K >= 1, while the trainer updates on the batch before)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import ReferenceServing, Rollouts


@dataclass(frozen=True)
class ServerReference:
    """How the trainer asks for pi_ref's log-probs: in the padded layout and its micro-batches (the trainer's own
    unless ``model.packing`` packs them; then equal to its packed pass within float tolerance), at the
    loss's temperature, under its mixed-precision autocast (``None``: none)."""

    engine: ReferenceServing
    pad_token_id: int
    micro_batch_size: int
    temperature: float
    autocast: str | None = None
    micro_batch_tokens: int | None = None

    def __call__(self, prompts: list[list[int]], rollouts: Rollouts) -> Rollouts:
        """``rollouts`` with pi_ref's log-probs (``Rollouts.reference``) when the server holds a copy of pi_ref; a
        failed request becomes the rollouts' error, so every rank stops together (``check_lockstep``)."""
        if rollouts.error is not None or self.engine.reference_version is None:
            return rollouts
        padded = pad_rollouts(prompts, rollouts.groups, self.pad_token_id, self.micro_batch_size,
                              micro_batch_tokens=self.micro_batch_tokens)
        start = time.perf_counter()
        try:
            reference = self.engine.score_reference(list(padded.micro_batches()), *padded.completion_ids.shape,
                                                    self.temperature, self.autocast)
        except Exception as err:  # noqa: BLE001 (an HTTP failure or an odd answer: stop every rank together)
            return replace(rollouts, error=f"pi_ref scoring request failed: {type(err).__name__}: {err}",
                           reference_seconds=time.perf_counter() - start)
        return replace(rollouts, reference=reference, reference_seconds=time.perf_counter() - start)
