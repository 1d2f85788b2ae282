"""The trajectory runner end to end with scripted model turns (turns, summed rewards, the ways a trajectory ends, an
environment that fails), its statistics, multi-turn completions in checkpoints of batches in flight, the data module's
refusals and failure, and the acceptance: a user's environment in the plain form trains through ``python -m lit_grpo
fit`` with no other code."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import toy_environments
from conftest import MetricsRecorder, tiny_module, tiny_trainer
from toy_environments import (
    Broken,
    Counting,
    GuessTheNumber,
    RandomStart,
    ScriptedSampler,
    TypedGuess,
    WrongShape,
    guess_after,
    scripted_turns_data,
)

from lit_grpo.data.multi_turn import EnvironmentStartError, MultiTurnOptions, TrajectoryRunner, trajectory_stats
from lit_grpo.data.staleness import groups_from_state, groups_to_state
from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import parse_hermes
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import tiny_tokenizer

SAMPLING = SamplingConfig(max_new_tokens=16)
EOS = 2
TOKENIZER = tiny_tokenizer()


def chars(text: str, end: bool = True) -> list[int]:
    """``text`` as the character tokenizer's ids, then <|im_end|> unless ``end`` is False."""
    return [TOKENIZER.convert_tokens_to_ids(c) for c in text] + ([EOS] if end else [])


def run(environment, rows, n: int, script, **options) -> list[list[Completion]]:
    runner = TrajectoryRunner(environment, ToolBox([]), parse_hermes, ConversationRenderer(TOKENIZER),
                              MultiTurnOptions(**options))
    return runner.run(rows, n, ScriptedSampler(script), SAMPLING, seed=0).groups


def count_up(prefix: list[int], j: int) -> list[int]:
    """A script for GuessTheNumber: completion j guesses j first, then one more each turn."""
    return chars(str(guess_after(prefix, j) % 10))


def tokens(text: str) -> int:
    """How many tokens ``text`` (special tokens written as such) is."""
    return len(TOKENIZER(text, add_special_tokens=False)["input_ids"])


HIGHER = tokens("\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")  # 27
AGAIN = tokens("\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")  # 26


def test_turns_rewards_and_the_end_of_a_trajectory():
    # target 2: completion 0 says 0, 1, 2 (done on its third turn), completion 1 says 1, 2 (done on its second)
    (group,) = run(GuessTheNumber, [{"target": 2}], 2, count_up, max_turns=5)
    first, second = (c.trajectory for c in group)
    assert (first["turns"], first["stop"], first["env_reward"]) == (3, "done", 1.0)
    assert (second["turns"], second["stop"], second["env_reward"]) == (2, "done", 1.0)
    assert not any(c.truncated for c in group)
    assert [m["role"] for m in first["messages"]] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in first["messages"][2::2]] == ["Higher.", "Higher."]
    assert first["messages"][-1]["reward"] == 1.0 and first["final_text"] == "2"
    # the typed form (StepResult, replies as chat messages) gives the same trajectories
    (typed,) = run(TypedGuess, [{"target": 2}], 2, count_up, max_turns=5)
    assert [c.token_ids for c in typed] == [c.token_ids for c in group]


def test_rewards_add_up_and_max_turns_truncates():
    Counting.closed = 0
    (group,) = run(Counting, [{}], 3, lambda prefix, j: chars("go"), max_turns=3)
    for c in group:
        record = c.trajectory
        assert record["env_reward"] == 1.5  # three steps of 0.5
        assert (record["turns"], record["stop"], c.truncated) == (3, "max_turns", True)
        assert c.mask[-1] == 1  # the trajectory ends on the model's last token: the last reply is not rendered
        assert record["env_tokens"] == 2 * AGAIN
    assert Counting.closed == 3  # every environment closed once


def test_max_total_tokens_cuts_and_truncates():
    env_part = AGAIN
    turn = chars("abcd")  # 5 tokens
    # the second model turn is cut to what the cap leaves
    cap = 5 + env_part + 3
    (group,) = run(Counting, [{}], 1, lambda prefix, j: turn, max_turns=5, max_total_tokens=cap)
    (c,) = group
    assert len(c.token_ids) == cap and c.token_ids[-3:] == turn[:3]
    assert (c.trajectory["stop"], c.truncated, c.trajectory["turns"]) == ("max_total_tokens", True, 2)
    assert c.trajectory["env_reward"] == 1.0  # the cut turn is still scored by the environment
    assert c.trajectory["model_tokens"] == 8 and c.logprobs[-3:] == [pytest.approx(-x / 100) for x in (6, 7, 8)]
    # the environment's reply would not fit: the trajectory ends on the model's turn, no environment token added
    (group,) = run(Counting, [{}], 1, lambda prefix, j: turn, max_turns=5, max_total_tokens=5 + env_part)
    (c,) = group
    assert c.token_ids == turn and c.mask == (1,) * 5
    assert (c.trajectory["stop"], c.truncated, c.trajectory["env_reward"]) == ("max_total_tokens", True, 0.5)


def test_a_turn_cut_at_max_new_tokens_ends_the_trajectory():
    (group,) = run(Counting, [{}], 2, lambda prefix, j: (chars("abc", end=False), True), max_turns=5)
    for c in group:
        assert (c.trajectory["stop"], c.truncated, c.trajectory["turns"]) == ("max_new_tokens", True, 1)
        # the environment still scores the cut turn (as a reward scores a cut completion), then the trajectory ends
        assert c.trajectory["env_reward"] == 0.5 and c.mask == (1,) * 3
        assert c.token_ids == chars("abc", end=False)


def test_environments_of_one_task_must_start_alike():
    with pytest.raises(EnvironmentStartError) as error:
        run(RandomStart, [{"target": 1}], 2, count_up)
    message = str(error.value)
    assert "\n" not in message and "start with different messages" in message and "{'target': 1}" in message


def test_an_environment_that_fails_to_start_is_one_line():
    with pytest.raises(EnvironmentStartError, match=r"^the environment toy_environments:GuessTheNumber could not "
                                                     r"start the task \{'goal': 1\}: building it raised KeyError: "
                                                     r"'target'$") as error:
        run(GuessTheNumber, [{"goal": 1}], 2, count_up)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("environment, error", [
    (Broken, "RuntimeError: the environment broke"),
    (WrongShape, "EnvironmentShapeError: step() returned str 'just a string'; expected (reply, reward, done) or a "
                 "StepResult"),
])
def test_an_environment_that_raises_or_answers_out_of_shape_ends_its_trajectory(environment, error):
    (group,) = run(environment, [{}], 2, lambda prefix, j: chars("hi"), max_turns=4)
    for c in group:
        assert c.trajectory["env_error"] == error
        assert (c.trajectory["stop"], c.trajectory["turns"], c.truncated) == ("env_error", 1, False)
        assert c.token_ids == chars("hi") and c.mask == (1,) * 3


def test_step_answers_are_checked():
    import numpy as np

    from lit_grpo.environments.protocol import EnvironmentShapeError, StepResult, check_reset, check_step

    assert check_step(("more", 1, False)) == StepResult([{"role": "user", "content": "more"}], 1.0, False)
    assert check_step([None, None, True]) == StepResult(None, None, True)
    assert check_step((None, np.float32(0.5), True)).reward == 0.5  # a reward computed with NumPy
    assert check_step(StepResult([{"role": "tool", "content": "5"}], np.int64(2))).reward == 2.0
    assert check_step((None, 1.0, np.int64(3) == 3)).done is True  # a NumPy bool, as a comparison gives it
    assert check_reset([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])[1]["content"] == "u"
    for bad, expected in [((None, float("inf"), True), "reward inf; expected a finite number"),
                          ((None, float("nan"), True), "reward nan; expected a finite number"),
                          ((None, True, True), "reward True; expected a finite number"),
                          ((None, "1", True), "reward '1'; expected a finite number"),
                          ((None, 1.0, 1), "done=1; expected True or False"),
                          ((None, 1.0, np.array([True])), "expected True or False"),
                          (({"content": "x"}, 1.0, False), "expected a string or a list of chat messages"),
                          ((None, 1.0), "expected (reply, reward, done) or a StepResult")]:
        with pytest.raises(EnvironmentShapeError, match=re.escape(expected)):
            check_step(bad)
    for bad in ([], None, [{"content": "no role"}]):
        with pytest.raises(EnvironmentShapeError, match="reset"):
            check_reset(bad)


def test_trajectory_stats_by_hand():
    # target 2 (turns 3 and 2, done), Counting cut at max_turns 2 (two trajectories)
    (guess_group,) = run(GuessTheNumber, [{"target": 2}], 2, count_up, max_turns=5)
    (count_group,) = run(Counting, [{}], 2, lambda prefix, j: chars("go"), max_turns=2)
    stats = trajectory_stats([guess_group, count_group])
    assert stats == {
        "turns": (3 + 2 + 2 + 2) / 4,
        "model_tokens": (2 * 3 + 2 * 2 + 3 * 2 + 3 * 2) / 4,
        "env_tokens": (2 * HIGHER + HIGHER + AGAIN + AGAIN) / 4,
        "tool_calls": 0.0, "tool_errors": 0.0, "template_mismatch": 0.0,
        "truncated": 2 / 4,
    }
    assert trajectory_stats([[Completion([5], [-1.0], False)]]) == {}  # single-turn: nothing to say


def test_multi_turn_completions_survive_a_checkpoint_of_batches_in_flight(tmp_path):
    groups = run(GuessTheNumber, [{"target": 2}, {"target": 0}], 2, count_up, max_turns=5)
    groups.append([Completion([7, 8], [-0.5, -0.25], True, ("3",))] * 2)  # a single-turn group beside them
    state = groups_to_state(groups)
    torch.save({"groups": state}, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)["groups"]  # plain data only
    assert groups_from_state(loaded) == groups
    assert groups_from_state(json.loads(json.dumps(state))) == groups
    assert groups_from_state(loaded)[-1][0].mask is None


@pytest.mark.parametrize("options, expected", [
    ({"max_turns": 0}, "multi_turn.max_turns must be an integer >= 1, got 0"),
    ({"max_turns": True}, "multi_turn.max_turns must be an integer >= 1, got True"),
    ({"max_total_tokens": 0}, "multi_turn.max_total_tokens must be an integer >= 1 or null, got 0"),
    ({"max_total_tokens": 2.5}, "multi_turn.max_total_tokens must be an integer >= 1 or null, got 2.5"),
    ({"tool_timeout_s": 0}, "multi_turn.tool_timeout_s must be > 0, got 0"),
])
def test_bad_multi_turn_options_are_one_line(options, expected):
    with pytest.raises(ValueError) as error:
        MultiTurnOptions(**options)
    assert str(error.value) == expected


def test_overlong_penalty_with_an_environment_is_refused(tmp_path):
    from lit_grpo.data.datamodule import RolloutDataModule

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"target": 1}\n')
    with pytest.raises(ValueError, match="overlong_penalty scores one completion's length") as error:
        RolloutDataModule(dataset=str(rows), environment="toy_environments:GuessTheNumber", max_new_tokens=8,
                          overlong_penalty={"buffer": 2})
    assert "\n" not in str(error.value)


def test_an_environment_failing_on_the_whole_first_batch_stops_the_fit(tmp_path):
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import EnvironmentFailure

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"target": 1}\n' * 4)
    data = scripted_turns_data(dataset=str(rows), environment="toy_environments:Broken", prompts_per_step=2,
                               num_generations=2, micro_batch_size=4, max_new_tokens=4, system_prompt=None)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync(every_n_batches=1), MetricsRecorder()])
    with pytest.raises(EnvironmentFailure) as error:
        trainer.fit(tiny_module(), datamodule=data)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("the environment toy_environments:Broken failed on all 4 trajectories of the first "
                              "batch (the first on the task {'target': 1}: RuntimeError: the environment broke)")


# ---- the command line ------------------------------------------------------------------------------------------
# the plain form as a user writes it, in a module of their own outside the package: the text of the toy's class
USER_ENVIRONMENT = inspect.getsource(toy_environments.GuessTheNumber)


def test_a_users_plain_environment_trains_through_the_command_line(tmp_path):
    from lit_grpo.cli.plots import read_scalars

    user = tmp_path / "user_code"
    user.mkdir()
    (user / "mymod.py").write_text(textwrap.dedent(USER_ENVIRONMENT))
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"target": i % 10}) + "\n" for i in range(8)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--model.model_name", "tiny-random-llama",
         "--data.dataset", "train.jsonl", "--data.environment", "mymod:GuessTheNumber",
         "--data.prompts_per_step", "2", "--data.num_generations", "2", "--data.micro_batch_size", "4",
         "--data.max_new_tokens", "4", "--data.multi_turn.max_turns", "2", "--trainer.max_steps", "2",
         "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(tmp_path / "lightning_logs")
    for tag in ("rollout/turns", "rollout/model_tokens", "rollout/env_tokens", "rollout/env_errors",
                "rollout/truncated"):
        assert len(scalars[tag]) == 2, tag
    assert all(1.0 <= value <= 2.0 for _, value in scalars["rollout/turns"])


def test_print_config_takes_tools_and_multi_turn(tmp_path, monkeypatch, capsys):
    import yaml

    from lit_grpo.cli.commands import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.model_name", "tiny-random-llama", "--data.tools", "[toy_environments:add]",
              "--data.multi_turn.max_turns", "3", "--data.multi_turn.max_total_tokens", "256",
              "--data.multi_turn.tool_call_format", "toy_environments:parse_braces", "--print_config"])
    assert exit_.value.code == 0
    data = yaml.safe_load(capsys.readouterr().out)["data"]
    assert data["tools"] == ["toy_environments:add"]
    assert data["multi_turn"] == {"max_turns": 3, "max_total_tokens": 256, "tool_timeout_s": 10.0,
                                  "tool_call_format": "toy_environments:parse_braces", "tool_runner": "thread"}


def test_every_environment_is_closed_when_a_group_fails_to_start_and_a_failing_close_is_warned():
    class StartsOnce(Counting):
        made = 0

        def __init__(self, row: dict):
            StartsOnce.made += 1
            if StartsOnce.made == 3:  # the third environment of the task cannot start
                raise RuntimeError("no room")
            super().__init__(row)

    Counting.closed = 0
    with pytest.raises(EnvironmentStartError, match="no room"):
        run(StartsOnce, [{}], 4, lambda prefix, j: chars("hi"), max_turns=2)
    assert Counting.closed == 2  # the two that started are closed, none is left open

    class ClosesBadly(Counting):
        def close(self) -> None:
            raise OSError("socket already gone")

    with pytest.warns(UserWarning, match=r"close\(\) raised OSError: socket already gone; its trajectory is kept"):
        (group,) = run(ClosesBadly, [{}], 2, lambda prefix, j: chars("hi"), max_turns=2)
    assert [c.trajectory["env_reward"] for c in group] == [1.0, 1.0]  # two turns at 0.5 each: kept
