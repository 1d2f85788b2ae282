"""The training CLI's one-line errors, ``error: <what> (<key>, <where its value came from>)`` and exit status 2 (the
rule is :mod:`lit_grpo.cli.commands`'s), before any model is loaded where the value allows it. jsonargparse raises
its parse errors (``exit_on_error=False``); ``--ckpt_path`` and its hyperparameters are checked in
``parse_arguments``, before LightningCLI reads them; :mod:`lit_grpo.cli.hooks` locates a constructor's error."""

from __future__ import annotations

import inspect
import logging
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from lit_grpo.cli.commands import UsageError, debug, fail, one_line
from lit_grpo.cli.hooks import key_of_parse_error, object_under_construction
from lit_grpo.cli.option_hints import option_hint
from lit_grpo.cli.resume import LAST, checkpoint_folders, describe, latest_checkpoint
from lit_grpo.cli.sources import where
from lit_grpo.core.checkpoints import Checkpoint, CheckpointError
from lit_grpo.data.sampler_check import SamplerMismatchError
from lit_grpo.environments.protocol import EnvironmentFault

__all__ = ["HeldBack", "OneLineErrorsCLI", "held_back", "report_usage_errors"]
T = TypeVar("T")
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")  # ckpt_path values Lightning resolves itself
_USAGE_ERRORS = (ValueError, TypeError, MisconfigurationException)  # what a constructor raises for a bad value
# the config group of an object being built (the innermost one when nested)
_GROUPS = {Callback: "trainer.callbacks", LightningDataModule: "data", LightningModule: "model", Trainer: "trainer"}


class HeldBack:
    """Lightning's log lines ("Seed set to 0", the device summary) and Python warnings, held from the end of parsing
    until every value is checked so that a bad value prints its error line alone; let out in order afterwards."""

    items: list[Callable[[], None]] | None = None  # while held

    def start(self) -> None:
        if self.items is not None:
            return
        items: list[Callable[[], None]] = []
        self.items, self.showwarning = items, warnings.showwarning
        self.saved = [(lg, lg.handlers) for lg in map(logging.getLogger, ("lightning.fabric", "lightning.pytorch"))]
        hold = logging.Handler()
        hold.emit = lambda record: items.append(lambda: logging.getLogger(record.name).handle(record))  # type: ignore
        for logger, _ in self.saved:
            logger.handlers = [hold]
        warnings.showwarning = lambda *args, **kw: items.append(lambda: self.showwarning(*args, **kw))

    def stop(self, replay: bool = True) -> None:
        if self.items is None:
            return
        items, self.items, warnings.showwarning = self.items, None, self.showwarning
        for logger, handlers in self.saved:
            logger.handlers = handlers
        for emit in items if replay else ():
            emit()


held_back = HeldBack()


class OneLineErrorsCLI(LightningCLI):
    """A LightningCLI whose bad values raise :class:`~lit_grpo.cli.commands.UsageError` naming the config key and
    where its value came from; a subclass raises one for values of its own in ``before_instantiate_classes``, and
    turns a failure of the subcommand it runs into one in :meth:`run_failure`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.get("args")  # as typed, to tell where a value came from (LightningCLI reads sys.argv if None)
        self._argv = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else sys.argv[1:] if argv is None else []
        self._checkpoint: Checkpoint | None = None
        self._resumed_last: Path | None = None  # what `ckpt_path last` resolved to (lit_grpo.cli.resume)
        try:  # LightningCLI parses, builds and runs the subcommand here
            super().__init__(*args, **kwargs)
        except Exception as err:
            usage = self.run_failure(err) if not isinstance(err, UsageError) else None
            if usage is None:
                raise
            raise usage from err

    def run_failure(self, err: Exception) -> UsageError | None:
        """The one-line error for ``err``, raised while the subcommand ran (None: it stays as it is)."""
        return None

    def init_parser(self, **kwargs: Any):  # noqa: ANN201
        kwargs.setdefault("exit_on_error", False)  # raised, not printed with the 80-line usage
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            message, key = one_line(str(err)), key_of_parse_error(str(err))  # "fit.model.lr" under a subcommand
            key = key.partition(".")[2] if key and key.partition(".")[0] in self.subcommands() else key
            sub = next((a for a in self._argv if a in self.subcommands()), None)  # the known keys are its parser's
            hint = option_hint(message, list(map(str, (self._parser(sub) if sub else parser).get_defaults().keys())))
            raise UsageError(message + (f"; {hint}" if hint else ""), self._where(key)) from err
        ckpt_path = self._subcommand_config().get("ckpt_path") if self.config.get("subcommand") else None
        if str(ckpt_path) == LAST and self.config.get("subcommand") == "fit":
            ckpt_path = self._resolve_last()
        if ckpt_path and str(ckpt_path) not in _CKPT_KEYWORDS and "://" not in str(ckpt_path):
            try:  # read before LightningCLI loads it, and merges its hyperparameters, with a traceback
                self._checkpoint = Checkpoint(ckpt_path)
                hparams = {k: v for k, v in self._checkpoint.hyper_parameters.items() if k != "_instantiator"}
                if hparams and not self._checkpoint.sharded and "_class_path" not in hparams:
                    parser.parse_object({self.config.subcommand: {"model": hparams}}, self.config)
            except CheckpointError as err:
                raise UsageError(str(err), self._where("ckpt_path")) from err
            except ArgumentError as err:
                raise UsageError(f"the hyperparameters in checkpoint {self._checkpoint.path} do not fit: {err}",
                                 self._where("ckpt_path")) from err
        held_back.start()

    def _resolve_last(self) -> str | None:
        """``fit``'s ``ckpt_path last``: the run's newest checkpoint over every version of its folder
        (:mod:`lit_grpo.cli.resume`), put in the config as if named; None, after one line, when there is none."""
        config = self._subcommand_config()
        try:
            folders = checkpoint_folders(config.get("trainer"))
        except ValueError as err:
            raise UsageError(str(err), self._where("ckpt_path")) from err
        found = latest_checkpoint(folders)
        self._resumed_last = found
        config["ckpt_path"] = None if found is None else str(found)
        if found is None:  # Lightning's own line would say to set save_last, which is not what is missing
            print(f"ckpt_path last: no checkpoint in {describe(folders)}; the fit starts from the beginning",
                  file=sys.stderr)
        return config["ckpt_path"]

    def instantiate_classes(self) -> None:
        try:  # a subclass refuses values of its own before, in before_instantiate_classes
            super().instantiate_classes()
        except _USAGE_ERRORS as err:
            # jsonargparse wraps a callback's error in its own: the outermost one a constructor of ours raised
            chain = [err]
            while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and inner not in chain:
                chain.append(inner)
            missing = missing_package(str(err))  # before the causes: the class's own error is a long union error
            if missing is not None:
                raise UsageError(missing[1], self._where(missing[0])) from err
            for cause in chain:
                if isinstance(cause, _USAGE_ERRORS) and (key := self._raised_by(cause)) is not None:
                    raise UsageError(str(cause), self._where(key)) from err
            raise UsageError(str(err), self._where(None)) from err
        if self._checkpoint is None:  # else held until a subclass finds the checkpoint to fit the model
            held_back.stop()

    def _subcommand_config(self) -> Any:
        return self.config[self.config.subcommand] if self.config.get("subcommand") else self.config

    def _raised_by(self, err: BaseException) -> str | None:
        """The config key a constructor's error is about: the innermost object under construction tells the group
        (a section of its own such as ``sync`` or ``model.optimizer``, else model, data, trainer or a callback of
        trainer.callbacks), the argument its message names or whose value it quotes."""
        groups = getattr(self._parser(self.subcommand), "groups", {})
        sections = {cls: key for key, group in reversed(groups.items())  # the first section of a class names it
                    if isinstance(cls := getattr(group, "group_class", None), type)}
        owner = object_under_construction(err, (*_GROUPS, *sections))
        if owner is None:
            return None
        group = sections.get(type(owner)) or next(name for cls, name in _GROUPS.items() if isinstance(owner, cls))
        params = [p.name for p in inspect.signature(type(owner).__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        # an argument named alone or after its section's last part ("optimizer.lr"), not after another key's
        leaf = re.escape(group.rpartition(".")[2])
        named = [(m.start(), p) for p in params
                 if (m := re.search(rf"(?:(?<![\w.])|(?<=\b{leaf}\.)){re.escape(p)}(?!\w)", str(err)))]
        if group == "trainer.callbacks":
            return f"trainer.callbacks: {type(owner).__name__}" + (f".{min(named)[1]}" if named else "")
        values = {p: self._subcommand_config().get(f"{group}.{p}") for p in params}
        quoted = [p for p, v in values.items() if any(isinstance(x, str) and len(x) > 2 and x in str(err)
                                                      for x in (v if isinstance(v, (list, tuple)) else [v]))]
        return f"{group}.{min(named)[1]}" if named else f"{group}.{quoted[0]}" if quoted else group

    def _where(self, key: str | None, *, exact: bool = False) -> str:
        """``key`` and where its value came from: the command line or the last config file setting it. A group
        (``model``, a callback of trainer.callbacks) is named with all the sources, unless ``exact``."""
        return where(self._argv, key, self.subcommands(), _GROUPS.values(), exact=exact)


#: jsonargparse's words for a class whose package is missing (Lightning's loggers check their requirement when built)
_MISSING_REQUIREMENT = re.compile(r"class_path '(?P<path>[\w.]+)':\s+Requirement '(?P<requirement>[^']+)' not met")


def missing_package(message: str) -> tuple[str | None, str] | None:
    """``(config key, one line)`` for an error that says a class of the config needs a package that is not
    installed (``--trainer.logger WandbLogger`` without ``wandb``), with the install command; None for any other."""
    match = _MISSING_REQUIREMENT.search(message)
    if match is None:
        return None
    path, requirement = match["path"], match["requirement"]
    package = re.split(r"[<>=!~\[;\s]", requirement, maxsplit=1)[0]
    module, _, name = path.rpartition(".")
    key = "trainer.logger" if ".loggers" in module else "trainer.callbacks" if ".callbacks" in module else None
    return key, (f"{key + ' ' if key else ''}{name} needs the package {package}, which is not installed: "
                 f"pip install '{requirement}'")


def report_usage_errors(build: Callable[[], T]) -> T:
    """``build()`` (which makes a :class:`OneLineErrorsCLI`), with a usage error (or what the run finds once it
    started: the rollout engine's sampler mismatch, an environment that cannot start a task or fails on the whole
    first batch) printed as one line and exit status 2, or re-raised under ``LIT_GRPO_DEBUG``; the held-back log
    lines are let out unless the error is printed."""
    try:
        return build()
    except (UsageError, ArgumentError, SamplerMismatchError, EnvironmentFault) as err:
        held_back.stop(replay=debug())
        if debug():
            raise
        where = "data.engine_options and the server's flags" if isinstance(err, SamplerMismatchError) \
            else err.key if isinstance(err, EnvironmentFault) else "arguments"
        fail(err if isinstance(err, UsageError) else UsageError(str(err), where))
    finally:
        held_back.stop()  # no-op once stopped
