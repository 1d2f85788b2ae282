"""Rollout engines behind one interface (`RolloutEngine`)."""

from lit_grpo.engines.base import Completion, RolloutEngine, SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "ServerEngine", "TransformersEngine", "VLLMEngine"]


def __getattr__(name: str) -> type:
    if name == "ServerEngine":  # the HTTP client of rollout servers, in the serving package
        from lit_grpo.serving.client import ServerEngine

        return ServerEngine
    # vLLM is imported only when asked for: it is an optional extra and heavy.
    if name == "VLLMEngine":
        from lit_grpo.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
