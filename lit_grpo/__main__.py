"""``python -m lit_grpo``: the light dispatcher of :mod:`lit_grpo.cli.commands` (Lightning loads only for training)."""

from lit_grpo.cli.commands import run

if __name__ == "__main__":
    run()
