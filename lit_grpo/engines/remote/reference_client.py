"""The trainer's side of pi_ref on the rollout server (``data.reference_on_server``): ask for pi_ref's log-probs
of a batch's completions (``ReferenceClient``, owned by ``ServerEngine``). The push of pi_ref itself is
``ServerEngine.load_reference``; the server's side is ``lit_grpo.serve.reference_routes``.

``score`` does HTTP only (no collective), so the asynchronous producer runs it right after a batch's completions
come back, while the trainer updates on the batch before.
"""

from __future__ import annotations

import torch

from lit_grpo.core.batch import MicroBatch
from lit_grpo.engines.remote.connection import ServerConnection
from lit_grpo.engines.remote.fleet import Fleet, ServerDown
from lit_grpo.wire.protocol import ServerError, version_text


class ReferenceClient:
    """pi_ref's log-probs from the servers of ``fleet`` that are up and hold the version asked for, each request
    within ``timeout_s``."""

    def __init__(self, fleet: Fleet, timeout_s: float) -> None:
        self.fleet = fleet
        self.timeout_s = timeout_s

    def score(self, micro_batches: list[MicroBatch], num_sequences: int, width: int, temperature: float,
              autocast: str | None, version: str | None) -> tuple[torch.Tensor, str]:
        """pi_ref's log-probs of every completion token, ``[num_sequences, width]`` (zero where no micro-batch
        reaches: padding), computed by one server on exactly these micro-batches, one request each (under
        ``autocast``, the trainer's mixed-precision dtype, when given), with the pi_ref labelled ``version``, and
        that version. The first server up that holds it scores the batch; one whose connection is lost (after the
        fleet's retries) is down, and the whole batch goes to the next: every server holding ``version`` returns the
        same numbers. Raises ``ServerError`` when nothing was pushed (``version`` ``None``), no server up holds it,
        or a server answers oddly."""
        if version is None:
            raise ServerError("no pi_ref was pushed to the rollout server yet (WeightSync pushes it with the policy)")
        for server in self.fleet.up:
            if server.reference_version != version:
                continue
            try:
                return self.fleet.call(server, lambda s: self._score_on(s, micro_batches, num_sequences, width,
                                                                        temperature, autocast, version)), version
            except ServerDown:
                continue
        raise ServerError(f"no rollout server up holds pi_ref version {version!r} "
                          f"({', '.join(s.url for s in self.fleet.servers)}); expected WeightSync to push it to "
                          "every server up, a rejoining one too")

    def _score_on(self, server: ServerConnection, micro_batches: list[MicroBatch], num_sequences: int, width: int,
                  temperature: float, autocast: str | None, version: str) -> torch.Tensor:
        out = torch.zeros(num_sequences, width, dtype=torch.float32)
        # one request per micro-batch: a body the size of the whole batch grows with prompts x G x tokens and
        # outgrows the server's body limit (--max-body-bytes, 16 MiB) at 64 x 16 x 2,048 tokens; a micro-batch's
        # is bounded by micro_batch_size, which the trainer already sizes to fit its own forward pass
        for mb in micro_batches:
            body = {"reference_version": version, "temperature": float(temperature), "autocast": autocast,
                    "micro_batches": [micro_batch_body(mb)]}
            response = server.client.post("/reference/logprobs", body, timeout_s=self.timeout_s)
            got = version_text(response.get("reference_version"))
            pieces = response.get("logprobs")
            if got != version or not isinstance(pieces, list) or len(pieces) != 1:
                raise ServerError(f"rollout server {server.url} answered a pi_ref scoring request for version "
                                  f"{version!r} with version {got!r} and "
                                  f"{len(pieces) if isinstance(pieces, list) else pieces} micro-batches (expected 1)")
            values = torch.tensor(pieces[0], dtype=torch.float32)
            if values.shape != mb.completion_ids.shape:
                raise ServerError(f"rollout server {server.url} returned pi_ref log-probs of shape "
                                  f"{list(values.shape)} for a micro-batch of {list(mb.completion_ids.shape)}")
            out[mb.rows, : values.shape[1]] = values
        return out


def micro_batch_body(mb: MicroBatch) -> dict[str, list]:
    """One micro-batch of a ``/reference/logprobs`` request (``reference_routes.MICRO_BATCH_FIELDS``)."""
    return {"prompt_ids": mb.prompt_ids.tolist(), "prompt_mask": mb.prompt_mask.tolist(),
            "prompt_index": mb.prompt_index.tolist(), "completion_ids": mb.completion_ids.tolist(),
            "completion_mask": mb.completion_mask.tolist()}
