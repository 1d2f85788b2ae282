"""The chunked head's memory: a forward and backward of the update's log-probs holds a bounded number of chunks of
logits, whatever the number of completion tokens; the full logits' path holds all of them. Bytes are counted at
torch's dispatcher (``PeakLiveBytes`` of benchmarks/head_memory.py: every storage an operator allocates, alive at
once), not timed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from head_memory import QWEN25_VOCAB, group_micro_batch, measure, qwen_body  # noqa: E402

from lit_grpo.core.chunked_head import DEFAULT_HEAD_CHUNK_MB  # noqa: E402
from lit_grpo.math.chunked_logprobs import chunk_tokens_for  # noqa: E402

#: chunks of logits a chunk's forward and backward may hold at once (measured: 2, its float32 logits recomputed
#: for the backward and their gradient)
CHUNKS_HELD = 3


def chunk_bytes(vocab: int, budget_mb: float) -> int:
    return chunk_tokens_for(vocab, budget_mb) * vocab * 4


@pytest.mark.parametrize("layout", ["padded", "tree"])
def test_the_head_holds_the_same_few_chunks_for_any_number_of_tokens(layout: str) -> None:
    """At V = 8,192 and 2 MiB chunks (64 tokens): 512 and 2,048 completion tokens hold the same vocabulary-sized
    bytes at peak, at most 3 chunks; the full logits at 512 tokens hold more than the bound (so it can fail)."""
    vocab, budget = 8192, 2.0
    model = qwen_body(vocab)
    bound = CHUNKS_HELD * chunk_bytes(vocab, budget)
    peaks = {tokens: measure(model, group_micro_batch(tokens, vocab), layout, budget, vocab).vocab_peak
             for tokens in (512, 2048)}
    assert 0 < peaks[512] <= bound and peaks[2048] == peaks[512], peaks
    full = measure(model, group_micro_batch(512, vocab), layout, None, vocab).vocab_peak
    assert full >= 512 * vocab * 4 > bound  # the whole micro-batch's float32 logits, at least once


@pytest.mark.slow  # ~50 s a layout on one core: 4,096 x 151,936 logits, four times over
@pytest.mark.parametrize("layout", ["padded", "tree"])
def test_4096_tokens_at_qwen_s_vocabulary_hold_a_few_chunks(layout: str) -> None:
    """The brief's case: a 2-layer body of hidden size 64 (a Qwen2 config) with Qwen2.5's 151,936 tokens, 4,096
    completion tokens, the default budget (441-token chunks of 268 MB). The full logits would take 4,096 x 151,936
    x 4 B = 2.5 GB once, and their path peaks at about 5 GB; here the vocabulary-sized tensors stay within 3 chunks
    and everything the pass allocates (activations, the weights' gradients) within 1 GB."""
    model = qwen_body(QWEN25_VOCAB)
    meter = measure(model, group_micro_batch(4096, QWEN25_VOCAB), layout, DEFAULT_HEAD_CHUNK_MB, QWEN25_VOCAB)
    assert 0 < meter.vocab_peak <= CHUNKS_HELD * chunk_bytes(QWEN25_VOCAB, DEFAULT_HEAD_CHUNK_MB)
    assert meter.peak <= 1_000_000_000, meter.peak
