"""Bad values that a training command refuses from its command line and YAML files alone, before LightningCLI is
built: its parser imports Lightning and the training stack (several seconds), and a refusal found here answers
with the same one line in a fraction of that. Each check is the rule the option's own class applies (imported when
the option is set; :data:`EARLY_CHECKS`), so the two cannot disagree; LightningCLI still checks every value after.

A value is read only where it is certain: the command line (``--key value``, ``--key=value``) and the ``--config``
files, in order, a later one overriding an earlier one. A command with ``--ckpt_path`` (whose hyperparameters may
replace the value), with the option's group given whole (``--model file.yaml``), or asking for help or the config
is left to LightningCLI.

Before the rules, ``fit`` gets the parser's own first checks from the table of its options
(:mod:`lit_grpo.cli.option_types`): an unknown option (with the hint LightningCLI would give) and a value of the
wrong type or outside an option's choices, on the command line or in a config file, each refused only where the
parser surely refuses it too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from lit_grpo.cli.option_hints import option_hint
from lit_grpo.cli.option_table import OPTIONS
from lit_grpo.cli.option_types import GROUP, parser_yaml, type_refusal, unknown_key
from lit_grpo.cli.sources import SUBCOMMANDS, config_files, lookup, read_yaml


def _beta(value: float) -> None:
    from lit_grpo.math.objective import LossConfig  # the rule of every loss's config (imports torch only)

    LossConfig().with_beta(value)


def _optimizer(field: str) -> Callable[[float], None]:
    def check(value: float) -> None:
        from lit_grpo.training.optim import OptimizerArgs  # model.optimizer's own checks (imports torch only)

        OptimizerArgs(**{field: value})

    return check


def _batch(field: str) -> Callable[[float], None]:
    def check(value: float) -> None:
        from lit_grpo.data.option_checks import check_batch_numbers  # the data module's own checks (torch only)

        # the other numbers at values the rule accepts: only ``field``'s own bound can fail
        numbers = dict(num_generations=2, prompts_per_step=1, micro_batch_size=1, micro_batch_tokens=None,
                       advantage_eps=1.0, max_prompts=None)
        check_batch_numbers(**{**numbers, field: value})

    return check


#: option -> its rule (raises ``ValueError`` with the one-line message), given the value as an int, a float or a str
#: as the option is one (OPTIONS)
def _aggregation(mode: str) -> None:
    from lit_grpo.training.option_checks import check_loss_aggregation  # GRPOModule's (imports torch)

    check_loss_aggregation(mode)


def _module(field: str) -> Callable[[float], None]:
    def check(value: float) -> None:
        from lit_grpo.training.option_checks import check_module_numbers  # GRPOModule's own checks (light)

        check_module_numbers(**{field: value})

    return check


#: where the value is set, in this order: these rules import no torch but the last four (a bad number answers
#: soonest where it needs none). data.temperature is the loss's too (linked to model.temperature), refused there.
EARLY_CHECKS: dict[str, Callable[[Any], None]] = {
    **{f"data.{field}": _batch(field) for field in ("num_generations", "prompts_per_step", "micro_batch_size",
                                                    "advantage_eps", "max_prompts")},
    "data.temperature": _module("temperature"),
    "model.iterations_per_batch": _module("iterations_per_batch"),
    "model.peak_flops": _module("peak_flops"),
    "model.loss_aggregation": _aggregation,
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


def _unknown(key: str, dash: str) -> str:
    message = f"unrecognized arguments: --{key}" if dash else f"no option {key}"
    hint = option_hint(f"--{key}" if dash else f"accept option '{key}'", [k for k, v in OPTIONS.items() if v != GROUP])
    return f"{message}; {hint}" if hint else message


def command_line_refusal(rest: list[str]) -> tuple[str, str] | None:
    """``(message, where)`` of the first option after ``fit`` that is unknown or has a value of the wrong type."""
    for i, arg in enumerate(rest):
        if not arg.startswith("--"):
            continue
        name, eq, text = arg[2:].partition("=")
        name = name.removesuffix("+")  # --key+=value appends
        if "." not in name:
            continue  # --config, --ckpt_path, --seed_everything, a section given whole: the parser's
        if unknown_key(name, OPTIONS):
            return _unknown(name, dash="--"), f"{name}, on the command line"
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                continue  # no value: the parser says so
            text = rest[i + 1]
        if name in OPTIONS and (refused := type_refusal(name, OPTIONS[name], text)):
            return refused, f"{name}, on the command line"
    return None


def file_refusal(path: str) -> tuple[str, str] | None:
    """``(message, where)`` of the first key of a ``--config`` file that is unknown or has a value of the wrong type
    (a file that is not a mapping of sections, or holds a checkpoint or subcommand, is the parser's). The file is read
    as the parser reads it; a null is left to LightningCLI (its parser does not type-check a config file's null)."""
    try:
        data = parser_yaml(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None  # the parser says why
    if not isinstance(data, dict) or any(part in data for part in ("ckpt_path", *SUBCOMMANDS)):
        return None

    def walk(node: dict, prefix: str) -> tuple[str, str] | None:
        for part, value in node.items():
            key = f"{prefix}.{part}" if prefix else str(part)
            if prefix and unknown_key(key, OPTIONS):
                return _unknown(key, dash=""), f"{key}, in {path}"
            entry = OPTIONS.get(key)
            if entry == GROUP:
                if isinstance(value, dict) and not {"class_path", "init_args"} & set(value):
                    if (found := walk(value, key)) is not None:
                        return found
            elif entry is not None and value is not None and (refused := type_refusal(key, entry, value)):
                return refused, f"{key}, in {path}"
        return None

    return walk(data, "")


def early_refusal(argv: list[str]) -> tuple[str, str] | None:
    """``(message, where)``: for ``fit``, the first unknown option or value of the wrong type on its command line,
    then in its config files; else the first value of :data:`EARLY_CHECKS` that ``argv`` (``fit ...``) sets and its
    rule refuses; else None."""
    if not argv or argv[0] not in SUBCOMMANDS:
        return None
    rest = argv[1:]
    if any(arg.partition("=")[0] in _LEFT_TO_LIGHTNING for arg in rest):
        return None
    if argv[0] == "fit":  # the table is fit's parser's
        found = command_line_refusal(rest)
        for path in config_files(rest):
            if found is not None:
                break
            found = file_refusal(path)
        if found is not None:
            return found
    for key, check in EARLY_CHECKS.items():
        source, value = given_value(rest, key)
        if source is not None and (typed := as_typed(value, OPTIONS.get(key, "float"))) is not None:
            try:
                check(typed)
            except ValueError as err:
                return str(err), f"{key}, {source}"
    return None


def as_typed(value: object, entry: str) -> object:
    """``value`` as the parser gives it to the option's class (entry ``entry`` of the table: an int, a float or a
    str option), or None where its type is the parser's to refuse."""
    kind = entry.split("|")[0]
    if kind == "str":
        return value if isinstance(value, str) else None
    number = as_float(value)
    if number is None or kind == "int" and not number.is_integer():
        return None
    return int(number) if kind == "int" else number
