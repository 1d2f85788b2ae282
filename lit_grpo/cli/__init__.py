"""The command line, ``python -m lit_grpo COMMAND`` (``commands``: the dispatch and the one-line error rule): fit,
validate, test and predict through LightningCLI (``lightning_cli``, its hooks and error handling), and the tools
``eval``, ``export``, ``configs`` and ``plots``. It may import every other role; no other role imports it.
Importing this package imports nothing heavy: ``--help`` answers before torch loads."""

from typing import Any


def __getattr__(name: str) -> Any:
    """The names of the former module ``lit_grpo.cli`` (now ``lit_grpo.cli.lightning_cli``), loaded on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    module = importlib.import_module("lit_grpo.cli.lightning_cli")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'lit_grpo.cli' has no attribute {name!r}") from None
