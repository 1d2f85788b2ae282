"""``weight_transfer.bucket_spans``, the one cut of the weight push's buckets, against each of the three cuts it
replaces, on many shapes and caps: the same buckets for the same inputs, so the bytes on the wire do not change."""

from __future__ import annotations

import random

import torch

from lit_grpo.engines.remote.weight_gather import plan_buckets
from lit_grpo.wire.push_format import plan_spans
from lit_grpo.wire.weight_transfer import bucket_spans, buckets


def size_lists() -> list[list[int]]:
    """Hand-picked edge cases (empty, zeros, items at, above and below the cap) and random lists."""
    fixed = [[], [0], [0, 0, 0], [6], [7], [3, 3, 5, 1, 10, 2, 2], [6, 6, 6], [7, 0, 0, 7], [0, 6, 0, 7, 0],
             [1] * 13, [5, 1, 1, 5, 1], [100, 1, 1, 100]]
    rng = random.Random(0)
    drawn = [[rng.choice([0, 1, 2, 3, 4, 6, 8, 16, 33, 64]) for _ in range(rng.randint(1, 30))] for _ in range(300)]
    return fixed + drawn


def test_bucket_spans_cut_like_each_old_cut():
    for sizes in size_lists():
        for cap in (1, 2, 3, 5, 6, 7, 8, 16, 33, 64, 100, 1000):
            spans = list(bucket_spans(sizes, cap))
            assert spans == plan_spans(sizes, cap), (sizes, cap)
            assert [list(range(a, b)) for a, b in spans] == plan_buckets(sizes, cap), (sizes, cap)
            tensors = [(str(i), torch.zeros(s, dtype=torch.uint8)) for i, s in enumerate(sizes)]
            streamed = [[int(name) for name, _ in bucket] for bucket in buckets(iter(tensors), cap)]
            assert streamed == [list(range(a, b)) for a, b in spans], (sizes, cap)
