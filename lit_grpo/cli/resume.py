"""``fit --ckpt_path last`` (or ``ckpt_path: last`` in a config): resume the run's newest checkpoint, whichever
version of the run wrote it, and go on logging into that version.

Lightning resolves ``last`` only in the ``ModelCheckpoint`` folder of the run being started, which is a new
version's (``version_1/checkpoints``) when the logger numbers its versions: a rerun of the same command line then
finds nothing and trains from the start. Here ``last`` is resolved while the command line is parsed, from the
config alone, so that the checkpoint is then read exactly as a named one is (its hyperparameters, the layout check):

- the folders searched are those of the config's ``ModelCheckpoint`` callbacks that set ``dirpath``; otherwise every
  version of the first logger's folder, ``<save_dir>/<name>/*/checkpoints`` (TensorBoardLogger, CSVLogger; a
  WandbLogger's ``<save_dir>/<project>/*/checkpoints``), ``<default_root_dir>/lightning_logs/*/checkpoints`` for
  Lightning's default logger and ``<default_root_dir>/checkpoints`` with ``logger: false``, as ``ModelCheckpoint``
  lays them out;
- the checkpoint taken is the one written last (modification time) among their ``*.ckpt`` files and sharded
  directories; ``last.ckpt`` (a link with ``save_last: link``) is the same file as its target;
- none found: the fit starts from the beginning, after one line saying where it looked (a job script can pass
  ``--ckpt_path last`` from its first run on).

The resumed run logs into the version it resumes (:func:`continue_version`): a TensorBoardLogger gets that version and
a ``purge_step`` at the first step the resumed run logs, so that TensorBoard (and ``python -m lit_grpo plots``) hides
what the killed run logged after its checkpoint and draws one continued line. Other loggers start a new version, as
they would in Lightning, after one line saying why.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LAST = "last"
#: the logger Lightning builds when ``trainer.logger`` is unset or true, and its folder's name
DEFAULT_LOGGER_NAME = "lightning_logs"
#: the loggers whose folders are ``<save_dir>/<name>/<version>`` (``name`` empty: ``<save_dir>/<version>``)
FOLDER_LOGGERS = ("TensorBoardLogger", "CSVLogger")
#: Lightning's ``ModelCheckpoint`` folder inside a version
CHECKPOINTS = "checkpoints"


def _get(config: Any, key: str, default: Any = None) -> Any:  # noqa: ANN401 -- a jsonargparse Namespace or dict
    getter = getattr(config, "get", None)
    value = getter(key) if getter is not None else getattr(config, key, None)
    return default if value is None else value


def _class(path: Any) -> type | None:  # noqa: ANN401
    if not isinstance(path, str) or "." not in path:
        return None
    module, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def _entries(value: Any) -> list[Any]:  # noqa: ANN401
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


def _default(cls: type, name: str) -> Any:  # noqa: ANN401
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def checkpoint_dirpaths(callbacks: Any) -> list[Path]:  # noqa: ANN401
    """The ``dirpath`` of each ``ModelCheckpoint`` (or subclass) of a parsed ``trainer.callbacks`` that sets one."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found = []
    for entry in _entries(callbacks):
        if isinstance(entry, ModelCheckpoint):  # given as an object (Python), not a config entry
            dirpath = entry.dirpath
        else:
            cls = _class(_get(entry, "class_path"))
            if cls is None or not issubclass(cls, ModelCheckpoint):
                continue
            dirpath = _get(_get(entry, "init_args", {}), "dirpath")
        if dirpath:
            found.append(Path(str(dirpath)))
    return found


def logger_folder(logger: Any, root: Path) -> tuple[Path, bool]:  # noqa: ANN401
    """Where the first logger of a parsed ``trainer.logger`` keeps its checkpoints, and whether that folder holds
    one subfolder per version (``<version>/checkpoints``). Raises ``ValueError`` for a logger whose layout is not
    known here."""
    first = _entries(logger)[0] if _entries(logger) else logger
    if first is None or first is True:
        return root / DEFAULT_LOGGER_NAME, True
    if first is False:
        return root / CHECKPOINTS, False
    path = _get(first, "class_path")
    cls, args = _class(path), _get(first, "init_args", {})
    names = {c.__name__ for c in cls.__mro__} if cls is not None else set()
    if names & set(FOLDER_LOGGERS):
        name = _get(args, "name", _default(cls, "name"))
        return Path(str(_get(args, "save_dir", _default(cls, "save_dir") or root))) / str(name or ""), True
    if "WandbLogger" in names:
        save_dir = _get(args, "save_dir") or _get(args, "dir") or "."
        return Path(str(save_dir)) / str(_get(args, "project") or DEFAULT_LOGGER_NAME), True
    raise ValueError(f"ckpt_path 'last' with trainer.logger {path}: where that logger keeps its checkpoints is not "
                     "known here; expected a ModelCheckpoint with dirpath in trainer.callbacks, or the checkpoint's "
                     "path as ckpt_path")


def checkpoint_folders(trainer: Any, cwd: str | Path | None = None) -> list[Path]:  # noqa: ANN401
    """Where the fit of a parsed ``trainer`` section writes its checkpoints, in every version of its logger's
    folder: paths, each a folder or a pattern with one ``*`` for the version (``runs/x/tensorboard/*/checkpoints``)."""
    dirpaths = checkpoint_dirpaths(_get(trainer, "callbacks"))
    if dirpaths:
        return dirpaths
    root = Path(str(_get(trainer, "default_root_dir") or cwd or os.getcwd()))
    folder, versioned = logger_folder(_get(trainer, "logger"), root)
    return [folder / "*" / CHECKPOINTS] if versioned else [folder]


def _candidates(pattern: Path) -> list[Path]:
    parts = pattern.parts
    star = parts.index("*") if "*" in parts else len(parts)
    base, rest = Path(*parts[:star]), "/".join(parts[star:])
    folders = sorted(base.glob(rest)) if rest else [base]
    return [p for folder in folders if folder.is_dir() for p in sorted(folder.glob("*.ckpt"))]


def latest_checkpoint(folders: list[Path]) -> Path | None:
    """The checkpoint written last among the ``*.ckpt`` files and sharded directories of ``folders`` (patterns
    from :func:`checkpoint_folders`), or None. A link (``last.ckpt`` with ``save_last: link``) counts as its
    target; of the paths of one file, the link is returned, as Lightning names it."""
    best: tuple[float, int, Path] | None = None
    for pattern in folders:
        for path in _candidates(pattern):
            try:
                mtime = path.stat().st_mtime  # follows a link to its target
            except OSError:  # a dangling link: its target was removed
                continue
            key = (mtime, int(path.is_symlink() or path.name.startswith(LAST)), path)
            best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else best[2]


def describe(folders: list[Path]) -> str:
    """``folders`` in words, for a message."""
    return ", ".join(str(f) for f in folders)


def first_logged_step(meta: Mapping[str, Any]) -> int:
    """The logging step (Lightning's ``_batches_that_stepped``) of the first batch a run resumed from a checkpoint
    with ``meta`` (its non-tensor part) logs: a checkpoint saved at a batch's end holds the count before that
    batch's increment, which Lightning makes on restart."""
    loop = meta.get("loops", {}).get("fit_loop", {})
    stepped = int(loop.get("epoch_loop.state_dict", {}).get("_batches_that_stepped", 0))
    total = loop.get("epoch_loop.batch_progress", {}).get("total", {})
    return stepped + max(0, int(total.get("processed", 0)) - int(total.get("completed", 0)))


def continue_version(loggers: list[Any], checkpoint: Path, meta: Mapping[str, Any]) -> str | None:
    """Point the first logger at the version folder ``checkpoint`` lies in (``<root>/<version>/checkpoints/``), so
    that the resumed run logs there and saves its checkpoints there; a TensorBoardLogger also purges, at the first
    step the run logs again, what the killed run logged after the checkpoint. Returns why it cannot (one line), or
    None. Only a logger that has not started (no version chosen, nothing written) is changed."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if not loggers:
        return None
    logger = loggers[0]
    version_dir = checkpoint.absolute().parent.parent
    if not isinstance(logger, TensorBoardLogger):
        return (f"the resumed run logs to a new version of {type(logger).__name__}: only a TensorBoardLogger goes on "
                "in the version it resumes (it can withdraw what the stopped run logged after its checkpoint)")
    if checkpoint.absolute().parent.name != CHECKPOINTS or version_dir.parent != Path(logger.root_dir).absolute():
        return (f"the resumed run logs to a new TensorBoard version: checkpoint {checkpoint} is not in a version "
                f"folder of {logger.root_dir}")
    if getattr(logger, "_version", None) is not None or getattr(logger, "_experiment", None) is not None:
        return None  # a version the config names: kept
    logger._version = version_dir.name  # a string: the folder's name as it is (TensorBoardLogger.log_dir)
    logger._kwargs["purge_step"] = first_logged_step(meta)  # SummaryWriter(purge_step=...)
    return None
