"""A bad value that the command line and its config files alone show (``lit_grpo.cli.early_checks``) is refused in
one line before Lightning, transformers or jsonargparse is imported; anything less certain is left to LightningCLI,
which refuses the same value with the same message."""

import sys
from pathlib import Path

import pytest
from cli_runner import no_model, probe

from lit_grpo.cli.early_checks import early_refusal

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo_cpu.yaml")
NOT_LOADED = ("lightning", "transformers", "jsonargparse")
BETA = "beta must be a number >= 0 (model.beta, the KL weight of eq. 7), got "
LR = "optimizer.lr must be a finite number > 0, got "



def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("source", ["command_line", "config"])
def test_a_bad_beta_is_one_line_before_lightning_loads(source, tmp_path):
    bad = write(tmp_path / "bad.yaml", "model:\n  beta: -0.5\n")
    args, where = {"command_line": (["--model.beta", "-1"], "(model.beta, on the command line)"),
                   "config": (["--config", bad], f"(model.beta, in {bad})")}[source]
    result, _, err = probe(["fit", "--config", DEMO, *args], tmp_path, NOT_LOADED, env={"PATH": "/usr/bin:/bin"})
    lines = err.strip().splitlines()
    assert result == {"code": 2, "loaded": []}, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {BETA}") and lines[0].endswith(where), lines


@pytest.mark.parametrize("args, expected", [
    (["fit", "--model.beta", "-1"], BETA + "-1.0 (model.beta, on the command line)"),
    (["validate", "--model.beta=-2"], BETA + "-2.0 (model.beta, on the command line)"),
    (["fit", "--config", "{bad}", "--config", "{good}", "--model.beta", "-3"], BETA + "-3.0 (model.beta, on the "
                                                                                      "command line)"),
    (["fit", "--model.beta", "1", "--config", "{bad}"], BETA + "-0.5 (model.beta, in {bad})"),  # the later wins
    (["fit", "--model.beta", "nan"], BETA + "nan (model.beta, on the command line)"),
    (["fit", "--model.optimizer.lr", "0"], LR + "0.0 (model.optimizer.lr, on the command line)"),
    (["fit", "--config", "{bad_lr}"], LR + "-0.001 (model.optimizer.lr, in {bad_lr})"),
    (["fit", "--model.optimizer.weight_decay=-1"],
     "optimizer.weight_decay must be >= 0, got -1.0 (model.optimizer.weight_decay, on the command line)"),
    # the data module's and GRPOModule's own rules (lit_grpo/data/option_checks.py, lit_grpo/training/option_checks.py)
    (["fit", "--data.num_generations", "1"], "num_generations (G) must be >= 2 to form a group advantage, got 1 "
                                             "(data.num_generations, on the command line)"),
    (["fit", "--data.temperature", "0"], "temperature must be > 0, got 0.0 (data.temperature, on the command line)"),
    (["fit", "--model.iterations_per_batch=0"], "iterations_per_batch (i) must be >= 1, got 0 "
                                                "(model.iterations_per_batch, on the command line)"),
    (["fit", "--model.loss_aggregation", "sum"], "unknown loss_aggregation 'sum'; expected one of ('token_mean', "
                                                 "'seq_mean_token_mean', 'constant', 'seq_mean_token_sum') "
                                                 "(model.loss_aggregation, on the command line)"),
    # left to LightningCLI: a later file sets it right, a checkpoint's hyperparameters or a whole group may replace
    # it, help or the config is asked for, no subcommand, or nothing sets it
    (["fit", "--model.beta", "-1", "--config", "{good}"], None),
    (["fit", "--model.beta", "-1", "--ckpt_path", "x.ckpt"], None),
    (["fit", "--config", "{bad}", "--config", "{ckpt}"], None),
    (["fit", "--model.beta", "-1", "--model", "{good}"], None),
    (["fit", "--model.optimizer.lr", "0", "--model.optimizer", "{{lr: 1.0e-3}}"], None),
    (["fit", "--config", "{bad}", "--config", "{whole}"], None),
    (["fit", "--model.beta", "-1", "--print_config"], None),
    (["fit", "--model.beta", "-1", "--help"], None),
    # a value of the wrong type: fit's parser's own check, from the table of its options (tests/test_option_types.py)
    (["fit", "--model.beta", "minus one"], "model.beta expects a float, got 'minus one' (model.beta, on the command "
                                           "line)"),
    (["fit", "--model.beta", "true"], "model.beta expects a float, got 'true' (model.beta, on the command line)"),
    (["validate", "--model.beta", "true"], None),  # the table is fit's: the parser of validate checks it
    (["--model.beta", "-1"], None),
    (["fit", "--config", "{good}"], None),
    (["fit", "--config", "{nested}"], None),
    # a quoted value is a string the parser reads again as YAML: "true" is a bool, "null" null; a wrong one is refused
    (["fit", "--config", "{quoted}"], None),
    (["fit", "--config", "{quoted_bad}"], "model.packing expects a bool (true or false), got '1' (model.packing, in "
                                          "{quoted_bad})"),
])
def test_which_values_are_refused_early(args, expected, tmp_path):
    files = {"bad": "model:\n  beta: -0.5\n", "good": "model:\n  beta: 0.1\n", "ckpt": "ckpt_path: x.ckpt\n",
             "whole": "model: other.yaml\n", "nested": "fit:\n  model:\n    beta: -1\n",
             "bad_lr": "model:\n  optimizer:\n    lr: -1.0e-3\n",
             "quoted": 'model: {packing: "true", gradient_checkpointing: "false"}\n'
                       'data: {micro_batch_tokens: "null"}\n',
             "quoted_bad": 'model: {packing: "1"}\n'}
    paths = {name: write(tmp_path / f"{name}.yaml", text) for name, text in files.items()}
    refused = early_refusal([arg.format(**paths) for arg in args])
    assert (None if refused is None else f"{refused[0]} ({refused[1]})") == \
        (None if expected is None else expected.format(**paths))


@pytest.mark.parametrize("option, value, message", [
    ("model.beta", "-1", BETA + "-1.0 "), ("model.optimizer.lr", "0", LR + "0.0 "),
    ("data.num_generations", "1", "num_generations (G) must be >= 2 to form a group advantage, got 1 "),
    ("data.temperature", "0", "temperature must be > 0, got 0.0 "),
    ("model.iterations_per_batch", "0", "iterations_per_batch (i) must be >= 1, got 0 "),
    ("model.loss_aggregation", "sum", "unknown loss_aggregation 'sum'; expected one of "),
])
def test_lightning_cli_refuses_the_same_value_with_the_same_message(option, value, message, tmp_path, monkeypatch,
                                                                     capsys):
    """An early check is the rule LightningCLI applies when it builds the option's class: refused there too."""
    from lit_grpo.cli.commands import TRAINING

    no_model(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        __import__(TRAINING, fromlist=["train"]).train(
            ["fit", "--model.model_name", "tiny-random-llama", "--trainer.logger", "false", f"--{option}", value])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
