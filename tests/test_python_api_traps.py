"""The Python API's traps, each refused or reported before it can spoil a run: a module and a data module that
disagree on the sampling temperature, a fit in which nothing syncs the rollout engine, rewards given as functions
(accepted) or with a signature the runner cannot call (refused before training), and a reward that scores no
completion of the first batch (stops the run). The CLI keeps import paths for rewards."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks import WeightSync

from lit_grpo.data.fit_checks import (
    check_temperature_agrees,
    constant_normaliser_mismatch,
    module_setting,
    unsynced_engine_warning,
)
from lit_grpo.data.rewards import RewardFunctionError
from lit_grpo.engines.base import SamplingConfig

CALLS = []


def counted_digits(completion: str, answer: str, **kwargs: object) -> float:
    """A reward given as a function: the fraction of digits, and a record that it was called."""
    CALLS.append(completion)
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def path_of_the_cwd(completion: str, answer: str, **kwargs: object) -> str:
    return "/"  # text, not a number: what `os.getcwd` gave a run that trained at reward 0


class OwnSync(Callback):
    """A callback of one's own that loads the policy into the engine: it says so, and the warning stays off."""

    syncs_rollout_engine = True


def sync_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "syncs the rollout engine" in str(w.message)]


# --------------------------------------------------------------------------------------------- temperature


def test_a_temperature_mismatch_is_refused_before_the_first_step(tmp_path) -> None:
    recorder = MetricsRecorder()
    data = tiny_data(temperature=0.5)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(), recorder])
    with pytest.raises(ValueError) as info:
        trainer.fit(tiny_module(temperature=1.0), datamodule=data)
    assert str(info.value) == ("GRPOModule temperature=1.0 but RolloutDataModule temperature=0.5: the loss must use "
                               "the temperature the rollouts were sampled with; set them equal")
    # refused in the data module's setup: no engine built, no rollout sampled, no step taken
    assert data.rollout_engine is None and data.consumed == 0 and recorder.steps == []


def test_the_check_reads_a_module_duck_typed() -> None:
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7)
    check_temperature_agrees(SimpleNamespace(), sampling)  # a module of one's own with no temperature: nothing to check
    check_temperature_agrees(SimpleNamespace(temperature=0.7), sampling)
    with pytest.raises(ValueError, match="SimpleNamespace temperature=1 but RolloutDataModule temperature=0.7"):
        check_temperature_agrees(SimpleNamespace(temperature=1), sampling)
    # hparams first (what save_hyperparameters stores), then the attribute
    module = SimpleNamespace(hparams={"temperature": 0.7}, temperature=2.0)
    assert module_setting(module, "temperature") == 0.7
    check_temperature_agrees(module, sampling)


def test_a_constant_normaliser_other_than_the_generation_budget_is_named() -> None:
    sampling = SamplingConfig(max_new_tokens=8)
    other = SimpleNamespace(hparams={"loss_aggregation": "constant", "max_completion_length": 200})
    message = constant_normaliser_mismatch(other, sampling)
    assert message is not None and message.startswith(
        "SimpleNamespace max_completion_length=200 but RolloutDataModule max_new_tokens=8 with "
        "loss_aggregation='constant'")
    assert "scaled by 8/200" in message
    same = SimpleNamespace(hparams={"loss_aggregation": "constant", "max_completion_length": 8})
    token_mean = SimpleNamespace(hparams={"loss_aggregation": "token_mean", "max_completion_length": 200})
    assert constant_normaliser_mismatch(same, sampling) is None
    assert constant_normaliser_mismatch(token_mean, sampling) is None  # the length is not used there


# --------------------------------------------------------------------------------------------- engine sync


def test_a_fit_without_weight_sync_warns_and_one_with_it_does_not(tmp_path) -> None:
    runs = {}
    for name, callbacks in {"none": [], "weight_sync": [WeightSync()]}.items():  # OwnSync: the test below
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("ignore")  # recording every warning of a fit is slow; this one is what counts
            warnings.filterwarnings("always", message=".*syncs the rollout engine")
            tiny_trainer(tmp_path / name, max_steps=1, callbacks=callbacks).fit(tiny_module(), datamodule=tiny_data())
        runs[name] = sync_warnings(caught)
    assert len(runs["none"]) == 1
    assert "without WeightSync (lit_grpo.callbacks.WeightSync)" in runs["none"][0]
    assert "train/staleness grows" in runs["none"][0]
    assert runs["weight_sync"] == []


def test_the_sync_marker_is_read_from_callbacks_and_module() -> None:
    assert unsynced_engine_warning([WeightSync()], SimpleNamespace()) is None
    assert unsynced_engine_warning([], SimpleNamespace(syncs_rollout_engine=True)) is None
    assert unsynced_engine_warning([SimpleNamespace(syncs_rollout_engine="yes")], SimpleNamespace()) is not None
    assert unsynced_engine_warning([Callback()], SimpleNamespace()) is not None
    assert unsynced_engine_warning([Callback(), OwnSync()], SimpleNamespace()) is None


# --------------------------------------------------------------------------------------------- rewards


def test_a_reward_function_trains_next_to_an_import_path(tmp_path) -> None:
    recorder = MetricsRecorder()
    CALLS.clear()
    data = tiny_data(rewards=[counted_digits, "format"], reward_weights=[1.0, 0.5])
    tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(), recorder]).fit(tiny_module(), datamodule=data)
    assert len(recorder.steps) == 2
    assert len(CALLS) == 2 * 2 * 4  # steps x prompts x generations
    assert all(s["rollout/reward_errors"] == 0 for s in recorder.steps)


@pytest.mark.parametrize("spec", ["os:getcwd", "builtins:len"])
def test_a_reward_with_the_wrong_signature_is_refused_by_the_data_module(spec: str) -> None:
    with pytest.raises(ValueError, match=rf"reward '{spec}' has the signature .* cannot be called as "
                                         r"fn\(completion, answer\)"):
        tiny_data(rewards=[spec])


def test_a_reward_that_scores_no_completion_of_the_first_batch_stops_the_fit(tmp_path) -> None:
    recorder = MetricsRecorder()
    data = tiny_data(rewards=[path_of_the_cwd])
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(), recorder])
    with pytest.raises(RewardFunctionError, match=rf"reward '{__name__}:path_of_the_cwd' failed on all 8 completions "
                                                  r"of the first batch \(returned str '/', expected a number\)"):
        trainer.fit(tiny_module(), datamodule=data)
    assert recorder.steps == []


# --------------------------------------------------------------------------------------------- the CLI


def run_cli(args: list[str], monkeypatch, tmp_path) -> int:
    from lit_grpo.cli.lightning_cli import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])  # LightningCLI reads sys.argv too; keep pytest's out of it
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.model_name", "tiny-random-llama", *args])
    return exit_.value.code


def test_the_cli_still_parses_reward_paths(monkeypatch, tmp_path, capsys) -> None:
    code = run_cli(["--data.rewards", "[correctness, toy_rewards:digit_fraction]", "--print_config"], monkeypatch,
                   tmp_path)
    assert code in (0, None)
    assert "  rewards:\n  - correctness\n  - toy_rewards:digit_fraction\n" in capsys.readouterr().out


@pytest.mark.parametrize("spec", ["os:getcwd", "builtins:len"])
def test_the_cli_refuses_a_reward_with_the_wrong_signature_in_one_line(spec: str, monkeypatch, tmp_path,
                                                                        capsys) -> None:
    import lit_grpo.training.module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the reward was checked")

    monkeypatch.setattr(lit_grpo.training.module, "load_model_and_tokenizer", no_load)
    assert run_cli(["--data.rewards", f"[{spec}]"], monkeypatch, tmp_path) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: reward '{spec}' has the signature")
    assert lines[0].endswith("(data.rewards, on the command line)")


# --------------------------------------------------------------------------------------------- ranks


def test_a_reward_function_of_the_script_works_in_every_rank(tmp_path) -> None:
    """Each rank runs the user's script (Lightning's own DDP launch, or an external launcher), so a reward function
    defined in it is the script's own in every rank: nothing crosses a process boundary. This file is that script."""
    from distributed_launch import run_script_ranks

    codes, logs = run_script_ranks(__file__, tmp_path, world=2, timeout_s=240)
    assert codes == [0, 0], logs
    for rank in range(2):
        result = json.loads((tmp_path / f"out.{rank}.json").read_text())
        # this rank's 2 prompts x 4 completions, scored by the script's function under its name in the script
        assert result == {"calls": 8, "names": [["__main__:counted_digits", 1.0]], "errors": 0}, (rank, result)


def run_rank(out: Path) -> None:
    """One rank of ``test_a_reward_function_of_the_script_works_in_every_rank``: a one-step DDP fit whose reward is
    this script's ``counted_digits``."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90))
    data = tiny_data(rewards=[counted_digits])
    trainer = tiny_trainer(out.parent, max_steps=1, callbacks=[WeightSync()], devices=2, strategy=strategy)
    trainer.fit(tiny_module(), datamodule=data)
    result = {"calls": len(CALLS), "names": [list(s) for s in data.reward_runner.specs], "errors": data.reward_errors}
    out.with_suffix(f".{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]))
