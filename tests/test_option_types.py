"""The table of ``fit``'s options (``lit_grpo/cli/option_table.py``) is LightningCLI's parser's, and what it refuses
before Lightning loads the parser refuses too: an unknown option, a value of the wrong type, a value outside an
option's choices."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from cli_runner import probe

from lit_grpo.cli.early_checks import command_line_refusal, early_refusal, file_refusal
from lit_grpo.cli.option_table import OPTIONS
from lit_grpo.cli.option_types import ANY, GROUP, describe, read_text, type_refusal, unknown_key
from lit_grpo.cli.write_option_table import fit_parser, render, table_of

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
#: what a user may type for a value: numbers of every shape, booleans as YAML writes them, null, text, lists
TEXTS = ["1", "-1", "0", "2.5", "2.0", "1e-3", "nan", "inf", ".5", "+3", "true", "false", "True", "yes", "no",
         "null", "None", "~", "", "abc", "minus one", "[1, 2]", "{a: 1}", "bf16", "16-mixed", "32", "constant",
         "'1'", "warn", "pad"]


@pytest.fixture(scope="module")
def parser():
    return fit_parser()


def parser_refuses(parser, key: str, text: str) -> bool:
    try:
        parser.parse_args(["--model.model_name", "x", f"--{key}={text}"])
    except BaseException:  # noqa: BLE001 (jsonargparse raises ArgumentError, or exits on some errors)
        return True
    return False


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


def test_every_early_type_refusal_is_one_the_parser_makes_and_bad_text_is_refused(parser):
    """One option of each kind of entry, every text of TEXTS: a text refused early is refused by the parser (the
    early check may leave more to it, never less); and a word is refused early wherever the entry takes no text."""
    kinds: dict[str, str] = {}
    for key, entry in OPTIONS.items():
        if entry not in (GROUP, ANY):
            kinds.setdefault(entry, key)
    assert {"int", "float", "bool", "int|null", "float|null"} <= set(kinds), kinds
    wrongly_refused, refused_early = [], 0
    for entry, key in kinds.items():
        for text in TEXTS:
            refusal = type_refusal(key, entry, read_text(text), text)
            if refusal is not None:
                refused_early += 1
                assert refusal.startswith(f"{key} expects ") and repr(text) in refusal
                if not parser_refuses(parser, key, text):
                    wrongly_refused.append((key, text))
        if "str" not in entry.split("|"):
            assert type_refusal(key, entry, read_text("minus one"), "minus one") is not None, (key, entry)
    assert wrongly_refused == []
    assert refused_early > 50


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
