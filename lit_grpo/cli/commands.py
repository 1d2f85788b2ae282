"""``python -m lit_grpo COMMAND ...``: which module runs a command, imported only once that command is chosen.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's (:func:`lit_grpo.cli.lightning_cli.train`;
:mod:`lit_grpo.cli.lightning_cli` imports Lightning and the training stack). ``serve``, ``route``, ``eval``,
``export``, ``configs`` and ``plots`` are tools (:data:`TOOLS`), each a module with ``main(argv)`` that builds its
argparse parser before it imports torch, so that their ``--help`` and a bad argument answer without loading the
training stack.
:func:`main` is the one place that tells them apart (``lit_grpo.cli.lightning_cli``'s ``main`` and ``run`` are this
module's), and answers ``python -m lit_grpo --help`` itself, from :data:`COMMANDS`, without importing torch.

A bad value ends the program with one line on stderr, ``error: <what> (<where it came from>)``, and exit status 2;
``LIT_GRPO_DEBUG=1`` shows the traceback instead. This module holds that convention, for the tools and for
the training CLI (:mod:`lit_grpo.cli.errors`), and imports nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from lit_grpo.cli.fit_help import HELP_ALL, fit_help, help_request

DEBUG_ENV = "LIT_GRPO_DEBUG"

#: subcommands that are not Trainer methods -> the module whose ``main(argv)`` runs them
TOOLS: dict[str, str] = {"export": "lit_grpo.cli.export", "eval": "lit_grpo.cli.eval",
                         "serve": "lit_grpo.cli.serve", "route": "lit_grpo.cli.route",
                         "configs": "lit_grpo.cli.configs",
                         "plots": "lit_grpo.cli.plots"}
#: every other subcommand (fit, validate, test, predict) and no subcommand at all: LightningCLI, through the
#: ``train(args)`` of this module
TRAINING = "lit_grpo.cli.lightning_cli"
PROG = "python -m lit_grpo"
#: every command -> what it does, in one line: ``python -m lit_grpo --help``
COMMANDS: dict[str, str] = {
    "fit": "train the policy with GRPO from a config (python -m lit_grpo fit --config configs/demo_cpu.yaml)",
    "validate": "Pass@k of the `eval` section on its split (eval.split), for the model or a --ckpt_path checkpoint",
    "test": "Pass@k of the `eval` section on the test split, for the model or a --ckpt_path checkpoint",
    "predict": "sample completions of the `predictions` section's prompts, with their rewards, into a JSONL file",
    "serve": "run a rollout server, which a trainer with data.engine server samples from",
    "route": "run vllm-router in front of several rollout servers (sticky sessions, authenticated routes)",
    "eval": "Pass@k of a model or of a checkpoint's policy, without a config",
    "export": "write a checkpoint's policy (or a model alias) as a Hugging Face model directory",
    "configs": "list the shipped configs, or print one (python -m lit_grpo configs NAME > my.yaml)",
    "plots": "plot runs' TensorBoard scalars to a PNG (python -m lit_grpo plots RUN_DIR -o out.png)",
}


class UsageError(Exception):
    """A bad value given by the person running the CLI: printed as one line, exit status 2."""

    def __init__(self, what: str, where: str) -> None:
        super().__init__(f"{one_line(what)} ({where})")


class ToolParser(argparse.ArgumentParser):
    """The tools' argparse parser: a bad argument is raised as a ``ValueError`` with the usage on the same line,
    which :func:`run_tool` prints as the one-line usage error (argparse would print the usage and exit itself)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message}; usage: {self.format_usage().strip().removeprefix('usage: ')}")


def one_line(text: str) -> str:
    """``text`` with its lines joined by single spaces (argparse and jsonargparse messages span several)."""
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def debug() -> bool:
    """Whether ``LIT_GRPO_DEBUG`` asks for tracebacks instead of one-line errors."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def fail(err: BaseException) -> NoReturn:
    """Print ``error: <err>`` as one line on stderr and exit with status 2."""
    print(f"error: {one_line(str(err))}", file=sys.stderr)
    raise SystemExit(2)


def run_tool(name: str, argv: Sequence[str]) -> None:
    """Run the tool ``name`` (a key of :data:`TOOLS`) on ``argv``; a ``ValueError`` or ``OSError`` it raises
    (a bad argument, an unreadable checkpoint) is printed as one line with exit status 2."""
    tool = importlib.import_module(TOOLS[name])
    try:
        tool.main(list(argv))
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        if debug():
            raise
        fail(UsageError(str(err), " ".join([name, *argv])))


def usage() -> str:
    """The text of ``python -m lit_grpo --help``: every command with what it does."""
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [OPTIONS]", f"       {PROG} COMMAND --help", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    lines += ["", f"A bad value ends with one line on stderr and exit status 2 ({DEBUG_ENV}=1: the traceback)."]
    return "\n".join(lines)


def main(args: Sequence[str] | None = None) -> Any:
    """Run the command line ``args`` (default: ``sys.argv[1:]``): the list of commands for ``--help``, a tool, or
    LightningCLI for everything else (its return value, the CLI object, is passed on)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        raise SystemExit(0)
    if argv and argv[0] in TOOLS:
        run_tool(argv[0], argv[1:])
        return None
    wanted = help_request(argv)
    if wanted == "short":  # answered here: LightningCLI's parser takes seconds of imports to build
        print(fit_help(PROG))
        raise SystemExit(0)
    if wanted == "all":  # LightningCLI's own --help, every option
        argv = ["--help" if arg == HELP_ALL else arg for arg in argv]
        if args is None:
            sys.argv[1:] = argv
    from lit_grpo.cli.early_checks import early_refusal

    # a value that the command line and its files alone show to be bad: refused before Lightning is imported
    # (under LIT_GRPO_DEBUG LightningCLI refuses it, with the traceback)
    if not debug() and (refused := early_refusal(argv)) is not None:
        fail(UsageError(*refused))
    # None, not sys.argv's copy: LightningCLI reads sys.argv itself and warns when it is given both
    return importlib.import_module(TRAINING).train(None if args is None else argv)


def run() -> None:
    """Console-script entry point: exit status 0 after a run, not the CLI object."""
    main()
