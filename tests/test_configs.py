"""Every shipped config parses: the stand-alone ones alone, the overlays (a Table 1 row, a REC loss, a REC
off-policy setting, the server) stacked on the paper's base config, as the README starts them, and the longer stacks
as ``python -m lit_grpo configs`` lists them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from lit_grpo.cli.configs import shipped

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
BASE = CONFIGS / "gsm8k" / "base.yaml"
OVERLAYS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent != CONFIGS and p != BASE)
STANDALONE = sorted(CONFIGS.glob("*.yaml"))


def print_config(stack: list[Path], monkeypatch, capsys) -> dict:
    from lit_grpo.cli.lightning_cli import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    args = ["fit", *(a for path in stack for a in ("--config", str(path))), "--print_config"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code in (0, None), capsys.readouterr().err[-2000:]
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("path", STANDALONE, ids=lambda p: p.name)
def test_standalone_config_parses(path, monkeypatch, capsys):
    config = print_config([path], monkeypatch, capsys)
    assert config["model"]["model_name"] and config["trainer"]["max_steps"] > 0


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_overlay_config_parses_on_the_base_and_wins(path, monkeypatch, capsys):
    config = print_config([BASE, path], monkeypatch, capsys)
    overlay = yaml.safe_load(path.read_text())
    for section in ("model", "sync", "data"):  # the overlay's values override the base's
        for key, value in (overlay.get(section) or {}).items():
            if not isinstance(value, dict):
                assert config[section][key] == value, (section, key)


# the stacks of three configs that `python -m lit_grpo configs` lists (from each config's usage comment): a REC
# setting after a loss, the server or the calculator tool after a Table 1 row
STACKS = sorted({tuple(config.stack) for config in shipped().values() if len(config.stack) > 2})


def test_the_stacks_of_three_are_found():
    assert {stack[-1] for stack in STACKS} == {"gsm8k/server", "gsm8k/calculator", "rec/settings/mixed",
                                              "rec/settings/on_policy", "rec/settings/one_step_stale"}


@pytest.mark.parametrize("stack", STACKS, ids="+".join)
def test_a_listed_stack_of_three_parses_and_the_last_wins(stack, monkeypatch, capsys):
    config = print_config([CONFIGS / f"{name}.yaml" for name in stack], monkeypatch, capsys)
    last = yaml.safe_load((CONFIGS / f"{stack[-1]}.yaml").read_text())
    for section in ("model", "sync", "data"):
        for key, value in (last.get(section) or {}).items():
            if not isinstance(value, dict):
                assert config[section][key] == value, (section, key)


@pytest.mark.parametrize("extra, seed", [(["--seed_everything", "3"], 3), ([], 0), (["--seed_everything", "false"], 0)])
def test_seed_everything_also_seeds_the_rollouts(extra, seed, monkeypatch):
    from lit_grpo.cli.lightning_cli import GRPOCLI
    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.training.module import GRPOModule

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    cli = GRPOCLI(GRPOModule, RolloutDataModule, run=False,
                  args=["--config", str(CONFIGS / "demo_cpu.yaml"), "--model.model_name", "tiny-random-llama", *extra])
    assert cli.datamodule.seed == seed
