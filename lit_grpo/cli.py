"""``python -m lit_grpo fit --config configs/X.yaml``: LightningCLI over GRPOModule and RolloutDataModule.
``python -m lit_grpo export CKPT OUT_DIR``: the trained policy as a Hugging Face model directory.
``python -m lit_grpo eval --model M | --ckpt CKPT``: Pass@k of a model or checkpoint, without training.
``python -m lit_grpo serve --model M --port P``: the rollout server.

A bad value, in a config file, on the command line, in ``--ckpt_path`` or given to ``export``, ends the program
with one line on stderr, ``error: <what> (<where it came from>)``, and exit status 2, before any model is loaded
where the value allows it (the data module is built before the model). ``LIT_GRPO_DEBUG=1`` shows the traceback
instead. Errors raised once training has started keep their tracebacks.

``python -m lit_grpo`` reaches this module only for training subcommands (:mod:`lit_grpo.commands` dispatches the
tools without importing Lightning). What the error reporting needs from Lightning and jsonargparse beyond their
documented API is in :mod:`lit_grpo.cli_hooks`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
import sys
import warnings
from argparse import ArgumentError
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningCLI

from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync
from lit_grpo.checkpoints import Checkpoint, CheckpointError
from lit_grpo.cli_hooks import build_model_last, key_of_parse_error, object_under_construction
from lit_grpo.commands import DEBUG_ENV, TOOLS, UsageError, debug, fail, one_line, run_tool
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.module import GRPOModule
from lit_grpo.precision import check_trainer_precision

__all__ = ["DEBUG_ENV", "GRPOCLI", "TOOLS", "UsageError", "main", "one_line", "run"]
# values of ckpt_path that Lightning resolves itself rather than reading a path
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
# what a constructor raises for a bad value (Lightning's Trainer raises MisconfigurationException)
_USAGE_ERRORS = (ValueError, TypeError, MisconfigurationException)
# which config group an object being built belongs to, innermost first when nested
_GROUPS: tuple[tuple[type, str], ...] = (
    (Callback, "trainer.callbacks"), (LightningDataModule, "data"), (LightningModule, "model"), (Trainer, "trainer"),
)


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


def rollout_seed_of(seed_everything: object) -> int:
    """``data.seed`` from ``seed_everything``: the integer itself, else 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


class GRPOCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.get("args")
        # the arguments as typed, to tell where a bad value came from (LightningCLI reads sys.argv when None)
        self._argv = [str(a) for a in argv] if isinstance(argv, (list, tuple)) else (
            sys.argv[1:] if argv is None else [])
        self._checkpoint: Checkpoint | None = None
        # "parsed" from the end of parse_arguments to before_instantiate_classes: LightningCLI parses the
        # checkpoint's hyperparameters in between (lit_grpo.cli_hooks.HPARAMS_BETWEEN)
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
        # parse errors are raised, not printed with the 80-line usage, so that main() prints them as one line
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001
        # The three callbacks of the method are always there, each configured in its own section, so that a
        # Table 1 row is a short file on top of a base config (a second `--config` overrides single keys;
        # a `trainer.callbacks` list could only be replaced whole). Other callbacks go in trainer.callbacks.
        parser.add_lightning_class_args(WeightSync, "sync")
        parser.add_lightning_class_args(RefModelSwap, "ref_swap")
        parser.add_lightning_class_args(GSM8KPassAtK, "eval")
        # evaluation is opt-in on the command line: the callback's own defaults are the paper's full test split x
        # 50 samples, hours on a CPU; a config switches it on with `eval.every_n_optimizer_steps` / `at_end`
        parser.set_defaults({"eval.every_n_optimizer_steps": None, "eval.at_end": False})
        # One sampling config, in `data`: the loss must use the temperature the rollouts were sampled with,
        # evaluation samples like training (the paper's Pass@1), and Dr.GRPO's constant normaliser is the
        # generation budget.
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("data.max_new_tokens", "model.max_completion_length")
        for key in ("temperature", "top_p", "max_new_tokens", "system_prompt"):
            parser.link_arguments(f"data.{key}", f"eval.{key}")
        # One seed: `seed_everything` also seeds the rollouts (prompt order and sampling), which the data module
        # draws from its own seed so that they do not depend on the global RNG; `true` (a random seed) and
        # `false` leave the rollouts at seed 0.
        parser.link_arguments("seed_everything", "data.seed", compute_fn=rollout_seed_of)

    # ---- turning bad values into one line -------------------------------------------------------------
    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            message = one_line(str(err))
            key = key_of_parse_error(message)
            raise UsageError(message, self._where(self._strip_subcommand(key) if key else None)) from err
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

    def instantiate_classes(self) -> None:
        # build the model last, so that a bad value of the data module or a callback group (cheap to build, and
        # checking their values) fails before a model is loaded
        build_model_last(self._parser(self.subcommand))
        self._check_no_second_weight_sync()
        precision = self._subcommand_config().get("trainer.precision")
        if precision is not None:
            try:  # the trainer is built after the model: check its precision before the model loads
                check_trainer_precision(str(precision))
            except ValueError as err:
                _held_back.stop(replay=False)
                raise UsageError(str(err), self._where("trainer.precision")) from err
        try:
            super().instantiate_classes()
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

    def _check_no_second_weight_sync(self) -> None:
        # The `sync` section always adds a WeightSync; a second one under trainer.callbacks would make Lightning
        # refuse two stateful callbacks of one type, with a message that does not say what to do.
        for name in _callback_class_paths(self._subcommand_config().get("trainer.callbacks")):
            module, _, attr = name.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError):
                continue  # jsonargparse has checked the path; nothing more to say here
            if isinstance(cls, type) and issubclass(cls, WeightSync):
                _held_back.stop(replay=False)
                raise UsageError(
                    f"a {cls.__name__} under trainer.callbacks would be a second one: the `sync` section already "
                    f"adds the WeightSync callback; set its options there (e.g. sync.every_n_batches, sync.max_tv) "
                    f"and remove {cls.__name__} from trainer.callbacks", self._where("trainer.callbacks", exact=True))

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


def _callback_class_paths(callbacks: Any) -> list[str]:
    """The ``class_path`` of each entry of a parsed ``trainer.callbacks`` value (a list, one entry, or None)."""
    entries = callbacks if isinstance(callbacks, (list, tuple)) else [] if callbacks is None else [callbacks]
    paths = []
    for entry in entries:
        path = entry.get("class_path") if hasattr(entry, "get") else None
        if isinstance(path, str):
            paths.append(path)
    return paths


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


def main(args: list[str] | None = None) -> GRPOCLI | None:
    """Run the CLI on ``args`` (default: ``sys.argv[1:]``); returns the LightningCLI object of a training
    subcommand, None for ``serve``, ``export`` and ``eval``. A usage error exits with status 2 after one line on
    stderr."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:  # not Trainer methods: run as `python -m lit_grpo` runs them
        run_tool(argv[0], argv[1:])
        return None
    # A checkpoint taken after a training step holds the state after all of that step's optimizer steps,
    # together with the data position and counters of the same moment: exactly what an exact resume needs.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    try:
        return GRPOCLI(GRPOModule, RolloutDataModule, save_config_kwargs={"overwrite": True}, args=args)
    except (UsageError, ArgumentError) as err:
        _held_back.stop(replay=debug())
        if debug():
            raise
        fail(err if isinstance(err, UsageError) else UsageError(str(err), "arguments"))
    finally:
        _held_back.stop(replay=True)  # no-op once stopped


def run() -> None:
    """Console-script entry point (``lit-grpo``): exit status 0 after a run, not the CLI object."""
    main()
