"""A trainer's rank 0 pushing weights to a rollout server, in a process of its own so a test can kill it.

Usage: python server_sender.py URL WEIGHTS_PT STEP STALL_BUCKET. Pushes the ``{name: tensor}`` of WEIGHTS_PT with
``ServerEngine`` (token from $LIT_GRPO_SERVER_TOKEN) in small buckets; bucket STALL_BUCKET (1-based) is announced
over HTTP but its bytes are never sent, so the server sits in the middle of receiving it until the test kills
this process.
"""

from __future__ import annotations

import sys
import time

import torch

from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.remote.weight_push import WeightPusher


class Stalled:
    """Stands in for the transfer group: a broadcast that never happens."""

    def __init__(self, group) -> None:  # noqa: ANN001
        self.group = group  # keep the real group (and its connection to the server) alive

    def broadcast(self, tensor, root):  # noqa: ANN001, ANN201
        time.sleep(3600)


def main(url: str, weights: str, step: int, stall: int) -> None:
    torch.set_num_threads(1)
    tensors = torch.load(weights)
    engine = ServerEngine(url=url, bucket_mb=0.05, timeout_s=120)
    send, count = WeightPusher._send, [0]

    def stalling_send(self, server, info, payload):  # noqa: ANN001, ANN202
        count[0] += 1
        print(f"bucket {count[0]}: {len(info['names'])} tensors", flush=True)
        if count[0] == stall:
            server.group = Stalled(server.group)
        return send(self, server, info, payload)

    WeightPusher._send = stalling_send
    engine.load_weights(tensors.items(), step)
    print("pushed everything", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
