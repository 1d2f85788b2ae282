"""lit_grpo: on- and off-policy GRPO post-training of language models with PyTorch Lightning."""

__version__ = "0.1.0"
