"""A malformed weight-push round sent to a real ``vllm serve`` over this package's gloo plugin: the worker checks
the round against the vLLM model's own parameters before its layerwise reload sets any layer aside, refuses it
with the bad entries named, and keeps every weight and the version; a well-formed round then loads (the checks
resolve the checkpoint's names through vLLM's packed layers).

The vLLM tier: ``python -m pytest -m vllm`` in the CPU-with-vLLM environment (README, Install)."""

from __future__ import annotations

import pytest
from vllm_helpers import VLLMServe, perturbed, requires_vllm, save_model, tiny_vllm_llama

pytestmark = [pytest.mark.vllm, requires_vllm]


def test_vllm_serve_refuses_a_malformed_round_and_keeps_its_weights(tmp_path):
    import torch

    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.wire.protocol import ServerError

    server = VLLMServe(save_model(tmp_path / "tiny"), tmp_path / "serve.log")
    try:
        server.wait_ready()
        model, _ = tiny_vllm_llama()

        def engine(policy: torch.nn.Module, dtype: str) -> ServerEngine:
            return ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype=dtype, policy=policy,
                                timeout_s=120, token=server.token)

        first = engine(model, "float32")
        first.load_weights(model.named_parameters(), step=1)
        before = first.weight_checksums()[server.url]
        first.close()

        # the server holds float32: a round of bfloat16 tensors is refused before anything loads
        other = perturbed(tiny_vllm_llama()[0], scale=0.5, seed=3)
        wrong = engine(other, "bfloat16")
        with pytest.raises(ServerError) as refused:
            wrong.load_weights(other.named_parameters(), step=2)
        message = str(refused.value)
        assert "malformed weight-push round refused by the vLLM worker, nothing loaded" in message, message
        assert "dtype bfloat16, expected float32" in message and "\n" not in message
        wrong.close()

        # the server is untouched, and a well-formed round still goes through (a fresh group)
        right = engine(other, "float32")
        assert right.weight_checksums()[server.url] == before
        assert right.weight_versions() == {server.url: "1"}
        right.load_weights(other.named_parameters(), step=3)
        assert right.weight_versions() == {server.url: "3"}
        assert right.weight_checksums()[server.url] != before
        right.close()
    finally:
        server.stop()
