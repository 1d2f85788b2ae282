"""The Lightning and jsonargparse internals the CLI's one-line errors rely on (lit_grpo/cli/hooks.py) still hold
with the installed versions, checked through the behaviour each serves; a failure names the versions.

The errors themselves, end to end, are tests/test_cli_errors.py."""

from argparse import ArgumentError

import jsonargparse
import lightning
import pytest
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_grpo.cli import hooks as cli_hooks

VERSIONS = f"lightning {lightning.__version__}, jsonargparse {jsonargparse.__version__}"

built: list[str] = []


class ToyModel(LightningModule):
    def __init__(self, width: int = 1) -> None:
        super().__init__()
        built.append("model")


class ToyData(LightningDataModule):
    def __init__(self, size: int = 1) -> None:
        super().__init__()
        built.append("data")


class ToyCallback(Callback):
    def __init__(self, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        built.append("callback")


class ToyCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ToyCallback, "toy")

    def instantiate_classes(self) -> None:
        assert cli_hooks.build_model_last(self.parser), f"build_model_last did nothing ({VERSIONS})"
        super().instantiate_classes()


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["toy"])  # LightningCLI reads sys.argv too; keep pytest's out of it

    def run(*args: str) -> None:
        built.clear()
        ToyCLI(ToyModel, ToyData, run=False, args=[
            "--seed_everything", "0", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false", *args])

    return run


def test_the_model_is_built_after_the_data_module_and_the_callback_sections(toy):
    toy()
    assert built[-1] == "model" and sorted(built) == ["callback", "data", "model"], (
        f"build_model_last no longer orders what jsonargparse builds ({VERSIONS}): {built}")


def test_the_object_under_construction_is_found_through_jsonargparse(toy):
    with pytest.raises(ValueError) as err:
        toy("--toy.every", "0")
    owner = cli_hooks.object_under_construction(err.value, (Callback, LightningDataModule, LightningModule))
    assert isinstance(owner, ToyCallback), (
        f"the failing constructor's `self` is not in the traceback ({VERSIONS})")
    assert "model" not in built  # and the model was never built


def test_a_parse_error_names_its_key():
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(ToyModel, "model")
    with pytest.raises(ArgumentError) as err:
        parser.parse_args(["--model.width", "wide"])
    assert cli_hooks.key_of_parse_error(str(err.value)) == "model.width", (
        f"jsonargparse's message no longer names the key ({VERSIONS}): {err.value}")


@pytest.mark.parametrize("subcommand", ["fit", "validate", "predict"])
def test_predict_alone_has_the_predictions_section(subcommand, tmp_path, monkeypatch, capsys):
    """GRPOCLI extends LightningCLI._prepare_subcommand_parser(klass, subcommand) to give predict its options."""
    from lit_grpo.cli.commands import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lit_grpo"])
    with pytest.raises(SystemExit) as exit_:
        main([subcommand, "--help-all"])  # LightningCLI's own help (`fit --help` is the short list)
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert f"python -m lit_grpo [options] {subcommand}" in help_text  # the usage says how the CLI is run
    assert ("--predictions.output" in help_text) == (subcommand == "predict"), (
        f"_prepare_subcommand_parser no longer builds each subcommand's parser ({VERSIONS})")
