"""``python -m lit_grpo fit --config configs/X.yaml``: LightningCLI over GRPOModule and RolloutDataModule, with the
method's callbacks as config sections of their own and the links that keep one sampling config and one seed.

:mod:`lit_grpo.commands` is the one entry (``python -m lit_grpo``, ``lit-grpo``, and this module's ``main`` and
``run``, which are its own): it runs ``export``, ``eval`` and ``serve`` without importing Lightning and reaches
:func:`train` for the training subcommands. A bad value ends with one line on stderr and exit status 2; how its key
and source are found is :mod:`lit_grpo.cli_errors`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync
from lit_grpo.cli_errors import OneLineErrorsCLI, report_usage_errors
from lit_grpo.cli_hooks import build_model_last
from lit_grpo.commands import DEBUG_ENV, TOOLS, UsageError, main, one_line, run
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.module import GRPOModule
from lit_grpo.precision import check_trainer_precision

# the entry points and the error convention are lit_grpo.commands'; re-exported for callers of lit_grpo.cli
__all__ = ["DEBUG_ENV", "GRPOCLI", "TOOLS", "UsageError", "main", "one_line", "run", "train"]


def rollout_seed_of(seed_everything: object) -> int:
    """``data.seed`` from ``seed_everything``: the integer itself, else 0."""
    return seed_everything if isinstance(seed_everything, int) and not isinstance(seed_everything, bool) else 0


class GRPOCLI(OneLineErrorsCLI):
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

    def instantiate_classes(self) -> None:
        # build the model last, so that a bad value of the data module or a callback group (cheap to build, and
        # checking their values) fails before a model is loaded
        build_model_last(self._parser(self.subcommand))
        super().instantiate_classes()

    def check_values(self) -> None:
        self._check_no_second_weight_sync()
        precision = self._subcommand_config().get("trainer.precision")
        if precision is not None:
            try:  # the trainer is built after the model: check its precision before the model loads
                check_trainer_precision(str(precision))
            except ValueError as err:
                raise UsageError(str(err), self._where("trainer.precision")) from err

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
                raise UsageError(
                    f"a {cls.__name__} under trainer.callbacks would be a second one: the `sync` section already "
                    f"adds the WeightSync callback; set its options there (e.g. sync.every_n_batches, sync.max_tv) "
                    f"and remove {cls.__name__} from trainer.callbacks", self._where("trainer.callbacks", exact=True))


def _callback_class_paths(callbacks: Any) -> list[str]:
    """The ``class_path`` of each entry of a parsed ``trainer.callbacks`` value (a list, one entry, or None)."""
    entries = callbacks if isinstance(callbacks, (list, tuple)) else [] if callbacks is None else [callbacks]
    paths = []
    for entry in entries:
        path = entry.get("class_path") if hasattr(entry, "get") else None
        if isinstance(path, str):
            paths.append(path)
    return paths


def train(args: list[str] | None = None) -> GRPOCLI:
    """Run LightningCLI on ``args`` (default: ``sys.argv[1:]``), a training subcommand or none, and return its
    object; a usage error exits with status 2 after one line on stderr."""
    # A checkpoint taken after a training step holds the state after all of that step's optimizer steps,
    # together with the data position and counters of the same moment: exactly what an exact resume needs.
    warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
    return report_usage_errors(
        lambda: GRPOCLI(GRPOModule, RolloutDataModule, save_config_kwargs={"overwrite": True}, args=args))
