"""Environments and tools for multi-turn rollouts: the environment protocol a user implements (``protocol``), the
tools that a model calls by name (``tools``; ``calculator``, the demo's) and the formats their calls are parsed from
(``tool_calls``), how a conversation's new messages become tokens without touching the tokens the model sampled
(``rendering``), and adapters for tasks written elsewhere (``reasoning_gym``, ``openenv``). It imports ``core`` only:
environments are plain Python objects, free of engines, tensors of the trainer and Lightning; the data path drives
them."""

from lit_grpo.environments.protocol import Environment, StepResult, resolve_environment

__all__ = ["Environment", "StepResult", "resolve_environment"]
