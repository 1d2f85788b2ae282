"""What the training CLI (:mod:`lit_grpo.cli.lightning_cli`, :mod:`lit_grpo.cli.errors`) relies on in Lightning and
jsonargparse beyond their documented API, in one place.

The CLI's one-line errors (``error: <what> (<key>, <where>)``) need four things that no public hook gives, and
its ``predict`` options a fifth:

1. ``build_model_last``: jsonargparse builds the config groups of one depth in the order of the parser's private
   list ``_action_groups``, and LightningCLI adds ``model`` before ``data`` and the callback sections. The model's
   group is moved to the end so that a bad value of the data module or a callback fails before a model loads.
2. ``key_of_parse_error``: jsonargparse names the key of a value it rejects only in its message
   (``Parser key "model.lr": ...``).
3. ``object_under_construction``: a constructor's ``ValueError`` reaches the CLI with no trace of which object was
   being built (jsonargparse wraps a callback's error in its own message); the traceback's frames know it, as the
   ``self`` of the innermost frame that is a callback, data module, module or Trainer.
4. ``HPARAMS_BETWEEN``: ``LightningCLI.__init__`` parses the ``--ckpt_path`` checkpoint's hyperparameters into the
   config after ``parse_arguments`` and before ``before_instantiate_classes``, so a parse error raised between
   those two hooks is about the checkpoint.
5. ``SUBCOMMAND_PARSER``: ``LightningCLI._prepare_subcommand_parser(klass, subcommand, **kwargs)`` builds each
   subcommand's parser; ``GRPOCLI`` extends it to give ``predict`` alone its ``predictions`` section
   (``add_arguments_to_parser`` is called for every subcommand alike).

At run time each helper degrades quietly (an error is then reported with less detail, or after the model loaded);
:func:`check` verifies all five against the installed versions and raises :class:`HookBroken` naming the
versions and the hook, and the test suite calls it.
"""

from __future__ import annotations

import inspect
import re
from types import TracebackType
from typing import Any

HPARAMS_BETWEEN = ("parse_arguments", "_parse_ckpt_path", "before_instantiate_classes")
SUBCOMMAND_PARSER = "_prepare_subcommand_parser"
_PARSE_ERROR_KEY = re.compile(r'[Kk]ey "([\w.]+)"')


class HookBroken(RuntimeError):
    """Lightning or jsonargparse changed in a way that the CLI's error reporting relies on."""

    def __init__(self, hook: str, what: str) -> None:
        super().__init__(f"lit_grpo's CLI relies on {hook}, which no longer holds under {versions()}: {what} "
                         "(see lit_grpo/cli/hooks.py)")


def versions() -> str:
    """``lightning X, jsonargparse Y``: the installed versions the hooks were checked against."""
    import jsonargparse
    import lightning

    return f"lightning {lightning.__version__}, jsonargparse {jsonargparse.__version__}"


def build_model_last(parser: Any) -> bool:
    """Move the ``model`` group of a LightningCLI (sub)parser to the end of the order jsonargparse builds groups
    in. Help and config dumps keep the order the groups were added in. Returns whether it was moved."""
    groups = getattr(parser, "_action_groups", None)
    model = getattr(parser, "groups", {}).get("model")
    if not isinstance(groups, list) or model not in groups:
        return False
    groups.remove(model)
    groups.append(model)
    return True


def key_of_parse_error(message: str) -> str | None:
    """The config key a jsonargparse parse error is about (``model.lr``), if its message names one."""
    match = _PARSE_ERROR_KEY.search(message)
    return match.group(1) if match else None


def object_under_construction(err: BaseException, classes: tuple[type, ...]) -> Any:
    """The innermost object of one of ``classes`` whose method (its constructor) was running when ``err`` was
    raised, or None."""
    owner = None
    tb: TracebackType | None = err.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if isinstance(obj, classes):
            owner = obj
        tb = tb.tb_next
    return owner


def check() -> None:
    """Raise :class:`HookBroken` when one of the five assumptions above fails with the installed versions."""
    from lightning.pytorch import Callback
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Callback, "model")  # any class: a group named `model` is what matters
    if not isinstance(getattr(parser, "_action_groups", None), list) or not hasattr(parser, "groups"):
        raise HookBroken("jsonargparse's ArgumentParser._action_groups and .groups",
                         "the parser has no such list or mapping")
    if parser.groups.get("model") not in parser._action_groups or not build_model_last(parser):
        raise HookBroken("jsonargparse's ArgumentParser._action_groups", "a class group is not listed in it")

    parser.add_argument("--lr", type=float)
    try:
        parser.parse_args(["--lr", "abc"])
        message = "no error for --lr abc"
    except Exception as err:  # whatever it raises, its message must name the key
        message = str(err)
    if key_of_parse_error(message) != "lr":
        raise HookBroken('jsonargparse\'s parse error messages naming the key (Parser key "lr")', repr(message))

    class Probe(Callback):
        def __init__(self) -> None:
            raise ValueError("probe")

    try:
        Probe()
    except ValueError as err:
        if not isinstance(object_under_construction(err, (Callback,)), Probe):
            raise HookBroken("the traceback frames of a failing constructor", "its `self` is not found") from err

    source = inspect.getsource(LightningCLI.__init__)
    positions = [source.find(f"self.{name}(") for name in HPARAMS_BETWEEN]
    if min(positions) < 0 or positions != sorted(positions):
        raise HookBroken(
            "LightningCLI.__init__ calling " + ", then ".join(HPARAMS_BETWEEN),
            "the checkpoint's hyperparameters are no longer parsed between parse_arguments and "
            "before_instantiate_classes")

    prepare = getattr(LightningCLI, SUBCOMMAND_PARSER, None)
    params = list(inspect.signature(prepare).parameters) if callable(prepare) else []
    if params[:3] != ["self", "klass", "subcommand"] or f"self.{SUBCOMMAND_PARSER}(" not in inspect.getsource(
            LightningCLI._add_subcommands):
        raise HookBroken(f"LightningCLI.{SUBCOMMAND_PARSER}(klass, subcommand) building each subcommand's parser",
                         f"its parameters are {params}, or _add_subcommands no longer calls it")
