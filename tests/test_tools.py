"""Tools: Hermes tool calls parsed from a model's turn, the tool box (schemas from transformers, calls that never
raise: errors, unknown tools, wrong arguments and timeouts come back as text for the model), and tool calls through
the trajectory runner, in the Hermes format and in a user's own format named by import path."""

from __future__ import annotations

import time

import pytest
from toy_environments import ScriptedSampler, add, fail, slow

from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import ToolCall, ToolCallError, parse_hermes, resolve_tool_call_format
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import tiny_tool_tokenizer

EOS = 2


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
    assert box.call(ToolCall("slow", {"seconds": 0})).text == "woke"


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


def runner(tools, tool_call_format="hermes") -> TrajectoryRunner:  # noqa: ANN001
    box = ToolBox(tools)
    return TrajectoryRunner(None, box, resolve_tool_call_format(tool_call_format),
                            ConversationRenderer(TOKENIZER, box.schemas), MultiTurnOptions(max_turns=4))


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
