"""Rollout engines behind one interface (`RolloutEngine`)."""

from lit_grpo.engines.base import Completion, RolloutEngine, SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine

__all__ = ["Completion", "RolloutEngine", "SamplingConfig", "TransformersEngine", "VLLMEngine"]


def __getattr__(name: str):
    # vLLM is imported only when asked for: it is an optional extra and heavy.
    if name == "VLLMEngine":
        from lit_grpo.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
