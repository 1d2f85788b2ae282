"""The training CLI's one-line errors: a bad value, in a config file, on the command line or in ``--ckpt_path``,
ends the program with one line on stderr, ``error: <what> (<key>, <where its value came from>)``, and exit status 2,
before any model is loaded where the value allows it (the data module is built before the model).
``LIT_GRPO_DEBUG=1`` shows the traceback instead. Errors raised once training has started keep their tracebacks.

:class:`OneLineErrorsCLI` is the LightningCLI base that turns jsonargparse's and Lightning's exceptions into a
:class:`~lit_grpo.cli.commands.UsageError` naming the key and the source of its value; :func:`report_usage_errors`
prints it. The convention itself (the line, the exit status, the debug switch) is :mod:`lit_grpo.cli.commands`'s, shared
with the tools; what locating an error needs from Lightning and jsonargparse beyond their documented API is in
:mod:`lit_grpo.cli.hooks`.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from lit_grpo.cli.commands import UsageError, debug, fail, one_line
from lit_grpo.cli.hooks import key_of_parse_error, object_under_construction
from lit_grpo.core.checkpoints import Checkpoint, CheckpointError
from lit_grpo.data.sampler_check import SamplerMismatchError

__all__ = ["MOVED_OPTIONS", "NOT_OFFERED", "OneLineErrorsCLI", "option_hint", "report_usage_errors"]
T = TypeVar("T")
# values of ckpt_path that Lightning resolves itself rather than reading a path
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
# what a constructor raises for a bad value (Lightning's Trainer raises MisconfigurationException)
_USAGE_ERRORS = (ValueError, TypeError, MisconfigurationException)
# which config group an object being built belongs to, innermost first when nested
_GROUPS: tuple[tuple[type, str], ...] = (
    (Callback, "trainer.callbacks"), (LightningDataModule, "data"), (LightningModule, "model"), (Trainer, "trainer"),
)
#: option paths of earlier versions -> where the option lives now (``git log -p`` of configs/, module.py,
#: datamodule.py, losses.py and the callbacks); an unknown option named here gets its new place in its error line
MOVED_OPTIONS: dict[str, str] = {
    "model.lr": "model.optimizer.lr",
    "model.weight_decay": "model.optimizer.weight_decay",
    "model.adam_betas": "model.optimizer.betas",
    "model.warmup_steps": "model.optimizer.warmup_steps",
    "model.lr_schedule": "model.optimizer.schedule",
    "model.eps_low": "model.loss_options.grpo.eps_low",
    "model.eps_high": "model.loss_options.grpo.eps_high",
    "model.exact_ref_ratio": "model.loss_options.grpo.exact_ref_ratio",
    "model.ratio_cap": "model.loss_options.grpo.ratio_cap",
    "model.loss_options.ring_eps_low": "model.loss_options.rec_ring.ring_eps_low",
    "model.loss_options.ring_eps_high": "model.loss_options.rec_ring.ring_eps_high",
    "model.loss_options.tau": "model.loss_options.opmd.tau",  # or asymre.tau: the section of model.loss
    "model.loss_options.temperature": "model.loss_options.red_weight.temperature",
    "eval.every_n_steps": "eval.every_n_optimizer_steps",
}
#: LightningCLI options this CLI does not offer -> why, and what sets the same thing here
NOT_OFFERED: dict[str, str] = {
    "optimizer": "GRPOModule builds its own AdamW from `model.optimizer` (model.optimizer.lr, "
                 "model.optimizer.weight_decay, model.optimizer.betas)",
    "lr_scheduler": "GRPOModule builds its own schedule from `model.optimizer` (model.optimizer.schedule: constant, "
                    "linear or cosine; model.optimizer.warmup_steps)",
}
_UNKNOWN_OPTION = re.compile(r"(?:^|\s)--([\w.]+)(?:[=+\s]|$)|accept option '([\w.]+)'")


class _HeldBack:
    """Holds back Lightning's log lines ("Seed set to 0", the device summary) and Python warnings from the
    moment the arguments parse until the model, data module and trainer are built, so that a bad value prints
    its error line alone. Once the classes are built (or on any other error) they are replayed in order."""

    LOGGERS = ("lightning.fabric", "lightning.pytorch")

    def __init__(self) -> None:
        self.active = False

    def start(self) -> None:
        if self.active:
            return
        self.items: list[Callable[[], None]] = []
        self.saved = {name: (logging.getLogger(name).handlers[:], logging.getLogger(name).propagate)
                      for name in self.LOGGERS}
        held = self.items

        class Hold(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                held.append(lambda: logging.getLogger(record.name).handle(record))

        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = [Hold()], False
        self.showwarning = warnings.showwarning

        def hold_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
            held.append(lambda: self.showwarning(message, category, filename, lineno, file, line))

        warnings.showwarning = hold_warning
        self.active = True

    def stop(self, replay: bool) -> None:
        if not self.active:
            return
        self.active = False
        warnings.showwarning = self.showwarning
        for name, (handlers, propagate) in self.saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
        if replay:
            for emit in self.items:
                emit()


_held_back = _HeldBack()


class OneLineErrorsCLI(LightningCLI):
    """A LightningCLI whose bad values raise :class:`~lit_grpo.cli.commands.UsageError` naming the config key and
    where its value came from. A subclass refuses values of its own in :meth:`check_values`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.get("args")
        # the arguments as typed, to tell where a bad value came from (LightningCLI reads sys.argv when None)
        self._argv = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else (
            sys.argv[1:] if argv is None else [])
        self._checkpoint: Checkpoint | None = None
        # "parsed" from the end of parse_arguments to before_instantiate_classes: LightningCLI parses the
        # checkpoint's hyperparameters in between (lit_grpo.cli.hooks.HPARAMS_BETWEEN)
        self._stage = "parsing"
        try:
            super().__init__(*args, **kwargs)
        except ArgumentError as err:
            if self._stage != "parsed":
                raise
            path = self._checkpoint.path if self._checkpoint is not None else "ckpt_path"
            raise UsageError(
                f"the hyperparameters in checkpoint {path} do not fit: {err}", self._where("ckpt_path")
            ) from err

    def init_parser(self, **kwargs: Any):  # noqa: ANN201
        # parse errors are raised, not printed with the 80-line usage, so that they print as one line
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            message = one_line(str(err))
            key = key_of_parse_error(message)
            hint = option_hint(message, self._known_keys(args))
            raise UsageError(message + (f"; {hint}" if hint else ""),
                             self._where(self._strip_subcommand(key) if key else None)) from err
        ckpt_path = self._subcommand_config().get("ckpt_path") if self.config.get("subcommand") else None
        if ckpt_path and str(ckpt_path) not in _CKPT_KEYWORDS and "://" not in str(ckpt_path):
            # read it now: LightningCLI loads it next for its hyperparameters, with a traceback when it is bad
            try:
                self._checkpoint = Checkpoint(ckpt_path)
            except CheckpointError as err:
                raise UsageError(str(err), self._where("ckpt_path")) from err
        _held_back.start()
        self._stage = "parsed"

    def before_instantiate_classes(self) -> None:
        self._stage = "instantiating"

    def check_values(self) -> None:
        """Refuse values before any class is built, raising :class:`~lit_grpo.cli.commands.UsageError`."""

    def instantiate_classes(self) -> None:
        try:
            self.check_values()
            super().instantiate_classes()
        except UsageError:
            _held_back.stop(replay=False)
            raise
        except _USAGE_ERRORS as err:
            _held_back.stop(replay=False)
            # jsonargparse re-raises a callback's error inside a long "does not validate" message: report the
            # outermost error that a constructor of ours raised, where there is one
            for cause in _chain(err):
                key = self._raised_by(cause) if isinstance(cause, _USAGE_ERRORS) else None
                if key is not None:
                    raise UsageError(str(cause), self._where(key)) from err
            raise UsageError(str(err), self._where(None)) from err
        if self._checkpoint is None:  # else held until the checkpoint is found to fit the model
            _held_back.stop(replay=True)

    def _check_checkpoint_fits(self) -> None:
        if self._checkpoint is None:
            return
        from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

        where = self._where("ckpt_path")
        if self._checkpoint.sharded and not isinstance(self.trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
            _held_back.stop(replay=False)
            raise UsageError(
                f"checkpoint {self._checkpoint.path} is a sharded directory, which only trainer.strategy "
                f"ModelParallelStrategy or FSDPStrategy can resume from (this run uses "
                f"{type(self.trainer.strategy).__name__}); `python -m lit_grpo export` reads it anywhere", where)
        try:
            layout = getattr(self.model, "checkpoint_layout", self.model.state_dict)()  # pi_ref may not exist yet
            self._checkpoint.check_fits(layout, strict=self.model.strict_loading)
        except CheckpointError as err:
            _held_back.stop(replay=False)
            raise UsageError(str(err), where) from err
        self._checkpoint = None  # Lightning reads the file itself; no need to keep it mapped during training
        _held_back.stop(replay=True)

    def before_fit(self) -> None:
        self._check_checkpoint_fits()

    before_validate = before_test = before_predict = before_fit

    def _known_keys(self, args: Any) -> list[str]:
        """The option paths of the subcommand ``args`` names (of the main parser without one), for suggestions."""
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else self._argv
        name = next((a for a in argv if a in self.subcommands()), None)
        try:
            parser = self._parser(name) if name else self.parser
            return [str(k) for k in parser.get_defaults().keys()]
        except Exception:  # noqa: BLE001 - a suggestion is a courtesy: no suggestion rather than a second error
            return []

    def _policy_from_checkpoint(self, policy: Any, prefix: str = "policy.") -> int:
        """Load the ``--ckpt_path`` checkpoint's policy tensors (``prefix``) into ``policy``, as ``validate``,
        ``test`` and ``predict`` read weights; returns the checkpoint's ``global_step`` (0 without a checkpoint).
        A keyword (``last``, ``best``) or a checkpoint that does not fit is a usage error."""
        ckpt_path = self._subcommand_config().get("ckpt_path")
        where = self._where("ckpt_path")
        if ckpt_path and self._checkpoint is None:
            raise UsageError(f"ckpt_path {ckpt_path!r}: {self.subcommand} reads a checkpoint file or sharded "
                             f"directory; `last` and `best` are resolved by fit only: name the file", where)
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is not None:
            from lit_grpo.cli.export import tied_aliases

            expected = policy.state_dict()
            aliases = tied_aliases(policy)
            try:
                checkpoint.check_fits(expected, prefix=prefix, optional=aliases)
                policy.load_state_dict(checkpoint.tensors(prefix, like=expected), strict=False)
            except CheckpointError as err:
                raise UsageError(str(err), where) from err
        _held_back.stop(replay=True)
        return int(checkpoint.meta.get("global_step", 0)) if checkpoint is not None else 0

    # ---- where a value came from ----------------------------------------------------------------------
    def _subcommand_config(self) -> Any:
        return self.config[self.config.subcommand] if self.config.get("subcommand") else self.config

    def _strip_subcommand(self, key: str) -> str:
        first, _, rest = key.partition(".")
        return rest if rest and first in self.subcommands() else key

    def _raised_by(self, err: BaseException) -> str | None:
        """The config key of the value an error from a constructor is about: the innermost object under
        construction tells the group (model, data, trainer, a callback, an option group such as
        model.optimizer), the message the argument."""
        # a class with its own config section (model, data, a callback group such as `sync`, a dataclass of
        # options) is named by it
        sections = {key: cls for key, group in getattr(self._parser(self.subcommand), "groups", {}).items()
                    if isinstance(cls := getattr(group, "group_class", None), type)}
        owner = object_under_construction(err, tuple(cls for cls, _ in _GROUPS) + tuple(sections.values()))
        if owner is None:
            return None
        group = next((key for key, cls in sections.items() if cls is type(owner)), None) or next(
            name for cls, name in _GROUPS if isinstance(owner, cls))
        message = str(err)
        params = [p for p in inspect.signature(type(owner).__init__).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        # an argument named alone or after its section's last part ("optimizer.lr"), not after another key's
        leaf = re.escape(group.rpartition(".")[2])
        named = [(m.start(), p.name) for p in params
                 if (m := re.search(rf"(?:(?<![\w.])|(?<=\b{leaf}\.)){re.escape(p.name)}(?!\w)", message))]
        if group == "trainer.callbacks":  # one of the trainer.callbacks list
            param = min(named)[1] if named else None
            return f"trainer.callbacks: {type(owner).__name__}" + (f".{param}" if param else "")
        if named:
            return f"{group}.{min(named)[1]}"
        config = self._subcommand_config()
        for p in params:  # no argument named: the one whose value the message quotes ("unknown model 'x'")
            value = config.get(f"{group}.{p.name}")
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, str) and len(v) > 2 and v in message for v in values):
                return f"{group}.{p.name}"
        return group

    def _where(self, key: str | None, *, exact: bool = False) -> str:
        """``key`` and where its value came from: the command line or the last config file setting it. A group
        (``model``, a callback of trainer.callbacks) is named with all the sources, unless ``exact``."""
        files = _config_files(self._argv)
        if key is None or not exact and (key in dict(_GROUPS).values() or key.startswith("trainer.callbacks:")):
            sources = ", ".join(files + ["the command line"]) if files else "the command line"
            return f"{key}, from {sources}" if key else f"from {sources}"
        # `--key+=value` appends to a list (trainer.callbacks)
        if any(a == f"--{key}" or a.startswith((f"--{key}=", f"--{key}+")) for a in self._argv):
            return f"{key}, on the command line"
        for path in reversed(files):  # a later --config overrides an earlier one
            if _sets(path, key, self.subcommands()):
                return f"{key}, in {path}"
        return key


def report_usage_errors(build: Callable[[], T]) -> T:
    """``build()`` (which makes a :class:`OneLineErrorsCLI`), with a usage error printed as one line and exit
    status 2, or re-raised under ``LIT_GRPO_DEBUG``; the held-back log lines are let out either way."""
    try:
        return build()
    except (UsageError, ArgumentError) as err:
        _held_back.stop(replay=debug())
        if debug():
            raise
        fail(err if isinstance(err, UsageError) else UsageError(str(err), "arguments"))
    except SamplerMismatchError as err:  # the rollout engine's setup, found at the first batch: also one line
        _held_back.stop(replay=debug())
        if debug():
            raise
        fail(UsageError(str(err), "data.engine_options and the server's flags"))
    finally:
        _held_back.stop(replay=True)  # no-op once stopped


def option_hint(message: str, known: list[str]) -> str | None:
    """What to say about the unknown options a parse error names: an option of an earlier version gets its new
    path (:data:`MOVED_OPTIONS`), one LightningCLI offers elsewhere what this CLI sets (:data:`NOT_OFFERED`), and
    a typo the closest known option path; None when nothing fits."""
    flags = "--" in message
    dash = "--" if flags else ""
    hints = []
    for match in _UNKNOWN_OPTION.finditer(message):
        name = match.group(1) or match.group(2)
        old = next((k for k in MOVED_OPTIONS if name == k or name.startswith(k + ".")), None)
        top = name.partition(".")[0]
        if old is not None:
            hints.append(f"`{dash}{old}` is now `{dash}{MOVED_OPTIONS[old]}`")
        elif top in NOT_OFFERED:
            hints.append(f"`{dash}{top}` is not offered: {NOT_OFFERED[top]}")
        elif close := difflib.get_close_matches(name, known, n=1, cutoff=0.8):
            hints.append(f"did you mean `{dash}{close[0]}`?")
    return "; ".join(dict.fromkeys(hints)) or None


def _chain(err: BaseException) -> list[BaseException]:
    """An exception, then the one it was raised from or while handling, and so on inwards."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _config_files(argv: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(argv):
        if arg in ("-c", "--config") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _sets(path: str, key: str, subcommands: Any) -> bool:
    """Whether a YAML config file sets ``key`` (``model.lr``), at the top or under a subcommand."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    roots = [data] + [data.get(s) for s in subcommands if isinstance(data, dict)]
    for node in roots:
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError:
            return True
    return False
