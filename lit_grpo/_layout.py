"""Where the package's modules are: the old import paths of modules that moved into role folders, and the two
folders that live at the top of the repository (``callbacks/``, ``configs/``) but import as ``lit_grpo.callbacks``
and ``lit_grpo.configs``.

Both are import-system finders (:mod:`importlib.abc`), installed once by ``lit_grpo/__init__.py``:

- an old path (``lit_grpo.module``, ``lit_grpo.losses``, ...) imports the module at its new path under both names,
  so code, configs (``class_path: lit_grpo.module.GRPOModule``) and checkpoints pickled before the move keep
  working; it warns with a ``DeprecationWarning`` naming the new path;
- in a source checkout imported without an editable install (``python -m lit_grpo`` run in the checkout beside a
  regular install), ``lit_grpo.callbacks`` and ``lit_grpo.configs`` are found in the checkout's top-level folders
  instead of failing deep in an import. Installed copies never need this: the wheel maps them (pyproject.toml).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: old import path -> new import path (the move into role folders)
MOVED: dict[str, str] = {
    "lit_grpo.cli_errors": "lit_grpo.cli.errors",
    "lit_grpo.cli_hooks": "lit_grpo.cli.hooks",
    "lit_grpo.cli_subcommands": "lit_grpo.cli.predict",
    "lit_grpo.cli.subcommands": "lit_grpo.cli.predict",
    "lit_grpo.commands": "lit_grpo.cli.commands",
    "lit_grpo.eval_command": "lit_grpo.cli.eval",
    "lit_grpo.export": "lit_grpo.cli.export",
    "lit_grpo.plots": "lit_grpo.cli.plots",
    "lit_grpo.trainer_knobs": "lit_grpo.training.trainer_knobs",
    "lit_grpo.module": "lit_grpo.training.module",
    "lit_grpo.losses": "lit_grpo.training.losses",
    "lit_grpo.step_metrics": "lit_grpo.training.step_metrics",
    "lit_grpo.stat_reduction": "lit_grpo.training.stat_reduction",
    "lit_grpo.optim": "lit_grpo.training.optim",
    "lit_grpo.option_groups": "lit_grpo.core.option_groups",
    "lit_grpo.precision": "lit_grpo.training.precision",
    "lit_grpo.scoring": "lit_grpo.core.scoring",
    "lit_grpo.flops": "lit_grpo.training.flops",
    "lit_grpo.measured_metrics": "lit_grpo.core.measured_metrics",
    "lit_grpo.training.measured_metrics": "lit_grpo.core.measured_metrics",  # shared with the callbacks
    "lit_grpo.batch": "lit_grpo.core.batch",
    "lit_grpo.model_copies": "lit_grpo.models.copies",
    "lit_grpo.warm_start": "lit_grpo.training.warm_start",
    "lit_grpo.lora": "lit_grpo.models.lora",
    "lit_grpo.metrics": "lit_grpo.evaluation.metric",
    "lit_grpo.distributed": "lit_grpo.core.distributed",
    "lit_grpo.checkpoints": "lit_grpo.core.checkpoints",
    "lit_grpo.import_paths": "lit_grpo.core.import_paths",
}

#: subpackages whose folder sits at the top of the repository, not inside lit_grpo/
TOP_LEVEL_FOLDERS: dict[str, str] = {"lit_grpo.callbacks": "callbacks", "lit_grpo.configs": "configs"}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path of :data:`MOVED` as the module at its new path (one module object, two names)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        # the import system sets the returned module's __spec__ to the old path's spec next; keep the new one, so
        # that exec_module can put it back
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (:meth:`create_module` returned the already imported module), but give it back its own
        spec: with the old path's, ``importlib.reload`` of the new module would find this loader and run nothing."""
        module.__spec__ = module.__spec__.loader_state


class CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds ``lit_grpo.callbacks`` and ``lit_grpo.configs`` in a checkout's top-level folders. Consulted after
    every other finder, so an installed or editable copy's own mapping always wins. Only a checkout counts (its
    ``pyproject.toml`` beside the folders): beside an installed copy, in site-packages, a ``configs`` or
    ``callbacks`` folder is some other distribution's top-level package."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        folder = TOP_LEVEL_FOLDERS.get(fullname)
        init = self.root / folder / "__init__.py" if folder else None
        if init is None or not init.is_file() or not (self.root / "pyproject.toml").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install(package_path: Sequence[str]) -> None:
    """Add the two finders to :data:`sys.meta_path` (once per process)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
    root = Path(next(iter(package_path))).resolve().parent
    if not any(isinstance(f, CheckoutFolders) for f in sys.meta_path):
        sys.meta_path.append(CheckoutFolders(root))
