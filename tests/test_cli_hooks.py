"""The Lightning and jsonargparse internals the CLI's one-line errors rely on (lit_grpo/cli/hooks.py) still hold
with the installed versions; when one does not, the failure names the versions and the hook.

The errors themselves, end to end, are tests/test_cli_errors.py."""

from argparse import ArgumentError

import lightning
import pytest
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lit_grpo.cli import hooks as cli_hooks


def test_every_hook_holds_for_the_installed_versions():
    cli_hooks.check()  # raises HookBroken naming the versions and the hook


def test_a_broken_hook_names_the_versions_and_the_hook(monkeypatch):
    # as if LightningCLI.__init__ parsed the checkpoint's hyperparameters after building the classes
    monkeypatch.setattr(cli_hooks, "HPARAMS_BETWEEN", ("parse_arguments", "before_instantiate_classes",
                                                       "_parse_ckpt_path"))
    with pytest.raises(cli_hooks.HookBroken) as broken:
        cli_hooks.check()
    message = str(broken.value)
    assert f"lightning {lightning.__version__}" in message and "jsonargparse" in message
    assert "LightningCLI.__init__" in message and "cli/hooks.py" in message


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
        assert cli_hooks.build_model_last(self.parser), f"build_model_last did nothing ({cli_hooks.versions()})"
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
        f"build_model_last no longer orders what jsonargparse builds ({cli_hooks.versions()}): {built}")


def test_the_object_under_construction_is_found_through_jsonargparse(toy):
    with pytest.raises(ValueError) as err:
        toy("--toy.every", "0")
    owner = cli_hooks.object_under_construction(err.value, (Callback, LightningDataModule, LightningModule))
    assert isinstance(owner, ToyCallback), (
        f"the failing constructor's `self` is not in the traceback ({cli_hooks.versions()})")
    assert "model" not in built  # and the model was never built


def test_a_parse_error_names_its_key():
    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_lightning_class_args(ToyModel, "model")
    with pytest.raises(ArgumentError) as err:
        parser.parse_args(["--model.width", "wide"])
    assert cli_hooks.key_of_parse_error(str(err.value)) == "model.width", (
        f"jsonargparse's message no longer names the key ({cli_hooks.versions()}): {err.value}")
