"""The table of ``fit``'s options (``lit_grpo/cli/option_table.py``) is LightningCLI's parser's, and what it refuses
before Lightning loads the parser refuses too: an unknown option, a value of the wrong type, a value outside an
option's choices."""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest
from cli_runner import probe
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lit_grpo.cli.early_checks import command_line_refusal, early_refusal, file_refusal
from lit_grpo.cli.option_table import OPTIONS
from lit_grpo.cli.option_types import ANY, GROUP, describe, type_refusal, unknown_key
from lit_grpo.cli.write_option_table import fit_parser, render, table_of

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
#: the options whose values the early check judges (a group's or an ``any`` option's value is the parser's alone)
TYPED = [key for key, entry in OPTIONS.items() if entry not in (GROUP, ANY)]
#: what a user may type for a value: booleans and nulls as YAML 1.1 and Python spell them, numbers of every shape
#: (YAML 1.1's and 1.2's floats, underscores, signs, hex, octal), dates, text, lists and mappings
SPELLINGS = ["true", "false", "True", "FALSE", "yes", "no", "on", "off", "y", "tRUE", "null", "Null", "NULL", "~",
             "None", "none", "", " ", "nan", "NaN", ".nan", "inf", "-inf", ".inf", "-.Inf", "1e-3", "1.0e5", "1e3",
             "1.6e1", "+3", "-0", "1_000", "1__0e5", "0x1F", "0o17", "017", "1:30", "2.", ".5", "2024-01-01",
             "[1, 2]", "{a: 1}", "abc", "minus one", "bf16", "16-mixed", "warn"]
#: where a value is given, and how: on the command line as typed (with quotes the shell passed on) or in a config
#: file, bare (YAML reads it) or quoted (a YAML string)
WAYS = [(where, quotes) for where in ("command line", "config file") for quotes in ("bare", "double", "single")]


@pytest.fixture(scope="module")
def parser():
    return fit_parser()


def test_the_committed_table_is_the_parsers(parser):
    assert render(table_of(parser)) == (ROOT / "lit_grpo" / "cli" / "option_table.py").read_text(), \
        "the options of fit changed: python -m lit_grpo.cli.write_option_table --write"


# typing.Optional and typing.Union on purpose: the parser's hints come in both spellings
@pytest.mark.parametrize("hint, entry", [
    (float, "float"), (typing.Optional[int], "int|null"), (int | None, "int|null"),  # noqa: UP045
    (typing.Literal["pad", "error"], "'pad'|'error'"),
    (typing.Union[bool, typing.Literal["warn"], None], "bool|'warn'|null"),  # noqa: UP007
    (list[int], ANY), (typing.Union[int, list[str]], ANY), (Path, "str"),  # noqa: UP007
    (typing.Optional[Path], "str|null"),  # noqa: UP045
])
def test_an_entry_lists_what_a_type_hint_accepts(hint, entry):
    assert describe(hint) == entry


def literals(key: str) -> list[str]:
    """The choices of an option's entry as a user types them (``pad``, ``16``)."""
    return [str(ast.literal_eval(alternative)) for alternative in OPTIONS[key].split("|")
            if alternative not in ("int", "float", "bool", "str", "null")]


@st.composite
def values(draw: st.DrawFn) -> tuple[str, str, str, str]:
    """``(option, where, quotes, text)``: any option the early check judges, given any way, with a value of the right
    or a wrong type, one of its choices or a near miss, null, or text."""
    key = draw(st.sampled_from(TYPED))
    choices = literals(key)
    text = draw(st.one_of(
        st.sampled_from(SPELLINGS),
        st.integers(-10**12, 10**12).map(str),
        st.floats().map(repr), st.floats().map("{:e}".format), st.floats().map("{:_}".format),
        st.sampled_from(choices or SPELLINGS),
        st.sampled_from(choices or SPELLINGS).map(lambda choice: choice.upper() + "x"),  # out of the choices
        st.text(st.sampled_from("0123456789.+-_eE ~'\"[]{},:#tTrRuUfFaAlLsSnNox"), max_size=8),
    ))
    return (key, *draw(st.sampled_from(WAYS)), text)


def nested(key: str, value: str) -> str:
    """A config file that sets the dotted ``key`` to the YAML ``value``."""
    *groups, leaf = key.split(".")
    return "".join(f"{'  ' * depth}{group}:\n" for depth, group in enumerate(groups)) + \
        f"{'  ' * len(groups)}{leaf}: {value}\n"


def given_as(key: str, where: str, quotes: str, text: str, folder: Path) -> list[str]:
    """The command line (after ``fit``) that gives option ``key`` the value ``text`` the way ``where``, ``quotes``
    say (a config file is written in ``folder``)."""
    if where == "command line":
        mark = {"bare": "", "double": '"', "single": "'"}[quotes]
        return [f"--{key}={mark}{text}{mark}"]
    shown = dict(bare=text, double=json.dumps(text), single="'" + text.replace("'", "''") + "'")[quotes]
    (folder / "c.yaml").write_text(nested(key, shown))
    return ["--config", str(folder / "c.yaml")]


def early_type_refusal(args: list[str]) -> str | None:
    """The early type check's refusal of ``args`` (one option, on the command line or in one config file)."""
    refused = file_refusal(args[1]) if args[0] == "--config" else command_line_refusal(args)
    return None if refused is None else refused[0]


@pytest.fixture(scope="module")
def option_parsers(parser):
    """jsonargparse's own check of each option's type, the one fit's parser runs on that option: a parser of the
    option alone, with the type hint and default fit's parser gives it, reading ``--config`` files as fit's does
    (milliseconds a parse where fit's parser takes a fifth of a second; :func:`test_one_option_parsers_are_fits` and
    the end-to-end tier's ``--print_config`` runs show they agree)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    found = {}
    for action in parser._actions:
        if action.dest in TYPED:
            alone = ArgumentParser(exit_on_error=False)
            alone.add_argument("--config", action=ActionConfigFile)
            alone.add_argument(f"--{action.dest}", type=action._typehint, default=action.default)
            found[action.dest] = alone
    assert set(found) == set(TYPED)
    return found


def parser_refuses(option_parser, args: list[str]) -> bool:  # noqa: ANN001
    from jsonargparse import ArgumentError

    try:
        option_parser.parse_args(args)
    except ArgumentError:
        return True
    return False


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:  # noqa: ANN001
    return tmp_path_factory.mktemp("configs")


# derandomized: the default tier draws the same 500 values on every run (a failure is never one run's luck), and
# writes no example database into the checkout
@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(value=values())
# a quoted value in a config file is a string that the parser reads again: a bool, null, a number
@example(value=("model.packing", "config file", "double", "true"))
@example(value=("model.gradient_checkpointing", "config file", "double", "false"))
@example(value=("data.micro_batch_tokens", "config file", "double", "null"))
@example(value=("data.micro_batch_tokens", "config file", "single", "~"))
@example(value=("trainer.precision", "config file", "double", "null"))
@example(value=("model.beta", "config file", "double", "1e-3"))
@example(value=("seed_everything", "config file", "double", "true"))
@example(value=("data.dynamic_sampling.at_cap", "config file", "bare", "null"))  # the parser checks no null there
@example(value=("trainer.precision", "config file", "bare", "1.6e1"))  # 16.0, the literal 16
def test_the_early_check_refuses_only_what_the_parser_refuses(value, option_parsers, folder):
    """Every option the early check judges, each way of giving a value (typed on the command line, bare or quoted in
    a config file), values of the right and wrong types, choices and near misses, null: a value refused early is
    refused by the parser's own check of that option, with a one-line message naming the option and the value."""
    key, where, quotes, text = value
    args = given_as(key, where, quotes, text, folder)
    refusal = early_type_refusal(args)
    if refusal is not None:
        assert refusal.startswith(f"{key} expects ") and "\n" not in refusal, refusal
        assert parser_refuses(option_parsers[key], args), f"refused early, taken by the parser: {args} ({refusal})"


def test_every_option_takes_early_what_the_parser_takes(option_parsers, tmp_path):
    """The property on every option of the table, not the ones drawn: a bool, null and numbers, quoted in a config
    file and typed on the command line (the parser reads both alike), and the option's choices."""
    judged = 0
    for key in TYPED:
        for text in ["true", "false", "null", "1", "2.5", "1e-3", *literals(key)]:
            for where, quotes in (("config file", "double"), ("command line", "bare")):
                args = given_as(key, where, quotes, text, tmp_path)
                if (refusal := early_type_refusal(args)) is not None:
                    judged += 1
                    assert parser_refuses(option_parsers[key], args), f"refused early, taken: {args} ({refusal})"
    assert judged > 300, judged  # most options take only some of these


def test_a_word_is_refused_early_wherever_an_option_takes_no_text(tmp_path):
    """The other side of the property: the early check is no check that refuses nothing. A word, typed or quoted in
    a file, is refused for every option whose entry takes no str, naming the option and the word (on the command
    line, an option outside the sections, ``--seed_everything``, is the parser's)."""
    wordless = [key for key in TYPED if "str" not in OPTIONS[key].split("|")]
    assert len(wordless) > 100, wordless
    for key in wordless:
        for where, quotes in WAYS if "." in key else WAYS[3:]:
            refusal = early_type_refusal(given_as(key, where, quotes, "minus one", tmp_path))
            assert refusal is not None and refusal.startswith(f"{key} expects ") and "minus one" in refusal, \
                (key, where, quotes, refusal)
        assert type_refusal(key, OPTIONS[key], "minus one") is not None


@pytest.mark.parametrize("key, where, quotes, text, refused", [
    ("model.packing", "config file", "double", "true", False),
    ("model.gradient_checkpointing", "config file", "double", "false", False),
    ("data.micro_batch_tokens", "config file", "double", "null", False),
    ("model.packing", "config file", "double", "1", True),
    ("model.packing", "command line", "double", "true", True),  # the shell passed the quotes on: not a bool
    ("model.beta", "config file", "double", "1e-3", False),
    ("model.beta", "config file", "bare", "true", True),
    ("model.beta", "command line", "bare", "abc", True),
    ("data.num_generations", "command line", "bare", "2.5", True),
    ("data.num_generations", "config file", "double", "8", False),
    ("trainer.max_epochs", "command line", "bare", "None", True),
    ("trainer.max_epochs", "config file", "bare", "null", False),
    ("data.dynamic_sampling.at_cap", "config file", "bare", "drop", True),
    ("data.dynamic_sampling.at_cap", "config file", "double", "pad", False),
    ("trainer.precision", "config file", "double", "null", False),
    ("trainer.precision", "command line", "bare", "bf16", False),
])
def test_one_option_parsers_are_fits(key, where, quotes, text, refused, parser, option_parsers, tmp_path):
    """The anchors of the property test: fit's own parser and the parser of the option alone give the same answer,
    and the early check's is theirs."""
    args = given_as(key, where, quotes, text, tmp_path)
    assert parser_refuses(parser, ["--model.model_name", "x", *args]) == refused
    assert parser_refuses(option_parsers[key], args) == refused
    assert (early_type_refusal(args) is not None) == refused


QUOTED = 'model: {packing: "true", gradient_checkpointing: "false"}\ndata: {micro_batch_tokens: "null"}\n'


@pytest.mark.slow
@pytest.mark.parametrize("text, code", [(QUOTED, 0), ('model: {packing: "1"}\n', 2)])
def test_lightning_cli_reads_quoted_values_as_the_early_check_does(text, code, tmp_path):
    """``python -m lit_grpo fit --config F --print_config`` (LightningCLI itself: the early check leaves
    ``--print_config`` to it) takes the quoted values the early check takes, and refuses the one it refuses."""
    path = tmp_path / "quoted.yaml"
    path.write_text(text)
    assert (early_refusal(["fit", "--config", DEMO, "--config", str(path)]) is None) == (code == 0)
    result, out, err = probe(["fit", "--config", DEMO, "--config", str(path), "--print_config"], tmp_path, ())
    assert result["code"] == code, err[-2000:]
    if code == 0:
        assert "  packing: true" in out and "  gradient_checkpointing: false" in out, out[-3000:]
        assert "  micro_batch_tokens: null" in out, out[-3000:]
    else:
        assert "model.packing" in err, err[-2000:]


def test_unknown_keys_are_those_of_a_section_that_lacks_them():
    assert unknown_key("model.bta", OPTIONS)
    assert unknown_key("model.optimizer.learning_rate", OPTIONS)
    assert not unknown_key("model.beta", OPTIONS)
    assert not unknown_key("trainer.logger.init_args.save_dir", OPTIONS)  # under a class: the parser's
    assert not unknown_key("data.engine_options.url", OPTIONS)  # under a dict or class
    assert not unknown_key("optimizer", OPTIONS) and not unknown_key("lr_scheduler.x", OPTIONS)  # outside sections


@pytest.mark.parametrize("args, expected", [
    (["--model.bta", "1"], "unrecognized arguments: --model.bta; did you mean `--model.beta`? (model.bta, on the "
                           "command line)"),
    (["--model.lr=0.1"], "unrecognized arguments: --model.lr; `--model.lr` is now `--model.optimizer.lr` "
                         "(model.lr, on the command line)"),
    (["--model.beta", "abc"], "model.beta expects a float, got 'abc' (model.beta, on the command line)"),
    (["--data.num_generations", "2.5"], "data.num_generations expects an int, got '2.5' (data.num_generations, on "
                                        "the command line)"),
    (["--model.optimizer.schedule", "step"], "model.optimizer.schedule expects one of 'constant', 'linear', "
                                             "'cosine', got 'step' (model.optimizer.schedule, on the command line)"),
    (["--trainer.max_epochs", "None"], "trainer.max_epochs expects an int or null, got 'None' (trainer.max_epochs, "
                                       "on the command line)"),
    # left to the parser: values it may take, options outside the sections, under a class or a dict, no value
    (["--model.beta", "1e-3", "--trainer.precision", "bf16-mixed", "--trainer.enable_checkpointing", "yes"], None),
    (["--optimizer", "Adam"], None),
    (["--trainer.logger.init_args.save_dir", "x"], None),
    (["--data.engine_options.url", "http://127.0.0.1:1"], None),
    (["--model.beta"], None),
    (["--data.rewards+=format"], None),
])
def test_command_line_refusals(args, expected):
    refused = command_line_refusal(args)
    assert (None if refused is None else f"{refused[0]} ({refused[1]})") == expected


@pytest.mark.parametrize("text, expected", [
    ("model:\n  bta: 1\n", "no option model.bta; did you mean `model.beta`? (model.bta, in {path})"),
    ("data:\n  num_generations: two\n", "data.num_generations expects an int, got 'two' (data.num_generations, in "
                                        "{path})"),
    ("data:\n  dynamic_sampling:\n    at_cap: drop\n", "data.dynamic_sampling.at_cap expects one of 'pad', 'error', "
                                                      "got 'drop' (data.dynamic_sampling.at_cap, in {path})"),
    ("model:\n  optimizer:\n    lr: 1.0e-3\n    warmup_steps: 10\n", None),
    ("model:\n  lora:\n    r: 8\n", None),  # a class's options: the parser's
    ("trainer:\n  logger:\n    class_path: x\n", None),
    ("fit:\n  model:\n    bta: 1\n", None),  # nested under the subcommand: the parser's
    ("model: other.yaml\n", None),
    ("[1, 2]\n", None),
])
def test_config_file_refusals(text, expected, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    refused = file_refusal(str(path))
    assert (None if refused is None else f"{refused[0]} ({refused[1]})") == \
        (None if expected is None else expected.format(path=path))


def test_the_command_line_is_read_before_the_files_and_the_files_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  bta: 1\n")
    (tmp_path / "b.yaml").write_text("model:\n  betaa: 1\n")
    a, b = str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")
    assert early_refusal(["fit", "--config", a, "--config", b])[1] == f"model.bta, in {a}"
    assert early_refusal(["fit", "--config", b, "--config", a])[1] == f"model.betaa, in {b}"
    assert early_refusal(["fit", "--config", a, "--model.beta", "x"])[1] == "model.beta, on the command line"
    assert early_refusal(["validate", "--config", a]) is None  # the table is fit's


@pytest.mark.parametrize("args, message", [
    (["--model.bta", "1"], "error: unrecognized arguments: --model.bta; did you mean `--model.beta`?"),
    (["--trainer.max_steps", "ten"], "error: trainer.max_steps expects an int, got 'ten'"),
    (["--data.num_generations", "1"], "error: num_generations (G) must be >= 2"),
])
def test_refused_before_torch_or_lightning_loads(args, message, tmp_path):
    result, _, err = probe(["fit", "--config", DEMO, *args], tmp_path, ("torch", "lightning", "transformers"),
                           env={"PATH": "/usr/bin:/bin"})
    lines = err.strip().splitlines()
    assert result == {"code": 2, "loaded": []}, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(message), lines
