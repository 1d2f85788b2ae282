"""Writes :mod:`lit_grpo.cli.option_table`, the table of ``fit``'s options that :mod:`lit_grpo.cli.option_types`
reads, from LightningCLI's parser (which imports the training stack):

    python -m lit_grpo.cli.write_option_table --write   # after an option of fit was added, removed or retyped
    python -m lit_grpo.cli.write_option_table --check   # exit 1 where the written table is not the parser's
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lit_grpo.cli.option_types import ANY, GROUP, describe


def table_of(parser: Any) -> dict[str, str]:
    """The table of a ``fit`` parser (jsonargparse): every option and section, in the parser's order."""
    from jsonargparse import ActionConfigFile
    from jsonargparse._actions import _ActionConfigLoad, _ActionHelpClassPath, _ActionPrintConfig
    from jsonargparse._link_arguments import ActionLink

    table: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, (ActionConfigFile, _ActionPrintConfig, _ActionHelpClassPath)) or action.dest == "help":
            continue
        if isinstance(action, _ActionConfigLoad):
            table[action.dest] = GROUP
        elif isinstance(action, ActionLink):
            table[action.dest] = ANY  # set through its source; the parser says so
        else:
            hint = getattr(action, "_typehint", None)
            table[action.dest] = ANY if hint is None else describe(hint)
    return table


def fit_parser() -> Any:
    """LightningCLI's parser of ``fit``, built as ``python -m lit_grpo fit`` builds it (imports the training stack)."""
    from lit_grpo.cli import lightning_cli

    class Built(Exception):
        """Carries the parser out of LightningCLI's constructor, before it parses anything."""

    class Probe(lightning_cli.GRPOCLI):
        def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
            raise Built(parser)

    try:
        Probe(lightning_cli.GRPOModule, lightning_cli.RolloutDataModule, args=["fit"],
              auto_configure_optimizers=False, parser_kwargs={"prog": "lit_grpo"})
    except Built as built:
        return built.args[0]._subcommands_action._name_parser_map["fit"]
    raise RuntimeError("LightningCLI parsed its arguments before this probe could stop it")


def render(table: dict[str, str]) -> str:
    """The source of :mod:`lit_grpo.cli.option_table` for ``table``."""
    lines = ['"""Every option of ``fit`` and what it accepts (see :mod:`lit_grpo.cli.option_types`). Written by',
             "``python -m lit_grpo.cli.write_option_table --write``; do not edit: tests/test_option_types.py checks",
             'it against LightningCLI\'s parser."""', "", "OPTIONS: dict[str, str] = {"]
    rows = [f"    {key!r}: {entry!r}," for key, entry in table.items()]
    lines += [row if len(row) <= 120 else f"{row}  # noqa: E501 (one option a line)" for row in rows]
    return "\n".join([*lines, "}", ""])


TABLE_FILE = Path(__file__).with_name("option_table.py")


def main(argv: list[str]) -> int:
    """``--write``: write the table from the parser; ``--check``: exit 1 where the written one differs."""
    text = render(table_of(fit_parser()))
    if argv == ["--write"]:
        TABLE_FILE.write_text(text)
        return 0
    if argv == ["--check"]:
        return 0 if TABLE_FILE.read_text() == text else 1
    print("usage: python -m lit_grpo.cli.write_option_table --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
