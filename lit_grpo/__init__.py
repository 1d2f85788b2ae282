"""lit_grpo: on- and off-policy GRPO post-training of language models with PyTorch Lightning.

The package is laid out by role, one folder each (every folder's docstring says what it may import):
``cli`` (the commands), ``training`` (GRPOModule and its step), ``math`` (the paper's formulas, pure torch),
``data`` (prompts, rewards, rollouts), ``engines`` (who samples), ``serve`` and ``wire`` (the rollout server and
what both sides share), ``models`` (loading, copies, LoRA), ``evaluation`` (Pass@k). ``lit_grpo.callbacks`` and
``lit_grpo.configs`` are the repository's top-level ``callbacks/`` and ``configs/`` folders.
"""

from lit_grpo import _layout

__version__ = "0.1.0"

_layout.install(__path__)
