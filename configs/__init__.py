"""The shipped run configurations (YAML), installed as ``lit_grpo.configs``: ``python -m lit_grpo configs``
lists them and ``python -m lit_grpo configs NAME`` prints one."""
