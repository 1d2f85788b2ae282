"""Bad values that a training command refuses from its command line and YAML files alone, before LightningCLI is
built: its parser imports Lightning and the training stack (several seconds), and a refusal found here answers
with the same one line in a fraction of that. Each check is the rule the option's own class applies (imported when
the option is set; :data:`EARLY_CHECKS`), so the two cannot disagree; LightningCLI still checks every value after.

A value is read only where it is certain: the command line (``--key value``, ``--key=value``) and the ``--config``
files, in order, a later one overriding an earlier one. A command with ``--ckpt_path`` (whose hyperparameters may
replace the value), with the option's group given whole (``--model file.yaml``), or asking for help or the config
is left to LightningCLI, as is a value of the wrong type (its parser names the type).
"""

from __future__ import annotations

from collections.abc import Callable

import yaml

from lit_grpo.cli.sources import SUBCOMMANDS, lookup, read_yaml


def _beta(value: float) -> None:
    from lit_grpo.math.objective import LossConfig  # the rule of every loss's config (imports torch only)

    LossConfig().with_beta(value)


def _optimizer(field: str) -> Callable[[float], None]:
    def check(value: float) -> None:
        from lit_grpo.training.optim import OptimizerArgs  # model.optimizer's own checks (imports torch only)

        OptimizerArgs(**{field: value})

    return check


#: option -> its rule (raises ``ValueError`` with the one-line message); float options only
EARLY_CHECKS: dict[str, Callable[[float], None]] = {
    "model.beta": _beta,
    "model.optimizer.lr": _optimizer("lr"),
    "model.optimizer.weight_decay": _optimizer("weight_decay"),
}
#: options after which the values are not the command line's and the files' alone, or nothing is checked
_LEFT_TO_LIGHTNING = ("--ckpt_path", "--print_config", "--help", "-h")


def as_float(value: object) -> float | None:
    """A number given for a float option (an integer, a float, or its text on the command line), else None."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            return None
        if isinstance(value, str):
            try:
                return float(value)  # "1e-3", "nan": YAML reads them as text, the parser as floats
            except ValueError:
                return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def given_value(argv: list[str], key: str) -> tuple[str | None, object]:
    """``(where, value)`` where the command line ``argv`` (after the subcommand) surely sets ``key``: the last of
    its ``--key`` values and its ``--config`` files' values, in order, and where it is (``on the command line``,
    ``in <file>``); ``(None, None)`` where nothing sets it or a group above ``key`` is given whole."""
    found, value = None, None
    groups = [key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)]  # model.optimizer.lr: model.optimizer, model
    for i, arg in enumerate(argv):
        name, eq, text = arg.partition("=")
        if name.removeprefix("--") in groups:
            return None, None
        if name in ("-c", "--config"):
            path = text if eq else argv[i + 1] if i + 1 < len(argv) else None
            data = read_yaml(path) if path else None
            if isinstance(data, dict) and any(part in data for part in ("ckpt_path", *SUBCOMMANDS)):
                return None, None  # the file's checkpoint (or nesting) is LightningCLI's to read
            if any((hit := lookup(data, group))[0] and not isinstance(hit[1], dict) for group in groups):
                return None, None  # a group given whole, as a file name or null
            hit, setting = lookup(data, key)
            if hit:
                found, value = f"in {path}", setting
        elif name == f"--{key}":
            if eq:
                found, value = "on the command line", text
            elif i + 1 < len(argv):
                found, value = "on the command line", argv[i + 1]
    return found, value


def early_refusal(argv: list[str]) -> tuple[str, str] | None:
    """``(message, where)`` of the first value of :data:`EARLY_CHECKS` that ``argv`` (``fit ...``) sets and its
    rule refuses, else None."""
    if not argv or argv[0] not in SUBCOMMANDS:
        return None
    rest = argv[1:]
    if any(arg.partition("=")[0] in _LEFT_TO_LIGHTNING for arg in rest):
        return None
    for key, check in EARLY_CHECKS.items():
        source, value = given_value(rest, key)
        number = as_float(value) if source else None
        if number is None:
            continue
        try:
            check(number)
        except ValueError as err:
            return str(err), f"{key}, {source}"
    return None
