"""``python -m lit_grpo configs``: the run configurations shipped in the package (:mod:`lit_grpo.configs`, the
repository's ``configs/``), for an install that has no checkout to copy them from.

- ``configs`` lists them: each name, its first comment line, and for a config that is stacked on others (a Table 1
  row on ``gsm8k/base``, a REC setting after a loss) the stack its own usage comment runs;
- ``configs NAME`` prints one to stdout (``python -m lit_grpo configs demo_cpu > demo.yaml``);
- ``configs [NAME] --out DIR`` writes NAME and the configs of its stack (every config without NAME) under DIR,
  keeping their subfolders, so ``--out configs`` makes the commands in the configs' comments run as written.

The configs name no other file (a stack is several ``--config`` options, not an include), so a config printed or
written anywhere runs the same. Reads the YAML as text through :mod:`importlib.resources`: no torch, no Lightning.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

from lit_grpo.cli.commands import ToolParser

if TYPE_CHECKING:  # the module moved in Python 3.11; only the annotation needs it
    from importlib.resources.abc import Traversable

PACKAGE = "lit_grpo.configs"
SUFFIX = ".yaml"
# a `--config configs/<name>.yaml` option in a config's usage comment
CONFIG_OPTION = re.compile(r"--config[ =]configs/(\S+?)\.yaml\b")


@dataclass(frozen=True)
class ShippedConfig:
    """One shipped config: its name (the path under ``configs/`` without ``.yaml``) and its text."""

    name: str
    text: str

    @property
    def description(self) -> str:
        """The first comment line (every shipped config opens with what it runs), with ``...`` where its sentence
        goes on in the next line."""
        for line in self.text.splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                first = stripped.lstrip("#").strip()
                return first if first.endswith((".", ":", ")", "!", "?")) else f"{first} ..."
            if stripped:
                break
        return ""

    @property
    def stack(self) -> list[str]:
        """The configs its first ``fit`` usage comment passes as ``--config``, in order (this one among them);
        just this one when the comment runs it alone or there is no such comment."""
        for command in usage_commands(self.text):
            if " fit " in f"{command} ":
                names = CONFIG_OPTION.findall(command)
                if self.name in names:
                    return names
        return [self.name]


def usage_commands(text: str) -> list[str]:
    """The ``python -m lit_grpo ...`` commands of a config's leading comment, ``\\``-continued lines joined."""
    commands: list[str] = []
    joining = False
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if joining:
            commands[-1] += " " + body.removesuffix("\\").strip()
        elif "python -m lit_grpo " in body:
            commands.append(body[body.index("python -m lit_grpo "):].removesuffix("\\").strip())
        else:
            continue
        joining = body.endswith("\\")
    return commands


def shipped() -> dict[str, ShippedConfig]:
    """Every shipped config by name (``demo_cpu``, ``gsm8k/v10_i1``), sorted."""
    found: dict[str, ShippedConfig] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(SUFFIX):
                name = prefix + entry.name.removesuffix(SUFFIX)
                found[name] = ShippedConfig(name, entry.read_text(encoding="utf-8"))

    walk(files(PACKAGE), "")
    return dict(sorted(found.items()))


def canonical(name: str) -> str:
    """The config name of ``name`` as a person may write it: ``demo_cpu``, ``demo_cpu.yaml``,
    ``configs/gsm8k/v10_i1.yaml`` (the paths the README and the configs' comments show)."""
    name = name.strip().replace("\\", "/").removeprefix("./").removeprefix("configs/")
    return name.removesuffix(SUFFIX).removesuffix(".yml")


def find(name: str, configs: dict[str, ShippedConfig]) -> ShippedConfig:
    """The shipped config ``name``; an unknown one is a ``ValueError`` naming it and every known name."""
    config = configs.get(canonical(name))
    if config is None:
        raise ValueError(f"unknown config {name!r}; the shipped configs are: {', '.join(configs)}")
    return config


def listing(configs: dict[str, ShippedConfig]) -> str:
    """The listing ``configs`` prints: name and description, and the stack of a config not run alone."""
    width = max(len(name) for name in configs) + 2
    lines = []
    for name, config in configs.items():
        lines.append(f"{name:<{width}}{config.description}")
        if config.stack != [name]:
            lines.append(f"{'':<{width}}stacked: {' + '.join(config.stack)} (a --config each, in this order)")
    lines += ["", "python -m lit_grpo configs NAME > NAME.yaml     # print one",
              "python -m lit_grpo configs [NAME] --out configs   # write NAME and its stack (default: all) as files"]
    return "\n".join(lines)


def write(chosen: list[ShippedConfig], out: Path) -> list[Path]:
    """Write ``chosen`` under ``out`` as ``<name>.yaml``; a different existing file is left alone (``ValueError``)
    so that a config someone edited is never overwritten."""
    targets = [(config, out / f"{config.name}{SUFFIX}") for config in chosen]
    clashes = [str(path) for config, path in targets if path.exists() and path.read_text() != config.text]
    if clashes:
        raise ValueError(f"{', '.join(clashes)} already exist with other content; remove them or choose another --out")
    for config, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config.text, encoding="utf-8")
    return [path for _, path in targets]


def build_parser() -> argparse.ArgumentParser:
    """The ``configs`` arguments."""
    parser = ToolParser(
        prog="python -m lit_grpo configs",
        description="List the run configurations shipped with lit_grpo, print one (to start from it: "
        "python -m lit_grpo configs demo_cpu > demo.yaml; python -m lit_grpo fit --config demo.yaml), "
        "or write them as files.")
    parser.add_argument("name", nargs="?", help="a config to print, e.g. demo_cpu or gsm8k/v10_i1 (.yaml optional)")
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="write NAME and the configs it is stacked on (without NAME: every config) under DIR "
                             "as DIR/<name>.yaml instead of printing")
    return parser


def main(argv: Sequence[str]) -> None:
    """The ``configs`` subcommand; errors are raised for the CLI to print."""
    args = build_parser().parse_args(list(argv))
    configs = shipped()
    if args.out is None:
        text = listing(configs) + "\n" if args.name is None else find(args.name, configs).text
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            # `configs | head`: the reader has what it wanted; silence the flush at exit instead of an error line
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return
    chosen = list(configs.values()) if args.name is None else \
        [find(name, configs) for name in find(args.name, configs).stack]
    written = write(chosen, args.out)
    for path in written:
        print(f"wrote {path}")
    if args.name is not None:
        print("run it: python -m lit_grpo fit " + " ".join(f"--config {path}" for path in written))
