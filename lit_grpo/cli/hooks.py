"""What the training CLI (:mod:`lit_grpo.cli.lightning_cli`, :mod:`lit_grpo.cli.errors`) needs of Lightning and
jsonargparse that their documented API does not give, in one place; ``tests/test_cli_hooks.py`` checks each against
the installed versions through the behaviour it serves.

1. :func:`build_model_last`: jsonargparse builds the config groups of one depth in the order of the parser's list
   ``_action_groups``, where LightningCLI adds ``model`` before ``data`` and the callback sections. The model's group
   is moved to the end so that a bad value of the data module or a callback fails before a model loads.
2. :func:`key_of_parse_error`: jsonargparse names the key of a value it rejects only in its message
   (``Parser key "model.lr": ...``).
3. :func:`object_under_construction`: a constructor's ``ValueError`` reaches the CLI with no trace of which object
   was being built (jsonargparse wraps a callback's error in its own message); the traceback's frames know it, as
   the ``self`` of the innermost frame that is a callback, data module, module, Trainer or option group.
4. LightningCLI's ``_prepare_subcommand_parser(klass, subcommand)`` builds each subcommand's parser (``GRPOCLI``
   extends it to give ``predict`` alone its ``predictions`` section) and ``_parser(subcommand)`` returns it.

Each of 1-3 degrades quietly: an error is then reported with less detail, or after the model loaded.
"""

from __future__ import annotations

import re
from typing import Any

_PARSE_ERROR_KEY = re.compile(r'[Kk]ey "([\w.]+)"')


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
    owner, tb = None, err.__traceback__
    while tb is not None:
        if isinstance(obj := tb.tb_frame.f_locals.get("self"), classes):
            owner = obj
        tb = tb.tb_next
    return owner
