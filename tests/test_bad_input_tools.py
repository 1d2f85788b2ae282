"""Bad input to tools: the tool runner's option and the tools the process runner cannot run are refused in one line
before the model loads; a tool that raises or hangs is warned about once, in one line naming it and its first error
(the model is still told, and the run goes on)."""

from __future__ import annotations

import warnings

import pytest
from cli_runner import refusal_line
from test_cli_errors import TINY_RUN
from toy_environments import ScriptedSampler, add, fail
from toy_tools import hang, make_scaler

from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import ToolCall, parse_hermes
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import tiny_tool_tokenizer

TOOLS_RUN = ["--data.dataset", "synthetic:mul_2digit", "--data.tools", "[lit_grpo.environments.calculator:calculator]"]


# ---- the runner's option ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fork", "", 1, None])
def test_tool_runner_is_thread_or_process(value):
    with pytest.raises(ValueError) as error:
        MultiTurnOptions(tool_runner=value)
    assert str(error.value) == f"multi_turn.tool_runner must be one of ['process', 'thread'], got {value!r}"
    with pytest.raises(ValueError, match=r"tool_runner must be one of \['process', 'thread'\], got 'fork'"):
        ToolBox([add], runner="fork")


def test_a_bad_tool_runner_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys):
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN, *TOOLS_RUN,
                         f"--trainer.default_root_dir={tmp_path}", "--data.multi_turn.tool_runner", "fork"],
                        tmp_path, monkeypatch, capsys)
    assert "multi_turn.tool_runner must be one of ['process', 'thread'], got 'fork'" in line


# ---- tools the process runner cannot run -----------------------------------------------------------------------
def test_the_process_runner_refuses_a_closure_in_one_line():
    with pytest.raises(ValueError) as error:
        ToolBox([add, make_scaler(2)], runner="process")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tool 'scaled' cannot run with multi_turn.tool_runner 'process'")
    assert "package.module:function" in message and "tool_runner 'thread'" in message
    ToolBox([add, make_scaler(2)], runner="thread")  # the thread runner calls it as it is


def test_the_process_runner_refuses_a_function_of_the_main_script_in_one_line():
    def main_tool(x: int) -> int:
        """Echo.

        Args:
            x: a number
        """
        return x

    main_tool.__module__, main_tool.__qualname__ = "__main__", "main_tool"
    with pytest.raises(ValueError, match=r"^tool 'main_tool' cannot run with multi_turn.tool_runner 'process': it "
                                         r"is defined in the script run as __main__"):
        ToolBox([main_tool], runner="process")


def test_a_closure_named_by_path_is_refused_on_the_command_line(tmp_path, monkeypatch, capsys):
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN, "--data.dataset",
                         "synthetic:mul_2digit", "--data.tools", "[toy_tools:scaled]",
                         f"--trainer.default_root_dir={tmp_path}", "--data.multi_turn.tool_runner", "process"],
                        tmp_path, monkeypatch, capsys)
    assert "tool 'scaled' cannot run with multi_turn.tool_runner 'process'" in line


# ---- a tool that fails is warned about once --------------------------------------------------------------------
TOKENIZER = tiny_tool_tokenizer()


def tool_turns(calls: list[str]) -> ScriptedSampler:
    """Trajectory ``j``'s first turn is ``calls[j]``, its second a plain answer that ends it."""
    def turn(text: str) -> list[int]:
        return list(TOKENIZER(text, add_special_tokens=False)["input_ids"]) + [2]

    return ScriptedSampler(lambda prefix, j: turn(calls[j]) if prefix.count(1) == 2 else turn("Done."))


def run_calls(tools: list, calls: list[str], timeout_s: float = 10.0) -> list[str]:  # noqa: ANN001
    """The warnings of a batch of ``len(calls)`` trajectories of one task, each making one turn's calls."""
    box = ToolBox(tools, timeout_s=timeout_s)
    runner = TrajectoryRunner(None, box, parse_hermes, ConversationRenderer(TOKENIZER, box.schemas),
                              MultiTurnOptions(tool_timeout_s=timeout_s))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # a second batch: the same tools fail again, and are not warned about again
            runner.run([{"question": "q"}], len(calls), tool_turns(calls), SamplingConfig(max_new_tokens=64), seed=0)
    return [str(w.message) for w in caught]


def hermes(name: str, **arguments) -> str:  # noqa: ANN003
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_a_tool_that_raises_is_warned_about_once_with_its_first_error():
    messages = run_calls([add, fail], [hermes("fail", x=1), hermes("fail", x=2), hermes("add", a=1, b=2)])
    assert messages == ["tool 'fail' failed (it raised ZeroDivisionError: cannot take 1): the model is told the "
                        "error and its trajectory goes on; counted in rollout/tool_errors (further failures of this "
                        "tool are counted, not warned)"]


def test_a_tool_that_hangs_is_warned_about_once_naming_the_timeout():
    messages = run_calls([hang, fail], [hermes("hang"), hermes("fail", x=5), hermes("hang")], timeout_s=0.5)
    assert len(messages) == 2 and all("\n" not in m for m in messages), messages
    assert messages[0].startswith("tool 'hang' failed (it timed out after 0.5 s; tool_runner 'thread' cannot stop "
                                  "its call, which runs on: tool_runner 'process' kills it)")
    assert messages[1].startswith("tool 'fail' failed (it raised ZeroDivisionError: cannot take 5)")


def test_the_model_s_own_mistakes_are_not_warned_about():
    """An unknown tool, arguments a tool does not take or a call that cannot be read are the model's to learn from:
    counted in rollout/tool_errors, not warned."""
    assert run_calls([add], [hermes("mul", a=1), hermes("add", a=1), '<tool_call>{"name": </tool_call>']) == []
    assert ToolBox([add]).call(ToolCall("add", {"a": 1, "c": 2})).failed


def test_a_tool_box_built_while_a_script_runs_again_in_a_call_s_process_is_refused(monkeypatch):
    """Where a call's process runs the script of ``__main__`` again (a server started by other code, or ``spawn``),
    an entry point without ``if __name__ == "__main__":`` would reach the training there: refused in one line."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError) as error:
        ToolBox([add], runner="process")
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("multi_turn.tool_runner 'process' started a tool's process, which ran the "
                                       "script's code again")
    assert "guard the script's entry point with if __name__ == '__main__':" in str(error.value)
