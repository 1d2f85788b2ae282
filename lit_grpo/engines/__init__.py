"""Rollout engines behind one contract (``base``: `RolloutEngine`, with `RemoteEngine` and `ReferenceServing` for
what an engine in other processes adds): in process (`TransformersEngine`, colocated `VLLMEngine`) or rollout servers
over HTTP (`ServerEngine`, the trainer's side in ``remote``); each kind's options in ``options``. It imports
``core``, ``math``, ``models`` and the shared protocol (``wire``); never data, training, the server process or the
command line."""

from lit_grpo.engines.base import Completion, ReferenceServing, RemoteEngine, RolloutEngine, SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine

__all__ = ["Completion", "ReferenceServing", "RemoteEngine", "RolloutEngine", "SamplingConfig", "ServerEngine",
           "TransformersEngine", "VLLMEngine"]


def __getattr__(name: str) -> type:
    if name == "ServerEngine":  # the HTTP client of rollout servers (lit_grpo.engines.remote)
        from lit_grpo.engines.remote.client import ServerEngine

        return ServerEngine
    # vLLM is imported only when asked for: it is an optional extra and heavy.
    if name == "VLLMEngine":
        from lit_grpo.engines.vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
