"""Tools: Hermes tool calls parsed from a model's turn, the tool box (schemas from transformers, calls that never
raise: errors, unknown tools, wrong arguments and timeouts come back as text for the model), and tool calls through
the trajectory runner, in the Hermes format and in a user's own format named by import path."""

from __future__ import annotations

import os
import time

import pytest
from toy_environments import ScriptedSampler, add, fail, slow
from toy_tools import hang, hang_then_write, whoami

from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import ToolCall, ToolCallError, parse_hermes, resolve_tool_call_format
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import tiny_tool_tokenizer

EOS = 2
# a tool that raises or hangs is warned about once (tests/test_bad_input_tools.py checks the warning)
pytestmark = pytest.mark.filterwarnings("ignore:tool '.*' failed:UserWarning")


# ---- parsing ---------------------------------------------------------------------------------------------------
def test_parse_one_call():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert parse_hermes(text) == [ToolCall("add", {"a": 2, "b": 3})]


def test_parse_several_calls_in_order_and_none():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>{"name": "slow", "arguments": {"seconds": 0.5}}</tool_call>')
    assert parse_hermes(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("slow", {"seconds": 0.5})]
    assert parse_hermes("The answer is 5.") == []


def test_parse_arguments_written_as_a_json_string_and_an_unclosed_last_call():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}'
    assert parse_hermes(text) == [ToolCall("add", {"a": 4, "b": 5})]


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "is not valid JSON"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', 'needs a "name" string'),
    ('<tool_call>["add"]</tool_call>', 'needs a "name" string'),
    ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', "the arguments of 'add' are not valid JSON"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "the arguments of 'add' must be a JSON object"),
])
def test_a_call_that_cannot_be_read_is_one_line(text, expected):
    with pytest.raises(ToolCallError, match=expected) as error:
        parse_hermes(text)
    assert "\n" not in str(error.value)


def test_tool_call_formats_by_name_path_or_function():
    assert resolve_tool_call_format("hermes") is parse_hermes
    parse = resolve_tool_call_format("toy_environments:parse_braces")
    assert parse("then {{add 2 3}}") == [ToolCall("add", {"a": 2, "b": 3})]
    assert resolve_tool_call_format(parse) is parse
    with pytest.raises(ValueError, match=r"unknown tool_call_format 'json'; expected one of \['hermes'\]"):
        resolve_tool_call_format("json")


# ---- the tool box ----------------------------------------------------------------------------------------------
def test_schemas_come_from_transformers():
    from transformers.utils import get_json_schema

    box = ToolBox([add, "toy_environments:slow"])
    assert box.schemas == [get_json_schema(add), get_json_schema(slow)]
    assert box.schemas[0]["function"]["name"] == "add"
    assert box.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                           "description": "the first"}
    assert box.call(ToolCall("add", {"a": 2, "b": 3})).text == "5"  # a non-string result is written as JSON


def test_failures_become_text_for_the_model():
    box = ToolBox([add, fail])
    raised = box.call(ToolCall("fail", {"x": 3}))
    assert (raised.text, raised.failed) == ("Error: fail raised ZeroDivisionError: cannot take 3", True)
    unknown = box.call(ToolCall("mul", {"a": 1}))
    assert unknown.failed and unknown.text == "Error: unknown tool 'mul'; the tools are ['add', 'fail']"
    wrong = box.call(ToolCall("add", {"a": 1, "c": 2}))
    assert wrong.failed and wrong.text.startswith("Error: add does not take these arguments (")
    assert not box.call(ToolCall("add", {"a": 1, "b": 2})).failed


def test_a_tool_past_its_time_limit_answers_with_a_timeout_quickly():
    box = ToolBox([slow], timeout_s=0.2)
    start = time.perf_counter()
    outcome = box.call(ToolCall("slow", {"seconds": 5}))
    assert time.perf_counter() - start < 2.0
    assert (outcome.text, outcome.failed, outcome.timed_out) == ("Error: slow timed out after 0.2 s", True, True)
    # a call in time answers (a limit a loaded machine meets: 0.2 s can pass before a worker thread is scheduled)
    assert ToolBox([slow], timeout_s=30).call(ToolCall("slow", {"seconds": 0})).text == "woke"


def undocumented(a, b):  # noqa: ANN001, ANN201
    return a + b


def test_a_function_transformers_cannot_describe_is_refused_in_one_line():
    with pytest.raises(ValueError, match="tool 'undocumented' cannot be described for the chat template") as error:
        ToolBox([undocumented])
    assert "\n" not in str(error.value) and "give it type hints and a docstring" in str(error.value)


def test_duplicate_names_and_bad_timeouts_are_refused():
    with pytest.raises(ValueError, match=r"two tools share a name: \['add', 'add'\]"):
        ToolBox([add, "toy_environments:add"])
    with pytest.raises(ValueError, match="tool_timeout_s must be > 0, got 0"):
        ToolBox([add], timeout_s=0)
    with pytest.raises(ValueError, match="a tool must be an import path or a function, got int"):
        ToolBox([3])


# ---- through the runner ----------------------------------------------------------------------------------------
TOKENIZER = tiny_tool_tokenizer()


def turn(text: str) -> list[int]:
    """A model turn: ``text`` as the tool tokenizer encodes it (tags one token each), then <|im_end|>."""
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"]) + [EOS]


def runner(tools, tool_call_format="hermes", timeout_s=10.0, tool_runner="thread") -> TrajectoryRunner:  # noqa: ANN001
    box = ToolBox(tools, timeout_s=timeout_s, runner=tool_runner)
    options = MultiTurnOptions(max_turns=4, tool_timeout_s=timeout_s, tool_runner=tool_runner)
    return TrajectoryRunner(None, box, resolve_tool_call_format(tool_call_format),
                            ConversationRenderer(TOKENIZER, box.schemas), options)


def two_turns(first: str, second: str = "The sum is 5."):
    return ScriptedSampler(lambda prefix, j: turn(first) if prefix.count(1) == 2 else turn(second))


@pytest.mark.parametrize("tool_call_format, call", [
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'),
    ("toy_environments:parse_braces", "{{add 2 3}}"),
])
def test_a_tool_result_goes_back_as_a_tool_message_and_the_trajectory_goes_on(tool_call_format, call):
    sampler = two_turns(call)
    (group,) = runner([add], tool_call_format).run([{"question": "What is 2 + 3?"}], 1, sampler,
                                                   SamplingConfig(max_new_tokens=64), seed=0).groups
    (c,) = group
    record = c.trajectory
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert record["messages"][1]["tool_calls"] == [{"type": "function",
                                                    "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert record["messages"][2] == {"role": "tool", "name": "add", "content": "5"}
    assert (record["tool_calls"], record["tool_errors"], record["turns"], record["stop"]) == (1, 0, 2, "done")
    assert record["final_text"] == "The sum is 5."
    tool_part = list(TOKENIZER("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n",
                               add_special_tokens=False)["input_ids"])
    assert c.token_ids == turn(call) + tool_part + turn("The sum is 5.")
    assert c.mask == (1,) * len(turn(call)) + (0,) * len(tool_part) + (1,) * len(turn("The sum is 5."))
    assert sampler.requests[1] == [sampler.requests[0][0] + turn(call) + tool_part]


def test_a_failing_or_unreadable_call_is_answered_and_counted():
    bad_json = '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'
    (group,) = runner([add, fail]).run([{"question": "q"}], 1, two_turns(bad_json), SamplingConfig(max_new_tokens=64),
                                       seed=0).groups
    record = group[0].trajectory
    assert record["messages"][2]["role"] == "tool" and record["messages"][2]["content"].startswith(
        "Error: the tool call")
    assert (record["tool_calls"], record["tool_errors"], record["turns"], record["stop"]) == (0, 1, 2, "done")
    raising = '<tool_call>{"name": "fail", "arguments": {"x": 1}}</tool_call>'
    (group,) = runner([add, fail]).run([{"question": "q"}], 1, two_turns(raising), SamplingConfig(max_new_tokens=64),
                                       seed=0).groups
    record = group[0].trajectory
    assert record["messages"][2]["content"] == "Error: fail raised ZeroDivisionError: cannot take 1"
    assert (record["tool_calls"], record["tool_errors"], record["turns"]) == (1, 1, 2)


# ---- running the calls: concurrently, on threads or in processes ---------------------------------------------------
TIMEOUT_S = 1.5  # a hung call's limit in the timing tests: long enough for a loaded 2-core machine to start a call


@pytest.mark.parametrize("tool_runner", ["thread", "process"])
def test_a_batch_of_hanging_calls_waits_about_one_timeout_not_their_sum(tool_runner):
    """Eight trajectories each call a tool that hangs: their calls run at once, so the turn waits about one
    ``tool_timeout_s`` (one after another they took eight)."""
    call = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    trajectories = runner([hang], timeout_s=TIMEOUT_S, tool_runner=tool_runner)
    start = time.perf_counter()
    (group,) = trajectories.run([{"question": "q"}], 8, two_turns(call), SamplingConfig(max_new_tokens=64),
                                seed=0).groups
    elapsed = time.perf_counter() - start
    assert TIMEOUT_S <= elapsed < 3 * TIMEOUT_S + 1.5, elapsed  # the sum would be 8 * TIMEOUT_S = 12 s
    for c in group:
        record = c.trajectory
        assert record["messages"][2] == {"role": "tool", "name": "hang",
                                         "content": f"Error: hang timed out after {TIMEOUT_S:g} s"}
        assert (record["tool_calls"], record["tool_errors"], record["stop"]) == (1, 1, "done")


@pytest.mark.parametrize("tool_runner", ["thread", "process"])
def test_outcomes_keep_the_order_of_the_calls(tool_runner):
    box = ToolBox([add, fail, hang], timeout_s=TIMEOUT_S, runner=tool_runner)
    calls = [ToolCall("add", {"a": 1, "b": 2}), ToolCall("hang", {}), ToolCall("fail", {"x": 3}),
             ToolCall("nope", {}), ToolCall("add", {"a": 3, "b": 4})]
    outcomes = box.call_many(calls)
    assert [o.text for o in outcomes] == ["3", f"Error: hang timed out after {TIMEOUT_S:g} s",
                                          "Error: fail raised ZeroDivisionError: cannot take 3",
                                          "Error: unknown tool 'nope'; the tools are ['add', 'fail', 'hang']", "7"]
    assert [(o.failed, o.timed_out) for o in outcomes] == [(False, False), (True, True), (True, False),
                                                           (True, False), (False, False)]


def test_the_process_runner_runs_each_call_in_another_process():
    box = ToolBox([whoami, add, "lit_grpo.environments.calculator:calculator"], runner="process")
    first, second, total, product = box.call_many([ToolCall("whoami", {}), ToolCall("whoami", {}),
                                                   ToolCall("add", {"a": 2, "b": 3}),
                                                   ToolCall("calculator", {"expression": "47 * 38"})])
    assert (total.text, product.text) == ("5", "1786")
    pids = {int(first.text), int(second.text)}
    assert os.getpid() not in pids and len(pids) == 2


def test_the_process_runner_kills_a_hung_call_at_its_timeout(tmp_path):
    """The call's process is gone when the timeout is answered, and what the tool would have done after it never
    happens (a thread cannot be stopped: its tool would still write the file)."""
    target = tmp_path / "side_effect"
    box = ToolBox([hang_then_write], timeout_s=TIMEOUT_S, runner="process")
    start = time.perf_counter()
    outcome = box.call(ToolCall("hang_then_write", {"path": str(target), "seconds": 3 * TIMEOUT_S}))
    assert outcome.timed_out and outcome.text == f"Error: hang_then_write timed out after {TIMEOUT_S:g} s"
    assert time.perf_counter() - start < 3 * TIMEOUT_S
    pid = int((tmp_path / "side_effect.pid").read_text())
    assert pid != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped
    time.sleep(max(0.0, start + 3 * TIMEOUT_S + 1.0 - time.perf_counter()))  # past the moment it would write
    assert not target.exists()


def test_the_thread_runner_keeps_at_most_its_slots_of_hung_calls(monkeypatch):
    """A thread cannot be stopped: a hung call keeps its thread, and its tool's slot. A tool that hangs for ever
    thus holds at most MAX_CONCURRENT_CALLS threads; its calls beyond them wait for a slot no longer than the limit,
    and the other tools keep theirs."""
    import threading

    import lit_grpo.environments.tools as tools

    monkeypatch.setattr(tools, "MAX_CONCURRENT_CALLS", 2)
    box = ToolBox([hang, add], timeout_s=TIMEOUT_S)
    before = {t for t in threading.enumerate() if t.name == "tool-hang"}
    for _ in range(2):
        start = time.perf_counter()
        outcomes = box.call_many([ToolCall("hang", {})] * 4 + [ToolCall("add", {"a": 1, "b": 1})])
        assert TIMEOUT_S <= time.perf_counter() - start < 3 * TIMEOUT_S
        assert [o.timed_out for o in outcomes] == [True] * 4 + [False] and outcomes[-1].text == "2"
    assert len({t for t in threading.enumerate() if t.name == "tool-hang"} - before) == 2


def test_a_call_s_process_does_not_run_the_trainer_s_script_again(tmp_path):
    """multiprocessing runs the script of ``__main__`` again in each process it starts; the calls' processes skip it
    (they need the tool's module only), so an unguarded script works and its imports are not paid per call."""
    import subprocess
    import sys

    runs = tmp_path / "runs.txt"
    script = tmp_path / "train.py"
    script.write_text(f"""
from pathlib import Path
with Path({str(runs)!r}).open("a") as f:  # the script's top level: run once, by the trainer only
    f.write("ran\\n")
from lit_grpo.environments.tool_calls import ToolCall
from lit_grpo.environments.tools import ToolBox
box = ToolBox(["toy_tools:whoami", "lit_grpo.environments.calculator:calculator"], runner="process", timeout_s=60)
outcomes = box.call_many([ToolCall("whoami", {{}})] * 4 + [ToolCall("calculator", {{"expression": "6*7"}})])
print(" ".join(o.text for o in outcomes))
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(__file__)})
    assert out.returncode == 0, out.stderr
    *pids, product = out.stdout.split()
    assert product == "42" and len(set(pids)) == 4
    assert runs.read_text() == "ran\n"
