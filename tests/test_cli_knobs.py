"""Lightning's knobs against the training CLI: --optimizer / --lr_scheduler are not offered (the module's
`model.optimizer` group is), trainer.gradient_clip_val maps to model.gradient_clip_val, accumulate_grad_batches is
refused naming the data module's knobs, a second RefModelSwap is refused like a second WeightSync, PL_GLOBAL_SEED
seeds the rollouts as Lightning's seed_everything reads it, and option paths of earlier versions name their new
place. Each refusal is one line, exit status 2, before the model loads."""

import sys

import pytest
from cli_runner import no_model, one_line_error
from conftest import TOY_REWARD, tiny_module, tiny_trainer

from lit_grpo.cli.option_hints import MOVED_OPTIONS, option_hint

TINY = ["--model.model_name", "tiny-random-llama", "--data.rewards", f"[{TOY_REWARD}]", "--data.prompts_per_step",
        "2", "--data.num_generations", "4", "--data.micro_batch_size", "4", "--data.max_new_tokens", "8",
        "--data.max_prompts", "8", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.logger",
        "false", "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false"]


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # Lightning writes it; monkeypatch restores the original state
    monkeypatch.delenv("PL_GLOBAL_SEED")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def instantiate(args):
    """The CLI's objects for ``args`` (no subcommand run), built as ``python -m lit_grpo`` builds them."""
    from lit_grpo.cli.errors import report_usage_errors
    from lit_grpo.cli.lightning_cli import GRPOCLI
    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.training.module import GRPOModule

    return report_usage_errors(lambda: GRPOCLI(GRPOModule, RolloutDataModule, args=args, run=False,
                                               auto_configure_optimizers=False))


@pytest.mark.parametrize("flag, value, expected", [
    ("--optimizer", "torch.optim.SGD", ["`--optimizer` is not offered", "`model.optimizer`", "model.optimizer.lr"]),
    ("--lr_scheduler", "torch.optim.lr_scheduler.StepLR", ["`--lr_scheduler` is not offered",
                                                            "model.optimizer.schedule"]),
])
def test_optimizer_and_scheduler_are_not_offered(flag, value, expected, cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    line = one_line_error(["fit", *TINY, flag, value], capsys)
    for text in expected:
        assert text in line


def test_accumulate_grad_batches_is_refused_naming_the_data_knobs(cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    line = one_line_error(["fit", *TINY, "--trainer.accumulate_grad_batches", "2"], capsys)
    for text in ("trainer.accumulate_grad_batches=2", "data.micro_batch_size", "data.prompts_per_step",
                 "(trainer.accumulate_grad_batches, on the command line)"):
        assert text in line


def test_gradient_clip_algorithm_value_is_refused(cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    line = one_line_error(["fit", *TINY, "--trainer.gradient_clip_algorithm", "value"], capsys)
    assert "'value'" in line and "model.gradient_clip_val" in line


def test_trainer_gradient_clip_val_becomes_the_modules(cli_env):
    cli = instantiate([*TINY, "--trainer.gradient_clip_val", "0.25"])
    assert cli.model.hparams.gradient_clip_val == 0.25
    assert cli.trainer.gradient_clip_val is None  # Lightning's own clipping is refused under manual optimization


def test_two_different_clip_values_are_refused(cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    line = one_line_error(["fit", *TINY, "--trainer.gradient_clip_val", "0.25", "--model.gradient_clip_val", "2"],
                          capsys)
    assert "disagree" in line and "trainer.gradient_clip_val" in line and "model.gradient_clip_val" in line


def test_python_api_trainer_gradient_clip_val_names_the_modules_knob(tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=1, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"GRPOModule\(gradient_clip_val=1.0\)"):
        trainer.fit(tiny_module())


@pytest.mark.parametrize("where", ["command_line", "config"])
def test_second_ref_model_swap_is_refused(where, cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    if where == "config":
        (cli_env / "two.yaml").write_text("trainer:\n  callbacks:\n    - class_path: lit_grpo.callbacks.RefModelSwap\n")
        extra, source = ["--config", str(cli_env / "two.yaml")], f"in {cli_env / 'two.yaml'}"
    else:
        extra, source = ["--trainer.callbacks+=lit_grpo.callbacks.RefModelSwap"], "on the command line"
    line = one_line_error(["fit", *TINY, *extra], capsys)
    for text in ("the `ref_swap` section already adds the RefModelSwap callback", "ref_swap.max_swaps",
                 "remove RefModelSwap from trainer.callbacks", f"(trainer.callbacks, {source})"):
        assert text in line


def test_rollout_seed_follows_lightnings_precedence(monkeypatch):
    from lit_grpo.cli.lightning_cli import rollout_seed_of

    monkeypatch.setenv("PL_GLOBAL_SEED", "17")
    assert rollout_seed_of(True) == 17  # seed_everything true (the default): Lightning seeds with the variable
    assert rollout_seed_of(5) == 5  # an explicit integer wins, in Lightning too
    assert rollout_seed_of(False) == 0  # no global seeding: the rollouts keep a fixed seed
    monkeypatch.delenv("PL_GLOBAL_SEED")
    assert rollout_seed_of(True) == 0  # Lightning's own default without the variable


def test_pl_global_seed_seeds_the_data_module(cli_env, monkeypatch):
    seeds = {}
    for env in ("11", "23", "11"):
        monkeypatch.setenv("PL_GLOBAL_SEED", env)
        seeds.setdefault(env, []).append(instantiate(TINY).datamodule.seed)
    assert seeds == {"11": [11, 11], "23": [23]}
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    assert instantiate([*TINY, "--seed_everything", "4"]).datamodule.seed == 4


def test_bad_pl_global_seed_is_one_line(cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    monkeypatch.setenv("PL_GLOBAL_SEED", "abc")
    line = one_line_error(["fit", *TINY], capsys)
    assert "PL_GLOBAL_SEED='abc' is not an integer seed" in line


@pytest.mark.parametrize("args, expected", [
    (["--model.lr", "1e-3"], "`--model.lr` is now `--model.optimizer.lr`"),
    (["--model.eps_low", "0.2"], "`--model.eps_low` is now `--model.loss_options.grpo.eps_low`"),
    (["--eval.every_n_steps", "5"], "`--eval.every_n_steps` is now `--eval.every_n_optimizer_steps`"),
    (["--model.optimizer.lrr", "1"], "did you mean `--model.optimizer.lr`?"),
])
def test_old_and_misspelt_option_paths_name_the_right_one(args, expected, cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    line = one_line_error(["fit", *TINY, *args], capsys)
    assert expected in line


def test_old_option_path_in_a_config_file(cli_env, monkeypatch, capsys):
    no_model(monkeypatch)
    (cli_env / "old.yaml").write_text("model:\n  lr: 0.001\n")
    line = one_line_error(["fit", *TINY, "--config", str(cli_env / "old.yaml")], capsys)
    assert "`model.lr` is now `model.optimizer.lr`" in line


def test_option_hint_table():
    known = ["model.optimizer.lr", "data.micro_batch_size"]
    assert option_hint("unrecognized arguments: --model.lr 1", known) == "`--model.lr` is now `--model.optimizer.lr`"
    assert option_hint("does not accept option 'model.lr'", known) == "`model.lr` is now `model.optimizer.lr`"
    assert option_hint("unrecognized arguments: --data.micro_batchsize 2", known) == (
        "did you mean `--data.micro_batch_size`?")
    assert option_hint("unrecognized arguments: --nothing.like.it 2", known) is None


def test_every_new_path_of_the_table_is_an_option(cli_env, capsys):
    import yaml

    from lit_grpo.cli.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.model_name", "tiny-random-llama", "--print_config"])
    assert exit_.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    for new in MOVED_OPTIONS.values():
        node = config
        for part in new.split("."):
            assert isinstance(node, dict) and part in node, new
            node = node[part]
