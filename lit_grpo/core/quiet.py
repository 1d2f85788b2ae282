"""Lines that third-party packages print on every run and that say nothing to this project's user, each dropped
where it is emitted (a logging filter on the one logger that writes it, matched by its text), so that every other
line of that logger still shows.

- Lightning (2.6) logs an advertisement for its hosted logger (``💡 Tip: ... litlogger ...``) at every
  ``Trainer`` construction that has no ``LitLogger``; it has no switch of its own.
- vLLM logs its whole engine configuration (several kilobytes on one line) when an engine starts; the colocated
  engine's options are the project's own (``VLLMEngine``), so the dump repeats what the run's config says. Only
  that record is dropped: vLLM's other lines (the KV cache size, its warnings) still show. ``vllm serve`` runs
  its engine in processes of its own, where ``VLLM_LOGGING_LEVEL=WARNING`` quiets it.
- Lightning 2.6 builds ``torch.utils._pytree.LeafSpec``, which torch 2.13 deprecated (a ``FutureWarning`` at each
  fit, addressed to Lightning): that one warning is filtered by its text.

And one thing is reshaped rather than dropped: Python prints a warning as ``path:line: Category: message`` followed by
the source line that warned, appended to whatever the terminal's line holds, the progress bar's included. In the
command line (:func:`one_line_warnings`) a warning of the project is one line, ``Category: message``, and every
warning is written on a line of its own above the bar.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

#: the logger Lightning's ``rank_zero_info`` writes to, and a piece of the tip's text
LIGHTNING_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
LITLOGGER_TIP = "litlogger"
#: the logger of vLLM's engine core, and a piece of its configuration dump ("Initializing a V1 LLM engine (v...)
#: with config: ...")
VLLM_ENGINE_CORE_LOGGER = "vllm.v1.engine.core"
VLLM_CONFIG_DUMP = "LLM engine (v"


class DropMessages(logging.Filter):
    """Drops the records whose message contains one of ``pieces``."""

    def __init__(self, *pieces: str) -> None:
        super().__init__()
        self.pieces = pieces

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(piece in message for piece in self.pieces)


def drop_messages(logger_name: str, *pieces: str) -> None:
    """Drop ``logger_name``'s records containing one of ``pieces`` from now on (once per logger and pieces)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessages) and f.pieces == pieces for f in logger.filters):
        logger.addFilter(DropMessages(*pieces))


#: torch's deprecation of the ``LeafSpec`` that Lightning's pytree helpers build
LIGHTNING_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def quiet_lightning() -> None:
    """Drop Lightning's litlogger tip and torch's deprecation warning addressed to Lightning's pytree helpers."""
    drop_messages(LIGHTNING_RANK_ZERO_LOGGER, LITLOGGER_TIP)
    warnings.filterwarnings("ignore", message=LIGHTNING_LEAFSPEC, category=FutureWarning)


def quiet_vllm() -> None:
    """Drop vLLM's configuration dump at engine start (in this process)."""
    drop_messages(VLLM_ENGINE_CORE_LOGGER, VLLM_CONFIG_DUMP)


def project_folders() -> tuple[Path, ...]:
    """The folders of the project's code: the package's, and the callbacks' (a folder of its own in a checkout)."""
    folders = []
    for name in ("lit_grpo", "lit_grpo.callbacks"):
        spec = importlib.util.find_spec(name)
        folders += [Path(p).resolve() for p in (spec.submodule_search_locations or [])] if spec else []
    return tuple(folders)


def one_line(message: Warning | str, category: type[Warning]) -> str:
    """A warning as one line, ``Category: message`` (a message of several lines joined by spaces)."""
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return f"{category.__name__}: {text}"


class OneLineWarnings:
    """A ``warnings.showwarning`` that writes a warning of the project (one whose place is in
    :func:`project_folders`) as :func:`one_line`, any other as ``warnings.formatwarning`` has it, and either on a
    line of its own: through ``tqdm.write``, which lifts a progress bar drawn on the terminal out of the way and
    draws it again below."""

    def __init__(self, folders: tuple[Path, ...]) -> None:
        self.folders = folders

    def is_project(self, filename: str) -> bool:
        try:
            path = Path(filename).resolve()
        except (OSError, ValueError):
            return False
        return any(path.is_relative_to(folder) for folder in self.folders)

    def __call__(self, message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
        if self.is_project(filename):
            text = one_line(message, category)
        else:
            text = warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n")
        try:
            tqdm.write(text, file=file if file is not None else sys.stderr)
        except OSError:  # as Python's own showwarning: a closed or broken stream loses the warning, not the run
            pass


def shows_warnings_as_python_does() -> bool:
    """Whether warnings are still shown by Python's own printer: nobody replaced ``warnings.showwarning``, and no
    ``warnings.catch_warnings(record=True)`` (pytest's, a user's) is collecting them, which it does by swapping
    ``warnings._showwarnmsg_impl`` while leaving ``showwarning`` at the original."""
    impl = getattr(warnings, "_showwarnmsg_impl", None)
    return (warnings.showwarning is getattr(warnings, "_showwarning_orig", None)
            and getattr(impl, "__module__", None) == "warnings")


def one_line_warnings() -> None:
    """From now on, show warnings as :class:`OneLineWarnings` does (once per process). Only in place of Python's own
    printer: a printer someone installed (``logging.captureWarnings``, a test's recorder) keeps the warnings."""
    if shows_warnings_as_python_does():
        warnings.showwarning = OneLineWarnings(project_folders())
