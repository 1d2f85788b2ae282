"""Environments that cannot serve a run are refused in one line naming the environment and the row; what a single
trajectory's environment (or chat template) gets wrong ends that trajectory only; an OpenEnv row cannot pick the
server that scores its completions unless the factory allows it.

Through the command line (``python -m lit_grpo fit``, run in this process: one model load per case, no new
interpreter), each failure is one ``error:`` line and exit status 2: an environment failing on every trajectory of
the first batch, a ``reset()`` that raises or answers out of shape, G environments of one task that start
differently, and an ``eval.dataset`` the environment cannot start (but a ``reset()`` that always fails is the
environment's fault, not the eval dataset's).
"""

from __future__ import annotations

import json
import sys

import pytest
from toy_environments import STRICT_ROLES_TEMPLATE, GuessTheNumber, ObservationRole, ScriptedSampler, guess_after

from lit_grpo.data.multi_turn import EnvironmentStartError, MultiTurnOptions, TrajectoryRunner
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.environments.openenv import OpenEnvEnvironment, OpenEnvFactory
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import parse_hermes
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import tiny_tokenizer

TINY_FIT = ["fit", "--model.model_name", "tiny-random-llama", "--data.prompts_per_step", "2",
            "--data.num_generations", "2", "--data.micro_batch_size", "4", "--data.max_new_tokens", "4",
            "--data.system_prompt", "null", "--data.multi_turn.max_turns", "2", "--trainer.max_steps", "1",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--trainer.enable_checkpointing", "false"]


def fit_error_line(args: list[str], tmp_path, monkeypatch, capsys) -> str:  # noqa: ANN001
    """``python -m lit_grpo`` + ``TINY_FIT`` + ``args`` in this process, in ``tmp_path``: it must exit with status
    2, print no traceback and exactly one ``error: ...`` line on stderr, its last, which is returned (Lightning's own
    log lines of a started fit may come before it)."""
    from lit_grpo.cli.commands import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*TINY_FIT, *args])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-5:]
    assert not any("Traceback" in line for line in lines)
    return errors[0]


@pytest.fixture
def rows(tmp_path):
    """Task rows of ``toy_environments``' environments (a ``target``), and rows they cannot start (a ``goal``)."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"target": i}) + "\n" for i in range(4)))
    (tmp_path / "goals.jsonl").write_text("".join(json.dumps({"goal": i}) + "\n" for i in range(4)))
    return tmp_path


@pytest.mark.parametrize("environment, expected", [
    ("toy_environments:Broken",
     "the environment toy_environments:Broken failed on all 4 trajectories of the first batch (the first on the task "
     "{'target': "),
    ("toy_environments:ResetRaises",
     "the environment toy_environments:ResetRaises could not start the task {'target': "),
    ("toy_environments:ResetOutOfShape",
     "the environment toy_environments:ResetOutOfShape could not start the task {'target': "),
    ("toy_environments:RandomStart",
     "the environments toy_environments:RandomStart of the task {'target': "),
])
def test_an_environment_that_cannot_serve_the_fit_is_one_line(environment, expected, rows, monkeypatch, capsys):
    line = fit_error_line(["--data.dataset", "train.jsonl", "--data.environment", environment], rows, monkeypatch,
                          capsys)
    assert line.startswith(f"error: {expected}"), line
    assert line.endswith("(data.environment)"), line
    what = {"toy_environments:Broken": "RuntimeError: the environment broke",
            "toy_environments:ResetRaises": "reset() raised RuntimeError: reset broke",
            "toy_environments:ResetOutOfShape": "reset() returned int 42; expected a string or a list of chat messages",
            "toy_environments:RandomStart": "start with different messages"}[environment]
    assert what in line, line


def test_an_eval_dataset_the_environment_cannot_start_is_one_line(rows, monkeypatch, capsys):
    line = fit_error_line(["--data.dataset", "train.jsonl", "--data.environment", "toy_environments:GuessTheNumber",
                           "--eval.dataset", "goals.jsonl", "--eval.split", "train", "--eval.at_end", "true"],
                          rows, monkeypatch, capsys)
    assert line.startswith("error: GSM8KPassAtK: dataset 'goals.jsonl train' holds no task the environment "
                           "toy_environments:GuessTheNumber can start"), line
    assert "the task {'goal': 0}" in line and "KeyError: 'target'" in line, line
    assert line.endswith("(eval.dataset)"), line


def test_a_reset_that_always_fails_is_not_blamed_on_the_eval_dataset(rows, monkeypatch, capsys):
    line = fit_error_line(["--data.dataset", "train.jsonl", "--data.environment", "toy_environments:ResetRaises",
                           "--eval.dataset", "train.jsonl", "--eval.split", "train", "--eval.at_end", "true"],
                          rows, monkeypatch, capsys)
    assert line.startswith("error: the environment toy_environments:ResetRaises could not start the task"), line
    assert "reset() raised RuntimeError: reset broke" in line and line.endswith("(data.environment)"), line
    assert "eval" not in line and "GSM8KPassAtK" not in line, line


# ---- a chat template that raises on the environment's reply (item 8) ------------------------------------------
def strict_tokenizer():
    """The tiny model's character tokenizer with a template that raises on an unknown role (built here, offline)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = STRICT_ROLES_TEMPLATE
    return tokenizer


def test_a_template_that_raises_on_a_reply_ends_that_trajectory_as_an_environment_error():
    tokenizer = strict_tokenizer()
    with pytest.raises(Exception, match="Only user, assistant and system roles are supported"):  # the real template
        tokenizer.apply_chat_template([{"role": "observation", "content": "x"}], tokenize=False)
    runner = TrajectoryRunner(ObservationRole, ToolBox([]), parse_hermes, ConversationRenderer(tokenizer),
                              MultiTurnOptions(max_turns=4))

    def script(prefix: list[int], j: int) -> list[int]:  # guesses j: completion 1 is right, completion 0 is not
        return [tokenizer.convert_tokens_to_ids(str(guess_after(prefix, j) % 10)), tokenizer.eos_token_id]

    (group,) = runner.run([{"target": 1}], 2, ScriptedSampler(script), SamplingConfig(max_new_tokens=4), seed=0).groups
    wrong, right = (c.trajectory for c in group)
    # the wrong guess is answered in the role the template refuses: counted as an environment error, the run goes on
    assert wrong["stop"] == "env_error" and wrong["turns"] == 1
    assert wrong["env_error"].startswith("RenderingError: the chat template raised TemplateError: Only user, "
                                         "assistant and system roles are supported!"), wrong["env_error"]
    assert "\n" not in wrong["env_error"]
    assert (right["stop"], right["env_error"], right["env_reward"]) == ("done", None, 1.0)


def test_a_template_that_raises_on_the_first_messages_is_one_line_naming_the_environment():
    class ObservationFirst(GuessTheNumber):
        def reset(self):
            return [{"role": "observation", "content": "Guess."}]

    runner = TrajectoryRunner(ObservationFirst, ToolBox([]), parse_hermes, ConversationRenderer(strict_tokenizer()),
                              MultiTurnOptions())
    for start in (lambda: runner.prompt({"target": 3}),
                  lambda: runner.run([{"target": 3}], 2, ScriptedSampler(lambda p, j: [2]), SamplingConfig(), 0)):
        with pytest.raises(EnvironmentStartError) as error:
            start()
        message = str(error.value)
        assert "\n" not in message and "ObservationFirst could not start the task {'target': 3}" in message
        assert "the chat template raised TemplateError: Only user, assistant and system roles" in message


# ---- OpenEnv: a row's server address is opt-in (item 11) ------------------------------------------------------
def test_an_openenv_rows_address_is_refused_unless_the_factory_allows_it():
    row = {"seed": 1, "base_url": "http://elsewhere:9"}
    for make in (lambda: OpenEnvFactory(base_url="http://configured:1")(row), lambda: OpenEnvEnvironment(row)):
        with pytest.raises(ValueError) as error:
            make()
        message = str(error.value)
        assert "\n" not in message
        assert "the dataset row's 'base_url' 'http://elsewhere:9'" in message and "url_from_row=True" in message
    # allowed explicitly, the row's address is the one used; a row without one keeps the factory's
    assert OpenEnvFactory(base_url="http://configured:1", url_from_row=True)(row).base_url == "http://elsewhere:9"
    assert OpenEnvFactory(base_url="http://configured:1")({"seed": 1}).base_url == "http://configured:1"
    # the configured address repeated in a row changes nothing: it is not refused
    assert OpenEnvFactory(base_url="http://elsewhere:9")(row).base_url == "http://elsewhere:9"
