"""Reward functions beside an environment's own reward are refused in one line, before the model loads, unless the
sum is asked for: a reasoning-gym task on a base config's ``data.rewards: [correctness]`` would score a right answer
2 instead of the task's 1."""

import json
from pathlib import Path

import pytest
from cli_runner import refusal_line

from lit_grpo.data.datamodule import RolloutDataModule

ROOT = Path(__file__).resolve().parents[1]
TASK = "reasoning_gym:basic_arithmetic:size=20:test_size=4"


@pytest.mark.parametrize("rewards", [["correctness"], ["correctness", "format"]])
def test_rewards_beside_a_reasoning_gym_task_are_refused(rewards):
    with pytest.raises(ValueError) as err:
        RolloutDataModule(dataset=TASK, num_generations=2, rewards=rewards)
    line = str(err.value)
    assert "\n" not in line
    assert f"data.rewards {rewards}" in line
    assert "lit_grpo.environments.reasoning_gym:ReasoningGymEnvironment" in line
    assert "data.rewards: []" in line and "data.add_rewards_to_environment: true" in line


def test_rewards_beside_a_written_environment_are_refused(tmp_path):
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"target": i}) + "\n" for i in range(4)))
    with pytest.raises(ValueError, match=r"data.rewards \['correctness'\] would add to the reward of "
                                         r"data.environment toy_environments:GuessTheNumber"):
        RolloutDataModule(dataset=str(rows), environment="toy_environments:GuessTheNumber", num_generations=2,
                          rewards=["correctness"])


def test_a_reasoning_gym_task_on_a_config_with_rewards_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """The trap as a user meets it: a shipped config whose ``data.rewards`` is ``[correctness]``, its dataset
    swapped for a reasoning-gym task."""
    line = refusal_line(["fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model.model_name",
                         "tiny-random-llama", "--data.dataset", TASK, f"--trainer.default_root_dir={tmp_path}"],
                        tmp_path, monkeypatch, capsys)
    assert "data.rewards ['correctness'] would add to the reward of data.environment" in line
    assert "data.add_rewards_to_environment: true" in line


def test_no_rewards_or_the_sum_asked_for_are_accepted(tmp_path):
    assert RolloutDataModule(dataset=TASK, num_generations=2, rewards=[]).reward_runner.functions == []
    added = RolloutDataModule(dataset=TASK, num_generations=2, rewards=["correctness"],
                              add_rewards_to_environment=True)
    assert len(added.reward_runner.functions) == 1
    # tools alone have no reward of their own: data.rewards score their last turn, as before
    tools = RolloutDataModule(num_generations=2, tools=["lit_grpo.environments.calculator:calculator"])
    assert len(tools.reward_runner.functions) == 1


def test_the_eval_command_refuses_a_reasoning_gym_task_before_loading(monkeypatch, capsys):
    """The ``eval`` tool samples single-turn questions with GSM8K's prompt and judge: a reasoning-gym task would be
    prompted and scored unlike its training, so it is sent to ``validate``, which samples through the task's
    environment."""
    from cli_runner import no_model, one_line_error

    import lit_grpo.models.loading

    no_model(monkeypatch)
    monkeypatch.setattr(lit_grpo.models.loading, "load_model_and_tokenizer", lambda *a, **k: pytest.fail("loaded"))
    line = one_line_error(["eval", "--model", "tiny-random-llama", "--dataset", TASK], capsys)
    assert f"--dataset {TASK!r}" in line and "validate" in line
